//! Rank-side GPU checks of the backward (IPC path): combine-backward, dispatch-backward and
//! `reduce_grad` against [`crate::reference`], exactly, with poisoned outputs. Called from
//! [`super::selftest`] after a case's forward checks, on the same buffer and plan.

use half::bf16;

use super::GpuError;
use super::driver::{read_ptr, write_ptr};
use super::ep::{EpBuffer, EpConfig, Tokens, Transport, plan_config};
use super::rank::Rank;
use super::selftest::{Case, mismatch, poison_bf16_pair};
use super::workload::{Routing, make_topk, random_bf16, random_f32, tpe_of};
use crate::reference::{
    self, ClusterPlan, POISON, ReplicaPools, VirtualCluster, combine_backward, dispatch_backward,
};

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn to_bf16(v: &[u16]) -> Vec<bf16> {
    v.iter().map(|&b| bf16::from_bits(b)).collect()
}

/// After a forward case: combine-backward of fresh token gradients must leave every used row
/// equal to the reference (gradient rows, zero padding) and keep the slot weights; then
/// dispatch-backward of fresh slot gradients must equal the reference dx and dw.
pub(crate) fn check_case_backward(
    rank: &mut Rank,
    buf: &mut EpBuffer,
    c: &Case,
    seed: u64,
    plan: &ClusterPlan,
    forward: &VirtualCluster,
) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let e = |x: GpuError| x.to_string();
    let used = plan.global.layouts[me].used_rows() as usize;
    // 1. combine-backward.
    let grads: Vec<Vec<u16>> = (0..r)
        .map(|src| random_bf16(c.s, c.h, seed ^ (0x4000 + src as u64)))
        .collect();
    let grads_bf: Vec<Vec<bf16>> = grads.iter().map(|g| to_bf16(g)).collect();
    let want = combine_backward(plan, &grads_bf, c.h).map_err(|x| x.to_string())?;
    let dev = &rank.dev;
    let g_d = dev.upload(&grads[me]).map_err(e)?;
    dev.memset_u32(
        buf.hidden.ptr(),
        poison_bf16_pair(),
        buf.shard_slots() * c.h / 2,
    )
    .map_err(e)?;
    dev.sync().map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.combine_backward(rank, g_d.ptr).map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    let got: Vec<u16> = read_ptr(buf.hidden.ptr(), used * c.h).map_err(e)?;
    mismatch(
        "combine_backward rows vs reference",
        &got,
        &bits(&want.shards[me][..used * c.h]),
    )?;
    let got_w: Vec<u32> = read_ptr(buf.wts.ptr(), used).map_err(e)?;
    let keep: Vec<u32> = forward.wts[me][..used]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    mismatch("combine_backward kept slot weights", &got_w, &keep)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    // 2. dispatch-backward: fresh slot gradients (rows and weights) on every rank's used rows.
    let nvs = plan.global.shard_slots as usize;
    let mut gy = vec![vec![bf16::from_f32(POISON); nvs * c.h]; r];
    let mut gw = vec![vec![POISON; nvs]; r];
    for d in 0..r {
        let u = plan.global.layouts[d].used_rows() as usize;
        let rows = random_bf16(u, c.h, seed ^ (0x5000 + d as u64));
        gy[d][..u * c.h].copy_from_slice(&to_bf16(&rows));
        gw[d][..u].copy_from_slice(&random_f32(u, seed ^ (0x6000 + d as u64)));
    }
    if used > 0 {
        write_ptr(buf.hidden.ptr(), &bits(&gy[me][..used * c.h])).map_err(e)?;
        write_ptr(buf.wts.ptr(), &gw[me][..used]).map_err(e)?;
    }
    let want = dispatch_backward(plan, &gy, Some(&gw), c.h).map_err(|x| x.to_string())?;
    let dev = &rank.dev;
    let dx_d = dev.alloc(c.s * c.h * 2).map_err(e)?;
    let dw_d = dev.alloc(c.s * c.k * 4).map_err(e)?;
    dev.memset_u32(dx_d.ptr, poison_bf16_pair(), c.s * c.h / 2)
        .map_err(e)?;
    dev.memset_u32(dw_d.ptr, POISON.to_bits(), c.s * c.k)
        .map_err(e)?;
    dev.sync().map_err(e)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.dispatch_backward(rank, dx_d.ptr, dw_d.ptr).map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    let got_dx: Vec<u16> = read_ptr(dx_d.ptr, c.s * c.h).map_err(e)?;
    mismatch(
        "dispatch_backward dx vs reference",
        &got_dx,
        &bits(&want.dx[me]),
    )?;
    let got_dw: Vec<u32> = read_ptr(dw_d.ptr, c.s * c.k).map_err(e)?;
    let want_dw: Vec<u32> = want.dw.as_ref().ok_or("no dw")?[me]
        .iter()
        .map(|v| v.to_bits())
        .collect();
    mismatch("dispatch_backward dw vs reference", &got_dw, &want_dw)?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    Ok(())
}

/// `reduce_grad` under a skewed routing (replicas on the cold rank): home grads equal the
/// reference sum bit for bit, consumed reduce slots are zero, unused slots keep their poison.
pub fn run_reduce_grad_case(rank: &mut Rank, routing: Routing, seed: u64) -> Result<(), String> {
    let (me, r) = (rank.env.rank, rank.env.world);
    let e = |x: GpuError| x.to_string();
    // A `gh × gh` gradient per expert (the reference's ReplicaPools are square).
    let (experts, k, s, h, gh) = (8 * r, 4usize, 128usize, 64usize, 24usize);
    let elems = gh * gh;
    let mut cfg = EpConfig::new(experts, k, s, h);
    cfg.grad_elems = elems;
    cfg.padding = 8;
    cfg.num_blocks = 8;
    let mut buf = EpBuffer::new(rank, cfg).map_err(e)?;
    if buf.transport != Transport::Nvlink {
        return Err("reduce_grad needs the IPC transport".into());
    }
    let topk = make_topk(routing, r, experts, k, s, seed);
    let tpe_all: Vec<u32> = topk
        .iter()
        .flat_map(|t| tpe_of(t, experts))
        .map(|x| x as u32)
        .collect();
    let topk_u32: Vec<Vec<u32>> = topk
        .iter()
        .map(|t| t.iter().map(|&x| x as u32).collect())
        .collect();
    let pc = plan_config(&cfg, r, s, None);
    let plan = ClusterPlan::new(&pc, &tpe_all, &topk_u32).map_err(|x| x.to_string())?;
    let epn = experts / r;
    let dev = &rank.dev;
    let x_d = dev.upload(&random_bf16(s, h, seed)).map_err(e)?;
    let topk_d = dev.upload(&topk[me]).map_err(e)?;
    let tpe_d = dev.upload(&tpe_of(&topk[me], experts)).map_err(e)?;
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
    buf.check(&rank.dev).map_err(e)?;
    // Reduce slots: fresh values where a replica lives, poison elsewhere; home grads fresh.
    let mut reduce = ReplicaPools::filled(r, epn, gh, POISON);
    let mut home: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); epn]; r];
    for d in 0..r {
        for (b, &x) in plan.global.layouts[d].experts_to_copy.iter().enumerate() {
            if x >= 0 {
                reduce.slots[d][b] = random_f32(elems, seed ^ (0x7000 + (d * epn + b) as u64));
            }
        }
        for g in 0..epn {
            home[d][g] = random_f32(elems, seed ^ (0x8000 + (d * epn + g) as u64));
        }
    }
    let replicas: usize = (0..r).map(|d| plan.global.replicas_on(d)).sum();
    if replicas == 0 {
        return Err("routing produced no replica; reduce_grad untested".into());
    }
    let mine: Vec<f32> = reduce.slots[me].iter().flatten().copied().collect();
    let own_reduce = buf.reduce.as_ref().ok_or("no reduce slots")?.ptr();
    write_ptr(own_reduce, &mine).map_err(e)?;
    let home_mine: Vec<f32> = home[me].iter().flatten().copied().collect();
    let home_d = rank.dev.upload(&home_mine).map_err(e)?;
    reference::reduce_grad(&plan, &mut home, &mut reduce);
    rank.store.barrier().map_err(|x| x.to_string())?;
    buf.reduce_grad(&rank.dev, home_d.ptr).map_err(e)?;
    buf.check(&rank.dev).map_err(e)?;
    let u32s = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let got: Vec<u32> = read_ptr(home_d.ptr, epn * elems).map_err(e)?;
    let want: Vec<f32> = home[me].iter().flatten().copied().collect();
    mismatch("reduce_grad home grads vs reference", &got, &u32s(&want))?;
    let got: Vec<u32> = read_ptr(own_reduce, epn * elems).map_err(e)?;
    let want: Vec<f32> = reduce.slots[me].iter().flatten().copied().collect();
    mismatch("reduce slots after reduce_grad", &got, &u32s(&want))?;
    rank.store.barrier().map_err(|x| x.to_string())?;
    Ok(())
}
