// kda_bwd_chunk.cu, launches 2 and 3 split over warp pairs (opt-in, `PassSchedule::PairV`): the same math
// as states_body / dstates_body, with half the mma of a chained chunk step per warp.
//
// An 8-warp block covers the same 64 value rows as a 4-warp block of the w4 passes. Warp w is half
// hf = w & 1 of pair pr = w >> 1; the pair owns value rows vw + [0, 16), vw = v0 + 16 pr; the warp holds
// keys [64 hf, 64 hf + 64) of them. Local accumulator tile j (j < 8) is global key tile 8 hf + j: lane
// (gq, tq) holds rows vw + gq (elements 0, 1) and vw + gq + 8 (2, 3), keys 64 hf + 8 j + 2 tq + (0, 1).
// The key-summed product of a step (W = S kd^T; dS kr^T of dU) is a partial over the warp's 64 keys; the
// pair exchanges the 16 x 16 fp32 partials through shared memory (tile [warp][step & 1], fragment order:
// float4 (X[nt][0..3]) at nt * 32 + lane, read back by the partner's same lane) and both add the partner's
// (P_own + P_other: the same fp32 bits in both warps). The exchange rides the block barrier every chunk
// step already has (the partial is computed from registers and the mbarrier-delivered record before it),
// so no extra barrier sits on the chain; PB (the `_p8n*` kernels) instead computes the partial after the
// block barrier and exchanges it through a pair-scoped named barrier (`bar.sync 1 + pr, 64`: ids 1 - 4,
// id 0 is __syncthreads, no other named barrier in these kernels). Two tiles used in turn: a warp writes
// step s + 2's partial only after the barrier of step s + 1, which its partner reaches after reading step
// s's. Both warps do the 16 x 16 work (identical inputs, identical results); the stores of the 16 x 16
// tiles are split (hi by half 0, lo by half 1; dv by half 0), each warp stores its own 64 keys of the chunk
// state (2 KiB, keys [64 hf, 64 hf + 64) of the tiled [value/16][key][value%16] layout) and of dh0 / dgl.
#pragma once

#define PAIR_XCH 256  // floats of one exchange tile (a warp's 16 x 16 fp32 partial)

// Dynamic shared memory: PS stages, per warp DB state staging tiles [64 key][16 value] bf16 and a 16 x 16
// bf16 tile staging tile, per warp two exchange tiles, PS mbarriers (`pair_smem_bytes` in src/launch/bwd.rs).
#define PAIR_SMEM(PS, DB) ((PS) * (REC_BYTES + CH * (64 + 8) * 2) + 8 * ((DB) * 64 + CH) * 16 * 2 + 8 * 2 * PAIR_XCH * 4 + (PS) * 8)
static_assert(sizeof(PassStage<64>) == REC_BYTES + CH * (64 + 8) * 2, "pair_smem_bytes in src/launch/bwd.rs");
static_assert(PAIR_SMEM(2, 2) == 86672 && PAIR_SMEM(3, 2) == 103384, "pair_smem_bytes in src/launch/bwd.rs");

// Pair pr's named barrier, id 1 + pr (literal ids: ptxas then counts 5 barriers, not 16).
__device__ __forceinline__ void pair_sync(int pr) {
  if (pr == 0) asm volatile("bar.sync 1, 64;\n" ::: "memory");
  else if (pr == 1) asm volatile("bar.sync 2, 64;\n" ::: "memory");
  else if (pr == 2) asm volatile("bar.sync 3, 64;\n" ::: "memory");
  else asm volatile("bar.sync 4, 64;\n" ::: "memory");
}

__device__ __forceinline__ void xch_put(float* xt, const float (&X)[2][4], int lane) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
    reinterpret_cast<float4*>(xt)[nt * 32 + lane] = make_float4(X[nt][0], X[nt][1], X[nt][2], X[nt][3]);
}

__device__ __forceinline__ void xch_add(float (&X)[2][4], const float* xt, int lane) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float4 o = reinterpret_cast<const float4*>(xt)[nt * 32 + lane];
    X[nt][0] += o.x;
    X[nt][1] += o.y;
    X[nt][2] += o.z;
    X[nt][3] += o.w;
  }
}

// One chained step's pair exchange: this warp's key-summed partial X (made by `partial`) goes to the
// partner before (PB false) or after (PB true) the block barrier that publishes `store`'s state
// rows and precedes `issue`'s next fetch; then the partner's partial (its slot `par` of `xch`) is added.
template <bool PB, typename Partial, typename Store, typename Issue>
__device__ __forceinline__ void pair_exchange(float (&X)[2][4], float* xch, int warp, int par, int pr,
                                              int lane, Partial&& partial, Store&& store, Issue&& issue) {
  float* xo = xch + ((warp * 2) + par) * PAIR_XCH;
  if (!PB) {
    partial();
    xch_put(xo, X, lane);
  }
  store();
  __syncthreads();
  issue();
  if (PB) {
    partial();
    xch_put(xo, X, lane);
    pair_sync(pr);
  }
  xch_add(X, xch + (((warp ^ 1) * 2) + par) * PAIR_XCH, lane);
}

// d G_last of the last chunk from the fp32 start state S: sum over the pair's 16 value rows of dht S for
// this warp's keys, into dgl[dbase + key]. The row pointer goes through an opaque move so that the 16
// addresses are not hoisted out of the chunk loop (32 registers held for the last chunk only).
__device__ __forceinline__ void dgl_rows_h(const KdaBwdParams& p, const float (&S)[8][4], size_t sbase, size_t dbase,
                                           int r0, int k0, int gq, int tq) {
  // element (row r0 + 8 hr, key k0 + 8 nt + 2 tq) at e0 + 8 hr KD + 8 nt; the row pointer is opaque
  const size_t e0 = sbase + (size_t)r0 * KD + k0 + 2 * tq;
  const unsigned char* base = static_cast<const unsigned char*>(p.dht) + e0 * (p.state_fp32 ? 4 : 2);
  asm volatile("mov.b64 %0, %0;\n" : "+l"(base));
  float part[8][2];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    part[nt][0] = part[nt][1] = 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int o = 8 * hr * KD + 8 * nt;
      float d0, d1;
      if (p.state_fp32) {
        const float2 x = *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(base) + o);
        d0 = x.x; d1 = x.y;
      } else {
        const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(reinterpret_cast<const bf16*>(base) + o);
        d0 = __low2float(x); d1 = __high2float(x);
      }
      part[nt][0] = fmaf(d0, S[nt][2 * hr], part[nt][0]);
      part[nt][1] = fmaf(d1, S[nt][2 * hr + 1], part[nt][1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = part[nt][e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (gq == 0) p.dgl[dbase + k0 + nt * 8 + 2 * tq + e] = v;
    }
}

// dh0 = the final dS, this warp's rows and keys; block and warp coordinates read again (not held in
// registers across the chunk loop).
__device__ __forceinline__ void store_dh0_h(const KdaBwdParams& p, const float (&dS)[8][4]) {
  uint32_t tid, bid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(bid));
  const int warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3, H = p.num_heads;
  const int slice = bid % 2, h = (bid / 2) % H, n = bid / (2 * H);
  const int vw = slice * 64 + (warp >> 1) * 16, k0 = 64 * (warp & 1);
  store_dh0_rows(p, dS, ((size_t)n * H + h) * KD * KD, vw + gq, k0, tq);
}

// The shared-memory carve-up of a pair block (after the PS stages).
template <int PS, int DB>
struct PairLayout {
  bf16* ots;     // this warp's DB state staging tiles
  bf16* tts;     // this warp's 16 x 16 tile staging
  float* xch;    // exchange tiles [8 warps][2][PAIR_XCH]
  uint64_t* bars;
  __device__ __forceinline__ PairLayout(unsigned char* raw, int warp) {
    unsigned char* b = raw + PS * sizeof(PassStage<64>);
    ots = reinterpret_cast<bf16*>(b) + warp * DB * 64 * 16;
    tts = reinterpret_cast<bf16*>(b) + 8 * DB * 64 * 16 + warp * CH * 16;
    xch = reinterpret_cast<float*>(b + 8 * (DB * 64 + CH) * 16 * 2);
    bars = reinterpret_cast<uint64_t*>(b + 8 * (DB * 64 + CH) * 16 * 2 + 8 * 2 * PAIR_XCH * 4);
  }
};

// ---- 2. forward state pass over warp pairs
template <int PS, int DB, bool PB>
__device__ __forceinline__ void states_pair_body(const KdaBwdParams& p, int bid) {
  constexpr int VS = 64, SLICES = KD / VS, NT = 256;
  extern __shared__ __align__(16) unsigned char bsm_raw[];
  PassStage<VS>* stg = reinterpret_cast<PassStage<VS>*>(bsm_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const PairLayout<PS, DB> L(bsm_raw, warp);
  mbar_init_stages(L.bars, PS, tid);
  __syncthreads();
  const int H = p.num_heads;
  const int slice = bid % SLICES, h = (bid / SLICES) % H, n = bid / (SLICES * H);
  long long bos, len, slot0;
  bseq(p, n, bos, len, slot0);
  const int pr = warp >> 1, hf = warp & 1, k0 = 64 * hf;
  const int v0 = slice * VS, vl = pr * 16, vw = v0 + vl;
  const int nch = (int)((len + CH - 1) / CH);
  const int lrow = ((lane >> 4) << 3) + (lane & 7), lhalf = (lane >> 3) & 1;
  float S[8][4];
  load_rows(S, p.h0, p.state_fp32, ((size_t)n * H + h) * KD * KD, vw + gq, tq, k0);
  auto nvalid = [&](int c) {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? (int)rem : CH;
  };
  auto issue = [&](int c) {  // one commit group per chunk, empty past the end
    if (c < nch) pass_prefetch<NT, VS, false>(stg[c % PS], smem_u32(&L.bars[c % PS]), p, p.v, slot0 + c, h, bos + (long long)c * CH, nvalid(c), v0, tid);
    else cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < PS - 1; ++c) issue(c);
  for (int c = 0; c < nch; ++c) {
    cp_async_wait_group<PS - 2>();
    mbar_wait(smem_u32(&L.bars[c % PS]), (uint32_t)((c / PS) & 1));
    const PassStage<VS>& st = stg[c % PS];
    const long long slot = slot0 + c;
    const int nv = nvalid(c);
    const size_t sh = (size_t)slot * H + h;
    if (c == nch - 1 && p.dht != nullptr) dgl_rows_h(p, S, ((size_t)n * H + h) * KD * KD, (((size_t)n * H + h) * 8 + vw / 16) * KD, vw + gq, k0, gq, tq);
    const bf16* kd = reinterpret_cast<const bf16*>(st.rec + R_KD);
    // W^T partial = S kd^T over this warp's keys: k-step j covers keys k0 + 16 j + [0, 16)
    float W[2][4] = {};
    auto partial = [&]() { kd_product<4>(W, S, kd, k0, lrow, lhalf); };
    pair_exchange<PB>(
        W, L.xch, warp, c & 1, pr, lane, partial,
        [&]() { store_rows_t<DB>(S, L.ots + (c % DB) * 64 * 16, p.sst + sh * KD * KD + (size_t)(vw / 16) * KD * 16 + k0 * 16, lane); },
        [&]() { issue(c + PS - 1); });
    const bf16* krT = reinterpret_cast<const bf16*>(st.rec + R_KR);
    const bf16* inv = reinterpret_cast<const bf16*>(st.rec + R_INV);
    const float* E = reinterpret_cast<const float*>(st.rec + R_E);
    const float* b = reinterpret_cast<const float*>(st.rec + R_B);
    // Wr = v - W (hi stored by half 0, lo by half 1), Vb = Wr b split hi + lo; U = INV Vb
    bf16* wr = p.wu + sh * 4 * CH * KD + vw;
    float vb[2][4];
    {
      float x[2][4];
      wr_residual(x, nullptr, vb, st.t, W, b, nv, vl, gq, tq);
      if (hf == 0) {
        store_tile_t(x, L.tts, wr, KD, CH, lane);
      } else {
        float xl[2][4];
        lo_tile(xl, x);
        store_tile_t(xl, L.tts, wr + 3 * CH * KD, KD, CH, lane);
      }
    }
    uint32_t uah[4], ual[4];
    solve_u_split(uah, ual, vb, inv, lrow, lhalf);
    // S = S diag(E) + U^T kr, this warp's keys
    update_state_split<4>(S, uah, ual, krT, E, k0, lrow, lhalf, tq);
  }
  bulk_drain(lane);
}

// ---- 3. reverse state-gradient pass over warp pairs
template <int PS, int DB, bool PB>
__device__ __forceinline__ void dstates_pair_body(const KdaBwdParams& p, int bid) {
  constexpr int VS = 64, SLICES = KD / VS, NT = 256;
  extern __shared__ __align__(16) unsigned char bsm_raw[];
  PassStage<VS>* stg = reinterpret_cast<PassStage<VS>*>(bsm_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const PairLayout<PS, DB> L(bsm_raw, warp);
  mbar_init_stages(L.bars, PS, tid);
  __syncthreads();
  const int H = p.num_heads;
  const int slice = bid % SLICES, h = (bid / SLICES) % H, n = bid / (SLICES * H);
  long long bos, len, slot0;
  bseq(p, n, bos, len, slot0);
  const int pr = warp >> 1, hf = warp & 1, k0 = 64 * hf;
  const int v0 = slice * VS, vl = pr * 16, vw = v0 + vl;
  const int nch = (int)((len + CH - 1) / CH);
  const int lj = lane >> 3, lr = (lane & 7) + 8 * (lj & 1), lc = 8 * (lj >> 1);  // ldmatrix.trans rows
  const size_t sbase = ((size_t)n * H + h) * KD * KD;
  const long long hs = (long long)H * KD;
  float dS[8][4];
  load_rows(dS, p.dht, p.state_fp32, sbase, vw + gq, tq, k0);
  auto nvalid = [&](int c) {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? (int)rem : CH;
  };
  auto issue = [&](int k) {  // k-th chunk from the end; one commit group each, empty past the start
    const int c = nch - 1 - k;
    if (c >= 0) pass_prefetch<NT, VS, true>(stg[k % PS], smem_u32(&L.bars[k % PS]), p, p.dout, slot0 + c, h, bos + (long long)c * CH, nvalid(c), v0, tid);
    else cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < PS - 1; ++k) issue(k);
  for (int k = 0; k < nch; ++k) {
    const int c = nch - 1 - k;
    cp_async_wait_group<PS - 2>();
    mbar_wait(smem_u32(&L.bars[k % PS]), (uint32_t)((k / PS) & 1));
    const PassStage<VS>& st = stg[k % PS];
    const long long slot = slot0 + c, t0 = bos + (long long)c * CH;
    const int nv = nvalid(c);
    const size_t sh = (size_t)slot * H + h;
    const bf16* krT = reinterpret_cast<const bf16*>(st.rec + R_KR);
    // dU^T partial = dS kr^T over this warp's keys: k-step j covers keys k0 + 16 j + [0, 16)
    float dU[2][4] = {};
    auto partial = [&]() { kr_product<4>(dU, dS, krT, k0, lr, lc); };
    pair_exchange<PB>(
        dU, L.xch, warp, k & 1, pr, lane, partial,
        [&]() { store_rows_t<DB>(dS, L.ots + (k % DB) * 64 * 16, p.dss + sh * KD * KD + (size_t)(vw / 16) * KD * 16 + k0 * 16, lane); },
        [&]() { issue(k + PS - 1); });
    const bf16* kd = reinterpret_cast<const bf16*>(st.rec + R_KD);
    const bf16* qd = reinterpret_cast<const bf16*>(st.rec + R_QD);
    const bf16* inv = reinterpret_cast<const bf16*>(st.rec + R_INV);
    const bf16* mm = reinterpret_cast<const bf16*>(st.rec + R_M);
    const float* E = reinterpret_cast<const float*>(st.rec + R_E);
    const float* b = reinterpret_cast<const float*>(st.rec + R_B);
    uint32_t oa[4];  // dO^T as an A operand (value rows x tokens); dU^T += dO^T M
    dout_m(dU, oa, st.t, mm, vl, gq, tq, lr, lc);
    bf16* dus = p.wu + (sh * 4 + 1) * CH * KD + vw;
    if (hf == 0) {
      store_tile_t(dU, L.tts, dus, KD, CH, lane);
    } else {
      float dl[2][4];
      lo_tile(dl, dU);
      store_tile_t(dl, L.tts, dus + CH * KD, KD, CH, lane);
    }
    // dv^T = (dU^T INV) diag(b)
    float dW[2][4];
    dv_tile(dW, dU, inv, b, lr, lc, tq);
    if (hf == 0) store_tile_t(dW, L.tts, p.dv + t0 * hs + (long long)h * KD + vw, (size_t)hs, nv, lane);
    uint32_t wh[4], wl[4];
    split_tile(wh, wl, dW, -1.f);
    // dS = dS diag(E) + dO^T qd - dv^T kd, this warp's keys: step np covers keys k0 + 16 np + [0, 16)
    update_dstate_split<4>(dS, oa, wh, wl, qd, kd, E, k0, lr, lc, tq);
  }
  if (p.dh0 != nullptr) store_dh0_h(p, dS);
  bulk_drain(lane);
}

// 8-warp blocks (4 pairs, 64 value rows: the w4 passes' grid) at <= 128 registers: two blocks per SM, so
// both passes of H = 64 fixed (2 x 128 blocks) are resident at once. d2 / d3: 2 / 3 cp.async stages,
// double-buffered state staging; n2: d2 with the named pair barrier.
extern "C" __global__ void __launch_bounds__(256, 2) kdab_states_p8d2(const KdaBwdParams p) { states_pair_body<2, 2, false>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) kdab_dstates_p8d2(const KdaBwdParams p) { dstates_pair_body<2, 2, false>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) kdab_states_p8d3(const KdaBwdParams p) { states_pair_body<3, 2, false>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) kdab_dstates_p8d3(const KdaBwdParams p) { dstates_pair_body<3, 2, false>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) kdab_states_p8n2(const KdaBwdParams p) { states_pair_body<2, 2, true>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(256, 2) kdab_dstates_p8n2(const KdaBwdParams p) { dstates_pair_body<2, 2, true>(p, blockIdx.x); }
