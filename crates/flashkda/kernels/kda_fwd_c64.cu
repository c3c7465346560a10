// KDA forward with 64-token chunks on wgmma (issue 11, opt-in `Kernel::Chunk64`; correct on the GPU,
// slower than the default, 2026-12-05). Math: `reference::chunked64` (16-token sub-chunks keep every factor in range: see its
// module docs); rounding: `reference::emulated64::C64_KERNEL` (= `Rounding::SPLIT`: hi + lo bf16
// pairs for the prep products, M, Vb and U; bf16 kd, qd, kr, INV and state operand; fp32 state).
//
// kda_prep64: fully parallel, one 256-thread block per (64-token chunk slot, head), two blocks per
// SM. Norms, beta, gate cumsum, kd/qd/krT/E/b, the sub-chunked A -> INV (block forward substitution,
// off-diagonal blocks on mma.sync) and M, written straight to one REC64_BYTES record per (slot,
// head), every bf16 tile in the no-swizzle K-major core-matrix layout of the state pass's wgmma B
// descriptors; the zero blocks above the diagonal of INV, M hi, M lo are left unwritten (the state
// pass neither copies nor reads them).
// kda_state64: the serial pass. One block of two warpgroups per (sequence, head) chain, warpgroup
// wg owning value rows [64 wg, 64 wg + 64) of the fp32 state in m64n128 wgmma accumulators for the
// whole sequence. One block rather than two: both warpgroups read the same record, so one shared
// copy halves the record traffic and shared memory (2 stages of 74.5 KB fit once per SM, and
// H <= 132 chains per sequence stay one wave); the price is a block-wide barrier per chunk.
// Records arrive by bulk copy on mbarriers (19 pieces around the zero blocks; 2 stages: chunk c + 2
// is requested when chunk c is done), v rows by cp.async per warpgroup (pad rows zero-filled).
#include "kda_common.cuh"
#include "kda_c64_wgmma.cuh"

#define C64 64        // tokens per chunk
#define SUB 16        // tokens per sub-chunk (range bound of docs/specs/kda.md §1.4 at lower bound -5)
#define PRS (KD + 8)  // padded row stride of the prep's [64][KD] bf16 tiles
static_assert(KD == 128, "kda_fwd_c64.cu is head dim 128 only");

// Record (bytes). Tile [N][K] bf16, element (n, k) at (n / 8) * SBO + (k / 8) * 128 + (n % 8) * 16
// + (k % 8) * 2: LBO = 128, SBO = K * 16.
#define R64_KD 0          // kd  [64 tok][128 ch], SBO 2048 (B of W^T = S kd^T)
#define R64_QD 16384      // qd  [64 tok][128 ch], SBO 2048 (B of O1^T = S qd^T)
#define R64_KR 32768      // krT [128 ch][64 tok], SBO 1024 (B of S += U^T kr)
#define R64_INV 49152     // INV [64 i][64 j],     SBO 1024 (B of U^T = Vb^T INV^T)
#define R64_MH 57344      // M hi [64 i][64 j],    SBO 1024 (B of O^T += U^T M^T)
#define R64_ML 65536      // M lo
#define R64_E 73728       // f32 [128] 2^Gtot
#define R64_B 74240       // f32 [64] sigmoid(beta), 0 on pad rows
#define REC64_BYTES 74496 // mirrored in launch/c64.rs
static_assert(REC64_BYTES == R64_B + 256 && REC64_BYTES % 16 == 0, "record layout");

__device__ __forceinline__ int core_off(int n, int k, int sbo) { return (n >> 3) * sbo + (k >> 3) * 128 + (n & 7) * 16 + (k & 7) * 2; }


// Phase-disjoint buffers share memory so that two blocks fit per SM (2 x (109.25 + 1) KiB <= 228 KiB):
// g only until the cumsum, the column operands only during the A/M steps, X/Y only for the inverse;
// row block s of q becomes row block s of A once A/M step s has read it (q rows of block s are used
// by no later step). Row operands are built in registers, M goes from the accumulators to the record.
#define ERS (KD + 8)  // padded row stride of ER (floats): float2 fragment reads conflict-free per half-warp
#define AST (PRS / 2) // row stride (floats) of A, stored over q's rows
struct __align__(16) Prep64Smem {
  bf16 q[C64][PRS];   // q rows; rows of block s hold A's rows (fp32, stride AST) after A/M step s
  bf16 k[C64][PRS];
  float G[C64][KD];   // cumulative log2 decay from the chunk start (pad rows: the last valid one)
  float rnq[C64], rnk[C64], b[C64];
  float ER[SUB][ERS];  // A/M step s: 2^(G_i - R) of its 16 rows, shared by the kdl and qdl fragments
  union U {
    bf16 g[C64][PRS];  // gate rows, until the cumsum
    struct {
      bf16 h[C64][PRS];  // column operands kc^(s) (hi)
      bf16 l[C64][PRS];  // (lo)
    } col;
    struct {
      float X[C64][C64 + 1];  // INV, fp32
      float Y[3][SUB][SUB + 1];
    } inv;
  } u;
};
#define PREP64_SMEM ((int)sizeof(Prep64Smem))
static_assert(sizeof(Prep64Smem) == 111872, "update launch/c64.rs");
static_assert(2 * (sizeof(Prep64Smem) + 1024) <= 228 * 1024, "two kda_prep64 blocks per SM");
static_assert(SUB * AST * 4 <= SUB * PRS * 2, "a row block of A fits in a row block of q");

__device__ __forceinline__ void split_bf16(float x, bf16& hi, bf16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}

// 256 threads: 8 warps.
extern "C" __global__ void __launch_bounds__(256, 2) kda_prep64(const KdaParams p) {
  extern __shared__ __align__(16) unsigned char prep_raw[];
  Prep64Smem& sm = *reinterpret_cast<Prep64Smem*>(prep_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long slot = blockIdx.x;
  const int h = blockIdx.y;
  const int n = slot_owner<C64>(p, slot);
  const SeqInfo si = seq_slots<C64>(p, n);
  const long long c = slot - si.slot0;
  if (c < 0 || c * C64 >= si.len) return;  // unused slot (block-uniform)
  const long long rem = si.len - c * C64;
  const int nv = rem < C64 ? static_cast<int>(rem) : C64;
  const long long t0 = si.bos + c * C64;
  const long long hs = (long long)H * KD, hoff = (long long)h * KD;
  const long long qhs = (long long)p.qk_heads * KD;
  const long long qhoff = (long long)(h / (H / p.qk_heads)) * KD;

  // q, k (of the q/k head), g rows; rows from nv on zero-filled
  for (int i = tid; i < 3 * C64 * 16; i += 256) {
    const int which = i / (C64 * 16), r = (i / 16) % C64, cc = i % 16;
    const bf16* src = which == 0 ? p.q : (which == 1 ? p.k : p.g);
    bf16* dst = which == 0 ? &sm.q[r][cc * 8] : (which == 1 ? &sm.k[r][cc * 8] : &sm.u.g[r][cc * 8]);
    const bool ok = r < nv;
    const long long off = which == 2 ? (t0 + r) * hs + hoff : (t0 + r) * qhs + qhoff;
    cp_async16(dst, ok ? src + off + cc * 8 : src, ok ? 16 : 0);
  }
  cp_async_commit();
  const float exp_a = __expf(p.a_log[h]);
  const float lb2 = p.lower_bound * 1.4426950408889634f;
  unsigned char* rec = reinterpret_cast<unsigned char*>(p.ws) + (size_t)(slot * H + h) * REC64_BYTES;
  cp_async_wait_all();
  __syncthreads();

  // norms of the 64 q and 64 k rows (warp w: rows w, w + 8, ...), sigmoid(beta)
  for (int r = warp; r < 2 * C64; r += 8) {
    const bf16* row = r < C64 ? &sm.q[r][0] : &sm.k[r - C64][0];
    float x = lane_sq128(row, lane);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) {
      if (r < C64) sm.rnq[r] = rsqrtf(x + 1e-6f); else sm.rnk[r - C64] = rsqrtf(x + 1e-6f);
    }
  }
  if (tid < C64) sm.b[tid] = tid < nv ? sigmoidf_(__bfloat162float(p.beta[(t0 + tid) * H + h])) : 0.f;
  // gate cumsum, one thread per channel (pad rows add no decay)
  if (tid < KD) {
    const float dtb = p.dt_bias[hoff + tid];
    float acc = 0.f;
#pragma unroll 8
    for (int i = 0; i < C64; ++i) {  // the sigmoids are independent: only acc is serial
      const float gm = lb2 * sigmoidf_(exp_a * (__bfloat162float(sm.u.g[i][tid]) + dtb));
      acc += i < nv ? gm : 0.f;
      sm.G[i][tid] = acc;
    }
  }
  __syncthreads();

  // ---- state-pass tiles straight into the record: kd, qd (thread: token i, 8 channels by 16-byte
  // shared loads), krT (thread: channel, 8 tokens; lanes along channels, so the shared column reads
  // are conflict-free and 8 lanes fill one 128-byte core row), E, b
  for (int u = tid; u < C64 * 16; u += 256) {
    const int i = u >> 4, c0 = (u & 15) * 8;
    const uint4 kraw = *reinterpret_cast<const uint4*>(&sm.k[i][c0]);
    const uint4 qraw = *reinterpret_cast<const uint4*>(&sm.q[i][c0]);
    const float4 g0 = *reinterpret_cast<const float4*>(&sm.G[i][c0]);
    const float4 g1 = *reinterpret_cast<const float4*>(&sm.G[i][c0 + 4]);
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    const bf16* kb = reinterpret_cast<const bf16*>(&kraw);
    const bf16* qb = reinterpret_cast<const bf16*>(&qraw);
    const float rk = sm.rnk[i], rq = sm.rnq[i];
    uint32_t kw[4], qw[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      float kv[2], qv[2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const float ex = ex2(gv[e + x]);
        kv[x] = __bfloat162float(kb[e + x]) * rk * ex;
        qv[x] = __bfloat162float(qb[e + x]) * rq * p.scale * ex;
      }
      kw[e / 2] = pack(kv[0], kv[1]);
      qw[e / 2] = pack(qv[0], qv[1]);
    }
    *reinterpret_cast<uint4*>(rec + R64_KD + core_off(i, c0, 2048)) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
    *reinterpret_cast<uint4*>(rec + R64_QD + core_off(i, c0, 2048)) = make_uint4(qw[0], qw[1], qw[2], qw[3]);
  }
  for (int u = tid; u < KD * 8; u += 256) {
    const int ch = u % KD, i0 = (u / KD) * 8;
    const float gt = sm.G[C64 - 1][ch];
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const float k0 = __bfloat162float(sm.k[i0 + e][ch]) * sm.rnk[i0 + e];
      const float k1 = __bfloat162float(sm.k[i0 + e + 1][ch]) * sm.rnk[i0 + e + 1];
      w[e / 2] = pack(k0 * ex2(gt - sm.G[i0 + e][ch]), k1 * ex2(gt - sm.G[i0 + e + 1][ch]));
    }
    *reinterpret_cast<uint4*>(rec + R64_KR + core_off(ch, i0, 1024)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (tid < KD) reinterpret_cast<float*>(rec + R64_E)[tid] = ex2(sm.G[C64 - 1][tid]);
  if (tid < C64) reinterpret_cast<float*>(rec + R64_B)[tid] = sm.b[tid];

  // ---- A and M by row blocks of 16 (reference::chunked64::build_intra). Step s: warp t <= s
  // computes the 16 x 16 tiles A_st and M_st.
  float* const Af = reinterpret_cast<float*>(&sm.q[0][0]);  // A(i, j) = Af[i * AST + j], rows of done steps
  for (int s = 0; s < C64 / SUB; ++s) {
    const int ncol = SUB * (s + 1);
    // row factors 2^(G_i - R), R = G at the end of sub-chunk s - 1, of the rows i of block s
    // (thread: 2 channels, the same pair on every iteration as 256 is a multiple of KD / 2)
    const int chp = 2 * (tid % (KD / 2));
    const float2 r = s == 0 ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(&sm.G[SUB * s - 1][chp]);
    for (int u = tid; u < SUB * KD / 2; u += 256) {
      const int li = u / (KD / 2), ch = chp;
      const float2 gi = *reinterpret_cast<const float2*>(&sm.G[SUB * s + li][ch]);
      *reinterpret_cast<float2*>(&sm.ER[li][ch]) = make_float2(ex2(gi.x - r.x), ex2(gi.y - r.y));
    }
    // column operands kc_j = k_j 2^(R - G_j), j < 16 (s + 1): <= 1 off the diagonal block
    for (int u = tid; u < ncol * KD / 2; u += 256) {
      const int j = u / (KD / 2), ch = chp;
      const float2 gj = *reinterpret_cast<const float2*>(&sm.G[j][ch]);
      const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sm.k[j][ch]));
      const float rk = sm.rnk[j];
      bf16 h0, l0, h1, l1;
      split_bf16(kk.x * rk * ex2(r.x - gj.x), h0, l0);
      split_bf16(kk.y * rk * ex2(r.y - gj.y), h1, l1);
      *reinterpret_cast<__nv_bfloat162*>(&sm.u.col.h[j][ch]) = __halves2bfloat162(h0, h1);
      *reinterpret_cast<__nv_bfloat162*>(&sm.u.col.l[j][ch]) = __halves2bfloat162(l0, l1);
    }
    __syncthreads();
    const bool busy = warp <= s;  // warp t: the A and M tiles of column block t (shared B fragments)
    const int t = warp;
    float acc[2][2][4] = {};  // [which: 0 = A, 1 = M][nt]
    if (busy) {
      // row operands kdl, qdl = (k, scale q) 2^(G_i - R), split in registers (rows 16 s + gq, + 8;
      // columns kc, kc + 1, kc + 8, kc + 9); the factors 2^(G_i - R) read once for both
      const int i0 = SUB * s + gq;
      const float rk0 = sm.rnk[i0], rk1 = sm.rnk[i0 + 8];
      const float rq0 = sm.rnq[i0], rq1 = sm.rnq[i0 + 8];
      auto rowpairs = [&](int li, int ch, float rk, float rq, uint32_t& kh, uint32_t& kl, uint32_t& qh, uint32_t& ql) {
        const float2 er = *reinterpret_cast<const float2*>(&sm.ER[li][ch]);
        const float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sm.k[SUB * s + li][ch]));
        const float2 qq = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sm.q[SUB * s + li][ch]));
        bf16 h0, l0, h1, l1;
        split_bf16(kk.x * rk * er.x, h0, l0);  // = (k rn) 2^(G_i - R), as the float64 form's kn * ex
        split_bf16(kk.y * rk * er.y, h1, l1);
        __nv_bfloat162 hh = __halves2bfloat162(h0, h1), ll = __halves2bfloat162(l0, l1);
        kh = *reinterpret_cast<uint32_t*>(&hh);
        kl = *reinterpret_cast<uint32_t*>(&ll);
        split_bf16(qq.x * rq * p.scale * er.x, h0, l0);  // = (q rn scale) 2^(G_i - R)
        split_bf16(qq.y * rq * p.scale * er.y, h1, l1);
        hh = __halves2bfloat162(h0, h1);
        ll = __halves2bfloat162(l0, l1);
        qh = *reinterpret_cast<uint32_t*>(&hh);
        ql = *reinterpret_cast<uint32_t*>(&ll);
      };
#pragma unroll 2
      for (int kb = 0; kb < KD / 16; ++kb) {
        const int kc = kb * 16 + 2 * tq;
        uint32_t ka[4], kl[4], qa[4], ql[4];
        rowpairs(gq, kc, rk0, rq0, ka[0], kl[0], qa[0], ql[0]);
        rowpairs(gq + 8, kc, rk1, rq1, ka[1], kl[1], qa[1], ql[1]);
        rowpairs(gq, kc + 8, rk0, rq0, ka[2], kl[2], qa[2], ql[2]);
        rowpairs(gq + 8, kc + 8, rk1, rq1, ka[3], kl[3], qa[3], ql[3]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int j = SUB * t + nt * 8 + gq;
          const uint32_t b0 = ld32(&sm.u.col.h[j][kc]), b1 = ld32(&sm.u.col.h[j][kc + 8]);
          const uint32_t c0 = ld32(&sm.u.col.l[j][kc]), c1 = ld32(&sm.u.col.l[j][kc + 8]);
          mma(acc[0][nt], ka[0], ka[1], ka[2], ka[3], b0, b1, acc[0][nt]);
          mma(acc[1][nt], qa[0], qa[1], qa[2], qa[3], b0, b1, acc[1][nt]);
          mma(acc[0][nt], ka[0], ka[1], ka[2], ka[3], c0, c1, acc[0][nt]);
          mma(acc[1][nt], qa[0], qa[1], qa[2], qa[3], c0, c1, acc[1][nt]);
          mma(acc[0][nt], kl[0], kl[1], kl[2], kl[3], b0, b1, acc[0][nt]);
          mma(acc[1][nt], ql[0], ql[1], ql[2], ql[3], b0, b1, acc[1][nt]);
        }
      }
    }
    __syncthreads();  // q rows of block s are read; they become A's rows
    if (busy) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = SUB * s + gq + 8 * hr, j = SUB * t + nt * 8 + 2 * tq;
          const float v0 = acc[0][nt][2 * hr], v1 = acc[0][nt][2 * hr + 1];
          const float m0 = acc[1][nt][2 * hr], m1 = acc[1][nt][2 * hr + 1];
          // select, never mask by multiplying: above the diagonal the products may be huge
          Af[i * AST + j] = j < i ? v0 * sm.b[i] : 0.f;
          Af[i * AST + j + 1] = j + 1 < i ? v1 * sm.b[i] : 0.f;
          // M straight to the record (hi, lo pairs; j even, so 4-byte aligned)
          bf16 h0, lo0, h1, lo1;
          split_bf16(j <= i ? m0 : 0.f, h0, lo0);
          split_bf16(j + 1 <= i ? m1 : 0.f, h1, lo1);
          const int off = core_off(i, j, 1024);
          *reinterpret_cast<__nv_bfloat162*>(rec + R64_MH + off) = __halves2bfloat162(h0, h1);
          *reinterpret_cast<__nv_bfloat162*>(rec + R64_ML + off) = __halves2bfloat162(lo0, lo1);
        }
    }
    __syncthreads();  // the column operands are rewritten by the next step
  }

  // ---- INV = (I + A)^-1: diagonal blocks by forward substitution in fp32 (thread: one column,
  // the column kept in registers) ...
  float(*X)[C64 + 1] = sm.u.inv.X;
  if (tid < C64) {
    const int s0 = (tid / SUB) * SUB, j = tid, lj = tid % SUB;
    float xc[SUB];
#pragma unroll
    for (int li = 0; li < SUB; ++li) {
      float acc = li == lj ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < li; ++m) acc = fmaf(-Af[(s0 + li) * AST + s0 + m], xc[m], acc);
      xc[li] = acc;
      X[s0 + li][j] = acc;
    }
  }
  __syncthreads();
  // ... then X_st = -X_ss (sum_{t <= m < s} A_sm X_mt), row block by row block, on mma.sync with
  // split operands (hi hi + hi lo + lo hi, fp32 accumulation): warp w < 2 s owns columns
  // [16 t + 8 nt, + 8) of X_st, t = w / 2, nt = w % 2.
  auto afrag = [&](const float* base, int ld, int r, int c, uint32_t& hi, uint32_t& lo) {
    bf16 h0, l0, h1, l1;
    split_bf16(base[r * ld + c], h0, l0);
    split_bf16(base[r * ld + c + 1], h1, l1);
    __nv_bfloat162 hh = __halves2bfloat162(h0, h1), ll = __halves2bfloat162(l0, l1);
    hi = *reinterpret_cast<uint32_t*>(&hh);
    lo = *reinterpret_cast<uint32_t*>(&ll);
  };
  auto bfrag = [&](const float* base, int ld, int kr, int n, uint32_t& hi, uint32_t& lo) {
    bf16 h0, l0, h1, l1;
    split_bf16(base[kr * ld + n], h0, l0);
    split_bf16(base[(kr + 1) * ld + n], h1, l1);
    __nv_bfloat162 hh = __halves2bfloat162(h0, h1), ll = __halves2bfloat162(l0, l1);
    hi = *reinterpret_cast<uint32_t*>(&hh);
    lo = *reinterpret_cast<uint32_t*>(&ll);
  };
  for (int s = 1; s < C64 / SUB; ++s) {
    if (warp < 2 * s) {
      const int t = warp >> 1, n = SUB * t + 8 * (warp & 1) + gq;  // this lane's B column
      float y[4] = {};
      for (int m0 = SUB * t; m0 < SUB * s; m0 += SUB) {  // Y = sum_m A_sm X_mt
        uint32_t a[4], al[4], b[2], bl[2];
        const float* Ab = Af + SUB * s * AST;
        afrag(Ab, AST, gq, m0 + 2 * tq, a[0], al[0]);
        afrag(Ab, AST, gq + 8, m0 + 2 * tq, a[1], al[1]);
        afrag(Ab, AST, gq, m0 + 2 * tq + 8, a[2], al[2]);
        afrag(Ab, AST, gq + 8, m0 + 2 * tq + 8, a[3], al[3]);
        bfrag(&X[0][0], C64 + 1, m0 + 2 * tq, n, b[0], bl[0]);
        bfrag(&X[0][0], C64 + 1, m0 + 2 * tq + 8, n, b[1], bl[1]);
        mma(y, a[0], a[1], a[2], a[3], b[0], b[1], y);
        mma(y, a[0], a[1], a[2], a[3], bl[0], bl[1], y);
        mma(y, al[0], al[1], al[2], al[3], b[0], b[1], y);
      }
      float(*Y)[SUB + 1] = sm.u.inv.Y[t];  // this warp's 8 columns of Y_t
      const int yc = 8 * (warp & 1) + 2 * tq;
      Y[gq][yc] = y[0];
      Y[gq][yc + 1] = y[1];
      Y[gq + 8][yc] = y[2];
      Y[gq + 8][yc + 1] = y[3];
      __syncwarp();
      uint32_t a[4], al[4], b[2], bl[2];  // X_st = -X_ss Y
      const float* Xs = &X[SUB * s][SUB * s];
      afrag(Xs, C64 + 1, gq, 2 * tq, a[0], al[0]);
      afrag(Xs, C64 + 1, gq + 8, 2 * tq, a[1], al[1]);
      afrag(Xs, C64 + 1, gq, 2 * tq + 8, a[2], al[2]);
      afrag(Xs, C64 + 1, gq + 8, 2 * tq + 8, a[3], al[3]);
      bfrag(&Y[0][0], SUB + 1, 2 * tq, 8 * (warp & 1) + gq, b[0], bl[0]);
      bfrag(&Y[0][0], SUB + 1, 2 * tq + 8, 8 * (warp & 1) + gq, b[1], bl[1]);
      float x[4] = {};
      mma(x, a[0], a[1], a[2], a[3], b[0], b[1], x);
      mma(x, a[0], a[1], a[2], a[3], bl[0], bl[1], x);
      mma(x, al[0], al[1], al[2], al[3], b[0], b[1], x);
      const int i = SUB * s + gq, j = SUB * t + yc;
      X[i][j] = -x[0];
      X[i][j + 1] = -x[1];
      X[i + 8][j] = -x[2];
      X[i + 8][j + 1] = -x[3];
    }
    __syncthreads();
  }

  // ---- INV (bf16) into the record (thread: row i, 8 columns). The zero blocks above the diagonal
  // of INV, M hi and M lo are never written: kda_state64 neither copies nor reads them (its shared
  // copies hold zeros there)
  for (int u = tid; u < C64 * 8; u += 256) {
    const int i = u >> 3, j0 = (u & 7) * 8;
    if (j0 >= SUB * (i / SUB + 1)) continue;
    uint32_t wi[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const float x0 = j0 + e <= i ? X[i][j0 + e] : 0.f, x1 = j0 + e + 1 <= i ? X[i][j0 + e + 1] : 0.f;
      wi[e / 2] = pack(x0, x1);
    }
    const int off = core_off(i, j0, 1024);
    *reinterpret_cast<uint4*>(rec + R64_INV + off) = make_uint4(wi[0], wi[1], wi[2], wi[3]);
  }
}

#include "kda_fwd_c64_state.cuh"
#include "kda_c64_selftest.cuh"
