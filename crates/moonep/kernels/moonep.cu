// moonep GPU kernels (spec moonep.md §2 and §5). Compiled ahead of time for sm_90a by build.rs.
// Every kernel has a CPU reference: the planner in src/plan/, dispatch/combine in src/reference/.
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

// ---------------------------------------------------------------------------------------------
// Barrier (kernel 1). ctrl layout (u64 words): [0, R) flags written by peers, [R] epoch,
// [R+1] status (low 32 bits). One block; thread j < R signals peer j then waits for flag j.
// Timeout writes ST_BARRIER_TIMEOUT and returns; an earlier error makes it return at once.
extern "C" __global__ void moonep_barrier(unsigned long long* ctrl, const unsigned long long* peer_ctrl,
                                          long long me, long long R, unsigned long long timeout_ns) {
  unsigned* status = reinterpret_cast<unsigned*>(ctrl + R + 1);
  __shared__ unsigned long long epoch;
  __shared__ int failed;
  if (threadIdx.x == 0) {
    epoch = ctrl[R] + 1;
    failed = (*(volatile unsigned*)status != ST_OK);
  }
  __syncthreads();
  if (failed) return;
  const unsigned long long e = epoch;
  int j = threadIdx.x;
  if (j < R) {
    __threadfence_system();
    unsigned long long* peer = reinterpret_cast<unsigned long long*>(peer_ctrl[j]);
    st_release_sys(peer + me, e);
    unsigned long long t0 = global_ns();
    while (ld_acquire_sys(ctrl + j) < e) {
      if (global_ns() - t0 > timeout_ns) {
        set_status(status, ST_BARRIER_TIMEOUT);
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) ctrl[R] = e;
}

// ---------------------------------------------------------------------------------------------
// Planning, stage D part 1: per block of HIST_BLOCK entries, the stable ordinal of each entry among
// same-expert entries of the block (ord[i]) and the block histogram hist[b*E + e].
extern "C" __global__ void moonep_plan_hist(const int* topk, long long n, long long E, int* ord, int* hist,
                                            unsigned* status) {
  extern __shared__ int wcnt[];  // [HIST_BLOCK/32][E]
  const int nw = HIST_BLOCK / 32;
  for (long long x = threadIdx.x; x < nw * E; x += blockDim.x) wcnt[x] = 0;
  __syncthreads();
  long long i = (long long)blockIdx.x * HIST_BLOCK + threadIdx.x;
  int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  int e = -1;
  if (i < n) {
    e = topk[i];
    if (e < 0 || e >= E) {
      set_status(status, ST_EXPERT_RANGE);
      e = -1;
    }
  }
  unsigned peers = __match_any_sync(0xffffffffu, e);
  int within = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && within == 0) wcnt[w * E + e] = __popc(peers);
  __syncthreads();
  if (e >= 0) {
    int base = 0;
    for (int v = 0; v < w; ++v) base += wcnt[v * E + e];
    ord[i] = base + within;
  }
  __syncthreads();
  for (long long x = threadIdx.x; x < E; x += blockDim.x) {
    int c = 0;
    for (int v = 0; v < nw; ++v) c += wcnt[v * E + x];
    hist[(long long)blockIdx.x * E + x] = c;
  }
}

// Warp argmax over v[0..n) with ties to the lowest index. Returns (value, index) in all lanes.
__device__ void warp_argmax(const long long* v, int n, long long& best, int& bidx) {
  int lane = threadIdx.x % 32;
  long long b = LLONG_MIN;
  int bi = 0x7fffffff;
  for (int x = lane; x < n; x += 32) {
    if (v[x] > b) { b = v[x]; bi = x; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    long long ob = __shfl_xor_sync(0xffffffffu, b, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ob > b || (ob == b && oi < bi)) { b = ob; bi = oi; }
  }
  best = b;
  bidx = bi;
}

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
// Shared memory: tpe-independent scratch sized by the host (see gpu::plan).
extern "C" __global__ void __launch_bounds__(1024) moonep_plan_global(Dims d, const int* tpe, int* hist, long long nblk, int* alloc,
                                              int* alloc_cum, int* src_off, int* grp_start, int* etc,
                                              int* counts, int* cu, int* zfill, unsigned* status) {
  extern __shared__ long long sm[];
  const int R = (int)d.R, E = (int)d.E, epn = (int)d.epn;
  long long* bal = sm;                 // [R]
  long long* z = bal + MAX_R;          // [R*R]
  long long* rem = z + MAX_R * MAX_R;  // [E]
  long long* tsum = rem + E;           // [E] = T_e
  __shared__ int bad;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32, nwarp = nt / 32;
  if (tid == 0) bad = 0;
  __syncthreads();
  // Contract: row sums (block-parallel: warp sums, then shared atomics) and total.
  __shared__ unsigned long long rowsum[MAX_R], gsum[MAX_R];
  if (tid < MAX_R) rowsum[tid] = gsum[tid] = 0;
  __syncthreads();
  for (int r = 0; r < R; ++r) {
    unsigned v = 0;
    for (int e = tid; e < E; e += nt) v += (unsigned)tpe[(long long)r * E + e];
    v = __reduce_add_sync(0xffffffffu, v);
    if (lane == 0 && v) atomicAdd(&rowsum[r], (unsigned long long)v);
  }
  __syncthreads();
  if (tid < R) {
    long long sum = (long long)rowsum[tid];
    if (sum % d.K != 0 || sum / d.K < 1 || sum / d.K > d.S) atomicOr(&bad, 1);
    if (tid == d.me && sum != d.s * d.K) atomicOr(&bad, 1);
    if (d.uniform && sum != d.s * d.K) atomicOr(&bad, 1);
  }
  if (tid == 0) {
    long long tot = 0;
    for (int r = 0; r < R; ++r) tot += (long long)rowsum[r];
    if (tot != d.T * d.K) atomicOr(&bad, 1);
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) set_status(status, ST_CONTRACT);
    return;
  }
  for (int e = tid; e < E; e += nt) {
    long long acc = 0;
    for (int r = 0; r < R; ++r) {
      if (r == d.me) src_off[e] = (int)acc;
      acc += tpe[(long long)r * E + e];
    }
    tsum[e] = acc;
    rem[e] = acc;
    atomicAdd(&gsum[e / epn], (unsigned long long)acc);
    for (int r = 0; r < R; ++r) alloc[(long long)e * R + r] = (r == e / epn) ? (int)acc : 0;
  }
  for (int x = tid; x < MAX_R * MAX_R; x += nt) z[x] = 0;
  __syncthreads();
  // Stage A (single thread; <= R-1 rounds).
  if (tid == 0) {
    long long tk = d.T * d.K;
    for (int h = 0; h < R; ++h) {
      long long g = (long long)gsum[h];
      long long cap = tk / R + ((long long)h < tk % R ? 1 : 0);
      bal[h] = g - cap;
    }
    int rounds = 0;
    for (;;) {
      int h = 0, u = 0;
      for (int r = 1; r < R; ++r) {
        if (bal[r] > bal[h]) h = r;
        if (bal[r] < bal[u]) u = r;
      }
      if (bal[h] <= 0) break;
      long long m = -bal[u];
      z[h * MAX_R + u] += m;
      bal[h] -= m;
      bal[u] = 0;
      if (++rounds > R) { bad = 1; break; }
    }
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) set_status(status, ST_PLANNER_STUCK);
    return;
  }
  // Stage B: warp per donor. q lives in registers (lane d holds q[d], R <= 32); each lane keeps
  // the best (largest, then lowest index) of its strided rem entries, and only the lane owning the
  // changed expert recomputes it, so a step costs two warp reductions.
  for (int h = warp; h < R; h += nwarp) {
    long long* remh = rem + (long long)h * epn;
    unsigned qv = lane < R ? (unsigned)z[h * MAX_R + lane] : 0u;
    unsigned lb = 0;
    int li = 0x7fffffff;
    for (int x = lane; x < epn; x += 32)
      if ((unsigned)remh[x] > lb || li == 0x7fffffff) { lb = (unsigned)remh[x]; li = x; }
    for (;;) {
      unsigned qmax = __reduce_max_sync(0xffffffffu, qv);
      if (qmax == 0) break;
      int dd = __ffs(__ballot_sync(0xffffffffu, lane < R && qv == qmax)) - 1;
      unsigned rmax = __reduce_max_sync(0xffffffffu, li == 0x7fffffff ? 0u : lb);
      if (rmax == 0) {
        if (lane == 0) atomicOr(&bad, 1);
        break;
      }
      int le = (int)__reduce_min_sync(0xffffffffu, (li != 0x7fffffff && lb == rmax) ? (unsigned)li : 0x7fffffffu);
      unsigned take = rmax < qmax ? rmax : qmax;
      // Each (e, dd) pair is hit at most once (a step exhausts the expert or the quota), and
      // alloc[e][h] always equals rem[e]: plain store here, home column written after the loop.
      if (lane == 0) alloc[((long long)h * epn + le) * R + dd] = (int)take;
      if (lane == dd) qv -= take;
      if (lane == le % 32) {
        remh[le] -= take;
        lb = 0;
        li = 0x7fffffff;
        for (int x = lane; x < epn; x += 32)
          if ((unsigned)remh[x] > lb || li == 0x7fffffff) { lb = (unsigned)remh[x]; li = x; }
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) set_status(status, ST_PLANNER_STUCK);
    return;
  }
  for (int e = tid; e < E; e += nt) alloc[(long long)e * R + e / epn] = (int)rem[e];
  __syncthreads();
  // alloc_cum.
  for (int e = tid; e < E; e += nt) {
    int acc = 0;
    for (int r = 0; r < R; ++r) {
      acc += alloc[(long long)e * R + r];
      alloc_cum[(long long)e * R + r] = acc;
    }
  }
  // Stage C: warp per destination rank.
  const unsigned lt = (1u << lane) - 1u;
  for (int dr = warp; dr < R; dr += nwarp) {
    int end = 0;
    for (int c = 0; c < epn; c += 32) {
      int g = c + lane;
      int cnt = g < epn ? alloc[(long long)(dr * epn + g) * R + dr] : 0;
      int padded = (int)align_up_ll(cnt, d.P);
      int incl = padded;
      for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      int start = end + incl - padded;
      if (g < epn) {
        grp_start[(long long)dr * E + dr * epn + g] = cnt > 0 ? start : -1;
        if (dr == d.me) {
          counts[g] = cnt;
          cu[g] = start + padded;
          zfill[2 * g] = start + cnt;
          zfill[2 * g + 1] = padded - cnt;
        }
      }
      end += __shfl_sync(0xffffffffu, incl, 31);
    }
    int nslot = 0;
    for (int c = 0; c < E; c += 32) {
      int e = c + lane;
      int cnt = (e < E && e / epn != dr) ? alloc[(long long)e * R + dr] : 0;
      unsigned ball = __ballot_sync(0xffffffffu, cnt > 0);
      int slot = nslot + __popc(ball & lt);
      int padded = (int)align_up_ll(cnt, d.P);
      int incl = padded;
      for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      int start = end + incl - padded;
      if (e < E && e / epn != dr) grp_start[(long long)dr * E + e] = cnt > 0 ? start : -1;
      if (cnt > 0) {
        if (slot >= epn) {
          atomicOr(&bad, 1);
        } else {
          etc[(long long)dr * epn + slot] = e;
          if (dr == d.me) {
            counts[epn + slot] = cnt;
            cu[epn + slot] = start + padded;
            zfill[2 * (epn + slot)] = start + cnt;
            zfill[2 * (epn + slot) + 1] = padded - cnt;
          }
        }
      }
      end += __shfl_sync(0xffffffffu, incl, 31);
      nslot += __popc(ball);
    }
    for (int b = (nslot < epn ? nslot : epn) + lane; b < epn; b += 32) {
      etc[(long long)dr * epn + b] = -1;
      if (dr == d.me) {
        counts[epn + b] = 0;
        cu[epn + b] = end;
        zfill[2 * (epn + b)] = end;
        zfill[2 * (epn + b) + 1] = 0;
      }
    }
    if (dr == d.me && lane == 0 && (long long)end > d.nvs_s) atomicOr(&bad, 2);
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) set_status(status, ST_OVERFLOW);
    return;
  }
  // Stage D prefix: hist[b][e] -> exclusive prefix over blocks; total must equal tpe[me][e].
  for (int e = tid; e < E; e += nt) {
    if (block_prefix(hist, nblk, E, e) != tpe[d.me * E + e]) atomicOr(&bad, 4);
  }
  __syncthreads();
  if (bad && tid == 0) set_status(status, ST_HISTOGRAM);
}

// Stage D part 2: dst[i] = d*NvS + loff.
extern "C" __global__ void moonep_plan_dst(Dims d, const int* topk, long long n, const int* ord,
                                           const int* hist, const int* alloc_cum, const int* src_off,
                                           const int* grp_start, long long* dst, const unsigned* status) {
  long long i = (long long)blockIdx.x * HIST_BLOCK + threadIdx.x;
  if (i >= n) return;
  if (*(volatile const unsigned*)status != ST_OK) {
    dst[i] = -1;
    return;
  }
  const int R = (int)d.R, E = (int)d.E;
  int e = topk[i];
  int g = src_off[e] + hist[(long long)blockIdx.x * E + e] + ord[i];
  const int* cum = alloc_cum + (long long)e * R;
  int r = 0;
  while (r < R - 1 && cum[r] <= g) ++r;
  int before = r == 0 ? 0 : cum[r - 1];
  long long loff = (long long)grp_start[(long long)r * E + e] + (g - before);
  dst[i] = (long long)r * d.NvS + loff;
}

// Zeroes the padding rows listed in zfill (2*epn groups, each < P rows): the flat index
// q = g*(P-1) + r spreads every (group, row) pair over all warps.
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
    if (lane == 0) own_w[row] = 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch (kernel 3), NVLink path. Warp per token: the row is read once in pieces of 32 lanes x
// VEC uint4 and stored to every target slot (local entries, plus one leader per remote rank when
// `dedup`; every entry otherwise). With dedup a remote non-leader gets dup_src[loff] = leader row on
// the destination, which `moonep_replicate` resolves after the exit barrier. Weights travel per
// entry. Extra warps zero this rank's padding rows (hidden and weights).
#define VEC 4
extern "C" __global__ void __launch_bounds__(512) moonep_dispatch(
    Dims d, const uint4* x, const float* w, const long long* dst, const unsigned long long* peer_hidden,
    const unsigned long long* peer_wts, const unsigned long long* peer_dup, const int* zfill, int dedup,
    const unsigned* status) {
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
      float wv = w ? w[t * K + lane] : 1.0f;
      reinterpret_cast<float*>(peer_wts[dr])[loff] = wv;
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
  zero_padding(d, own, own_w, zfill, gw, nwarps, lane);
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

// ---------------------------------------------------------------------------------------------
// NCCL send/recv fallback (no peer access). Counting pass: cnt[d] = entries of this rank to d.
extern "C" __global__ void moonep_fb_count(Dims d, const long long* dst, int* cnt, const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  long long n = d.s * d.K;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    int dr = (int)(dst[i] / d.NvS);
    atomicAdd(&cnt[dr], 1);
  }
}

// Pack: local entries go straight to the own shard; remote entries to staging at base[d] + an
// atomic position (pos_of[i] records it; meta carries (loff, weight bits) with the row).
extern "C" __global__ void moonep_fb_pack(Dims d, const uint4* x, const float* w, const long long* dst,
                                          const int* cnt, int* fill, uint4* own_hidden, float* own_wts,
                                          uint4* stage, int2* meta, int* pos_of, const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8, n = d.s * d.K;
  for (long long i = gw; i < n; i += nwarps) {
    long long slot = dst[i];
    int dr = (int)(slot / d.NvS);
    long long loff = slot % d.NvS;
    float wv = w ? w[i] : 1.0f;
    uint4* to;
    if (dr == d.me) {
      to = own_hidden + loff * hv;
      if (lane == 0) own_wts[loff] = wv;
    } else {
      long long pos = 0;
      if (lane == 0) {
        long long base = 0;
        for (int r = 0; r < dr; ++r) base += (r == d.me) ? 0 : cnt[r];
        pos = base + atomicAdd(&fill[dr], 1);
        meta[pos] = make_int2((int)loff, __float_as_int(wv));
        pos_of[i] = (int)pos;
      }
      pos = __shfl_sync(0xffffffffu, pos, 0);
      to = stage + pos * hv;
    }
    const uint4* from = x + (i / d.K) * hv;
    for (long long c = lane; c < hv; c += 32) to[c] = from[c];
  }
}

// Unpack received rows into their final slots (nrows received in total).
extern "C" __global__ void moonep_fb_unpack(Dims d, const uint4* stage, const int2* meta, long long nrows,
                                            uint4* own_hidden, float* own_wts, const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  for (long long q = gw; q < nrows; q += nwarps) {
    int2 m = meta[q];
    uint4* to = own_hidden + (long long)m.x * hv;
    for (long long c = lane; c < hv; c += 32) to[c] = stage[q * hv + c];
    if (lane == 0) own_wts[m.x] = __int_as_float(m.y);
  }
}

// Combine fallback, owner side: gather own slot rows (and weights) named by received meta.
extern "C" __global__ void moonep_fb_gather(Dims d, const int2* meta, long long nrows, const uint4* own_hidden,
                                            const float* own_wts, uint4* out_rows, float* out_w,
                                            const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  const long long hv = d.H / 8;
  for (long long q = gw; q < nrows; q += nwarps) {
    int loff = meta[q].x;
    for (long long c = lane; c < hv; c += 32) out_rows[q * hv + c] = own_hidden[(long long)loff * hv + c];
    if (lane == 0) out_w[q] = own_wts[loff];
  }
}

// Zero this rank's padding rows (fallback path; the NVLink dispatch does it inline).
extern "C" __global__ void moonep_zero_pad(Dims d, uint4* own_hidden, float* own_wts, const int* zfill,
                                           const unsigned* status) {
  if (*(volatile const unsigned*)status != ST_OK) return;
  const int lane = threadIdx.x % 32;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long nwarps = (long long)gridDim.x * blockDim.x / 32;
  zero_padding(d, own_hidden, own_wts, zfill, gw, nwarps, lane);
}

// ---------------------------------------------------------------------------------------------
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
