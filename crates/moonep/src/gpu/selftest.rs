//! Rank-side GPU correctness checks, run by `moonep-gpu-rank selftest` under `moonep-launch` (and
//! through it by `tests/gpu_ep.rs`). Every case compares the device against the CPU planner
//! ([`crate::plan`]) and a plain-loop reference of docs/specs/moonep.md §3 on fresh seeded data,
//! with poisoned outputs.

use half::bf16;

use super::baseline::Baseline;
use super::driver::read_ptr;
use super::ep::{EpBuffer, EpConfig, Tokens, Transport, plan_config};
use super::rank::Rank;
pub use super::workload::{Routing, make_topk, random_bf16, random_f32, tpe_of};
use super::{GpuError, status};
use crate::plan::{GlobalPlan, plan_entries, plan_global};
use crate::reference::{self, ClusterPlan, POISON, VirtualCluster};

/// Two bf16 copies of the reference poison (NaN) as one 32-bit fill word.
pub fn poison_bf16_pair() -> u32 {
    u32::from(bf16::from_f32(POISON).to_bits()) * 0x10001
}

/// One dispatch/combine case.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub name: &'static str,
    pub experts: usize,
    pub k: usize,
    pub cap: usize,
    pub s: usize,
    pub h: usize,
    pub p: usize,
    pub routing: Routing,
    pub dedup: bool,
    pub fallback: bool,
}

pub(crate) fn mismatch<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} vs {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}[{i}]: gpu {:?} vs cpu {:?} ({} differ)",
            got[i],
            want[i],
            got.iter().zip(want).filter(|(a, b)| a != b).count()
        )),
    }
}

/// Compares the device plan with the CPU planner (every array, bit for bit).
pub(crate) fn check_plan(
    buf: &EpBuffer,
    rank: &Rank,
    gp: &GlobalPlan,
    dst_cpu: &[i64],
) -> Result<(), String> {
    let dp = buf.read_plan(&rank.dev).map_err(|e| e.to_string())?;
    let me = rank.env.rank;
    let lay = &gp.layouts[me];
    mismatch(
        "alloc",
        &dp.alloc,
        &gp.alloc.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    mismatch(
        "alloc_cum",
        &dp.alloc_cum,
        &gp.alloc_cum.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    let etc: Vec<i32> = gp
        .layouts
        .iter()
        .flat_map(|l| l.experts_to_copy.iter().copied())
        .collect();
    mismatch("experts_to_copy", &dp.experts_to_copy, &etc)?;
    mismatch(
        "counts",
        &dp.counts,
        &lay.counts.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    mismatch(
        "cu_seqlens",
        &dp.cu_seqlens,
        &lay.cu_seqlens.iter().map(|&x| x as i32).collect::<Vec<_>>(),
    )?;
    let zf: Vec<i32> = lay
        .zero_fill
        .iter()
        .flat_map(|&(a, b)| [a as i32, b as i32])
        .collect();
    mismatch("zero_fill", &dp.zero_fill, &zf)?;
    mismatch("dst", &dp.dst, dst_cpu)
}

/// Runs one case on every rank; `Err` carries the first difference.
pub fn run_case(rank: &mut Rank, c: &Case, seed: u64) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let mut cfg = EpConfig::new(c.experts, c.k, c.cap, c.h);
    cfg.padding = c.p;
    cfg.dedup = c.dedup;
    cfg.force_fallback = c.fallback;
    cfg.num_blocks = 8;
    let e = |x: GpuError| x.to_string();
    let mut buf = EpBuffer::new(rank, cfg).map_err(e)?;
    if c.fallback != (buf.transport == Transport::NcclFallback) {
        return Err(format!(
            "transport {:?} but fallback={}",
            buf.transport, c.fallback
        ));
    }
    let topk = make_topk(c.routing, r, c.experts, c.k, c.s, seed);
    let tpe_all: Vec<u32> = topk
        .iter()
        .flat_map(|t| tpe_of(t, c.experts))
        .map(|x| x as u32)
        .collect();
    let pc = plan_config(&cfg, r, c.s, None);
    let gp = plan_global(&pc, &tpe_all).map_err(|x| x.to_string())?;
    let topk_u32: Vec<Vec<u32>> = topk
        .iter()
        .map(|t| t.iter().map(|&x| x as u32).collect())
        .collect();
    let dsts: Vec<Vec<i64>> = (0..r)
        .map(|src| plan_entries(&pc, &gp, src, &topk_u32[src]))
        .collect::<Result<_, _>>()
        .map_err(|x| x.to_string())?;
    let xs: Vec<Vec<u16>> = (0..r)
        .map(|src| random_bf16(c.s, c.h, seed ^ (0x1000 + src as u64)))
        .collect();
    let ws: Vec<Vec<f32>> = (0..r)
        .map(|src| random_f32(c.s * c.k, seed ^ (0x2000 + src as u64)))
        .collect();
    let dev = &rank.dev;
    let nvs = buf.shard_slots();
    let x_d = dev.upload(&xs[me]).map_err(e)?;
    let w_d = dev.upload(&ws[me]).map_err(e)?;
    let topk_d = dev.upload(&topk[me]).map_err(e)?;
    let tpe_d = dev.upload(&tpe_of(&topk[me], c.experts)).map_err(e)?;
    // Poison the shard and weights.
    dev.memset_u32(buf.hidden.ptr(), poison_bf16_pair(), nvs * c.h / 2)
        .map_err(e)?;
    dev.memset_u32(buf.wts.ptr(), POISON.to_bits(), nvs)
        .map_err(e)?;
    dev.sync().map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: w_d.ptr,
            topk: topk_d.ptr,
            tpe: tpe_d.ptr,
            s: c.s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    check_plan(&buf, rank, &gp, &dsts[me])?;
    // Expected shards: the CPU reference cluster (crate::reference) on the same inputs.
    let plan = ClusterPlan::new(&pc, &tpe_all, &topk_u32).map_err(|x| x.to_string())?;
    let mut cluster = VirtualCluster::new(r, nvs, c.h);
    let xs_bf: Vec<Vec<bf16>> = xs
        .iter()
        .map(|v| v.iter().map(|&b| bf16::from_bits(b)).collect())
        .collect();
    cluster
        .dispatch(&plan, &xs_bf, Some(&ws))
        .map_err(|x| x.to_string())?;
    let nvs_s = buf.step_slots();
    let want_h: Vec<u16> = cluster.shards[me][..nvs_s * c.h]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let want_w: Vec<u32> = cluster.wts[me][..nvs_s]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let got_h: Vec<u16> = read_ptr(buf.hidden.ptr(), nvs_s * c.h).map_err(e)?;
    let got_w: Vec<u32> = read_ptr(buf.wts.ptr(), nvs_s).map_err(e)?;
    mismatch("shard rows vs reference cluster", &got_h, &want_h)?;
    mismatch("slot weights vs reference cluster", &got_w, &want_w)?;
    // Combine: fresh expert outputs y in every rank's used rows, same on both sides.
    let mut ys = cluster.shards.clone();
    for (d, y) in ys.iter_mut().enumerate() {
        let used = gp.layouts[d].used_rows() as usize;
        let fresh = random_bf16(used, c.h, seed ^ (0x3000 + d as u64));
        for (dst, &b) in y[..used * c.h].iter_mut().zip(&fresh) {
            *dst = bf16::from_bits(b);
        }
    }
    let used_me = gp.layouts[me].used_rows() as usize;
    if used_me > 0 {
        let mine: Vec<u16> = ys[me][..used_me * c.h]
            .iter()
            .map(|v| v.to_bits())
            .collect();
        crate::gpu::driver::write_ptr(buf.hidden.ptr(), &mine).map_err(e)?;
    }
    let out_d = dev.alloc(c.s * c.h * 2).map_err(e)?;
    let wout_d = dev.alloc(c.s * c.k * 4).map_err(e)?;
    dev.memset_u32(out_d.ptr, poison_bf16_pair(), c.s * c.h / 2)
        .map_err(e)?;
    dev.memset_u32(wout_d.ptr, POISON.to_bits(), c.s * c.k)
        .map_err(e)?;
    dev.sync().map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.combine(rank, out_d.ptr, wout_d.ptr).map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    let want_out: Vec<u16> = reference::combine(&plan, &ys, c.h)[me]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let got_out: Vec<u16> = read_ptr(out_d.ptr, c.s * c.h).map_err(e)?;
    mismatch("combine out vs reference cluster", &got_out, &want_out)?;
    let want_wout = reference::gather_slots(&plan, &cluster.wts);
    let got_wout: Vec<f32> = read_ptr(wout_d.ptr, c.s * c.k).map_err(e)?;
    mismatch(
        "combine weight gather vs reference",
        &got_wout,
        &want_wout[me],
    )?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    if buf.transport == Transport::Nvlink {
        super::selftest_backward::check_case_backward(rank, &mut buf, c, seed, &plan, &cluster)?;
    }
    Ok(())
}

/// Baseline: expert-major rows after dispatch and the K-sum after combine (identity experts).
pub fn run_baseline_case(rank: &mut Rank, c: &Case, seed: u64) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let e = |x: GpuError| x.to_string();
    let mut cfg = EpConfig::new(c.experts, c.k, c.cap, c.h);
    cfg.num_blocks = 8;
    let mut base = Baseline::new(rank, cfg).map_err(e)?;
    let topk = make_topk(c.routing, r, c.experts, c.k, c.s, seed);
    let xs: Vec<Vec<u16>> = (0..r)
        .map(|src| random_bf16(c.s, c.h, seed ^ (0x1000 + src as u64)))
        .collect();
    let dev = &rank.dev;
    let x_d = dev.upload(&xs[me]).map_err(e)?;
    let topk_d = dev.upload(&topk[me]).map_err(e)?;
    let tpe_d = dev.upload(&tpe_of(&topk[me], c.experts)).map_err(e)?;
    base.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: 0,
            topk: topk_d.ptr,
            tpe: tpe_d.ptr,
            s: c.s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    rank.dev.sync().map_err(e)?;
    let epn = c.experts / r;
    let mut want = Vec::new();
    for le in 0..epn {
        for (src, tk) in topk.iter().enumerate() {
            for (i, &x) in tk.iter().enumerate() {
                if x as usize == me * epn + le {
                    let t = i / c.k;
                    want.extend_from_slice(&xs[src][t * c.h..(t + 1) * c.h]);
                }
            }
        }
    }
    let got: Vec<u16> = read_ptr(base.perm.ptr, want.len()).map_err(e)?;
    mismatch("baseline expert-major rows", &got, &want)?;
    let out_d = rank.dev.alloc(c.s * c.h * 2).map_err(e)?;
    rank.dev
        .memset_u32(out_d.ptr, poison_bf16_pair(), c.s * c.h / 2)
        .map_err(e)?;
    base.combine(rank, out_d.ptr).map_err(e)?;
    rank.dev.sync().map_err(e)?;
    let want_out: Vec<u16> = (0..c.s * c.h)
        .map(|idx| {
            let (t, j) = (idx / c.h, idx % c.h);
            let v = bf16::from_bits(xs[me][t * c.h + j]).to_f32();
            let mut acc = 0f32;
            for _ in 0..c.k {
                acc += v;
            }
            bf16::from_f32(acc).to_bits()
        })
        .collect();
    let got_out: Vec<u16> = read_ptr(out_d.ptr, c.s * c.h).map_err(e)?;
    mismatch("baseline combine out", &got_out, &want_out)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    Ok(())
}

fn expert_pattern(expert: usize, bytes: usize) -> Vec<u32> {
    (0..bytes / 4)
        .map(|j| (expert as u32).wrapping_mul(0x9e37_79b9) ^ (j as u32).wrapping_mul(0x85eb_ca6b))
        .collect()
}

/// Prefetch: after a skewed dispatch, every prefetch slot holds its expert's weights; unused
/// slots keep their poison.
pub fn run_prefetch_case(rank: &mut Rank, seed: u64) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let e = |x: GpuError| x.to_string();
    let (experts, k, s, h, wb) = (16usize, 4usize, 64usize, 64usize, 4096usize);
    let mut cfg = EpConfig::new(experts, k, s, h);
    cfg.expert_bytes = wb;
    cfg.num_blocks = 8;
    let mut buf = EpBuffer::new(rank, cfg).map_err(e)?;
    if buf.transport != Transport::Nvlink {
        return Err("prefetch needs peer access".into());
    }
    let topk = make_topk(Routing::Clustered(0.9), r, experts, k, s, seed);
    let epn = experts / r;
    let dev = &rank.dev;
    let local: Vec<u32> = (0..epn)
        .flat_map(|le| expert_pattern(me * epn + le, wb))
        .collect();
    let local_d = dev.upload(&local).map_err(e)?;
    let x_d = dev.upload(&random_bf16(s, h, seed)).map_err(e)?;
    let topk_d = dev.upload(&topk[me]).map_err(e)?;
    let tpe_d = dev.upload(&tpe_of(&topk[me], experts)).map_err(e)?;
    let pool = buf.pool.as_ref().ok_or("no pool")?.ptr();
    dev.memset_u32(pool, 0xabab_abab, epn * wb / 4).map_err(e)?;
    dev.sync().map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: 0,
            topk: topk_d.ptr,
            tpe: tpe_d.ptr,
            s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    buf.prefetch(&rank.dev, local_d.ptr).map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    let etc = buf.read_plan(&rank.dev).map_err(e)?.experts_to_copy;
    let got: Vec<u32> = read_ptr(pool, epn * wb / 4).map_err(e)?;
    let mut replicas = 0;
    for b in 0..epn {
        let x = etc[me * epn + b];
        let want = if x >= 0 {
            expert_pattern(x as usize, wb)
        } else {
            vec![0xabab_abab; wb / 4]
        };
        replicas += usize::from(x >= 0);
        mismatch(
            &format!("prefetch slot {b} (expert {x})"),
            &got[b * wb / 4..(b + 1) * wb / 4],
            &want,
        )?;
    }
    let total: usize = rank
        .store
        .all_gather(&[replicas as u8])
        .map_err(|x| x.to_string())?
        .iter()
        .map(|v| v[0] as usize)
        .sum();
    if total == 0 {
        return Err("skewed routing produced no replica; prefetch untested".into());
    }
    Ok(())
}

/// Error paths: a barrier with an absent peer times out into the status word; a contract
/// violation and a bad expert id are reported on every rank without a hang; then it recovers.
pub fn run_error_cases(rank: &mut Rank, seed: u64) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let e = |x: GpuError| x.to_string();
    let (experts, k, s, h) = (8usize, 2usize, 32usize, 64usize);
    let mut cfg = EpConfig::new(experts, k, s, h);
    cfg.num_blocks = 4;
    cfg.barrier_timeout_ns = 2_000_000_000;
    let mut buf = EpBuffer::new(rank, cfg).map_err(e)?;
    let expect_code = |res: Result<(), GpuError>, code: u32, what: &str| match res {
        Err(GpuError::DeviceStatus { code: c, .. }) if c == code => Ok(()),
        other => Err(format!(
            "{what}: expected status {} ({}), got {other:?}",
            code,
            status::describe(code)
        )),
    };
    // 1. Lone barrier on rank 0.
    if me == 0 {
        buf.barrier_with_timeout(&rank.dev, 50_000_000).map_err(e)?;
        expect_code(
            buf.check(&rank.dev),
            status::BARRIER_TIMEOUT,
            "lone barrier",
        )?;
    }
    buf.reset_control(rank).map_err(e)?;
    let topk = make_topk(Routing::Random, r, experts, k, s, seed);
    let dev = &rank.dev;
    let x_d = dev.upload(&random_bf16(s, h, seed)).map_err(e)?;
    // 2. Contract violation on the last rank's tpe: every rank sees it after the all-gather.
    let mut tpe = tpe_of(&topk[me], experts);
    if me == r - 1 {
        tpe[0] += 1;
    }
    let tpe_bad = dev.upload(&tpe).map_err(e)?;
    let topk_d = dev.upload(&topk[me]).map_err(e)?;
    buf.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: 0,
            topk: topk_d.ptr,
            tpe: tpe_bad.ptr,
            s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    expect_code(buf.check(&rank.dev), status::CONTRACT, "contract violation")?;
    buf.reset_control(rank).map_err(e)?;
    // 3. Expert id out of range on rank 0 only: rank 0 reports it, the others time out.
    let mut bad = topk[me].clone();
    if me == 0 {
        bad[0] = experts as i32;
    }
    let dev = &rank.dev;
    let bad_d = dev.upload(&bad).map_err(e)?;
    let tpe_d = dev.upload(&tpe_of(&topk[me], experts)).map_err(e)?;
    buf.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: 0,
            topk: bad_d.ptr,
            tpe: tpe_d.ptr,
            s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    let code = if me == 0 {
        status::EXPERT_RANGE
    } else {
        status::BARRIER_TIMEOUT
    };
    let res = buf.check(&rank.dev);
    if buf.transport == Transport::Nvlink {
        expect_code(res, code, "bad expert id")?;
    }
    buf.reset_control(rank).map_err(e)?;
    // 4. Recovery: a valid call succeeds.
    buf.dispatch(
        rank,
        &Tokens {
            x: x_d.ptr,
            w: 0,
            topk: topk_d.ptr,
            tpe: tpe_d.ptr,
            s,
            total_tokens: None,
        },
    )
    .map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    Ok(())
}

/// The case list: random and extreme routings, dedup on/off, P in {1, 8, 128}, the fallback.
pub fn cases(world: usize) -> Vec<Case> {
    let e = 8 * world;
    let c = |name, experts, k, cap, s, h, p, routing, dedup, fallback| Case {
        name,
        experts,
        k,
        cap,
        s,
        h,
        p,
        routing,
        dedup,
        fallback,
    };
    vec![
        c(
            "random",
            e,
            4,
            256,
            200,
            256,
            8,
            Routing::Random,
            false,
            false,
        ),
        c(
            "random dedup",
            e,
            4,
            256,
            200,
            256,
            8,
            Routing::Random,
            true,
            false,
        ),
        c(
            "random P=128 H=7168",
            e,
            8,
            128,
            128,
            7168,
            128,
            Routing::Random,
            true,
            false,
        ),
        c(
            "all tokens to one expert",
            e,
            4,
            64,
            64,
            128,
            8,
            Routing::OneExpert,
            true,
            false,
        ),
        c(
            "half experts empty",
            e,
            3,
            64,
            50,
            128,
            1,
            Routing::HalfEmpty,
            true,
            false,
        ),
        c("s=1", e, 4, 64, 1, 128, 8, Routing::Random, true, false),
        c(
            "s=1 K=1 P=1",
            e,
            1,
            16,
            1,
            64,
            1,
            Routing::Random,
            false,
            false,
        ),
        c(
            "clustered 90%",
            e,
            6,
            256,
            256,
            256,
            16,
            Routing::Clustered(0.9),
            true,
            false,
        ),
        c(
            "clustered 95% no dedup",
            e,
            6,
            256,
            256,
            256,
            16,
            Routing::Clustered(0.95),
            false,
            false,
        ),
        c(
            "duplicates in a token",
            e,
            5,
            128,
            100,
            128,
            8,
            Routing::Duplicates,
            true,
            false,
        ),
        c(
            "epn=1",
            world,
            1,
            64,
            64,
            64,
            4,
            Routing::Random,
            true,
            false,
        ),
        c(
            "fallback random",
            e,
            4,
            256,
            200,
            256,
            8,
            Routing::Random,
            false,
            true,
        ),
        c(
            "fallback clustered 90%",
            e,
            6,
            128,
            100,
            128,
            16,
            Routing::Clustered(0.9),
            false,
            true,
        ),
        c(
            "fallback s=1",
            e,
            2,
            16,
            1,
            64,
            8,
            Routing::Random,
            false,
            true,
        ),
    ]
}

/// Runs every check; prints one line per check on rank 0; returns the number of failures.
/// Ranks sharing a GPU have no NCCL: the fallback and baseline cases are left out (and say so).
pub fn run_all(rank: &mut Rank) -> Result<usize, GpuError> {
    let world = rank.env.world;
    let nccl = !rank.shares_device();
    if rank.env.rank == 0 {
        if nccl {
            println!("mode: {world} ranks on {world} GPUs (IPC + NCCL)");
        } else {
            println!(
                "mode: {world} ranks sharing a GPU (IPC only; NCCL fallback and baseline cases not run)"
            );
        }
    }
    let mut failures = 0;
    let mut report =
        |rank: &mut Rank, name: String, res: Result<(), String>| -> Result<(), GpuError> {
            let mine = match &res {
                Ok(()) => String::new(),
                Err(m) => m.clone(),
            };
            let all = rank.store.all_gather(mine.as_bytes())?;
            let bad: Vec<String> = all
                .iter()
                .enumerate()
                .filter(|(_, m)| !m.is_empty())
                .map(|(r, m)| format!("rank {r}: {}", String::from_utf8_lossy(m)))
                .collect();
            if !bad.is_empty() {
                failures += 1;
            }
            if rank.env.rank == 0 {
                if bad.is_empty() {
                    println!("PASS {name}");
                } else {
                    println!("FAIL {name}: {}", bad.join("; "));
                }
            }
            Ok(())
        };
    for (i, c) in cases(world).iter().enumerate() {
        if c.fallback && !nccl {
            continue;
        }
        let res = run_case(rank, c, 1000 + i as u64);
        report(
            rank,
            format!(
                "dispatch/combine{} {} (E={} K={} s={} H={} P={} dedup={})",
                if c.fallback { "" } else { " + backward" },
                c.name,
                c.experts,
                c.k,
                c.s,
                c.h,
                c.p,
                c.dedup
            ),
            res,
        )?;
    }
    for (i, c) in cases(world)
        .iter()
        .filter(|c| !c.fallback && nccl)
        .take(6)
        .enumerate()
    {
        let res = run_baseline_case(rank, c, 2000 + i as u64);
        report(rank, format!("baseline {}", c.name), res)?;
    }
    let res = run_prefetch_case(rank, 3000);
    report(rank, "prefetch replicas".into(), res)?;
    for (i, share) in [0.75, 0.95].into_iter().enumerate() {
        let res = super::selftest_backward::run_reduce_grad_case(
            rank,
            Routing::Clustered(share),
            3100 + i as u64,
        );
        report(rank, format!("reduce_grad clustered {share}"), res)?;
    }
    let res = run_error_cases(rank, 4000);
    report(
        rank,
        "barrier timeout / contract / bad id reported, then recovery".into(),
        res,
    )?;
    Ok(failures)
}
