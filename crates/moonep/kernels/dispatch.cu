// Dispatch (NVLink/IPC path): rows into their final slots on every rank, dedup replication.
#include "common.cuh"

// Dispatch (kernel 3), NVLink path. Warp per token: the row is read once in pieces of 32 lanes x
// VEC uint4 and stored to every target slot (local entries, plus one leader per remote rank when
// `dedup`; every entry otherwise). With dedup a remote non-leader gets dup_src[loff] = leader row on
// the destination, which `moonep_replicate` resolves after the exit barrier. Weights travel per
// entry. Extra warps zero this rank's padding rows (hidden and weights). `write_wts` = 0 (the
// combine-backward) leaves every slot weight as it was.
#define VEC 4
extern "C" __global__ void __launch_bounds__(512) moonep_dispatch(
    Dims d, const uint4* x, const float* w, const long long* dst, const unsigned long long* peer_hidden,
    const unsigned long long* peer_wts, const unsigned long long* peer_dup, const int* zfill, int dedup,
    int write_wts, const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;  // uint4 per row
  const int K = (int)d.K;
  for (long long t = gw; t < d.s; t += nwarps) {
    long long slot = lane < K ? dst[t * K + lane] : -1;
    int dr = lane < K ? (int)(slot / d.NvS) : -1;
    long long loff = lane < K ? slot % d.NvS : 0;
    unsigned same = __match_any_sync(0xffffffffu, dr);
    int leader = __ffs(same) - 1;
    long long lead_loff = __shfl_sync(0xffffffffu, loff, leader);
    bool target = lane < K && (!dedup || dr == d.me || leader == lane);
    if (lane < K) {
      if (write_wts) reinterpret_cast<float*>(peer_wts[dr])[loff] = w ? w[t * K + lane] : 1.0f;
      if (!target) reinterpret_cast<int*>(peer_dup[dr])[loff] = (int)lead_loff;
    }
    unsigned tmask = __ballot_sync(0xffffffffu, target);
    uint4* base = lane < K ? reinterpret_cast<uint4*>(peer_hidden[dr]) + loff * hv : nullptr;
    const uint4* src = x + t * hv;
    for (long long c0 = 0; c0 < hv; c0 += 32 * VEC) {
      uint4 v[VEC];
#pragma unroll
      for (int u = 0; u < VEC; ++u) {
        long long c = c0 + u * 32 + lane;
        if (c < hv) v[u] = src[c];
      }
      unsigned m = tmask;
      while (m) {
        int k = __ffs(m) - 1;
        m &= m - 1;
        uint4* p = reinterpret_cast<uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(base), k));
#pragma unroll
        for (int u = 0; u < VEC; ++u) {
          long long c = c0 + u * 32 + lane;
          if (c < hv) p[c] = v[u];
        }
      }
    }
  }
  // Padding rows of this rank: zero hidden and weights.
  uint4* own = reinterpret_cast<uint4*>(peer_hidden[d.me]);
  float* own_w = reinterpret_cast<float*>(peer_wts[d.me]);
  zero_padding(d, own, write_wts ? own_w : nullptr, zfill, gw, nwarps, lane);
  __threadfence_system();
}

// After the dispatch exit barrier: copy each deduplicated row from its leader row, reset dup_src.
extern "C" __global__ void moonep_replicate(Dims d, uint4* hidden, int* dup, const int* cu, const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  const long long used = cu[2 * d.epn - 1];
  for (long long r = gw; r < used; r += nwarps) {
    int s = dup[r];
    if (s < 0) continue;
    const uint4* from = hidden + (long long)s * hv;
    uint4* to = hidden + r * hv;
    for (long long c = lane; c < hv; c += 32) to[c] = from[c];
    __syncwarp();
    if (lane == 0) dup[r] = -1;
  }
}
