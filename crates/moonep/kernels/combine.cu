// Combine: the K-sum pulled from every rank's slot rows (also dispatch-backward).
#include "common.cuh"

// Combine (kernel 4): out[t] = bf16(Σ_k f32(y_{d(i)}[loff(i)])) in ascending k. Rows are pulled from
// peer shards (NVLink path) or, in the NCCL fallback, from `back` staging at row back_pos[i] for
// remote entries. Optionally gathers per-slot f32 weights into w_out[s*K].
extern "C" __global__ void __launch_bounds__(512) moonep_combine(
    Dims d, __nv_bfloat16* out, float* w_out, const long long* dst, const unsigned long long* peer_hidden,
    const unsigned long long* peer_wts, const uint4* back, const float* back_w, const int* back_pos,
    const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  const int K = (int)d.K;
  for (long long t = gw; t < d.s; t += nwarps) {
    const uint4* rowp = nullptr;
    if (lane < K) {
      long long slot = dst[t * K + lane];
      int dr = (int)(slot / d.NvS);
      long long loff = slot % d.NvS;
      if (back != nullptr && dr != d.me) {
        long long q = back_pos[t * K + lane];
        rowp = back + q * hv;
        if (w_out) w_out[t * K + lane] = back_w[q];
      } else {
        rowp = reinterpret_cast<const uint4*>(peer_hidden[dr]) + loff * hv;
        if (w_out) w_out[t * K + lane] = reinterpret_cast<const float*>(peer_wts[dr])[loff];
      }
    }
    uint4* o = reinterpret_cast<uint4*>(out) + t * hv;
    for (long long c0 = 0; c0 < hv; c0 += 32 * 2) {
      float acc[2][8];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      for (int k = 0; k < K; ++k) {
        const uint4* p = reinterpret_cast<const uint4*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(rowp), k));
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          long long c = c0 + u * 32 + lane;
          if (c < hv) {
            uint4 v = p[c];
            const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[u][j] += __bfloat162float(b[j]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        long long c = c0 + u * 32 + lane;
        if (c < hv) {
          uint4 v;
          __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(&v);
#pragma unroll
          for (int j = 0; j < 8; ++j) b[j] = __float2bfloat16_rn(acc[u][j]);
          o[c] = v;
        }
      }
    }
  }
}

