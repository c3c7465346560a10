#!/usr/bin/env python3
"""Per-kernel figures from `ncu --import X.ncu-rep --page raw --csv` files (argv): duration, SM / DRAM
throughput, DRAM bytes, L2, occupancy, registers, shared memory, grid and waves, issue activity, the
top warp stall reasons (WarpStateStats ratios and PC sampling), tensor-pipe utilization, the
instruction pipes above 5 % of peak."""
import csv
import sys

KEYS = [
    ("duration", "gpu__time_duration.sum"),
    ("sm_clock", "smsp__cycles_elapsed.avg.per_second"),
    ("dram_clock", "dram__cycles_elapsed.avg.per_second"),
    ("SM thru %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("mem thru %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM thru %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM bytes/s", "dram__bytes.sum.per_second"),
    ("DRAM read", "dram__bytes_read.sum"),
    ("DRAM write", "dram__bytes_write.sum"),
    ("L2 sectors (32 B)", "lts__t_sectors.sum"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("L1 thru %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("achieved occ %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("theoretical occ %", "sm__maximum_warps_per_active_cycle_pct"),
    ("regs/thread", "launch__registers_per_thread"),
    ("smem static/block", "launch__shared_mem_per_block_static"),
    ("smem dyn/block", "launch__shared_mem_per_block_dynamic"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
    ("waves/SM", "launch__waves_per_multiprocessor"),
    ("blocks/SM limit regs", "launch__occupancy_limit_registers"),
    ("blocks/SM limit smem", "launch__occupancy_limit_shared_mem"),
    ("blocks/SM limit warps", "launch__occupancy_limit_warps"),
    ("SMs", "device__attribute_multiprocessor_count"),
    ("SM active cycles", "sm__cycles_active.avg"),
    ("SM elapsed cycles", "sm__cycles_elapsed.avg"),
    ("SM active max", "sm__cycles_active.max"),
    ("SM active min", "sm__cycles_active.min"),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("cycles/issued inst", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("warps/scheduler", "smsp__warps_active.avg.per_cycle_active"),
    ("eligible/scheduler", "smsp__warps_eligible.avg.per_cycle_active"),
    ("inst executed", "smsp__inst_executed.sum"),
    ("tensor pipe % active", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe % elapsed", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed"),
    ("tensor pipe max SM %", "sm__pipe_tensor_op_hmma_cycles_active.max.pct_of_peak_sustained_elapsed"),
    ("smem wavefronts %", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed"),
]


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def main():
    for path in sys.argv[1:]:
        rows = list(csv.reader(open(path)))
        if len(rows) < 3:
            print(path, "no rows")
            continue
        head, units = rows[0], rows[1]
        idx = {h: i for i, h in enumerate(head)}
        print(f"== {path}")
        for r in rows[2:]:
            name = r[idx["Kernel Name"]] if "Kernel Name" in idx else "?"
            print(f"-- {name}")
            for label, m in KEYS:
                if m in idx:
                    print(f"   {label:22s} {r[idx[m]]:>16s} {units[idx[m]]}")
                else:
                    print(f"   {label:22s} {'(absent)':>16s}")
            for pref, suf in (("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"),
                              ("smsp__pcsamp_warps_issue_stalled_", "")):
                cols = [(h, num(r[i])) for h, i in idx.items()
                        if h.startswith(pref) and h.endswith(suf) and not h.endswith("_not_issued")
                        and (suf or "." not in h[len(pref):])]
                cols = [(h, v) for h, v in cols if v is not None]
                tot = sum(v for _, v in cols) or 1.0
                cols.sort(key=lambda x: -x[1])
                print(f"   stalls {pref}*{suf} (total {tot:.3f}):")
                for h, v in cols[:6]:
                    print(f"      {h[len(pref):len(h) - len(suf) if suf else None]:28s} {v:12.3f}  {100 * v / tot:5.1f} %")
            for h, i in sorted(idx.items()):
                if h.startswith("sm__inst_executed_pipe_") and h.endswith(".avg.pct_of_peak_sustained_active") \
                        and (num(r[i]) or 0) >= 5:
                    print(f"   {h:70s} {r[i]:>14s} {units[i]}")


if __name__ == "__main__":
    main()
