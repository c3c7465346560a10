// Shared by the KDA forward kernels: the launch parameters (mirrored by `launch.rs`) and
// small PTX helpers.
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
};

#define KD 128
#define CH 16
#define RS 136  // padded row stride of the 16x128 tiles (bank-conflict free fragment loads)
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

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Branch-free (no IEEE-division slow path), so unrolled loops keep their ILP.
__device__ __forceinline__ float sigmoidf_(float x) { return rcp_approx(1.0f + ex2(-1.4426950408889634f * x)); }


// The 128x128 state of one (sequence, head) lives in mma accumulator fragments: each warp holds 16 value
// rows, thread (gq, tq) rows r0 = first + gq and r0 + 8, columns nt*8 + 2*tq (+1). `sbase` is the
// element offset of the (sequence, head) state; a null `h0` means a zero initial state.
__device__ __forceinline__ void load_state(float (&S)[16][4], const KdaParams& p, size_t sbase, int r0, int tq) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
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
__device__ __forceinline__ void store_state(const float (&S)[16][4], const KdaParams& p, size_t sbase, int r0, int tq) {
  const int r1 = r0 + 8;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
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
