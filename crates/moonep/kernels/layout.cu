// Planning (docs/specs/moonep.md §2): stage-D histograms, stages A-C in one block, stage-D slots,
// and the IPC all-gather of tpe that feeds them.
#include "common.cuh"

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

// IPC all-gather of tpe: this rank's row tpe[E] goes to row `me` of every rank's tpe table (at
// element offset `base`, so calls alternate between two tables); a barrier follows.
extern "C" __global__ void moonep_tpe_push(Dims d, const int* tpe, const unsigned long long* peer_tpe, long long base) {
  for (long long j = blockIdx.x; j < d.R; j += gridDim.x) {
    int* to = reinterpret_cast<int*>(peer_tpe[j]) + base + d.me * d.E;
    for (long long e = threadIdx.x; e < d.E; e += blockDim.x) to[e] = tpe[e];
  }
  __threadfence_system();
}
