// kda_c64_wgmma_selftest (included by kda_fwd_c64.cu; launched only by tests/gpu_c64.rs): the wgmma
// building blocks of kda_state64 in isolation, so a device run can tell a layout error (descriptor,
// core-matrix tiles, accumulator -> A fragment mapping) from an error in the KDA math. One warpgroup:
//   D1 = bf16(X) Bm^T      X [64][128] fp32 in accumulator layout, Bm [64][128] bf16 as the kd tile
//                          (m64n64, K = 128, SBO 2048): the W^T product
//   D2 = X2 + (hi + lo)(D1) Kr   Kr [64][128] bf16 row-major, tiled as krT [128][64] (m64n128, K = 64,
//                          SBO 1024): the state update with a split A operand
extern "C" __global__ void __launch_bounds__(128) kda_c64_wgmma_selftest(const float* X, const bf16* Bm,
                                                                         const float* X2, const bf16* Kr,
                                                                         float* D1, float* D2) {
  __shared__ __align__(128) unsigned char tiles[2 * 16384];
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  for (int u = tid; u < 64 * 16; u += 128) {
    const int n = u >> 4, k0 = (u & 15) * 8;
    *reinterpret_cast<uint4*>(tiles + core_off(n, k0, 2048)) = *reinterpret_cast<const uint4*>(Bm + n * 128 + k0);
  }
  for (int u = tid; u < 128 * 8; u += 128) {
    const int n = u >> 3, k0 = (u & 7) * 8;
    __align__(16) bf16 t[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) t[e] = Kr[(k0 + e) * 128 + n];
    *reinterpret_cast<uint4*>(tiles + 16384 + core_off(n, k0, 1024)) = *reinterpret_cast<const uint4*>(t);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores -> wgmma reads
  __syncthreads();
  const uint32_t base = smem_u32(tiles);
  const int r = 16 * w + gq;
  float S[64], d1[32];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[4 * j + e] = X[(r + 8 * (e >> 1)) * 128 + 8 * j + 2 * tq + (e & 1)];
  uint32_t sa[8][4], unused[8][4];
  acc_to_a<8, false>(sa, unused, S);
  wg_fence();
  wg_m64n64_rs_z(d1, sa[0], wg_desc(base, 128, 2048));
#pragma unroll
  for (int kk = 1; kk < 8; ++kk) wg_m64n64_rs(d1, sa[kk], wg_desc(base + kk * 256, 128, 2048), 1);
  wg_commit();
  wg_wait<0>();
  wg_fence_acc(d1);
  wg_fence_a(sa);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) D1[(r + 8 * (e >> 1)) * 64 + 8 * j + 2 * tq + (e & 1)] = d1[4 * j + e];
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[4 * j + e] = X2[(r + 8 * (e >> 1)) * 128 + 8 * j + 2 * tq + (e & 1)];
  uint32_t uh[4][4], ul[4][4];
  acc_to_a<4, true>(uh, ul, d1);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wg_m64n128_rs(S, uh[kk], wg_desc(base + 16384 + kk * 256, 128, 1024), 1);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wg_m64n128_rs(S, ul[kk], wg_desc(base + 16384 + kk * 256, 128, 1024), 1);
  wg_commit();
  wg_wait<0>();
  wg_fence_acc(S);
  wg_fence_a(uh);
  wg_fence_a(ul);
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) D2[(r + 8 * (e >> 1)) * 128 + 8 * j + 2 * tq + (e & 1)] = S[4 * j + e];
}
