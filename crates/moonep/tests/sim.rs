//! Simulator: policy accounting against the real plan, and a quick sweep end to end.

use moonep::reference::ClusterPlan;
use moonep::router::{Placement, Skew, WorkloadSpec, generate};
use moonep::sim::{self, HardwareModel, Policy, SweepSpec, evaluate};

fn routing(
    ranks: usize,
    epn: usize,
    skew: Skew,
    placement: Placement,
    seed: u64,
) -> moonep::router::Routing {
    let spec = WorkloadSpec {
        experts: ranks * epn,
        top_k: 4,
        tokens: vec![48; ranks],
        skew,
        placement,
        seed,
    };
    generate(&spec).unwrap()
}

#[test]
fn moonep_traffic_matches_the_planned_slots() {
    let hw = HardwareModel::default();
    for (i, skew) in [
        Skew::Zipf { maxvio: 2.0 },
        Skew::HotHomeGroup,
        Skew::HotSourceRank,
        Skew::SingleHotExpert,
    ]
    .into_iter()
    .enumerate()
    {
        let r = routing(6, 4, skew, Placement::Clustered, i as u64);
        let topk: Vec<Vec<u32>> = (0..6).map(|rank| r.topk(rank, 9)).collect();
        let plan = ClusterPlan::new(&r.plan_config(48, hw.padding), &r.tpe, &topk).unwrap();
        let (mut inb, mut outb, mut load) = (vec![0u64; 6], vec![0u64; 6], vec![0u64; 6]);
        for src in 0..6 {
            for i in 0..topk[src].len() {
                let (d, _) = plan.slot(src, i);
                load[d] += 1;
                if d != src {
                    inb[d] += 2 * hw.hidden;
                    outb[src] += 2 * hw.hidden;
                }
            }
        }
        let out = evaluate(&r, Policy::MoonEp, &hw).unwrap();
        assert_eq!(
            (out.remote_in, out.remote_out, out.load),
            (inb, outb, load),
            "{skew:?}"
        );
        let replicas: Vec<u64> = (0..6).map(|d| plan.global.replicas_on(d) as u64).collect();
        assert_eq!(out.replicas, replicas);
    }
}

#[test]
fn policies_conserve_or_drop_tokens() {
    let hw = HardwareModel::default();
    let r = routing(8, 4, Skew::Zipf { maxvio: 3.0 }, Placement::Clustered, 3);
    let total: u64 = r.tpe.iter().map(|&x| u64::from(x)).sum();
    for policy in [
        Policy::None,
        Policy::MoonEp,
        Policy::Capacity { cf: 1.0 },
        Policy::CapacityGlobal { cf: 1.0 },
    ] {
        let out = evaluate(&r, policy, &hw).unwrap();
        let kept: u64 = out.load.iter().sum();
        assert_eq!(
            kept as f64,
            (total as f64 * (1.0 - out.drop_rate)).round(),
            "{policy:?}"
        );
        assert_eq!(
            out.remote_in.iter().sum::<u64>(),
            out.remote_out.iter().sum::<u64>()
        );
    }
    let none = evaluate(&r, Policy::None, &hw).unwrap();
    let cap = evaluate(&r, Policy::Capacity { cf: 1.0 }, &hw).unwrap();
    assert_eq!(none.drop_rate, 0.0);
    assert!(cap.drop_rate > 0.0, "maxvio 3 must drop at cf = 1");
    let moonep = evaluate(&r, Policy::MoonEp, &hw).unwrap();
    assert!(
        moonep.load.iter().all(|&l| l == moonep.load[0]),
        "exact balance"
    );
    assert!(none.load.iter().max() > moonep.load.iter().max());
}

#[test]
fn quick_sweep_writes_csv_and_plots() {
    let spec = SweepSpec::quick();
    let rows = sim::run_sweep(&spec).unwrap();
    assert_eq!(
        rows.len(),
        spec.shapes.len() * spec.workloads.len() * spec.policies.len()
    );
    for r in rows.iter().filter(|r| r.policy == "moonep") {
        assert_eq!(
            r.load_max_over_mean, 1.0,
            "{} {} {}",
            r.shape, r.workload, r.param
        );
        assert!(r.replicas_max as usize <= r.experts / r.ranks);
        assert!(r.stage_a_rounds < r.ranks);
    }
    // EP=2 with random placement hides the skew; EP=8 and clustered placement do not.
    let none = |ranks: usize, placement: &str| {
        rows.iter()
            .find(|r| {
                r.policy == "none"
                    && r.ranks == ranks
                    && r.workload == "zipf"
                    && r.param == "4"
                    && r.placement == placement
            })
            .unwrap()
            .load_max_over_mean
    };
    assert!(none(2, "random") < 1.02);
    assert!(none(8, "random") > none(2, "random"));
    assert!(none(2, "clustered") > 1.2);

    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("sim.csv");
    sim::write_csv(&rows, &csv).unwrap();
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(text.lines().count(), rows.len() + 1);
    assert!(text.starts_with(sim::CSV_HEADER));
    let svgs = sim::write_svgs(&rows, dir.path()).unwrap();
    assert_eq!(svgs.len(), spec.shapes.len() + 1);
    for p in svgs {
        let s = std::fs::read_to_string(&p).unwrap();
        assert!(
            s.contains("<svg") && s.contains("polyline"),
            "{}",
            p.display()
        );
    }
    assert!(!sim::report_plots(&rows).is_empty());
}
