// Shared by the KDA forward kernels: the launch parameters (mirrored by `launch.rs`), small PTX
// helpers, the state load/store and the per-chunk phases (written once, so one set of rounding
// points covers kda_fwd.cu, kda_fwd_pipelined.cu and kda_fwd_ws.cu).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

struct KdaParams {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const bf16* g;
  const bf16* beta;
  const float* a_log;
  const float* dt_bias;
  bf16* out;
  const void* h0;
  void* ht;
  const long long* cu_seqlens;
  long long seq_len;       // tokens per sequence without cu_seqlens
  long long total_tokens;  // B * T
  int num_heads;
  int num_seqs;
  int state_fp32;          // 1: h0/ht are fp32, 0: bf16
  float scale;
  float lower_bound;
  void* ws;                // kda_fwd_ws.cu: the per-(chunk slot, head) record workspace
  int seg_chunks;          // kda_fwd_ws.cu state passes: >0 splits each fixed-length sequence into
                           // segments of seg_chunks chunks (then sequence index = segment index)
  int segs_per_seq;        // ceil(chunks per sequence / seg_chunks) when seg_chunks > 0
  int qk_heads;            // q/k heads (GVA: num_heads is a multiple; value head h reads q/k head
                           // h / (num_heads / qk_heads)); kda_fwd_ws.cu only
  int pad_;
  unsigned int* flags;     // kda_fwd_ws_split.cu, overlapped prep and state pass: one ready flag per
                           // (chunk slot, head), zeroed before the call; null otherwise
};

// Ready flags of the overlapped prep and state pass (acquire/release at GPU scope).
__device__ __forceinline__ void flag_release(unsigned int* f) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(f), "r"(1u) : "memory");
}
__device__ __forceinline__ unsigned int flag_acquire(const unsigned int* f) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
  return v;
}
// Waits for flag f (a prep block that never runs traps after 2 s instead of hanging the stream; the
// caller gets a CUDA error), then orders the record before the bulk copy that reads it next.
__device__ __forceinline__ void flag_wait_bounded(const unsigned int* f) {
  unsigned long long w0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(w0));
  while (flag_acquire(f) == 0) {
    __nanosleep(100);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - w0 > 2000000000ull) __trap();
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// The slot space of C-token chunks (16: the workspace records, 64: the chunk-64 records). Sequence n:
// fixed length -> slots from n * ceil(T / C); varlen -> from cu[n] / C + n (a sequence of len tokens
// needs ceil(len/C) slots, and floor(a/C) + ceil(len/C) <= floor((a+len)/C) + 1, so slots never overlap;
// total <= T/C + N). Offsets are clamped to [0, total_tokens].
struct SeqInfo {
  long long bos, len, slot0;
};

template <class P>
__device__ __forceinline__ long long clamp_cu(const P& p, int n) {
  long long a = p.cu_seqlens[n];
  return a < 0 ? 0 : (a > p.total_tokens ? p.total_tokens : a);
}

// The varlen case (cu_seqlens set); P: KdaParams or KdaBwdParams.
template <int C, class P>
__device__ __forceinline__ void seq_slots_varlen(SeqInfo& s, const P& p, int n) {
  const long long a = clamp_cu(p, n);
  long long e = clamp_cu(p, n + 1);
  e = e < a ? a : e;
  s.bos = a;
  s.len = e - a;
  s.slot0 = a / C + n;
}

template <int C, class P>
__device__ __forceinline__ SeqInfo seq_slots(const P& p, int n) {
  SeqInfo s;
  if (p.cu_seqlens != nullptr) {
    seq_slots_varlen<C>(s, p, n);
  } else {
    s.bos = (long long)n * p.seq_len;
    s.len = p.seq_len;
    s.slot0 = (long long)n * ((p.seq_len + C - 1) / C);
  }
  return s;
}

// The sequence whose slots hold `slot` (varlen: the largest n with slot0(n) <= slot).
template <int C, class P>
__device__ __forceinline__ int slot_owner(const P& p, long long slot) {
  if (p.cu_seqlens != nullptr) {
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (clamp_cu(p, mid) / C + mid <= slot) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  return static_cast<int>(slot / ((p.seq_len + C - 1) / C));
}

// mbarrier + bulk copy (TMA engine) helpers of the workspace state passes, the backward and the chunk-64 pass.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// Thread 0: the ns stage barriers (count 1) of a pass; the caller syncs the block before their use.
__device__ __forceinline__ void mbar_init_stages(uint64_t* bars, int ns, int tid) {
  if (tid == 0) {
    for (int i = 0; i < ns; ++i) mbar_init(smem_u32(&bars[i]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// Key = value head dimension: 128, or 64 where a file defines it first (kda_fwd_ws_d64.cu,
// kda_fwd_ws_split_d64.cu; only the workspace schedule of kda_fwd_ws.cu supports 64).
#ifndef KD
#define KD 128
#endif
static_assert(KD == 128 || KD == 64, "head dim 64 or 128");
#define CH 16
#define RS (KD + 8)  // padded row stride of the 16xKD tiles (bank-conflict free fragment loads)
#define KRS 24  // krT row stride
#define TS 24   // 16x16 tile row stride

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t ld32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Branch-free (no IEEE-division slow path), so unrolled loops keep their ILP.
__device__ __forceinline__ float sigmoidf_(float x) { return rcp_approx(1.0f + ex2(-1.4426950408889634f * x)); }


// The KDxKD state of one (sequence, head) lives in mma accumulator fragments: each warp holds 16 value
// rows, thread (gq, tq) rows r0 = first + gq and r0 + 8, columns nt*8 + 2*tq (+1). `sbase` is the
// element offset of the (sequence, head) state; a null `h0` means a zero initial state.
__device__ __forceinline__ void load_state(float (&S)[KD / 8][4], const KdaParams& p, size_t sbase, int r0, int tq) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < KD / 8; ++nt) {
    const int col = nt * 8 + 2 * tq;
    if (p.h0 == nullptr) {
      S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.f;
    } else if (p.state_fp32) {
      const float* h0 = static_cast<const float*>(p.h0) + sbase;
      float2 x0 = *reinterpret_cast<const float2*>(h0 + (size_t)r0 * KD + col);
      float2 x1 = *reinterpret_cast<const float2*>(h0 + (size_t)r1 * KD + col);
      S[nt][0] = x0.x; S[nt][1] = x0.y; S[nt][2] = x1.x; S[nt][3] = x1.y;
    } else {
      const bf16* h0 = static_cast<const bf16*>(p.h0) + sbase;
      __nv_bfloat162 x0 = *reinterpret_cast<const __nv_bfloat162*>(h0 + (size_t)r0 * KD + col);
      __nv_bfloat162 x1 = *reinterpret_cast<const __nv_bfloat162*>(h0 + (size_t)r1 * KD + col);
      S[nt][0] = __low2float(x0); S[nt][1] = __high2float(x0);
      S[nt][2] = __low2float(x1); S[nt][3] = __high2float(x1);
    }
  }
}

// Writes the state fragments back to `p.ht` (fp32 or bf16, rounded once).
__device__ __forceinline__ void store_state(const float (&S)[KD / 8][4], const KdaParams& p, size_t sbase, int r0,
                                            int tq) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < KD / 8; ++nt) {
    const int col = nt * 8 + 2 * tq;
    if (p.state_fp32) {
      float* ht = static_cast<float*>(p.ht) + sbase;
      *reinterpret_cast<float2*>(ht + (size_t)r0 * KD + col) = make_float2(S[nt][0], S[nt][1]);
      *reinterpret_cast<float2*>(ht + (size_t)r1 * KD + col) = make_float2(S[nt][2], S[nt][3]);
    } else {
      bf16* ht = static_cast<bf16*>(p.ht) + sbase;
      *reinterpret_cast<__nv_bfloat162*>(ht + (size_t)r0 * KD + col) = __floats2bfloat162_rn(S[nt][0], S[nt][1]);
      *reinterpret_cast<__nv_bfloat162*>(ht + (size_t)r1 * KD + col) = __floats2bfloat162_rn(S[nt][2], S[nt][3]);
    }
  }
}

// ---- Per-chunk phases shared by the kernels (one set of rounding points, mirrored by
// `reference::emulated`). Tiles are passed as accessors where the layouts differ: `ld(r, c)` returns
// the bf16 pair (r, c), (r, c + 1) of a row-major tile as one register (padded rows in kda_fwd*.cu,
// the workspace record's swizzle in kda_fwd_ws.cu).

// Tokens [bos, bos + len) of sequence n; cu_seqlens offsets are clamped into [0, total_tokens].
__device__ __forceinline__ void seq_range(const KdaParams& p, int n, long long& bos, long long& len) {
  if (p.cu_seqlens != nullptr) {
    long long a = p.cu_seqlens[n], e = p.cu_seqlens[n + 1];
    a = a < 0 ? 0 : (a > p.total_tokens ? p.total_tokens : a);
    e = e < a ? a : (e > p.total_tokens ? p.total_tokens : e);
    bos = a;
    len = e - a;
  } else {
    bos = (long long)n * p.seq_len;
    len = p.seq_len;
  }
}

// cp.async of tokens [t0, t0 + nv) of q, k, g (128 channels) and of v (VS rows from v0) into one
// stage; rows from nv on are zero-filled. Head dim 128 only (kda_fwd.cu, kda_fwd_pipelined.cu).
template <int NT, int VS, int VRS>
__device__ __forceinline__ void prefetch_chunk(bf16 (*q)[RS], bf16 (*k)[RS], bf16 (*g)[RS], bf16 (*v)[VRS],
                                               const KdaParams& p, long long t0, int nv, long long hs,
                                               long long hoff, int v0, int tid) {
  for (int i = tid; i < 3 * 256; i += NT) {
    const int which = i >> 8, r = (i >> 4) & 15, cc = i & 15;
    const bf16* src = which == 0 ? p.q : (which == 1 ? p.k : p.g);
    bf16* dst = which == 0 ? &q[r][cc * 8] : (which == 1 ? &k[r][cc * 8] : &g[r][cc * 8]);
    const bool ok = r < nv;
    cp_async16(dst, ok ? src + (t0 + r) * hs + hoff + cc * 8 : src, ok ? 16 : 0);
  }
  constexpr int VCH = VS / 8;
  for (int i = tid; i < CH * VCH; i += NT) {
    const int r = i / VCH, cc = i % VCH;
    const bool ok = r < nv;
    cp_async16(&v[r][cc * 8], ok ? p.v + (t0 + r) * hs + hoff + v0 + cc * 8 : p.v, ok ? 16 : 0);
  }
  cp_async_commit();
}

// This lane's 4 channels of the squared norm of a 128-channel bf16 row.
__device__ __forceinline__ float lane_sq128(const bf16* row, int lane) {
  const uint2 raw = *reinterpret_cast<const uint2*>(row + lane * 4);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  float x = a.x * a.x;
  x = fmaf(a.y, a.y, x);
  x = fmaf(b2.x, b2.x, x);
  return fmaf(b2.y, b2.y, x);
}

// Squared norms of the 16 q rows and 16 k rows (row_of(r): q row r < 16, else k row r - 16); warp w
// of NW takes rows w, w + NW, ... (unrolled so the shuffle chains interleave); lane 0 stores
// put(r, 1 / sqrt(|row|^2 + 1e-6)).
template <int NW, class Row, class Put>
__device__ __forceinline__ void row_norms(Row row_of, Put put, int warp, int lane) {
  constexpr int RPW = 2 * CH / NW;
  float ss[RPW];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const bf16* row = row_of(warp + rr * NW);
#if KD == 128
    ss[rr] = lane_sq128(row, lane);
#else
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + lane * 2));
    ss[rr] = fmaf(a.y, a.y, a.x * a.x);
#endif
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) ss[rr] += __shfl_xor_sync(0xffffffffu, ss[rr], o);
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) put(warp + rr * NW, rsqrtf(ss[rr] + 1e-6f));
  }
}

// G[i] = cumulative gate (log2 units) of channel ch over tokens 0..i: lb2 * sigmoid(exp_a * (g + dtb)).
// Pad rows hold zeros (cp.async zero-fill): computing them is safe; select, don't branch.
__device__ __forceinline__ void gate_cumsum(float (&G)[CH], const bf16 (*g)[RS], int ch, float exp_a, float dtb,
                                            float lb2, int nv) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const float y = exp_a * (__bfloat162float(g[i][ch]) + dtb);
    const float gam = lb2 * sigmoidf_(y);
    acc += i < nv ? gam : 0.f;
    G[i] = acc;
  }
}

// Channel ch of the normed k and scaled, normed q rows (all loads first, so the caller's in-place
// stores do not serialize them).
__device__ __forceinline__ void normed_channel(float (&kv)[CH], float (&qv)[CH], const bf16 (*k)[RS],
                                               const bf16 (*q)[RS], const float* rnk, const float* rnq, int ch,
                                               float scale) {
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    kv[i] = __bfloat162float(k[i][ch]) * rnk[i];
    qv[i] = __bfloat162float(q[i][ch]) * rnq[i] * scale;
  }
}

// Channel ch of the decayed tiles, in place: k -> kd = kn 2^G, q -> qd = qn 2^G, g -> ki = kn 2^-G;
// krT[ch][i] = kn 2^(G_last - G), E[ch] = 2^G_last (kda_fwd.cu, kda_fwd_pipelined.cu layout).
__device__ __forceinline__ void decay_channel(bf16 (*q)[RS], bf16 (*k)[RS], bf16 (*g)[RS], bf16 (*krT)[KRS],
                                              float* E, const float* rnq, const float* rnk, const float (&G)[CH],
                                              int ch, float scale) {
  const float gt = G[CH - 1];
  E[ch] = ex2(gt);
  float kv[CH], qv[CH];
  normed_channel(kv, qv, k, q, rnk, rnq, ch, scale);
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const float e = ex2(G[i]);
    k[i][ch] = __float2bfloat16_rn(kv[i] * e);
    q[i][ch] = __float2bfloat16_rn(qv[i] * e);
    g[i][ch] = __float2bfloat16_rn(kv[i] * ex2(-G[i]));
    krT[ch][i] = __float2bfloat16_rn(kv[i] * ex2(gt - G[i]));
  }
}

// acc = lhs ki^T over the KD channels: one warp's 16 x 16 tile in mma accumulator layout.
template <class Lhs, class Ki>
__device__ __forceinline__ void tile_product(float (&acc)[2][4], Lhs lhs, Ki ki, int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int kb = 0; kb < KD / 16; ++kb) {
    const int kc = kb * 16 + 2 * tq;
    const uint32_t a0 = lhs(gq, kc), a1 = lhs(gq + 8, kc);
    const uint32_t a2 = lhs(gq, kc + 8), a3 = lhs(gq + 8, kc + 8);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b0 = ki(nt * 8 + gq, kc), b1 = ki(nt * 8 + gq, kc + 8);
      mma(acc[nt], a0, a1, a2, a3, b0, b1, acc[nt]);
    }
  }
}

// acc += lhs ki^T (tile_product without clearing acc).
template <class Lhs, class Ki>
__device__ __forceinline__ void tile_product_acc(float (&acc)[2][4], Lhs lhs, Ki ki, int gq, int tq) {
#pragma unroll
  for (int kb = 0; kb < KD / 16; ++kb) {
    const int kc = kb * 16 + 2 * tq;
    const uint32_t a0 = lhs(gq, kc), a1 = lhs(gq + 8, kc);
    const uint32_t a2 = lhs(gq, kc + 8), a3 = lhs(gq + 8, kc + 8);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b0 = ki(nt * 8 + gq, kc), b1 = ki(nt * 8 + gq, kc + 8);
      mma(acc[nt], a0, a1, a2, a3, b0, b1, acc[nt]);
    }
  }
}

// A = diag(b) strict_lower(kd ki^T), fp32 in shared memory.
__device__ __forceinline__ void store_a(float (*A)[CH + 1], const float (&acc)[2][4], const float* b, int gq,
                                        int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = gq + 8 * (e >> 1), col = nt * 8 + 2 * tq + (e & 1);
      A[row][col] = col < row ? acc[nt][e] * b[row] : 0.f;
    }
}

// Column jc of INV = (I + A)^-1 by fp32 forward substitution, A read as a(i, m); inv(i, jc, x)
// stores it as bf16.
template <class A_, class Inv>
__device__ __forceinline__ void invert_column(A_ a, int jc, Inv inv) {
  float x[CH];
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    float s = i == jc ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < i; ++m) s = fmaf(-a(i, m), x[m], s);
    x[i] = s;
  }
#pragma unroll
  for (int i = 0; i < CH; ++i) inv(i, jc, __float2bfloat16_rn(x[i]));
}

// M = lower(qd ki^T) (diagonal included) as bf16 through m(row, col, x).
template <class Mst>
__device__ __forceinline__ void store_m(const float (&acc)[2][4], Mst m, int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = gq + 8 * (e >> 1), col = nt * 8 + 2 * tq + (e & 1);
      m(row, col, __float2bfloat16_rn(col <= row ? acc[nt][e] : 0.f));
    }
}

// W^T = S kd^T and O1^T = S qd^T (value rows x tokens), S rounded to bf16.
template <class Kd, class Qd>
__device__ __forceinline__ void state_products(float (&W)[2][4], float (&O1)[2][4], const float (&S)[KD / 8][4],
                                               Kd kd, Qd qd, int gq, int tq) {
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
    const int kc = kb * 16 + 2 * tq;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int tr = nt * 8 + gq;
      mma(W[nt], a0, a1, a2, a3, kd(tr, kc), kd(tr, kc + 8), W[nt]);
      mma(O1[nt], a0, a1, a2, a3, qd(tr, kc), qd(tr, kc + 8), O1[nt]);
    }
  }
}

// Vb = (v - W) b per (token, value row) of the warp's tile: v(tok, row) reads v, b the chunk's beta.
template <class V>
__device__ __forceinline__ void residual(float (&vb)[2][4], V v, const float (&W)[2][4], const float* b, int vl,
                                         int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + 2 * tq + (e & 1);
      vb[nt][e] = (__bfloat162float(v(tok, vl + 8 * (e >> 1))) - W[nt][e]) * b[tok];
    }
}

// A 16 x 16 accumulator tile rounded to bf16 as an mma A operand.
__device__ __forceinline__ void pack_tile(uint32_t (&a)[4], const float (&x)[2][4]) {
  a[0] = pack(x[0][0], x[0][1]);
  a[1] = pack(x[0][2], x[0][3]);
  a[2] = pack(x[1][0], x[1][1]);
  a[3] = pack(x[1][2], x[1][3]);
}

// U = INV Vb (va: Vb packed).
template <class Inv>
__device__ __forceinline__ void solve_u(float (&U)[2][4], const uint32_t (&va)[4], Inv inv, int gq, int tq) {
  const float zero4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int ir = nt * 8 + gq;
    mma(U[nt], va[0], va[1], va[2], va[3], inv(ir, 2 * tq), inv(ir, 2 * tq + 8), zero4);
  }
}

// out^T = O1 + M U (value rows x tokens), bf16 into the warp's o tile [token][row].
template <class Mm>
__device__ __forceinline__ void out_tile(bf16 (*o)[TS], const uint32_t (&ua)[4], Mm mm, const float (&O1)[2][4],
                                         int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int ir = nt * 8 + gq;
    float O[4];
    mma(O, ua[0], ua[1], ua[2], ua[3], mm(ir, 2 * tq), mm(ir, 2 * tq + 8), O1[nt]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + 2 * tq + (e & 1);
      o[tok][gq + 8 * (e >> 1)] = __float2bfloat16_rn(O[e]);
    }
  }
}

// S = S diag(E) + U^T kr.
template <class Kr>
__device__ __forceinline__ void update_state(float (&S)[KD / 8][4], const uint32_t (&ua)[4], const float* E, Kr krT,
                                             int gq, int tq) {
#pragma unroll
  for (int nt = 0; nt < KD / 8; ++nt) {
    const int col = nt * 8 + 2 * tq;
    const float e0 = E[col], e1 = E[col + 1];
    const float cin[4] = {S[nt][0] * e0, S[nt][1] * e1, S[nt][2] * e0, S[nt][3] * e1};
    const int kr = nt * 8 + gq;
    mma(S[nt], ua[0], ua[1], ua[2], ua[3], krT(kr, 2 * tq), krT(kr, 2 * tq + 8), cin);
  }
}

// The warp's 16 output rows of the chunk's first nv tokens (starting at token t0), o tile -> out.
__device__ __forceinline__ void store_out(const KdaParams& p, const bf16 (*o)[TS], long long t0, int nv,
                                          long long hs, long long hoff, int vw, int lane) {
  const int tok = lane >> 1, half = lane & 1;
  if (tok < nv) {
    const uint4 val = *reinterpret_cast<const uint4*>(&o[tok][8 * half]);
    *reinterpret_cast<uint4*>(p.out + (t0 + tok) * hs + hoff + vw + 8 * half) = val;
  }
}
