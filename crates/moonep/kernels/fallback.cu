// NCCL send/recv fallback for hosts without peer access.
#include "common.cuh"

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

