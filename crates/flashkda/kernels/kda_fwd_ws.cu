// KDA forward in two launches through a device workspace (same math and rounding points as
// kda_fwd.cu, so `reference::emulated` covers it).
//
// kda_prep: fully parallel, one block per (16-token chunk slot, head). Everything that does not
// depend on the state (norms, sigmoid(beta), gate cumsum, kd/qd/kr, E, A -> INV, M) is written
// as one 13888-byte record per (slot, head), already in the swizzled shared-memory layout.
// kda_state_w{1,2,4}: the sequential pass. One block = (sequence, head, 16*NW value rows), NW
// warps each holding 16 state rows in fp32 mma accumulators. Per chunk one thread issues TMA bulk
// copies (record + the block's v rows) ST chunks ahead on an mbarrier; warps only do the
// state-dependent matmuls, so the per-chunk critical path is short and 128/(16*NW) blocks per
// chain fill the GPU.
//
// KDA_SPLIT_OPERANDS (kda_fwd_ws_split.cu compiles this file with it set to 1): the operands whose
// bf16 rounding costs accuracy (`reference::emulated::Rounding::SPLIT`) go into the tensor cores as
// hi + lo bf16 pairs: kd, qd, ki in the prep products A and M; M itself (its lo part is one more
// record field); Vb and U in the state pass. The B fragments of the state pass are loaded with
// ldmatrix.
//
// Head dim: KD = 128 unless the including file defines it (kda_fwd_ws_d64.cu and
// kda_fwd_ws_split_d64.cu set 64). Record offsets and sizes derive from KD; at 64 a chain has 4
// warps of value rows, so kda_state_w8 is not built and kda_state_w4 is one block per chain.
#include "kda_common.cuh"

#ifndef KDA_SPLIT_OPERANDS
#define KDA_SPLIT_OPERANDS 0
#endif

// Record offsets (bytes; the values at KD = 128 in brackets, asserted below).
#define R_KD 0                 // bf16 [16][KD], 16-byte chunks xor-swizzled by row & 7
#define R_QD (32 * KD)         // [4096] bf16 [16][KD], same swizzle
#define R_KR (64 * KD)         // [8192] bf16 krT [KD][16], 8-element halves swapped when (row >> 2) & 1
#define R_INV (96 * KD)        // [12288] bf16 [16][16], half swizzle
#define R_M (R_INV + 512)      // [12800] bf16 [16][16], half swizzle
#define R_E (R_M + 512)        // [13312] f32 [KD]
#define R_B (R_E + 4 * KD)     // [13824] f32 [16]
#if KDA_SPLIT_OPERANDS
#define R_ML (R_B + 64)        // [13888] bf16 [16][16], lo part of M, half swizzle
#define REC_BYTES (R_ML + 512) // [14400]
#else
#define REC_BYTES (R_B + 64)   // [13888]
#endif
#if KD == 128
static_assert(R_QD == 4096 && R_KR == 8192 && R_INV == 12288 && R_M == 12800 && R_E == 13312 && R_B == 13824,
              "record layout at head dim 128");
static_assert(REC_BYTES == (KDA_SPLIT_OPERANDS ? 14400 : 13888), "update launch.rs");
#else
static_assert(REC_BYTES == (KDA_SPLIT_OPERANDS ? 8000 : 7488), "update launch.rs");
#endif
static_assert(REC_BYTES % 16 == 0, "bulk copies move 16-byte multiples");
// log2 of the 16-byte chunks of a KD-channel row (loops over rows x chunks shift rather than divide)
#define KC_LOG2 (KD == 128 ? 4 : 3)

__device__ __forceinline__ int swz128(int r, int c) { return r * KD + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
__device__ __forceinline__ int swz16(int r, int c) { return r * 16 + ((((c >> 3) ^ ((r >> 2) & 1))) << 3) + (c & 7); }

// seq_slots<CH> written out with the segment case between its two branches (context parallelism:
// segment n of a fixed-length batch, same slots as unsegmented); kept in this order, which the measured
// kernels were compiled from.
__device__ __forceinline__ SeqInfo seq_info(const KdaParams& p, int n) {
  SeqInfo s;
  if (p.cu_seqlens != nullptr) {
    seq_slots_varlen<CH>(s, p, n);
  } else if (p.seg_chunks > 0) {
    // segment n of a fixed-length batch: same slots as the unsegmented layout
    const long long cps = (p.seq_len + CH - 1) / CH;
    const long long b = n / p.segs_per_seq, sg = n % p.segs_per_seq;
    const long long off = sg * p.seg_chunks * CH;
    const long long rem = p.seq_len - off;
    const long long sl = (long long)p.seg_chunks * CH;
    s.bos = b * p.seq_len + off;
    s.len = rem < 0 ? 0 : (rem < sl ? rem : sl);
    s.slot0 = b * cps + sg * p.seg_chunks;
  } else {
    const long long cps = (p.seq_len + CH - 1) / CH;
    s.bos = (long long)n * p.seq_len;
    s.len = p.seq_len;
    s.slot0 = (long long)n * cps;
  }
  return s;
}

struct __align__(16) PrepSmem {
  unsigned char rec[REC_BYTES];
  bf16 q[CH][RS];
  bf16 k[CH][RS];
  bf16 g[CH][RS];  // raw g, then ki in place (split: q, k and the record's krT area hold the lo
                   // parts of qd, kd and ki until the products are done; krT is written last)
  float A[CH][CH + 1];
  float rnq[CH];
  float rnk[CH];
};

// KD threads: one per key channel.
extern "C" __global__ void __launch_bounds__(KD) kda_prep(const KdaParams p) {
  constexpr int NT = KD, NW = KD / 32;
  __shared__ PrepSmem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
#if KDA_SPLIT_OPERANDS
  // one dimension, slot-major: the blocks of chunk slot s (all heads) start before those of s + 1,
  // the order in which an overlapped state pass consumes them
  const long long slot = blockIdx.x / H;
  const int h = static_cast<int>(blockIdx.x % H);
#else
  const long long slot = blockIdx.x;
  const int h = blockIdx.y;
#endif

  const int n = slot_owner<CH>(p, slot);
  const SeqInfo si = seq_info(p, n);
  const long long c = slot - si.slot0;
  if (c < 0 || c * CH >= si.len) return;  // unused slot (block-uniform)
  const long long rem = si.len - c * CH;
  const int nv = rem < CH ? static_cast<int>(rem) : CH;
  const long long t0 = si.bos + c * CH;
  const long long hs = (long long)H * KD;
  const long long hoff = (long long)h * KD;
  const long long qhs = (long long)p.qk_heads * KD;                // GVA: q/k of head h / group
  const long long qhoff = (long long)(h / (H / p.qk_heads)) * KD;

  for (int i = tid; i < 3 * (CH << KC_LOG2); i += NT) {
    const int which = i >> (KC_LOG2 + 4), r = (i >> KC_LOG2) & 15, cc = i & ((1 << KC_LOG2) - 1);
    const bf16* src = which == 0 ? p.q : (which == 1 ? p.k : p.g);
    bf16* dst = which == 0 ? &sm.q[r][cc * 8] : (which == 1 ? &sm.k[r][cc * 8] : &sm.g[r][cc * 8]);
    const bool ok = r < nv;
    const long long off = which == 2 ? (t0 + r) * hs + hoff : (t0 + r) * qhs + qhoff;
    cp_async16(dst, ok ? src + off + cc * 8 : src, ok ? 16 : 0);
  }
  cp_async_commit();
  const float beta_raw = (tid < nv) ? __bfloat162float(p.beta[(t0 + tid) * H + h]) : 0.f;
  const float exp_a = __expf(p.a_log[h]);
  const float lb2 = p.lower_bound * 1.4426950408889634f;
  const float dtb = p.dt_bias[hoff + tid];
  float* rec_b = reinterpret_cast<float*>(sm.rec + R_B);
  float* rec_e = reinterpret_cast<float*>(sm.rec + R_E);
  bf16* kd = reinterpret_cast<bf16*>(sm.rec + R_KD);
  bf16* qd = reinterpret_cast<bf16*>(sm.rec + R_QD);
  bf16* krT = reinterpret_cast<bf16*>(sm.rec + R_KR);
  bf16* inv = reinterpret_cast<bf16*>(sm.rec + R_INV);
  bf16* mm = reinterpret_cast<bf16*>(sm.rec + R_M);
  cp_async_wait_all();
  __syncthreads();

  // ---- norms, beta sigmoid, gate cumsum (as kda_fwd.cu)
  row_norms<NW>([&](int r) { return r < CH ? &sm.q[r][0] : &sm.k[r - CH][0]; },
                [&](int r, float rn) { if (r < CH) sm.rnq[r] = rn; else sm.rnk[r - CH] = rn; }, warp, lane);
  if (tid < CH) rec_b[tid] = tid < nv ? sigmoidf_(beta_raw) : 0.f;
  float G[CH];
  gate_cumsum(G, sm.g, tid, exp_a, dtb, lb2, nv);
  __syncthreads();  // norms and b visible

  // ---- decayed keys/queries (channel tid): kd, qd, krT into the record, ki in place of g
  uint32_t kr[CH / 2];
  {
    const int ch = tid;
    const float gt = G[CH - 1];
    rec_e[ch] = ex2(gt);
    float kv[CH], qv[CH];
    normed_channel(kv, qv, sm.k, sm.q, sm.rnk, sm.rnq, ch, p.scale);
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const float e = ex2(G[i]);
#if KDA_SPLIT_OPERANDS
      // hi parts into the record (the state pass's operands), lo parts in place of q, k
      const float kdf = kv[i] * e, qdf = qv[i] * e, kif = kv[i] * ex2(-G[i]);
      const bf16 kdh = __float2bfloat16_rn(kdf), qdh = __float2bfloat16_rn(qdf), kih = __float2bfloat16_rn(kif);
      kd[swz128(i, ch)] = kdh;
      qd[swz128(i, ch)] = qdh;
      sm.g[i][ch] = kih;
      sm.k[i][ch] = __float2bfloat16_rn(kdf - __bfloat162float(kdh));
      sm.q[i][ch] = __float2bfloat16_rn(qdf - __bfloat162float(qdh));
      krT[swz128(i, ch)] = __float2bfloat16_rn(kif - __bfloat162float(kih));  // ki lo, [16][KD]
#else
      kd[swz128(i, ch)] = __float2bfloat16_rn(kv[i] * e);
      qd[swz128(i, ch)] = __float2bfloat16_rn(qv[i] * e);
      sm.g[i][ch] = __float2bfloat16_rn(kv[i] * ex2(-G[i]));
#endif
    }
#pragma unroll
    for (int i = 0; i < CH; i += 2)
      kr[i / 2] = pack(kv[i] * ex2(gt - G[i]), kv[i + 1] * ex2(gt - G[i + 1]));
#if KDA_SPLIT_OPERANDS
  }
  // kr stays in registers until the products are done with ki's lo part in the krT area
#else
    const int sw = (ch >> 2) & 1;
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * sw]) = make_uint4(kr[0], kr[1], kr[2], kr[3]);
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * (sw ^ 1)]) = make_uint4(kr[4], kr[5], kr[6], kr[7]);
  }
#endif
  __syncthreads();  // kd, qd, ki visible

  // ---- A = diag(b) strict_lower(kd ki^T) and INV (warp 0); M (warp 1)
  if (warp < 2) {
    const bool do_a = warp == 0;
    const bf16* lhs = do_a ? kd : qd;
    float acc[2][4];
#if KDA_SPLIT_OPERANDS
    // (lhs_hi + lhs_lo)(ki_hi + ki_lo)^T without the lo lo term: three independent chains
    const bf16(*lhs_lo)[RS] = do_a ? sm.k : sm.q;
    float acc1[2][4], acc2[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = acc1[nt][e] = acc2[nt][e] = 0.f;
#pragma unroll
    for (int kb = 0; kb < KD / 16; ++kb) {
      const int kc = kb * 16 + 2 * tq;
      const uint32_t a0 = ld32(&lhs[swz128(gq, kc)]), a1 = ld32(&lhs[swz128(gq + 8, kc)]);
      const uint32_t a2 = ld32(&lhs[swz128(gq, kc + 8)]), a3 = ld32(&lhs[swz128(gq + 8, kc + 8)]);
      const uint32_t l0 = ld32(&lhs_lo[gq][kc]), l1 = ld32(&lhs_lo[gq + 8][kc]);
      const uint32_t l2 = ld32(&lhs_lo[gq][kc + 8]), l3 = ld32(&lhs_lo[gq + 8][kc + 8]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int r = nt * 8 + gq;
        const uint32_t b0 = ld32(&sm.g[r][kc]), b1 = ld32(&sm.g[r][kc + 8]);
        const uint32_t c0 = ld32(&krT[swz128(r, kc)]), c1 = ld32(&krT[swz128(r, kc + 8)]);
        mma(acc[nt], a0, a1, a2, a3, b0, b1, acc[nt]);
        mma(acc1[nt], a0, a1, a2, a3, c0, c1, acc1[nt]);
        mma(acc2[nt], l0, l1, l2, l3, b0, b1, acc2[nt]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] += acc1[nt][e] + acc2[nt][e];
#else
    tile_product(acc, [&](int r, int cc) { return ld32(&lhs[swz128(r, cc)]); },
                 [&](int r, int cc) { return ld32(&sm.g[r][cc]); }, gq, tq);
#endif
    if (do_a) {
      store_a(sm.A, acc, rec_b, gq, tq);
      __syncwarp();
      if (lane < CH)
        invert_column([&](int r, int m) { return sm.A[r][m]; }, lane,
                      [&](int r, int cc, bf16 x) { inv[swz16(r, cc)] = x; });
    } else {
#if KDA_SPLIT_OPERANDS
      bf16* ml = reinterpret_cast<bf16*>(sm.rec + R_ML);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = gq + 8 * (e >> 1), col = nt * 8 + 2 * tq + (e & 1);
          const float x = col <= row ? acc[nt][e] : 0.f;
          const bf16 hi = __float2bfloat16_rn(x);
          mm[swz16(row, col)] = hi;
          ml[swz16(row, col)] = __float2bfloat16_rn(x - __bfloat162float(hi));
        }
#else
      store_m(acc, [&](int r, int cc, bf16 x) { mm[swz16(r, cc)] = x; }, gq, tq);
#endif
    }
  }
#if KDA_SPLIT_OPERANDS
  __syncthreads();  // the products are done with ki's lo part: krT takes its place
  {
    const int ch = tid, sw = (ch >> 2) & 1;
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * sw]) = make_uint4(kr[0], kr[1], kr[2], kr[3]);
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * (sw ^ 1)]) = make_uint4(kr[4], kr[5], kr[6], kr[7]);
  }
#endif
  __syncthreads();  // record complete

  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(p.ws) +
                                        (size_t)(slot * H + h) * REC_BYTES);
  const uint4* src = reinterpret_cast<const uint4*>(sm.rec);
  for (int i = tid; i < REC_BYTES / 16; i += NT) dst[i] = src[i];
#if KDA_SPLIT_OPERANDS
  if (p.flags != nullptr) {  // publish the record to an overlapped state pass
    __threadfence();
    __syncthreads();
    if (tid == 0) flag_release(p.flags + slot * H + h);
  }
#endif
}

#if KDA_SPLIT_OPERANDS
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(ptr)));
}

// D = (ah + al) B for a 16 x 16 B in ldmatrix fragments bi (fp32 accumulators from zero).
__device__ __forceinline__ void mma_split16(float (&D)[2][4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                            const uint32_t (&bi)[4]) {
  const float zero4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    mma(D[nt], ah[0], ah[1], ah[2], ah[3], bi[2 * nt], bi[2 * nt + 1], zero4);
    mma(D[nt], al[0], al[1], al[2], al[3], bi[2 * nt], bi[2 * nt + 1], D[nt]);
  }
}

// S = S diag(E) + (U_hi + U_lo)^T kr over keys [k0, k0 + 16 NP) (S: those keys' tiles); krT rows are
// key channels, 16 tokens each.
template <int NP>
__device__ __forceinline__ void update_state_split(float (&S)[2 * NP][4], const uint32_t (&uah)[4],
                                                   const uint32_t (&ual)[4], const bf16* krT, const float* E, int k0,
                                                   int lrow, int lhalf, int tq) {
#pragma unroll
  for (int np = 0; np < NP; ++np) {
    uint32_t bk[4];
    const int r = np * 16 + lrow;  // key k0 + r; the half swizzle (r >> 2) & 1 is the same for k0 + r
    ldsm_x4(bk, krT + (k0 + r) * 16 + ((lhalf ^ ((r >> 2) & 1)) << 3));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int nt = 2 * np + j;
      const float2 e01 = *reinterpret_cast<const float2*>(&E[k0 + nt * 8 + 2 * tq]);
      const float cin[4] = {S[nt][0] * e01.x, S[nt][1] * e01.y, S[nt][2] * e01.x, S[nt][3] * e01.y};
      mma(S[nt], uah[0], uah[1], uah[2], uah[3], bk[2 * j], bk[2 * j + 1], cin);
      mma(S[nt], ual[0], ual[1], ual[2], ual[3], bk[2 * j], bk[2 * j + 1], S[nt]);
    }
  }
}

// One chunk of one warp's 16 state rows with split operands (the rounding of
// `Rounding::SPLIT`): W^T = S kd^T and O1^T = S qd^T (S as bf16), Vb = (v - W) b as hi + lo,
// U = INV Vb (fp32 accumulators), out = O1 + M U with M and U as hi + lo (the lo lo term
// dropped), S = S diag(E) + (U_hi + U_lo)^T kr. B fragments come from ldmatrix: for a 16-row
// operand tile, lane l addresses row (l >> 4) * 8 + (l & 7), 8-element half (l >> 3) & 1, so
// registers 0-3 are b0, b1 of n-tile 0 and b0, b1 of n-tile 1. `vrow` points at the warp's value
// columns of the chunk's v tile (row stride vs).
template <bool TRANS>
__device__ __forceinline__ void split_chunk(float (&S)[KD / 8][4], bf16 (*ow)[TS], const unsigned char* rec,
                                            const bf16* vrow, int vs, bool with_v, int nv, int lane) {
  const int gq = lane >> 2, tq = lane & 3;
  const bf16* kd = reinterpret_cast<const bf16*>(rec + R_KD);
  const bf16* qd = reinterpret_cast<const bf16*>(rec + R_QD);
  const bf16* krT = reinterpret_cast<const bf16*>(rec + R_KR);
  const bf16* inv = reinterpret_cast<const bf16*>(rec + R_INV);
  const bf16* mh = reinterpret_cast<const bf16*>(rec + R_M);
  const bf16* ml = reinterpret_cast<const bf16*>(rec + R_ML);
  const float* E = reinterpret_cast<const float*>(rec + R_E);
  const float* b = reinterpret_cast<const float*>(rec + R_B);
  const int lrow = ((lane >> 4) << 3) + (lane & 7), lhalf = (lane >> 3) & 1;

  float W[2][4], O1[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) W[nt][e] = O1[nt][e] = 0.f;
#pragma unroll
  for (int kb = 0; kb < KD / 16; ++kb) {
    const uint32_t a0 = pack(S[2 * kb][0], S[2 * kb][1]);
    const uint32_t a1 = pack(S[2 * kb][2], S[2 * kb][3]);
    const uint32_t a2 = pack(S[2 * kb + 1][0], S[2 * kb + 1][1]);
    const uint32_t a3 = pack(S[2 * kb + 1][2], S[2 * kb + 1][3]);
    const int off = lrow * KD + (((2 * kb + lhalf) ^ (lrow & 7)) << 3);
    uint32_t bk[4], bq[4];
    ldsm_x4(bk, kd + off);
    mma(W[0], a0, a1, a2, a3, bk[0], bk[1], W[0]);
    mma(W[1], a0, a1, a2, a3, bk[2], bk[3], W[1]);
    if (!TRANS) {
      ldsm_x4(bq, qd + off);
      mma(O1[0], a0, a1, a2, a3, bq[0], bq[1], O1[0]);
      mma(O1[1], a0, a1, a2, a3, bq[2], bq[3], O1[1]);
    }
  }

  // Vb = (v - W) b (pad tokens selected to 0: their v rows are stale), split hi + lo
  float vb[2][4], vlo[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + 2 * tq + (e & 1);
      const float vv = with_v ? __bfloat162float(vrow[tok * vs + gq + 8 * (e >> 1)]) : 0.f;
      const float x = tok < nv ? (vv - W[nt][e]) * b[tok] : 0.f;
      vb[nt][e] = x;
      vlo[nt][e] = x - __bfloat162float(__float2bfloat16_rn(x));
    }
  uint32_t vah[4], val[4];
  pack_tile(vah, vb);
  pack_tile(val, vlo);
  // 16 x 16 operands (INV, M): row (l >> 4) * 8 + (l & 7), half (l >> 3) & 1 of the half swizzle
  const int off16 = lrow * 16 + ((lhalf ^ ((lrow >> 2) & 1)) << 3);
  uint32_t bi[4];
  ldsm_x4(bi, inv + off16);
  float U[2][4];
  mma_split16(U, vah, val, bi);
  float ulo[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) ulo[nt][e] = U[nt][e] - __bfloat162float(__float2bfloat16_rn(U[nt][e]));
  uint32_t uah[4], ual[4];
  pack_tile(uah, U);
  pack_tile(ual, ulo);

  if (!TRANS) {
    uint32_t bmh[4], bml[4];
    ldsm_x4(bmh, mh + off16);
    ldsm_x4(bml, ml + off16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float O[4];
      mma(O, uah[0], uah[1], uah[2], uah[3], bmh[2 * nt], bmh[2 * nt + 1], O1[nt]);
      mma(O, ual[0], ual[1], ual[2], ual[3], bmh[2 * nt], bmh[2 * nt + 1], O);
      mma(O, uah[0], uah[1], uah[2], uah[3], bml[2 * nt], bml[2 * nt + 1], O);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * tq + (e & 1);
        ow[tok][gq + 8 * (e >> 1)] = __float2bfloat16_rn(O[e]);
      }
    }
  }

  // S = S diag(E) + (U_hi + U_lo)^T kr
  update_state_split<KD / 16>(S, uah, ual, krT, E, 0, lrow, lhalf, tq);
}
#endif

// dynamic shared memory of kda_state_w<NW> (mirrored in launch.rs)
#define STATE_SMEM(NW, ST) ((ST) * (REC_BYTES + CH * 16 * (NW) * 2) + (NW) * CH * TS * 2 + 8 * (ST))

// TRANS (context parallelism, first pass): each segment runs twice from its start, as blocks
// [0, SLICES) with the real v from a zero state (the particular solution P) and as blocks
// [SLICES, 2 SLICES) with v = 0 from the identity (the transition M: S_end = S_start M + P);
// no output; both land in ht as [segment, H, 2, KD, KD] fp32.
template <int NW, int ST, bool TRANS>
__device__ __forceinline__ void state_body(const KdaParams& p) {
  constexpr int VS = 16 * NW;
  constexpr int SLICES = KD / VS;
  static_assert(SLICES >= 1 && SLICES * VS == KD, "the block's value rows divide the head dim");
  constexpr int PARTS = TRANS ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* recs = smem_raw;                                      // [ST][REC_BYTES]
  bf16* vs = reinterpret_cast<bf16*>(smem_raw + ST * REC_BYTES);       // [ST][CH][VS]
  bf16* os = vs + ST * CH * VS;                                        // [NW][CH][TS]
  uint64_t* bars = reinterpret_cast<uint64_t*>(os + NW * CH * TS);     // [ST]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long bid = blockIdx.x;
  const int slice = static_cast<int>(bid % SLICES);
  const int part = static_cast<int>((bid / SLICES) % PARTS);  // 1: the transition M
  const int h = static_cast<int>((bid / (SLICES * PARTS)) % H);
  const int n = static_cast<int>(bid / (SLICES * PARTS * (long long)H));
  const SeqInfo si = seq_info(p, n);
  const long long bos = si.bos, len = si.len;
  const int v0 = slice * VS;
  const int vw = v0 + warp * 16;
  const long long hs = (long long)H * KD;
  const long long hoff = (long long)h * KD;
  const int nchunks = static_cast<int>((len + CH - 1) / CH);
  const unsigned char* ws = reinterpret_cast<const unsigned char*>(p.ws);

  auto nvalid = [&](int c) -> int {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? static_cast<int>(rem) : CH;
  };
  // split kernels: every warp prefetches its own 16 v columns with cp.async (one 16-byte copy
  // per lane and chunk, rows from nv on zero-filled), so thread 0 issues one bulk copy per chunk
  // instead of 17 and the warps never wait on each other for v
  constexpr bool WARP_V = KDA_SPLIT_OPERANDS != 0;
  const bool warp_v = WARP_V && part == 0;
  auto issue_v = [&](int c) {
    if (c < nchunks) {
      const int st = c % ST, nv = nvalid(c);
      const int r = lane >> 1, hf = lane & 1;
      const bool ok = r < nv;
      const long long t0 = bos + (long long)c * CH;
      cp_async16(vs + (st * CH + r) * VS + warp * 16 + hf * 8, ok ? p.v + (t0 + r) * hs + hoff + vw + hf * 8 : p.v,
                 ok ? 16 : 0);
    }
    cp_async_commit();  // one group per chunk, empty past the end, so the wait count stays ST - 1
  };
  // one thread: record + the block's v rows of chunk c into stage c % ST
  auto issue = [&](int c) {
    const int st = c % ST, nv = nvalid(c);
    const uint32_t bar = smem_u32(&bars[st]);
    const bool with_v = part == 0 && !WARP_V;
#if KDA_SPLIT_OPERANDS
    // overlapped with the prep: wait until its record is written
    if (p.flags != nullptr) flag_wait_bounded(p.flags + (si.slot0 + c) * H + h);
#endif
    mbar_expect_tx(bar, REC_BYTES + (with_v ? nv * VS * 2 : 0));
    bulk_g2s(smem_u32(recs + st * REC_BYTES), ws + (size_t)((si.slot0 + c) * H + h) * REC_BYTES, REC_BYTES, bar);
    const long long t0 = bos + (long long)c * CH;
    if (with_v)
      for (int r = 0; r < nv; ++r)
      bulk_g2s(smem_u32(vs + (st * CH + r) * VS), p.v + (t0 + r) * hs + hoff + v0, VS * 2, bar);
  };

  mbar_init_stages(bars, ST, tid);
  __syncthreads();
  if (tid == 0)
    for (int c = 0; c < ST && c < nchunks; ++c) issue(c);
  if (warp_v)
    for (int c = 0; c < ST; ++c) issue_v(c);

  float S[KD / 8][4];
  const size_t sbase = (((size_t)n * H + h) * PARTS + part) * KD * KD;
  if (TRANS) {
#pragma unroll
    for (int nt = 0; nt < KD / 8; ++nt) {
      const int col = nt * 8 + 2 * tq, r0 = vw + gq;
      const float one = part == 1 ? 1.f : 0.f;
      S[nt][0] = r0 == col ? one : 0.f;
      S[nt][1] = r0 == col + 1 ? one : 0.f;
      S[nt][2] = r0 + 8 == col ? one : 0.f;
      S[nt][3] = r0 + 8 == col + 1 ? one : 0.f;
    }
  } else {
    load_state(S, p, sbase, vw + gq, tq);
  }

  bf16(*ow)[TS] = reinterpret_cast<bf16(*)[TS]>(os + warp * CH * TS);
  for (int c = 0; c < nchunks; ++c) {
    const int st = c % ST, nv = nvalid(c);
    mbar_wait(smem_u32(&bars[st]), static_cast<uint32_t>((c / ST) & 1));
    if (warp_v) {
      cp_async_wait_group<ST - 1>();  // this chunk's v group landed (this thread's copy) ...
      __syncwarp();                   // ... and every lane's
    }
    const unsigned char* rec = recs + st * REC_BYTES;
    const bf16* vst = vs + st * CH * VS;
#if KDA_SPLIT_OPERANDS
    split_chunk<TRANS>(S, ow, rec, vst + warp * 16, VS, part == 0, nv, lane);
#else
    const bf16* kd = reinterpret_cast<const bf16*>(rec + R_KD);
    const bf16* qd = reinterpret_cast<const bf16*>(rec + R_QD);
    const bf16* krT = reinterpret_cast<const bf16*>(rec + R_KR);
    const bf16* inv = reinterpret_cast<const bf16*>(rec + R_INV);
    const bf16* mm = reinterpret_cast<const bf16*>(rec + R_M);
    const float* E = reinterpret_cast<const float*>(rec + R_E);
    const float* b = reinterpret_cast<const float*>(rec + R_B);

    // W^T = S kd^T, O1^T = S qd^T (value rows x tokens), S rounded to bf16
    float W[2][4], O1[2][4];
    state_products(W, O1, S, [&](int r, int cc) { return ld32(&kd[swz128(r, cc)]); },
                   [&](int r, int cc) { return ld32(&qd[swz128(r, cc)]); }, gq, tq);

    // Vb = bf16((v - W) b) (pad tokens selected to 0: their v rows are stale); U = INV Vb
    const int vl = warp * 16 + gq;
    float vb[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * tq + (e & 1);
        const float vv = part == 0 ? __bfloat162float(vst[tok * VS + vl + 8 * (e >> 1)]) : 0.f;
        vb[nt][e] = tok < nv ? (vv - W[nt][e]) * b[tok] : 0.f;
      }
    uint32_t va[4], ua[4];
    pack_tile(va, vb);
    float U[2][4];
    solve_u(U, va, [&](int r, int cc) { return ld32(&inv[swz16(r, cc)]); }, gq, tq);
    pack_tile(ua, U);
    // out = O1 + M U
    if (!TRANS) out_tile(ow, ua, [&](int r, int cc) { return ld32(&mm[swz16(r, cc)]); }, O1, gq, tq);
    // S = S diag(E) + U^T kr
    update_state(S, ua, E, [&](int r, int cc) { return ld32(&krT[swz16(r, cc)]); }, gq, tq);
#endif
    __syncwarp();
    if (!TRANS) store_out(p, ow, bos + (long long)c * CH, nv, hs, hoff, vw, lane);
    if (warp_v) issue_v(c + ST);  // the warp is done with its v columns of stage st
    // every warp is done with stage st (and with its o tile): refill it ST chunks ahead
    if (NW > 1) __syncthreads(); else __syncwarp();
    if (tid == 0 && c + ST < nchunks) issue(c + ST);
  }

  if (p.ht != nullptr) store_state(S, p, sbase, vw + gq, tq);
}

// Context-parallel scan: S_start(segment 0) = h0 (or 0), S_start(s + 1) = S_start(s) M_s + P_s,
// in fp32, for SCAN_ROWS value rows of one (sequence, head) per block; writes every segment's
// start state (fp32, read by the second state pass) and the final state (ht, in its dtype).
struct ScanParams {
  const float* pm;   // [B * segs, H, 2, KD, KD]: P then M
  float* starts;     // [B * segs, H, KD, KD]
  const void* h0;    // [B, H, KD, KD] or null
  void* ht;          // [B, H, KD, KD] or null
  int state_fp32;
  int num_heads;
  int segs;
};

#define SCAN_ROWS 16
// dynamic shared memory of kda_cp_scan: M and P rows of two segments (double buffer) + the rows
#define SCAN_SMEM ((2 * (KD * KD + SCAN_ROWS * KD) + SCAN_ROWS * KD) * 4)
extern "C" __global__ void __launch_bounds__(256) kda_cp_scan(const ScanParams p) {
  extern __shared__ __align__(16) float scan_smem[];
  float* mbuf = scan_smem;                          // [2][KD][KD]
  float* pbuf = mbuf + 2 * KD * KD;                 // [2][SCAN_ROWS][KD]
  float (*srow)[KD] = reinterpret_cast<float (*)[KD]>(pbuf + 2 * SCAN_ROWS * KD);
  constexpr int RPT = SCAN_ROWS * KD / 256;  // rows per thread (256 / KD row groups of KD columns)
  const int tid = threadIdx.x, c = tid & (KD - 1), rg = tid >> (KC_LOG2 + 3);
  const int H = p.num_heads;
  const int bh = blockIdx.x, h = bh % H, b = bh / H;
  const int rowb = blockIdx.y * SCAN_ROWS;
  const int row0 = rowb + rg * RPT;
  const size_t hd2 = (size_t)KD * KD;
  // M_s and this block's rows of P_s into buffer s & 1 (16-byte cp.async, all threads)
  auto prefetch = [&](int s) {
    const size_t seg = (size_t)b * p.segs + s;
    const float* P = p.pm + ((seg * H + h) * 2) * hd2;
    const float* M = P + hd2;
    float* md = mbuf + (s & 1) * KD * KD;
    float* pd = pbuf + (s & 1) * SCAN_ROWS * KD;
    for (int i = tid; i < KD * KD / 4; i += 256) cp_async16(md + 4 * i, M + 4 * i, 16);
    for (int i = tid; i < SCAN_ROWS * KD / 4; i += 256) cp_async16(pd + 4 * i, P + (size_t)rowb * KD + 4 * i, 16);
    cp_async_commit();
  };
  const int last = p.ht == nullptr ? p.segs - 1 : p.segs;  // steps that need M and P
  if (last > 0) prefetch(0);
  float acc[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const size_t i = (size_t)bh * hd2 + (size_t)(row0 + r) * KD + c;
    if (p.h0 == nullptr) acc[r] = 0.f;
    else if (p.state_fp32) acc[r] = static_cast<const float*>(p.h0)[i];
    else acc[r] = __bfloat162float(static_cast<const bf16*>(p.h0)[i]);
  }
  for (int s = 0; s < p.segs; ++s) {
    const size_t seg = (size_t)b * p.segs + s;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      p.starts[(seg * H + h) * hd2 + (size_t)(row0 + r) * KD + c] = acc[r];
      srow[rg * RPT + r][c] = acc[r];
    }
    if (s >= last) break;
    cp_async_wait_all();
    __syncthreads();  // buffer s & 1 and srow visible; buffer (s + 1) & 1 free
    if (s + 1 < last) prefetch(s + 1);
    const float* md = mbuf + (s & 1) * KD * KD;
    const float* pd = pbuf + (s & 1) * SCAN_ROWS * KD;
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r] = pd[(rg * RPT + r) * KD + c];
#pragma unroll 16
    for (int k = 0; k < KD; ++k) {
      const float m = md[k * KD + c];
#pragma unroll
      for (int r = 0; r < RPT; ++r) acc[r] = fmaf(srow[rg * RPT + r][k], m, acc[r]);
    }
    __syncthreads();  // srow and buffer s & 1 reused next step
  }
  if (p.ht != nullptr) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const size_t i = (size_t)bh * hd2 + (size_t)(row0 + r) * KD + c;
      if (p.state_fp32) static_cast<float*>(p.ht)[i] = acc[r];
      else static_cast<bf16*>(p.ht)[i] = __float2bfloat16_rn(acc[r]);
    }
  }
}
#if KD == 128
static_assert(SCAN_SMEM == 155648, "update launch.rs");

#if KDA_SPLIT_OPERANDS
static_assert(STATE_SMEM(8, 4) == 80160, "update launch.rs");
static_assert(STATE_SMEM(1, 2) == 30608, "update launch.rs");
static_assert(STATE_SMEM(2, 4) == 63264, "update launch.rs");
static_assert(STATE_SMEM(4, 4) == 68896, "update launch.rs");
static_assert(STATE_SMEM(4, 3) == 52440, "update launch.rs");
#else
static_assert(STATE_SMEM(8, 4) == 78112, "update launch.rs");
static_assert(STATE_SMEM(1, 2) == 29584, "update launch.rs");
static_assert(STATE_SMEM(2, 4) == 61216, "update launch.rs");
static_assert(STATE_SMEM(4, 4) == 66848, "update launch.rs");
static_assert(STATE_SMEM(4, 3) == 50904, "update launch.rs");
#endif
#else  // KD == 64
static_assert(SCAN_SMEM == 45056, "update launch.rs");
#if KDA_SPLIT_OPERANDS
static_assert(STATE_SMEM(1, 2) == 17808, "update launch.rs");
static_assert(STATE_SMEM(2, 4) == 37664, "update launch.rs");
static_assert(STATE_SMEM(4, 4) == 43296, "update launch.rs");
static_assert(STATE_SMEM(4, 3) == 33240, "update launch.rs");
#else
static_assert(STATE_SMEM(1, 2) == 16784, "update launch.rs");
static_assert(STATE_SMEM(2, 4) == 35616, "update launch.rs");
static_assert(STATE_SMEM(4, 4) == 41248, "update launch.rs");
static_assert(STATE_SMEM(4, 3) == 31704, "update launch.rs");
#endif
#endif
extern "C" __global__ void __launch_bounds__(32) kda_state_w1(const KdaParams p) { state_body<1, 2, false>(p); }
extern "C" __global__ void __launch_bounds__(64) kda_state_w2(const KdaParams p) { state_body<2, 4, false>(p); }
// at KD = 64: one block of 4 warps per chain
extern "C" __global__ void __launch_bounds__(128) kda_state_w4(const KdaParams p) { state_body<4, 4, false>(p); }
#if KD == 128
// one block of 8 warps per chain: every record is read once per chain instead of once per slice
extern "C" __global__ void __launch_bounds__(256, 2) kda_state_w8(const KdaParams p) { state_body<8, 4, false>(p); }
#endif
extern "C" __global__ void __launch_bounds__(128) kda_cp_transition_w4(const KdaParams p) { state_body<4, 4, true>(p); }
// 3 stages: 4 blocks fit one SM's shared memory (the segmented passes run many blocks per SM)
extern "C" __global__ void __launch_bounds__(128, 4) kda_cp_transition_w4s3(const KdaParams p) { state_body<4, 3, true>(p); }
extern "C" __global__ void __launch_bounds__(128, 4) kda_cp_state_w4s3(const KdaParams p) { state_body<4, 3, false>(p); }
