//! GPU test of the chunk-64 forward's wgmma building blocks (`kda_c64_wgmma_selftest` in
//! `kernels/kda_c64_selftest.cuh`): the no-swizzle K-major tiles and descriptors of the record, the
//! accumulator -> A-fragment mapping, m64n64 and m64n128 products, a split (hi + lo) A operand. Run
//! before the chunk64 variant of `tests/gpu.rs`: a failure here is a layout error, not a math one.
//! Skipped, with the reason printed, where no Hopper GPU is.

mod common;
use common::{gpu, log_line, seed};

use cudarc::driver::{LaunchConfig, PushKernelArg};
use flashkda::launch::embedded_cubin;
use rand::{Rng, SeedableRng};

fn bf(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn rel(x: &[f32], r: &[f64]) -> f64 {
    let num: f64 = x
        .iter()
        .zip(r)
        .map(|(a, b)| (f64::from(*a) - b).powi(2))
        .sum();
    let den: f64 = r.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

#[test]
fn chunk64_wgmma_building_blocks() {
    let Some((kernels, stream)) = gpu() else {
        return;
    };
    let s = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(s);
    let mut randv =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect() };
    let (x, x2) = (randv(64 * 128), randv(64 * 128));
    let bm: Vec<f32> = randv(64 * 128).into_iter().map(bf).collect();
    let kr: Vec<f32> = randv(64 * 128).into_iter().map(bf).collect();
    let bits = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&a| half::bf16::from_f32(a).to_bits())
            .collect()
    };

    let cubin = embedded_cubin("kda_fwd_c64").expect("kernels built");
    let module = kernels
        .context()
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
        .expect("load the kda_fwd_c64 cubin");
    let f = module
        .load_function("kda_c64_wgmma_selftest")
        .expect("kda_c64_wgmma_selftest");
    let dx = stream.clone_htod(&x).unwrap();
    let dbm = stream.clone_htod(&bits(&bm)).unwrap();
    let dx2 = stream.clone_htod(&x2).unwrap();
    let dkr = stream.clone_htod(&bits(&kr)).unwrap();
    let mut d1 = stream.clone_htod(&vec![f32::NAN; 64 * 64]).unwrap();
    let mut d2 = stream.clone_htod(&vec![f32::NAN; 64 * 128]).unwrap();
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&dx)
        .arg(&dbm)
        .arg(&dx2)
        .arg(&dkr)
        .arg(&mut d1)
        .arg(&mut d2);
    // SAFETY: one warpgroup reading the four inputs and writing D1 [64][64], D2 [64][128] f32.
    unsafe { launch.launch(cfg) }.expect("launch");
    stream.synchronize().expect("selftest ran");
    let g1 = stream.clone_dtoh(&d1).unwrap();
    let g2 = stream.clone_dtoh(&d2).unwrap();
    assert!(
        g1.iter().chain(&g2).all(|v| v.is_finite()),
        "outputs not written"
    );

    // D1 = bf16(X) Bm^T
    let mut r1 = vec![0.0f64; 64 * 64];
    for i in 0..64 {
        for n in 0..64 {
            r1[i * 64 + n] = (0..128)
                .map(|k| f64::from(bf(x[i * 128 + k])) * f64::from(bm[n * 128 + k]))
                .sum();
        }
    }
    // D2 = X2 + D1 Kr, D1 (the kernel's) entering as hi + lo: about 16 bits
    let mut r2 = vec![0.0f64; 64 * 128];
    for i in 0..64 {
        for c in 0..128 {
            let acc: f64 = (0..64)
                .map(|t| {
                    let v = g1[i * 64 + t];
                    let hi = bf(v);
                    f64::from(hi + bf(v - hi)) * f64::from(kr[t * 128 + c])
                })
                .sum();
            r2[i * 128 + c] = f64::from(x2[i * 128 + c]) + acc;
        }
    }
    let (e1, e2) = (rel(&g1, &r1), rel(&g2, &r2));
    log_line(&format!(
        "{{\"test\":\"wgmma selftest\",\"seed\":{s},\"d1_rel\":{e1:e},\"d2_rel\":{e2:e}}}"
    ));
    assert!(
        e1 < 1e-5,
        "m64n64 product (kd tile layout, S -> A fragments): rel {e1:e}"
    );
    assert!(
        e2 < 1e-5,
        "m64n128 product (krT tile layout, split A): rel {e2:e}"
    );
}
