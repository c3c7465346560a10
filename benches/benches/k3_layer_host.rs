//! Host-side work of one K3-like layer: moonep planning (what every rank runs per MoE layer when the plan is
//! computed on the CPU) and the flashkda float64 references (chunked form vs token recurrence).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use flashkda::reference::{KdaProblem, chunked_f64, recurrence_f64};
use k3_benches::{EP_CONFIGS, KDA_SHAPES};
use moonep::plan::{plan_entries, plan_global};

fn moe_planning(c: &mut Criterion) {
    let mut group = c.benchmark_group("moonep_plan");
    for cfg in EP_CONFIGS {
        let routing = moonep::router::generate(&cfg.workload(7)).expect("workload");
        let plan_cfg = routing.plan_config(cfg.tokens_per_rank, 128);
        let topk = routing.topk(0, 7);
        group.bench_with_input(
            BenchmarkId::new("global", cfg.name),
            &routing.tpe,
            |b, tpe| b.iter(|| plan_global(&plan_cfg, tpe).expect("plan")),
        );
        let plan = plan_global(&plan_cfg, &routing.tpe).expect("plan");
        group.bench_with_input(
            BenchmarkId::new("entries_rank0", cfg.name),
            &topk,
            |b, topk| b.iter(|| plan_entries(&plan_cfg, &plan, 0, topk).expect("entries")),
        );
    }
    group.finish();
}

fn kda_reference(c: &mut Criterion) {
    let mut group = c.benchmark_group("flashkda_reference");
    group.sample_size(10);
    for (name, lens, heads) in KDA_SHAPES {
        let p = KdaProblem::random(lens, *heads, true, 3);
        group.bench_with_input(BenchmarkId::new("chunked_f64", name), &p, |b, p| {
            b.iter(|| chunked_f64(p, flashkda::reference::CHUNK))
        });
        group.bench_with_input(BenchmarkId::new("recurrence_f64", name), &p, |b, p| {
            b.iter(|| recurrence_f64(p))
        });
    }
    group.finish();
}

criterion_group!(benches, moe_planning, kda_reference);
criterion_main!(benches);
