// Shared definitions of the moonep kernels: call sizes, status codes, system-scope atomics and the
// device helpers used by more than one phase.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// Shared sizes of one call; mirrored by `gpu::kernels::Dims` (repr(C), all i64).
struct Dims {
  long long R, me, E, epn, K, s, P, T, NvS, nvs_s, H, S, uniform;
};

// Status word codes (mirrored by `gpu::status`).
#define ST_OK 0u
#define ST_BARRIER_TIMEOUT 1u
#define ST_CONTRACT 2u
#define ST_EXPERT_RANGE 3u
#define ST_HISTOGRAM 4u
#define ST_OVERFLOW 5u
#define ST_PLANNER_STUCK 6u

#define MAX_R 32
#define HIST_BLOCK 256

__device__ __forceinline__ void set_status(unsigned* st, unsigned code) {
  atomicCAS(st, ST_OK, code);
}
__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long align_up_ll(long long x, long long p) { return (x + p - 1) / p * p; }

// hist[b][e] -> exclusive prefix over b (independent loads in chunks of 16); returns the total.
__device__ int block_prefix(int* hist, long long nblk, long long E, int e) {
  int acc = 0;
  for (long long b0 = 0; b0 < nblk; b0 += 16) {
    int v[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) v[u] = (b0 + u < nblk) ? hist[(b0 + u) * E + e] : 0;
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      if (b0 + u < nblk) hist[(b0 + u) * E + e] = acc;
      acc += v[u];
    }
  }
  return acc;
}

// Planning stages A–C plus the block prefix of stage D. One block of 1024 threads.
// Outputs (all device, this rank): alloc[E*R], alloc_cum[E*R], src_off[E] (= Σ_{r'<me} tpe[r'][e]),
// grp_start[R*E] (start row of e's group on d, -1 when absent), etc[R*epn], counts/cu/zero_fill for me,
// hist turned into exclusive prefix over blocks per expert.

// Zeroes the padding rows listed in zfill (2*epn groups, each < P rows): the flat index
// q = g*(P-1) + r spreads every (group, row) pair over all warps. `own_w` null: rows only.
__device__ void zero_padding(const Dims& d, uint4* own, float* own_w, const int* zfill, long long gw,
                             long long nwarps, int lane) {
  const long long hv = d.H / 8, pm = d.P > 1 ? d.P - 1 : 1;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (long long q = gw; q < 2 * d.epn * pm; q += nwarps) {
    long long g = q / pm, r = q % pm;
    long long len = zfill[2 * g + 1];
    if (r >= len) continue;
    long long row = zfill[2 * g] + r;
    uint4* p = own + row * hv;
    for (long long c = lane; c < hv; c += 32) p[c] = zero;
    if (lane == 0 && own_w) own_w[row] = 0.0f;
  }
}

