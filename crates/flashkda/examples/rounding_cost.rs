//! What each bf16 rounding point of the kernels costs against float64 (CPU only):
//! `cargo run --release -p flashkda --example rounding_cost`.
use flashkda::reference::emulated::{Operand, Rounding, emulated_with};
use flashkda::reference::metrics::rel_frobenius;
use flashkda::reference::{KdaProblem, recurrence_f64};

fn main() {
    let seed = 12345u64;
    let mut cases: Vec<(&str, KdaProblem)> = vec![
        ("fixed-2048-H2", KdaProblem::random(&[2048], 2, true, seed)),
        ("t16-H2", KdaProblem::random(&[16], 2, true, seed)),
        ("t37-H4", KdaProblem::random(&[37], 4, true, seed)),
    ];
    let mut nd = KdaProblem::random(&[1024], 2, true, seed);
    nd.g.iter_mut().for_each(|g| *g = -30.0);
    cases.push(("no-decay-1024-H2", nd));
    if std::env::args().any(|a| a == "--long") {
        // long memory: only the kernels' two roundings
        let mut nd = KdaProblem::random(&[4096], 1, true, seed);
        nd.g.iter_mut().for_each(|g| *g = -30.0);
        let long = KdaProblem::random(&[32768], 1, true, seed);
        for (name, p) in [("no-decay-4096-H1", nd), ("chain-32768-H1", long)] {
            let r = recurrence_f64(&p);
            for (rn, ro) in [("bf16", Rounding::KERNEL), ("split", Rounding::SPLIT)] {
                let e = emulated_with(&p, ro);
                println!(
                    "{name} {rn}: out {:.3e} state {:.3e}",
                    rel_frobenius(&e.out, &r.out),
                    rel_frobenius(&e.final_state, &r.final_state)
                );
            }
        }
        return;
    }
    type Set = fn(&mut Rounding, Operand);
    let points: [(&str, Set); 10] = [
        ("prep", |r, b| r.prep = b),
        ("kd", |r, b| r.kd = b),
        ("qd", |r, b| r.qd = b),
        ("kr", |r, b| r.kr = b),
        ("inv", |r, b| r.inv = b),
        ("m", |r, b| r.m = b),
        ("state_operand", |r, b| r.state_operand = b),
        ("vb", |r, b| r.vb = b),
        ("u_out", |r, b| r.u_out = b),
        ("u_state", |r, b| r.u_state = b),
    ];
    let f = Operand::F32;
    let combos: Vec<(&str, Rounding)> = vec![
        ("split kernel", Rounding::SPLIT),
        (
            "split kernel, U_state bf16",
            Rounding {
                u_state: Operand::Bf16,
                ..Rounding::SPLIT
            },
        ),
        (
            "fp32 prep, M, Vb, U",
            Rounding {
                prep: f,
                m: f,
                vb: f,
                u_out: f,
                u_state: f,
                ..Rounding::KERNEL
            },
        ),
        (
            "split + fp32 qd, kr",
            Rounding {
                qd: f,
                kr: f,
                ..Rounding::SPLIT
            },
        ),
        (
            "split + fp32 qd, kr, S",
            Rounding {
                qd: f,
                kr: f,
                state_operand: f,
                ..Rounding::SPLIT
            },
        ),
    ];
    for (name, p) in &cases {
        let r = recurrence_f64(p);
        let err = |ro: Rounding| {
            let e = emulated_with(p, ro);
            (
                rel_frobenius(&e.out, &r.out),
                rel_frobenius(&e.final_state, &r.final_state),
            )
        };
        let (ko, ks) = err(Rounding::KERNEL);
        let (no, ns) = err(Rounding::NONE);
        println!(
            "{name}: kernel out {ko:.3e} state {ks:.3e} | only output rounded: out {no:.3e} state {ns:.3e}"
        );
        for (pn, set) in points {
            let mut off = Rounding::KERNEL;
            set(&mut off, Operand::F32);
            let mut on = Rounding::NONE;
            set(&mut on, Operand::Bf16);
            let (o1, s1) = err(off);
            let (o2, s2) = err(on);
            println!(
                "  {pn:>14}: kernel without it out {o1:.3e} state {s1:.3e} | only it out {o2:.3e} state {s2:.3e}"
            );
        }
        for (cn, ro) in &combos {
            let (o, s) = err(*ro);
            println!("  {cn:>32}: out {o:.3e} state {s:.3e}");
        }
    }
}
