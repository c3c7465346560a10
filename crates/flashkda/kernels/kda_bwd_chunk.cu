// KDA backward on tensor cores, chunked (16-token chunks, the math of `reference::chunked_grad_f64`).
// Launches over one workspace (src/launch/bwd.rs):
//  1. kda_prep (kda_fwd_ws.cu, split): the per-(chunk slot, head) records: kd, qd (scaled), krT,
//     INV = (I + diag(b) A)^-1, M (scaled), E = 2^G_last, b.
//  2. kdab_states: the forward state pass again, storing per chunk the start state S0 (bf16,
//     transposed) and Wr = v - kd S0^T (hi + lo bf16), and for the last chunk sum_v dht S0 from the
//     fp32 state; parallel over value-row slices.
//  3. kdab_dstates: the reverse pass over chunks: dS (fp32, mma fragments) enters as d(end state),
//     is stored (bf16), gives dU = M^T dO + KR dS^T (stored hi + lo), dv = diag(b) INV^T dU, and
//     leaves as dS diag(E) + dO^T qd - dv^T kd; parallel over value-row slices. Independent of 2:
//     the launcher runs both at once (2 on a side stream), halving the sequential chunk steps.
//  4. kdab_chunk (.cuh): one block per (chunk, head) over all value rows: U = X diag(b) Wr, dO U^T,
//     dO S0, dv S0, U dS, dU Wr^T on mma (split operands where bf16 costs accuracy), the 16x16 WY
//     backward (dbeta, dA) in fp32, then d q_hat, d k_hat, d gamma, d b and, without GVA, the
//     finish (dq, dk, dg, dbeta, per-chunk partial sums of ddt_bias and dA_log for kdab_reduce).
//  5. GVA only: kda_bwd_finish (L2-norm, gate and sigmoid chain rules over the row sums).
#define KDA_SPLIT_OPERANDS 1
#include "kda_fwd_ws.cu"

// Mirrored by `BwdKernelParams` in src/launch/bwd.rs (size checked by a test there).
struct KdaBwdParams {
  const bf16* q;        // [T, Hqk, 128]
  const bf16* k;
  const bf16* v;        // [T, H, 128]
  const bf16* g;
  const bf16* beta;     // [T, H] logits
  const float* a_log;   // [H]
  const float* dt_bias; // [H, 128]
  const void* h0;       // [N, H, 128, 128] or null (zeros)
  const long long* cu_seqlens;
  const bf16* dout;     // [T, H, 128]
  const void* dht;      // [N, H, 128, 128] or null (zeros)
  bf16* dq;             // [T, Hqk, 128]
  bf16* dk;
  bf16* dv;             // [T, H, 128]
  bf16* dg;
  bf16* dbeta;          // [T, H]
  float* da_log;        // [H], zeroed by the launcher
  float* ddt_bias;      // [H, 128], zeroed by the launcher
  void* dh0;            // [N, H, 128, 128] or null
  const unsigned char* rec;  // [slots, H] prep records
  bf16* sst;            // [slots, H, 8, 128 key, 16 value] chunk start states (transposed 16-row tiles)
  bf16* dss;            // [slots, H, 8, 128 key, 16 value] d(chunk end state) (same)
  bf16* wu;             // [slots, H, 4, 16, 128]: Wr hi, dU hi, dU lo, Wr lo ([token][value row])
  float* acc;           // [T, H, ACC_W] row sums (GVA only)
  float* part;          // [slots, H, PART_W]: per-chunk ddt_bias[128], dA_log (not GVA)
  float* dgl;           // [N, H, 8, 128]: per 16-row tile, sum_v dht S0 of the last chunk (fp32 S0)
  long long seq_len;
  long long total_tokens;
  int num_heads;
  int qk_heads;
  int num_seqs;
  int state_fp32;       // h0 / dht
  int dh0_fp32;
  float scale;
  float lower_bound;
  int fused;            // 1 (no GVA): kdab_chunk writes dq, dk, dg, dbeta and the partial sums
  const unsigned int* flags;  // [slots, H] record ready flags (kdab_states beside the prep) or null
};
static_assert(sizeof(KdaBwdParams) == 264 && offsetof(KdaBwdParams, flags) == 256, "BwdKernelParams in src/launch/bwd.rs");

#define ACC_W (3 * KD + 4)  // per (token, head): dq_hat[128], dk_hat[128], dgamma[128], db, 3 pad
#define FS 132              // padded fp32 row stride (conflict-free [2tq][gq], 2-way [gq][2tq])
#define PART_W 132          // floats of a chunk's partial sums
#define PST 3               // stages of the state passes' cp.async pipeline (PST - 1 chunks ahead)

__device__ __forceinline__ void bseq(const KdaBwdParams& p, int n, long long& bos, long long& len, long long& slot0) {
  const SeqInfo s = seq_slots<CH>(p, n);
  bos = s.bos;
  len = s.len;
  slot0 = s.slot0;
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(ptr)));
}

__device__ __forceinline__ uint32_t pair_raw(bf16 lo, bf16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

// x - bf16(x): the lo part of a split operand.
__device__ __forceinline__ float lo_of(float x) { return x - __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ void split_tile(uint32_t (&hi)[4], uint32_t (&lo)[4], const float (&x)[2][4], float sign) {
  float y[2][4], l[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      y[nt][e] = sign * x[nt][e];
      l[nt][e] = lo_of(y[nt][e]);
    }
  pack_tile(hi, y);
  pack_tile(lo, l);
}

// State rows (fp32 fragments, the load_state layout) from a forward-side state tensor: keys
// [k0, k0 + 8 NTL) (all 128 in the w passes: k0 = 0).
template <int NTL>
__device__ __forceinline__ void load_rows(float (&S)[NTL][4], const void* base, int fp32, size_t sbase, int r0, int tq,
                                          int k0 = 0) {
#pragma unroll
  for (int nt = 0; nt < NTL; ++nt) {
    const int col = k0 + nt * 8 + 2 * tq;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const size_t o = sbase + (size_t)(r0 + 8 * hr) * KD + col;
      float x0 = 0.f, x1 = 0.f;
      if (base != nullptr && fp32) {
        const float2 x = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + o);
        x0 = x.x; x1 = x.y;
      } else if (base != nullptr) {
        const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(base) + o);
        x0 = __low2float(x); x1 = __high2float(x);
      }
      S[nt][2 * hr] = x0;
      S[nt][2 * hr + 1] = x1;
    }
  }
}

// 16-byte global store (one STG.128; the compiler split a plain uint4 store into four).
__device__ __forceinline__ void st_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void bulk_s2g(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;\n" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}

// The warp's 16 state rows (fp32 fragments, 8 NTL keys) as bf16 into its transposed global tile
// dst[key][16 values] (NTL KiB / 4): stmatrix.trans into the warp's staging tile ot[8 NTL][16], then one bulk
// copy by lane 0 (off the load/store units). DB staging tiles used in turn: the copy DB chunks back must have
// read ot first.
template <int DB, int NTL>
__device__ __forceinline__ void store_rows_t(const float (&S)[NTL][4], bf16* ot, bf16* dst, int lane) {
  const int mi = lane >> 3, c = lane & 7;
  if (lane == 0) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(DB - 1) : "memory");
  __syncwarp();
#pragma unroll
  for (int np = 0; np < NTL / 2; ++np) {
    const int nt = 2 * np;
    const uint32_t r[4] = {pack(S[nt][0], S[nt][1]), pack(S[nt][2], S[nt][3]), pack(S[nt + 1][0], S[nt + 1][1]),
                           pack(S[nt + 1][2], S[nt + 1][3])};
    const bf16* a = ot + (size_t)((nt + (mi >> 1)) * 8 + c) * 16 + 8 * (mi & 1);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(a)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the bulk copy reads ot next
  __syncwarp();
  if (lane == 0) bulk_s2g(dst, ot, NTL * 8 * 16 * 2);
}

// Lane 0's bulk copies complete before the block exits.
__device__ __forceinline__ void bulk_drain(int lane) {
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// A 16 x 16 accumulator tile X (rows: the warp's 16 value rows, columns: the chunk's tokens) as bf16
// into dst[token * stride + value] for tokens < nv: stmatrix.trans into the warp's staging tile, then
// one 16-byte store per lane (instead of eight 2-byte stores).
__device__ __forceinline__ void store_tile_t(const float (&X)[2][4], bf16* ot, bf16* dst, size_t stride, int nv,
                                             int lane) {
  const int mi = lane >> 3, c = lane & 7;
  const bf16* a = ot + (size_t)((mi >> 1) * 8 + c) * 16 + 8 * (mi & 1);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(a)),
               "r"(pack(X[0][0], X[0][1])), "r"(pack(X[0][2], X[0][3])), "r"(pack(X[1][0], X[1][1])),
               "r"(pack(X[1][2], X[1][3]))
               : "memory");
  __syncwarp();
  const int tok = lane >> 1, hf = lane & 1;
  const uint4 v = *reinterpret_cast<const uint4*>(ot + tok * 16 + 8 * hf);
  __syncwarp();
  if (tok < nv) st_v4(dst + tok * stride + 8 * hf, v);
}

// Stage of the two state passes: a record and a 16 x VS tile (v or dout) of this block's rows.
template <int VS>
struct __align__(16) PassStage {
  unsigned char rec[REC_BYTES];
  bf16 t[CH][VS + 8];
};

// Copies the record bytes a pass reads by bulk copies on the stage's mbarrier (thread 0): [0, R_ML) for
// the reverse pass (all but M's lo part), kd, [R_KR, R_M) and [R_E, R_ML) for the forward pass (no qd,
// no M); and this block's 16 x VS tile of src by cp.async (one commit group).
template <int NT, int VS, bool REVERSE>
__device__ __forceinline__ void pass_prefetch(PassStage<VS>& st, uint32_t bar, const KdaBwdParams& p, const bf16* src,
                                              long long slot, int h, long long t0, int nv, int v0, int tid) {
  static_assert(R_KD == 0 && R_QD == 4096 && R_KR == 8192 && R_M + 512 == R_E && R_B + 64 == R_ML, "record layout");
  if (tid == 0) {
    const unsigned char* rs = p.rec + (size_t)(slot * p.num_heads + h) * REC_BYTES;
    // beside the prep: wait until this record is written
    if (!REVERSE && p.flags != nullptr) flag_wait_bounded(p.flags + slot * p.num_heads + h);
    if (REVERSE) {
      mbar_expect_tx(bar, R_ML);
      bulk_g2s(smem_u32(st.rec), rs, R_ML, bar);
    } else {
      mbar_expect_tx(bar, R_QD + (R_M - R_KR) + (R_ML - R_E));
      bulk_g2s(smem_u32(st.rec), rs, R_QD, bar);
      bulk_g2s(smem_u32(st.rec + R_KR), rs + R_KR, R_M - R_KR, bar);
      bulk_g2s(smem_u32(st.rec + R_E), rs + R_E, R_ML - R_E, bar);
    }
  }
  constexpr int VCH = VS / 8;
  const long long hs = (long long)p.num_heads * KD;
  for (int i = tid; i < CH * VCH; i += NT) {
    const int r = i / VCH, cc = i % VCH;
    const bool ok = r < nv;
    cp_async16(&st.t[r][cc * 8], ok ? src + (t0 + r) * hs + (long long)h * KD + v0 + cc * 8 : src, ok ? 16 : 0);
  }
  cp_async_commit();
}

// ---- Chunk-step pieces of the state passes: the w passes hold all keys (k0 = 0; the k0 parameter served
// the warp-pair passes, 64 keys a warp, deleted after their device run lost to the w4 passes: bwd8).

// The lo parts of a 16 x 16 tile.
__device__ __forceinline__ void lo_tile(float (&l)[2][4], const float (&x)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) l[nt][e] = lo_of(x[nt][e]);
}

// W^T += S kd^T over keys [k0, k0 + 16 KB) (value rows x tokens).
template <int KB>
__device__ __forceinline__ void kd_product(float (&W)[2][4], const float (&S)[2 * KB][4], const bf16* kd, int k0,
                                           int lrow, int lhalf) {
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const uint32_t a0 = pack(S[2 * kb][0], S[2 * kb][1]), a1 = pack(S[2 * kb][2], S[2 * kb][3]);
    const uint32_t a2 = pack(S[2 * kb + 1][0], S[2 * kb + 1][1]), a3 = pack(S[2 * kb + 1][2], S[2 * kb + 1][3]);
    uint32_t bk[4];
    // unit k0 / 8 + 2 kb + lhalf of row lrow, xor lrow & 7 (< 8: k0's bit 3 kept)
    ldsm_x4(bk, kd + k0 + lrow * KD + (((2 * kb + lhalf) ^ (lrow & 7)) << 3));
    mma(W[0], a0, a1, a2, a3, bk[0], bk[1], W[0]);
    mma(W[1], a0, a1, a2, a3, bk[2], bk[3], W[1]);
  }
}

// Wr = x = v - W (0 from token nv on), its lo part xl (if given), Vb = x b; t: the stage's v tile, vl:
// the warp's first column.
template <int W>
__device__ __forceinline__ void wr_residual(float (&x)[2][4], float (*xl)[4], float (&vb)[2][4],
                                            const bf16 (&t)[CH][W], const float (&Wt)[2][4], const float* b, int nv,
                                            int vl, int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + 2 * tq + (e & 1), r = gq + 8 * (e >> 1);
      x[nt][e] = tok < nv ? __bfloat162float(t[tok][vl + r]) - Wt[nt][e] : 0.f;
      if (xl != nullptr) xl[nt][e] = lo_of(x[nt][e]);
      vb[nt][e] = x[nt][e] * b[tok];
    }
}

// U = INV Vb (Vb split hi + lo), returned split hi + lo.
__device__ __forceinline__ void solve_u_split(uint32_t (&uah)[4], uint32_t (&ual)[4], const float (&vb)[2][4],
                                              const bf16* inv, int lrow, int lhalf) {
  uint32_t vah[4], val[4];
  split_tile(vah, val, vb, 1.f);
  uint32_t bi[4];
  ldsm_x4(bi, inv + lrow * 16 + ((lhalf ^ ((lrow >> 2) & 1)) << 3));
  float U[2][4];
  mma_split16(U, vah, val, bi);
  split_tile(uah, ual, U, 1.f);
}

// dU^T += dS kr^T over keys [k0, k0 + 16 KB).
template <int KB>
__device__ __forceinline__ void kr_product(float (&dU)[2][4], const float (&dS)[2 * KB][4], const bf16* krT, int k0,
                                           int lr, int lc) {
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const uint32_t a0 = pack(dS[2 * kb][0], dS[2 * kb][1]), a1 = pack(dS[2 * kb][2], dS[2 * kb][3]);
    const uint32_t a2 = pack(dS[2 * kb + 1][0], dS[2 * kb + 1][1]);
    const uint32_t a3 = pack(dS[2 * kb + 1][2], dS[2 * kb + 1][3]);
    uint32_t bk[4];
    ldsm_x4_t(bk, krT + k0 * 16 + swz16(16 * kb + lr, lc));  // rows k0 + 16 kb + lr (same half swizzle)
    mma(dU[0], a0, a1, a2, a3, bk[0], bk[1], dU[0]);
    mma(dU[1], a0, a1, a2, a3, bk[2], bk[3], dU[1]);
  }
}

// oa = dO^T as an A operand (value rows x tokens) from the stage's dout tile t; dU^T += dO^T M.
template <int W>
__device__ __forceinline__ void dout_m(float (&dU)[2][4], uint32_t (&oa)[4], const bf16 (&t)[CH][W], const bf16* mm,
                                       int vl, int gq, int tq, int lr, int lc) {
  oa[0] = pair_raw(t[2 * tq][vl + gq], t[2 * tq + 1][vl + gq]);
  oa[1] = pair_raw(t[2 * tq][vl + gq + 8], t[2 * tq + 1][vl + gq + 8]);
  oa[2] = pair_raw(t[2 * tq + 8][vl + gq], t[2 * tq + 9][vl + gq]);
  oa[3] = pair_raw(t[2 * tq + 8][vl + gq + 8], t[2 * tq + 9][vl + gq + 8]);
  uint32_t bm[4];
  ldsm_x4_t(bm, mm + swz16(lr, lc));
  mma(dU[0], oa[0], oa[1], oa[2], oa[3], bm[0], bm[1], dU[0]);
  mma(dU[1], oa[0], oa[1], oa[2], oa[3], bm[2], bm[3], dU[1]);
}

// dv^T = (dU^T INV) diag(b), dU split hi + lo.
__device__ __forceinline__ void dv_tile(float (&dW)[2][4], const float (&dU)[2][4], const bf16* inv, const float* b,
                                        int lr, int lc, int tq) {
  uint32_t dh[4], dl[4];
  split_tile(dh, dl, dU, 1.f);
  {
    uint32_t bi[4];
    ldsm_x4_t(bi, inv + swz16(lr, lc));
    mma_split16(dW, dh, dl, bi);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dW[nt][e] *= b[nt * 8 + 2 * tq + (e & 1)];
}

// dS = dS diag(E) + dO^T qd - dv^T kd over keys [k0, k0 + 16 NP) (w: -dv^T split hi + lo).
template <int NP>
__device__ __forceinline__ void update_dstate_split(float (&dS)[2 * NP][4], const uint32_t (&oa)[4],
                                                    const uint32_t (&wh)[4], const uint32_t (&wl)[4], const bf16* qd,
                                                    const bf16* kd, const float* E, int k0, int lr, int lc, int tq) {
#pragma unroll
  for (int np = 0; np < NP; ++np) {
    uint32_t bq[4], bk[4];
    // swz128(lr, k0 + 16 np + lc) = k0 + swz128(lr, 16 np + lc): unit k0 / 8 + u, u ^ (lr & 7) < 8
    ldsm_x4_t(bq, qd + k0 + swz128(lr, 16 * np + lc));
    ldsm_x4_t(bk, kd + k0 + swz128(lr, 16 * np + lc));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int nt = 2 * np + j;
      const float2 e01 = *reinterpret_cast<const float2*>(&E[k0 + nt * 8 + 2 * tq]);
      const float cin[4] = {dS[nt][0] * e01.x, dS[nt][1] * e01.y, dS[nt][2] * e01.x, dS[nt][3] * e01.y};
      mma(dS[nt], oa[0], oa[1], oa[2], oa[3], bq[2 * j], bq[2 * j + 1], cin);
      mma(dS[nt], wh[0], wh[1], wh[2], wh[3], bk[2 * j], bk[2 * j + 1], dS[nt]);
      mma(dS[nt], wl[0], wl[1], wl[2], wl[3], bk[2 * j], bk[2 * j + 1], dS[nt]);
    }
  }
}

// dh0 = dS: rows r0, r0 + 8 of the (sequence, head) state at sbase, keys [k0, k0 + 8 NTL).
template <int NTL>
__device__ __forceinline__ void store_dh0_rows(const KdaBwdParams& p, const float (&dS)[NTL][4], size_t sbase, int r0,
                                               int k0, int tq) {
#pragma unroll
  for (int nt = 0; nt < NTL; ++nt) {
    const int col = k0 + nt * 8 + 2 * tq;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const size_t o = sbase + (size_t)(r0 + 8 * hr) * KD + col;
      if (p.dh0_fp32)
        *reinterpret_cast<float2*>(static_cast<float*>(p.dh0) + o) = make_float2(dS[nt][2 * hr], dS[nt][2 * hr + 1]);
      else
        *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.dh0) + o) =
            __floats2bfloat162_rn(dS[nt][2 * hr], dS[nt][2 * hr + 1]);
    }
  }
}

// ---- 2. forward state pass, storing S0, Wr and U per chunk
template <int NW, int PS, int DB>
__device__ __forceinline__ void states_body(const KdaBwdParams& p, int bid) {
  constexpr int VS = 16 * NW, SLICES = KD / VS, NT = 32 * NW;
  extern __shared__ __align__(16) unsigned char bsm_raw[];
  PassStage<VS>* stg = reinterpret_cast<PassStage<VS>*>(bsm_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  bf16* ots = reinterpret_cast<bf16*>(bsm_raw + PS * sizeof(PassStage<VS>)) + warp * DB * KD * 16;  // state staging
  bf16* tts = reinterpret_cast<bf16*>(bsm_raw + PS * sizeof(PassStage<VS>)) + NW * DB * KD * 16 + warp * CH * 16;
  uint64_t* bars = reinterpret_cast<uint64_t*>(bsm_raw + PS * sizeof(PassStage<VS>) + NW * (DB * KD + CH) * 16 * 2);
  mbar_init_stages(bars, PS, tid);
  __syncthreads();
  const int H = p.num_heads;
  const int slice = bid % SLICES, h = (bid / SLICES) % H, n = bid / (SLICES * H);
  long long bos, len, slot0;
  bseq(p, n, bos, len, slot0);
  const int v0 = slice * VS, vl = warp * 16, vw = v0 + vl;
  const int nch = (int)((len + CH - 1) / CH);
  const int lrow = ((lane >> 4) << 3) + (lane & 7), lhalf = (lane >> 3) & 1;
  float S[16][4];
  load_rows(S, p.h0, p.state_fp32, ((size_t)n * H + h) * KD * KD, vw + gq, tq);
  auto nvalid = [&](int c) {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? (int)rem : CH;
  };
  auto issue = [&](int c) {  // one commit group per chunk, empty past the end
    if (c < nch) pass_prefetch<NT, VS, false>(stg[c % PS], smem_u32(&bars[c % PS]), p, p.v, slot0 + c, h, bos + (long long)c * CH, nvalid(c), v0, tid);
    else cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < PS - 1; ++c) issue(c);
  for (int c = 0; c < nch; ++c) {
    cp_async_wait_group<PS - 2>();
    mbar_wait(smem_u32(&bars[c % PS]), (uint32_t)((c / PS) & 1));
    __syncthreads();
    issue(c + PS - 1);
    const PassStage<VS>& st = stg[c % PS];
    const long long slot = slot0 + c;
    const int nv = nvalid(c);
    if (c == nch - 1 && p.dht != nullptr) {
      // d G_last of the last chunk from the fp32 start state (bf16 storage costs dg accuracy there)
      float part[16][2];
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int col = nt * 8 + 2 * tq;
        part[nt][0] = part[nt][1] = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const size_t o = ((size_t)n * H + h) * KD * KD + (size_t)(vw + gq + 8 * hr) * KD + col;
          float d0, d1;
          if (p.state_fp32) {
            const float2 x = *reinterpret_cast<const float2*>(static_cast<const float*>(p.dht) + o);
            d0 = x.x; d1 = x.y;
          } else {
            const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.dht) + o);
            d0 = __low2float(x); d1 = __high2float(x);
          }
          part[nt][0] = fmaf(d0, S[nt][2 * hr], part[nt][0]);
          part[nt][1] = fmaf(d1, S[nt][2 * hr + 1], part[nt][1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 16; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = part[nt][e];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (gq == 0) p.dgl[(((size_t)n * H + h) * 8 + vw / 16) * KD + nt * 8 + 2 * tq + e] = v;
        }
    }
    const size_t sh = (size_t)slot * H + h;
    store_rows_t<DB>(S, ots + (c % DB) * KD * 16, p.sst + sh * KD * KD + (size_t)(vw / 16) * KD * 16, lane);
    const bf16* kd = reinterpret_cast<const bf16*>(st.rec + R_KD);
    const bf16* krT = reinterpret_cast<const bf16*>(st.rec + R_KR);
    const bf16* inv = reinterpret_cast<const bf16*>(st.rec + R_INV);
    const float* E = reinterpret_cast<const float*>(st.rec + R_E);
    const float* b = reinterpret_cast<const float*>(st.rec + R_B);
    // W^T = S kd^T (value rows x tokens)
    float W[2][4] = {};
    kd_product<8>(W, S, kd, 0, lrow, lhalf);
    // Wr = v - W (stored hi + lo), Vb = Wr b split hi + lo; U = INV Vb
    bf16* wr = p.wu + sh * 4 * CH * KD + vw;
    float vb[2][4];
    {
      float x[2][4], xl[2][4];
      wr_residual(x, xl, vb, st.t, W, b, nv, vl, gq, tq);
      store_tile_t(x, tts, wr, KD, CH, lane);
      store_tile_t(xl, tts, wr + 3 * CH * KD, KD, CH, lane);
    }
    uint32_t uah[4], ual[4];
    solve_u_split(uah, ual, vb, inv, lrow, lhalf);
    // S = S diag(E) + U^T kr
    update_state_split<8>(S, uah, ual, krT, E, 0, lrow, lhalf, tq);
  }
  bulk_drain(lane);
}

// ---- 3. reverse state-gradient pass
template <int NW, int PS, int DB>
__device__ __forceinline__ void dstates_body(const KdaBwdParams& p, int bid) {
  constexpr int VS = 16 * NW, SLICES = KD / VS, NT = 32 * NW;
  extern __shared__ __align__(16) unsigned char bsm_raw[];
  PassStage<VS>* stg = reinterpret_cast<PassStage<VS>*>(bsm_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  bf16* ots = reinterpret_cast<bf16*>(bsm_raw + PS * sizeof(PassStage<VS>)) + warp * DB * KD * 16;  // state staging
  bf16* tts = reinterpret_cast<bf16*>(bsm_raw + PS * sizeof(PassStage<VS>)) + NW * DB * KD * 16 + warp * CH * 16;
  uint64_t* bars = reinterpret_cast<uint64_t*>(bsm_raw + PS * sizeof(PassStage<VS>) + NW * (DB * KD + CH) * 16 * 2);
  mbar_init_stages(bars, PS, tid);
  __syncthreads();
  const int H = p.num_heads;
  const int slice = bid % SLICES, h = (bid / SLICES) % H, n = bid / (SLICES * H);
  long long bos, len, slot0;
  bseq(p, n, bos, len, slot0);
  const int v0 = slice * VS, vl = warp * 16, vw = v0 + vl;
  const int nch = (int)((len + CH - 1) / CH);
  const int lj = lane >> 3, lr = (lane & 7) + 8 * (lj & 1), lc = 8 * (lj >> 1);  // ldmatrix.trans rows
  const size_t sbase = ((size_t)n * H + h) * KD * KD;
  const long long hs = (long long)H * KD;
  float dS[16][4];
  load_rows(dS, p.dht, p.state_fp32, sbase, vw + gq, tq);
  auto nvalid = [&](int c) {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? (int)rem : CH;
  };
  auto issue = [&](int k) {  // k-th chunk from the end; one commit group each, empty past the start
    const int c = nch - 1 - k;
    if (c >= 0) pass_prefetch<NT, VS, true>(stg[k % PS], smem_u32(&bars[k % PS]), p, p.dout, slot0 + c, h, bos + (long long)c * CH, nvalid(c), v0, tid);
    else cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < PS - 1; ++k) issue(k);
  for (int k = 0; k < nch; ++k) {
    const int c = nch - 1 - k;
    cp_async_wait_group<PS - 2>();
    mbar_wait(smem_u32(&bars[k % PS]), (uint32_t)((k / PS) & 1));
    __syncthreads();
    issue(k + PS - 1);
    const PassStage<VS>& st = stg[k % PS];
    const long long slot = slot0 + c, t0 = bos + (long long)c * CH;
    const int nv = nvalid(c);
    const size_t sh = (size_t)slot * H + h;
    store_rows_t<DB>(dS, ots + (k % DB) * KD * 16, p.dss + sh * KD * KD + (size_t)(vw / 16) * KD * 16, lane);
    const bf16* kd = reinterpret_cast<const bf16*>(st.rec + R_KD);
    const bf16* qd = reinterpret_cast<const bf16*>(st.rec + R_QD);
    const bf16* krT = reinterpret_cast<const bf16*>(st.rec + R_KR);
    const bf16* inv = reinterpret_cast<const bf16*>(st.rec + R_INV);
    const bf16* mm = reinterpret_cast<const bf16*>(st.rec + R_M);
    const float* E = reinterpret_cast<const float*>(st.rec + R_E);
    const float* b = reinterpret_cast<const float*>(st.rec + R_B);
    // dU^T = dS kr^T + dO^T M (value rows x tokens)
    float dU[2][4] = {};
    kr_product<8>(dU, dS, krT, 0, lr, lc);
    uint32_t oa[4];  // dO^T as an A operand (value rows x tokens)
    dout_m(dU, oa, st.t, mm, vl, gq, tq, lr, lc);
    bf16* dus = p.wu + (sh * 4 + 1) * CH * KD + vw;
    {
      float dl[2][4];
      lo_tile(dl, dU);
      store_tile_t(dU, tts, dus, KD, CH, lane);
      store_tile_t(dl, tts, dus + CH * KD, KD, CH, lane);
    }
    // dv^T = (dU^T INV) diag(b)
    uint32_t dh[4], dl[4];
    split_tile(dh, dl, dU, 1.f);
    float dW[2][4];
    {
      uint32_t bi[4];
      ldsm_x4_t(bi, inv + swz16(lr, lc));
      mma_split16(dW, dh, dl, bi);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dW[nt][e] *= b[nt * 8 + 2 * tq + (e & 1)];
    store_tile_t(dW, tts, p.dv + t0 * hs + (long long)h * KD + vw, (size_t)hs, nv, lane);
    uint32_t wh[4], wl[4];
    split_tile(wh, wl, dW, -1.f);
    // dS = dS diag(E) + dO^T qd - dv^T kd
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t bq[4], bk[4];
      ldsm_x4_t(bq, qd + swz128(lr, 16 * np + lc));
      ldsm_x4_t(bk, kd + swz128(lr, 16 * np + lc));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int nt = 2 * np + j;
        const float2 e01 = *reinterpret_cast<const float2*>(&E[nt * 8 + 2 * tq]);
        const float cin[4] = {dS[nt][0] * e01.x, dS[nt][1] * e01.y, dS[nt][2] * e01.x, dS[nt][3] * e01.y};
        mma(dS[nt], oa[0], oa[1], oa[2], oa[3], bq[2 * j], bq[2 * j + 1], cin);
        mma(dS[nt], wh[0], wh[1], wh[2], wh[3], bk[2 * j], bk[2 * j + 1], dS[nt]);
        mma(dS[nt], wl[0], wl[1], wl[2], wl[3], bk[2 * j], bk[2 * j + 1], dS[nt]);
      }
    }
  }
  if (p.dh0 != nullptr) store_dh0_rows(p, dS, sbase, vw + gq, 0, tq);
  bulk_drain(lane);
}

// PS cp.async stages, DB state staging tiles per warp
#define PASS_SMEM_V(NW, PS, DB) ((PS) * (REC_BYTES + CH * (16 * (NW) + 8) * 2) + (NW) * ((DB) * KD + CH) * 16 * 2 + (PS) * 8)
#define PASS_SMEM(NW) PASS_SMEM_V(NW, PST, 1)
static_assert(sizeof(PassStage<32>) * PST + 2 * (KD + CH) * 16 * 2 + PST * 8 == PASS_SMEM(2), "pass_smem_bytes in src/launch/bwd.rs");
static_assert(PASS_SMEM(2) == 56280, "pass_smem_bytes in src/launch/bwd.rs");
static_assert(PASS_SMEM(4) == 68568, "pass_smem_bytes in src/launch/bwd.rs");
static_assert(PASS_SMEM_V(4, 2, 2) == 68240 && PASS_SMEM_V(4, 3, 2) == 84952 && PASS_SMEM_V(4, 4, 1) == 85280 &&
                  PASS_SMEM_V(4, 2, 3) == 84624 && PASS_SMEM_V(4, 3, 3) == 101336,
              "pass_smem_bytes in src/launch/bwd.rs");

extern "C" __global__ void __launch_bounds__(64) kdab_states_w2(const KdaBwdParams p) { states_body<2, PST, 1>(p, blockIdx.x); }
// 4-warp blocks at <= 168 registers (states: as compiled, 36 B of spills when capped; dstates: capped
// from 182): three blocks of either pass fit one SM, so both passes of H = 96 fixed (384 blocks) run at once.
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4(const KdaBwdParams p) { states_body<4, PST, 1>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(64) kdab_dstates_w2(const KdaBwdParams p) { dstates_body<2, PST, 1>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4(const KdaBwdParams p) { dstates_body<4, PST, 1>(p, blockIdx.x); }
// Double-buffered state staging (a chunk's bulk store need not have left shared memory before the next
// chunk's): d2 with 2 cp.async stages (68 KB, 3 blocks per SM), d3 with 3 (85 KB, 2 per SM); p4: one
// staging tile, 4 stages (3 chunks ahead, 85 KB); t2 / t3: three staging tiles, 2 / 3 stages (85 / 101 KB).
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4d2(const KdaBwdParams p) { states_body<4, 2, 2>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4d2(const KdaBwdParams p) { dstates_body<4, 2, 2>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4d3(const KdaBwdParams p) { states_body<4, 3, 2>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4d3(const KdaBwdParams p) { dstates_body<4, 3, 2>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4p4(const KdaBwdParams p) { states_body<4, 4, 1>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4p4(const KdaBwdParams p) { dstates_body<4, 4, 1>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4t2(const KdaBwdParams p) { states_body<4, 2, 3>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4t2(const KdaBwdParams p) { dstates_body<4, 2, 3>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128) kdab_states_w4t3(const KdaBwdParams p) { states_body<4, 3, 3>(p, blockIdx.x); }
extern "C" __global__ void __launch_bounds__(128, 3) kdab_dstates_w4t3(const KdaBwdParams p) { dstates_body<4, 3, 3>(p, blockIdx.x); }
#include "kda_bwd_chunk.cuh"
