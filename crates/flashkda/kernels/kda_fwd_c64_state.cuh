// kda_state64 (included by kda_fwd_c64.cu): the serial pass of the chunk-64 forward, one block of two
// warpgroups per (sequence, head) chain. Per chunk and warpgroup (value rows V = 64 wg .. + 64):
//   W^T  = Sb kd^T      m64n64, K = 128 (8 wgmma; A = bf16(S) from the state accumulator)
//   O^T  = Sb qd^T      m64n64, K = 128 (8; committed as its own group, off the chain)
//   Vb^T = (v^T - W^T) diag(b), split into hi + lo bf16 (pad tokens selected to 0)
//   U^T  = Vb^T INV^T   m64n64, K = 64 (hi and lo: 8)
//   S    = S diag(E) + U^T kr        m64n128, K = 64 (U hi and lo: 8; E scaled into the accumulator)
//   O^T += U^T M^T      m64n64, K = 64 (U hi M hi, U lo M hi, U hi M lo: 12)
// Accumulator and A-fragment layouts: kda_c64_wgmma.cuh.

#define ST64 2                               // record stages
#define VRS64 (KD + 8)                       // v / out tile row stride (bf16): conflict-free column reads
#define SM64_V (ST64 * REC64_BYTES)          // [ST64][64][VRS64] bf16
#define SM64_O (SM64_V + ST64 * C64 * VRS64 * 2)  // [64][VRS64] bf16 output staging
#define SM64_BAR (SM64_O + C64 * VRS64 * 2)  // [ST64] mbarriers
#define STATE64_SMEM (SM64_BAR + 8 * ST64)   // mirrored in launch/c64.rs
static_assert(STATE64_SMEM == 201232, "update launch/c64.rs");
static_assert(STATE64_SMEM <= 227 * 1024, "one block per SM");
// bytes copied per record: all but the 3 x 3072 zero bytes above the diagonal blocks of INV, M hi, M lo
// (kda_prep64 does not write them)
#define REC64_COPY_BYTES (REC64_BYTES - 3 * 3072)
static_assert(R64_MH == R64_INV + 8192 && R64_ML == R64_MH + 8192 && R64_E == R64_ML + 8192, "INV, M hi, M lo contiguous");
static_assert(SM64_V % 128 == 0 && SM64_O % 16 == 0 && SM64_BAR % 8 == 0, "alignment");

// The 128 threads of warpgroup wg (barrier ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void wg_bar(int wg) {
  if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
  else asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

// k-step kk of an m64 x (16 KS) accumulator as bf16 A fragments (hi, and lo = x - hi when LO).
template <int KS, bool LO>
__device__ __forceinline__ void acc_to_a(uint32_t (&hi)[KS][4], uint32_t (&lo)[KS][4], const float* x) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float a = x[8 * kk + 2 * r], b = x[8 * kk + 2 * r + 1];
      hi[kk][r] = pack(a, b);
      if (LO) {
        const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&hi[kk][r]);
        lo[kk][r] = pack(a - __low2float(h), b - __high2float(h));
      }
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) kda_state64(const KdaParams p) {
  extern __shared__ __align__(128) unsigned char sm64[];
  unsigned char* recs = sm64;
  bf16* vs = reinterpret_cast<bf16*>(sm64 + SM64_V);
  bf16* os = reinterpret_cast<bf16*>(sm64 + SM64_O);
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm64 + SM64_BAR);
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, w = wt >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const int h = static_cast<int>(blockIdx.x % H), n = static_cast<int>(blockIdx.x / H);
  const SeqInfo si = seq_slots<C64>(p, n);
  const long long bos = si.bos, len = si.len;
  const long long hs = (long long)H * KD, hoff = (long long)h * KD;
  const int nchunks = static_cast<int>((len + C64 - 1) / C64);
  const unsigned char* ws = reinterpret_cast<const unsigned char*>(p.ws);
  const int v0 = 64 * wg;                 // the warpgroup's value rows
  const int vr = v0 + 16 * w + gq;        // this thread's rows vr, vr + 8
  auto nvalid = [&](int c) -> int {
    const long long rem = len - (long long)c * C64;
    return rem < C64 ? static_cast<int>(rem) : C64;
  };
  // the warpgroup's 64 v columns of chunk c (one group per chunk, empty past the end)
  auto issue_v = [&](int c) {
    if (c < nchunks) {
      const int st = c % ST64, nv = nvalid(c);
      const long long t0 = bos + (long long)c * C64;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int u = wt + 128 * k, r = u >> 3, cc = u & 7;
        const bool ok = r < nv;
        cp_async16(vs + (st * C64 + r) * VRS64 + v0 + 8 * cc, ok ? p.v + (t0 + r) * hs + hoff + v0 + 8 * cc : p.v,
                   ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  auto issue_rec = [&](int c) {
    const int st = c % ST64;
    const uint32_t bar = smem_u32(&bars[st]);
    mbar_expect_tx(bar, REC64_COPY_BYTES);
    const unsigned char* src = ws + (size_t)((si.slot0 + c) * H + h) * REC64_BYTES;
    const uint32_t dst = smem_u32(recs + st * REC64_BYTES);
    // 19 pieces: everything but the zero blocks above the diagonal of INV, M hi, M lo (row group g of
    // such a tile keeps its first 256 (g / 2 + 1) bytes; groups 6, 7 are whole and run on into the
    // next tile or E, b)
    uint32_t a = 0;
#pragma unroll
    for (int t = 0; t < 3; ++t)
#pragma unroll
      for (int g = 0; g < 6; ++g) {
        const uint32_t base = R64_INV + t * 8192 + g * 1024, end = base + 256 * (g / 2 + 1);
        bulk_g2s(dst + a, src + a, end - a, bar);
        a = base + 1024;
      }
    bulk_g2s(dst + a, src + a, REC64_BYTES - a, bar);
  };

  mbar_init_stages(bars, ST64, tid);
  // the zero blocks the records leave out, once per stage (no copy ever writes them); the wgmma
  // read them through the async proxy
  for (int u = tid; u < ST64 * 3 * 8 * 64; u += 256) {
    const int q = u & 63, g = (u >> 6) & 7, t = (u >> 9) % 3, st = u / (3 * 8 * 64);
    if (g < 6 && 16 * q >= 256 * (g / 2 + 1))
      *reinterpret_cast<uint4*>(recs + st * REC64_BYTES + R64_INV + t * 8192 + g * 1024 + 16 * q) = make_uint4(0u, 0u, 0u, 0u);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (tid == 0)
    for (int c = 0; c < ST64 && c < nchunks; ++c) issue_rec(c);
  for (int c = 0; c < ST64; ++c) issue_v(c);

  // state rows vr, vr + 8 of the chain: S[4j + e] = S[vr + 8 (e >> 1)][8j + 2tq + (e & 1)]
  float S[64];
  const size_t sbase = ((size_t)n * H + h) * KD * KD;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int col = 8 * j + 2 * tq;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float2 x = make_float2(0.f, 0.f);
      const size_t at = sbase + (size_t)(vr + 8 * hr) * KD + col;
      if (p.h0 != nullptr) {
        if (p.state_fp32) x = *reinterpret_cast<const float2*>(static_cast<const float*>(p.h0) + at);
        else x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(p.h0) + at));
      }
      S[4 * j + 2 * hr] = x.x;
      S[4 * j + 2 * hr + 1] = x.y;
    }
  }
  float WU[32], O[32];  // WU: W^T, then (once Vb is formed) U^T

  for (int c = 0; c < nchunks; ++c) {
    const int st = c % ST64, nv = nvalid(c);
    mbar_wait(smem_u32(&bars[st]), static_cast<uint32_t>((c / ST64) & 1));
    cp_async_wait_group<ST64 - 1>();  // this thread's v copies of chunk c landed ...
    wg_bar(wg);                       // ... and the warpgroup's
    const unsigned char* rec = recs + st * REC64_BYTES;
    const uint32_t rbase = smem_u32(rec);
    const float* E = reinterpret_cast<const float*>(rec + R64_E);
    const float* b = reinterpret_cast<const float*>(rec + R64_B);
    const bf16* vst = vs + st * C64 * VRS64;

    // W^T = Sb kd^T, then O^T = Sb qd^T (own group; sa stays live until that group retires)
    uint32_t sa[8][4];
    {
      uint32_t unused[8][4];
      acc_to_a<8, false>(sa, unused, S);
      wg_fence();
      wg_m64n64_rs_z(WU, sa[0], wg_desc(rbase + R64_KD, 128, 2048));
#pragma unroll
      for (int kk = 1; kk < 8; ++kk) wg_m64n64_rs(WU, sa[kk], wg_desc(rbase + R64_KD + kk * 256, 128, 2048), 1);
      wg_commit();
      wg_m64n64_rs_z(O, sa[0], wg_desc(rbase + R64_QD, 128, 2048));
#pragma unroll
      for (int kk = 1; kk < 8; ++kk) wg_m64n64_rs(O, sa[kk], wg_desc(rbase + R64_QD + kk * 256, 128, 2048), 1);
      wg_commit();
      wg_wait<1>();
      wg_fence_acc(WU);
    }
    // Vb^T (tokens are the columns), hi + lo; U^T = Vb^T INV^T
    {
      float x[32];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 8 * j + 2 * tq + (e & 1);
          const float vv = __bfloat162float(vst[tok * VRS64 + vr + 8 * (e >> 1)]);
          x[4 * j + e] = tok < nv ? (vv - WU[4 * j + e]) * b[tok] : 0.f;
        }
      uint32_t vh[4][4], vl[4][4];
      acc_to_a<4, true>(vh, vl, x);
      wg_fence();
      wg_m64n64_rs_z(WU, vh[0], wg_desc(rbase + R64_INV, 128, 1024));
#pragma unroll
      for (int kk = 1; kk < 4; ++kk) wg_m64n64_rs(WU, vh[kk], wg_desc(rbase + R64_INV + kk * 256, 128, 1024), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg_m64n64_rs(WU, vl[kk], wg_desc(rbase + R64_INV + kk * 256, 128, 1024), 1);
      wg_commit();
      wg_wait<0>();  // U and O^T
      wg_fence_acc(WU);
      wg_fence_acc(O);
      wg_fence_a(sa);
      wg_fence_a(vh);
      wg_fence_a(vl);
    }
    // S = S diag(E) + U^T kr; O^T += U^T M^T (U and M as hi + lo, the lo lo term dropped)
    {
      uint32_t uh[4][4], ul[4][4];
      acc_to_a<4, true>(uh, ul, WU);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 e01 = *reinterpret_cast<const float2*>(&E[8 * j + 2 * tq]);
        S[4 * j] *= e01.x;
        S[4 * j + 1] *= e01.y;
        S[4 * j + 2] *= e01.x;
        S[4 * j + 3] *= e01.y;
      }
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg_m64n128_rs(S, uh[kk], wg_desc(rbase + R64_KR + kk * 256, 128, 1024), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wg_m64n128_rs(S, ul[kk], wg_desc(rbase + R64_KR + kk * 256, 128, 1024), 1);
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t dh = wg_desc(rbase + R64_MH + kk * 256, 128, 1024);
        wg_m64n64_rs(O, uh[kk], dh, 1);
        wg_m64n64_rs(O, ul[kk], dh, 1);
        wg_m64n64_rs(O, uh[kk], wg_desc(rbase + R64_ML + kk * 256, 128, 1024), 1);
      }
      wg_commit();
      wg_wait<0>();
      wg_fence_acc(S);
      wg_fence_acc(O);
      wg_fence_a(uh);
      wg_fence_a(ul);
    }
    // out: O^T -> os[token][value] -> the chunk's valid rows, 16-byte stores
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) os[(8 * j + 2 * tq + (e & 1)) * VRS64 + vr + 8 * (e >> 1)] = __float2bfloat16_rn(O[4 * j + e]);
    wg_bar(wg);
    {
      const long long t0 = bos + (long long)c * C64;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int u = wt + 128 * k, r = u >> 3, cc = u & 7;
        if (r < nv)
          *reinterpret_cast<uint4*>(p.out + (t0 + r) * hs + hoff + v0 + 8 * cc) =
              *reinterpret_cast<const uint4*>(os + r * VRS64 + v0 + 8 * cc);
      }
    }
    issue_v(c + ST64);  // the warpgroup is done with its v columns of stage st (barrier above)
    __syncthreads();    // both warpgroups are done with record stage st and with os
    if (tid == 0 && c + ST64 < nchunks) issue_rec(c + ST64);
  }
  cp_async_wait_all();

  if (p.ht != nullptr) {
    // the row base anew (an opaque copy), so the compiler does not keep the initial load's 32
    // addresses alive (spilled) across the chunk loop
    size_t rowbase = sbase + (size_t)vr * KD + 2 * tq;
    asm volatile("mov.b64 %0, %0;" : "+l"(rowbase));
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const size_t at = rowbase + (size_t)(8 * hr) * KD + 8 * j;
        const float a = S[4 * j + 2 * hr], bb = S[4 * j + 2 * hr + 1];
        if (p.state_fp32) *reinterpret_cast<float2*>(static_cast<float*>(p.ht) + at) = make_float2(a, bb);
        else *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.ht) + at) = __floats2bfloat162_rn(a, bb);
      }
    }
  }
}
