//! What the chunk-64 kernel's rounding choices cost against float64 (CPU only), on the cases of
//! `examples/rounding_cost.rs`: `cargo run --release -p flashkda --example rounding_cost_c64
//! [-- --long]`. Prints, per case, the 16-token kernels' two roundings and the chunk-64 emulation
//! under each candidate (`reference::emulated64`); `--long` runs only the long-memory cases.
use flashkda::reference::KdaProblem;
use flashkda::reference::emulated::{Operand, Rounding, emulated_with};
use flashkda::reference::emulated64::{C64_KERNEL, emulated_chunked_with};
use flashkda::reference::metrics::rel_frobenius;
use flashkda::reference::recurrence_f64;

fn main() {
    let seed = 12345u64;
    let long = std::env::args().any(|a| a == "--long");
    let mut cases: Vec<(&str, KdaProblem)> = Vec::new();
    if long {
        let mut nd = KdaProblem::random(&[4096], 1, true, seed);
        nd.g.iter_mut().for_each(|g| *g = -30.0);
        cases.push(("no-decay-4096-H1", nd));
        cases.push((
            "chain-32768-H1",
            KdaProblem::random(&[32768], 1, true, seed),
        ));
    } else {
        cases.push(("fixed-2048-H2", KdaProblem::random(&[2048], 2, true, seed)));
        cases.push(("t16-H2", KdaProblem::random(&[16], 2, true, seed)));
        cases.push(("t37-H4", KdaProblem::random(&[37], 4, true, seed)));
        let mut nd = KdaProblem::random(&[1024], 2, true, seed);
        nd.g.iter_mut().for_each(|g| *g = -30.0);
        cases.push(("no-decay-1024-H2", nd));
    }
    let s = Operand::Split;
    let b = Operand::Bf16;
    let candidates: Vec<(&str, Rounding)> = vec![
        ("c64 all bf16", Rounding::KERNEL),
        ("c64 kernel (16-token split points)", C64_KERNEL),
        (
            "c64 kernel + split INV",
            Rounding {
                inv: s,
                ..C64_KERNEL
            },
        ),
        (
            "c64 kernel, U_state bf16",
            Rounding {
                u_state: b,
                ..C64_KERNEL
            },
        ),
        (
            "c64 kernel, prep bf16",
            Rounding {
                prep: b,
                ..C64_KERNEL
            },
        ),
        (
            "c64 kernel, Vb bf16",
            Rounding {
                vb: b,
                ..C64_KERNEL
            },
        ),
        ("c64 kernel, M bf16", Rounding { m: b, ..C64_KERNEL }),
        (
            "c64 kernel + split kr",
            Rounding {
                kr: s,
                ..C64_KERNEL
            },
        ),
    ];
    for (name, p) in &cases {
        let r = recurrence_f64(p);
        let err = |e: flashkda::reference::KdaOutput| {
            (
                rel_frobenius(&e.out, &r.out),
                rel_frobenius(&e.final_state, &r.final_state),
            )
        };
        println!("{name}:");
        for (cn, ro) in [
            ("c16 bf16", Rounding::KERNEL),
            ("c16 split", Rounding::SPLIT),
        ] {
            let (o, st) = err(emulated_with(p, ro));
            println!("  {cn:>36}: out {o:.3e} state {st:.3e}");
        }
        for (cn, ro) in &candidates {
            if long && !cn.starts_with("c64 all") && !cn.starts_with("c64 kernel (") {
                continue;
            }
            let (o, st) = err(emulated_chunked_with(p, 64, *ro));
            println!("  {cn:>36}: out {o:.3e} state {st:.3e}");
        }
    }
}
