// Replica weights: prefetch (forward) and reduce_grad (backward).
#include "common.cuh"

// Prefetch (kernel 5): home rank pushes expert weights (wbytes each, 16-byte multiple) into prefetch
// slot b of every rank d with etc[d][b] homed here. Block per (d, b).
extern "C" __global__ void moonep_prefetch(Dims d, const int* etc, const uint4* local_w,
                                           const unsigned long long* peer_pool, long long wbytes,
                                           const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const long long pairs = d.R * d.epn;
  const long long n = wbytes / 16;
  for (long long p = blockIdx.x; p < pairs; p += gridDim.x) {
    long long dr = p / d.epn, b = p % d.epn;
    int e = etc[p];
    if (e < 0 || e / d.epn != d.me || dr == d.me) continue;
    const uint4* from = local_w + (long long)(e - d.me * d.epn) * n;
    uint4* to = reinterpret_cast<uint4*>(peer_pool[dr]) + b * n;
    for (long long c = threadIdx.x; c < n; c += blockDim.x) to[c] = from[c];
  }
  __threadfence_system();
}


// reduce_grad, after an entry barrier: for each home expert le of this rank, home_grad[le] +=
// every peer's reduce slot holding it, peers in ascending rank order (f32, like the reference).
// `elems` f32 per expert. Dynamic shared memory: R ints.
extern "C" __global__ void moonep_reduce_grad(Dims d, const int* etc, float* home_grad,
                                              const unsigned long long* peer_reduce, long long elems,
                                              const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  extern __shared__ int slot_of[];  // [R]: slot b on rank dr holding expert e, or -1
  for (long long le = 0; le < d.epn; ++le) {
    const long long e = d.me * d.epn + le;
    __syncthreads();
    for (long long dr = threadIdx.x; dr < d.R; dr += blockDim.x) {
      int b = -1;
      if (dr != d.me)
        for (long long x = 0; x < d.epn && b < 0; ++x)
          if (etc[dr * d.epn + x] == e) b = (int)x;
      slot_of[dr] = b;
    }
    __syncthreads();
    float* g = home_grad + le * elems;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < elems;
         j += (long long)gridDim.x * blockDim.x) {
      float acc = g[j];
      for (long long dr = 0; dr < d.R; ++dr) {
        int b = slot_of[dr];
        if (b >= 0) acc += reinterpret_cast<const float*>(peer_reduce[dr])[b * elems + j];
      }
      g[j] = acc;
    }
  }
}

// After the mid barrier: zero the reduce slots this rank filled (etc[me][b] >= 0).
extern "C" __global__ void moonep_zero_consumed(Dims d, const int* etc, float* own_reduce, long long elems,
                                                const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  for (long long b = 0; b < d.epn; ++b) {
    if (etc[d.me * d.epn + b] < 0) continue;
    float* s = own_reduce + b * elems;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < elems;
         j += (long long)gridDim.x * blockDim.x)
      s[j] = 0.0f;
  }
}
