// Megatron-style baseline: permute + all-to-all-v + unpermute (NCCL moves the rows).
#include "common.cuh"

// Megatron-style baseline. Layout pass (one block): from tpe_all and the block-prefixed hist,
// e_base[e] = Σ_{e'<e} tpe[me][e'] (permute-1 order = by expert = by destination rank);
// src_major[p*epn+le] / exp_major[le*R+p] = start rows of chunk (p, le) in the received buffer
// ([src][local expert]) and the expert-major buffer ([local expert][src]).
extern "C" __global__ void __launch_bounds__(1024) moonep_base_layout(Dims d, const int* tpe, int* hist, long long nblk, int* e_base,
                                              int* src_major, int* exp_major) {
  const int R = (int)d.R, E = (int)d.E, epn = (int)d.epn, me = (int)d.me;
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_prefix(hist, nblk, E, e);
  if (threadIdx.x != 0) return;
  int acc = 0;
  for (int e = 0; e < E; ++e) {
    e_base[e] = acc;
    acc += tpe[(long long)me * E + e];
  }
  acc = 0;
  for (int p = 0; p < R; ++p)
    for (int le = 0; le < epn; ++le) {
      src_major[p * epn + le] = acc;
      acc += tpe[(long long)p * E + me * epn + le];
    }
  src_major[R * epn] = acc;
  acc = 0;
  for (int le = 0; le < epn; ++le)
    for (int p = 0; p < R; ++p) {
      exp_major[le * R + p] = acc;
      acc += tpe[(long long)p * E + me * epn + le];
    }
}

// Permute-1: entry i goes to row e_base[e] + stable ordinal (hist prefix + ord).
extern "C" __global__ void moonep_base_permute1(Dims d, const uint4* x, const float* w, const int* topk,
                                                const int* ord, const int* hist, const int* e_base, uint4* send,
                                                float* send_w, int* pos_of) {
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8, n = d.s * d.K;
  for (long long i = gw; i < n; i += nwarps) {
    int e = topk[i];
    long long pos = (long long)e_base[e] + hist[(i / HIST_BLOCK) * d.E + e] + ord[i];
    const uint4* from = x + (i / d.K) * hv;
    for (long long c = lane; c < hv; c += 32) send[pos * hv + c] = from[c];
    if (lane == 0) {
      send_w[pos] = w ? w[i] : 1.0f;
      pos_of[i] = (int)pos;
    }
  }
}

// Permute-2 (forward: [src][le] -> [le][src]) or unpermute-2 (reverse), warp per row.
extern "C" __global__ void moonep_base_permute2(Dims d, const int* src_major, const int* exp_major, long long nrows,
                                                const uint4* from, uint4* to, const float* from_w, float* to_w,
                                                int reverse) {
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  const int nchunk = (int)(d.R * d.epn);
  for (long long q = gw; q < nrows; q += nwarps) {
    int lo = 0, hi = nchunk - 1;  // last chunk with src_major start <= q
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (src_major[mid] <= q) lo = mid; else hi = mid - 1;
    }
    int p = lo / (int)d.epn, le = lo % (int)d.epn;
    long long r = exp_major[le * d.R + p] + (q - src_major[lo]);
    long long a = reverse ? r : q, b = reverse ? q : r;
    for (long long c = lane; c < hv; c += 32) to[b * hv + c] = from[a * hv + c];
    if (lane == 0 && from_w) to_w[b] = from_w[a];
  }
}

// Unpermute-1 with the K-sum: out[t] = bf16(Σ_k f32(back[pos_of[t*K+k]])) in ascending k.
extern "C" __global__ void moonep_base_unpermute1(Dims d, const uint4* back, const int* pos_of,
                                                  __nv_bfloat16* out) {
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  const int K = (int)d.K;
  for (long long t = gw; t < d.s; t += nwarps) {
    long long mypos = lane < K ? pos_of[t * K + lane] : 0;
    uint4* o = reinterpret_cast<uint4*>(out) + t * hv;
    for (long long c0 = 0; c0 < hv; c0 += 32) {
      const long long c = c0 + lane;
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      for (int k = 0; k < K; ++k) {
        long long pos = __shfl_sync(0xffffffffu, mypos, k);
        if (c >= hv) continue;
        uint4 v = back[pos * hv + c];
        const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += __bfloat162float(b[j]);
      }
      uint4 v;
      __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = __float2bfloat16_rn(acc[j]);
      if (c < hv) o[c] = v;
    }
  }
}

