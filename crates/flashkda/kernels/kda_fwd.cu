// KDA chunked-prefill forward for sm_90a (docs/specs/kda.md §1.4).
//
// One block = one (sequence, head, value slice of 16*NW rows); NW warps, each owning 16 value rows
// of the state S (V x K, row = value channel) in fp32 mma accumulator registers for the whole
// sequence. Per 16-token chunk the block recomputes the key-side tensors (norms, gate cumsum,
// kd/qd/ki/kr, A, M, INV) in shared memory, then every warp runs the state-dependent chain with
// mma.sync m16n8k16 bf16 (fp32 accumulation). Inputs are double-buffered with cp.async; nothing
// goes through a device workspace. Rounding points are mirrored by `reference::emulated`.
#include "kda_common.cuh"

template <int NW>
struct __align__(16) Smem {
  bf16 q[2][CH][RS];  // raw q, then qd in place
  bf16 k[2][CH][RS];  // raw k, then kd in place
  bf16 g[2][CH][RS];  // raw g, then ki in place
  bf16 v[2][CH][16 * NW + 8];
  bf16 krT[KD][KRS];
  bf16 inv[CH][TS];
  bf16 m[CH][TS];
  bf16 o[NW][CH][TS];
  float E[KD];
  float A[CH][CH + 1];
  float rnq[CH];
  float rnk[CH];
  float b[CH];
};

template <int NW>
__device__ __forceinline__ void kda_fwd_body(const KdaParams& p) {
  constexpr int NT = NW * 32;
  constexpr int VS = 16 * NW;      // value rows per block
  constexpr int SLICES = KD / VS;  // blocks per (sequence, head)
  constexpr int CPT = KD / NT;     // gate channels per thread
  static_assert(NW == 2 || NW == 4, "two or four warps per block");
  __shared__ Smem<NW> sm;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long bid = blockIdx.x;
  const int slice = static_cast<int>(bid % SLICES);
  const int h = static_cast<int>((bid / SLICES) % H);
  const int n = static_cast<int>(bid / (SLICES * (long long)H));

  long long bos, len;
  seq_range(p, n, bos, len);
  const int v0 = slice * VS;
  const int vw = v0 + warp * 16;  // first value row owned by this warp
  const long long hs = (long long)H * KD;  // token stride in q/k/v/g/out
  const long long hoff = (long long)h * KD;

  // ---- state S rows [vw, vw+16) x 128 key columns, fp32 accumulator layout
  float S[16][4];
  const size_t sbase = ((size_t)n * H + h) * KD * KD;
  load_state(S, p, sbase, vw + gq, tq);

  const float exp_a = __expf(p.a_log[h]);
  const float lb2 = p.lower_bound * 1.4426950408889634f;  // gate in log2 units
  float dtb[CPT];
#pragma unroll
  for (int j = 0; j < CPT; ++j) dtb[j] = p.dt_bias[hoff + tid + j * NT];

  const int nchunks = static_cast<int>((len + CH - 1) / CH);

  auto prefetch = [&](int c, int st) {
    const long long rem = len - (long long)c * CH;
    prefetch_chunk<NT, VS>(sm.q[st], sm.k[st], sm.g[st], sm.v[st], p, bos + (long long)c * CH,
                           rem < CH ? static_cast<int>(rem) : CH, hs, hoff, v0, tid);
  };
  auto load_beta = [&](int c) -> float {
    const long long rem = len - (long long)c * CH;
    if (tid < CH && tid < rem) return __bfloat162float(p.beta[(bos + (long long)c * CH + tid) * H + h]);
    return 0.f;
  };

  float beta_next = 0.f;
  if (nchunks > 0) {
    prefetch(0, 0);
    beta_next = load_beta(0);
  }

  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    const long long rem = len - (long long)c * CH;
    const int nv = rem < CH ? static_cast<int>(rem) : CH;
    const float beta_raw = beta_next;
    cp_async_wait_all();
    __syncthreads();  // sync0: stage st landed; chunk c-1 fully consumed
    if (c + 1 < nchunks) {
      prefetch(c + 1, st ^ 1);
      beta_next = load_beta(c + 1);
    }

    // ---- phase 1: row norms, beta sigmoid, gate cumsum (registers)
    row_norms<NW>([&](int r) { return r < CH ? &sm.q[st][r][0] : &sm.k[st][r - CH][0]; },
                  [&](int r, float rn) { if (r < CH) sm.rnq[r] = rn; else sm.rnk[r - CH] = rn; }, warp, lane);
    if (tid < CH) sm.b[tid] = tid < nv ? sigmoidf_(beta_raw) : 0.f;

    float G[CPT][CH];
#pragma unroll
    for (int j = 0; j < CPT; ++j) gate_cumsum(G[j], sm.g[st], tid + j * NT, exp_a, dtb[j], lb2, nv);
    __syncthreads();  // sync1: norms visible

    // ---- phase 2: decayed keys/queries in place (q->qd, k->kd, g->ki), krT, E
#pragma unroll
    for (int j = 0; j < CPT; ++j)
      decay_channel(sm.q[st], sm.k[st], sm.g[st], sm.krT, sm.E, sm.rnq, sm.rnk, G[j], tid + j * NT, p.scale);
    __syncthreads();  // sync2: kd, qd, ki, krT, E visible


    // ---- phase 3a: A = diag(b) strict_lower(kd ki^T) and its inverse (warp 0); M (warp 1)
    if (warp < 2) {
      const bool do_a = warp == 0;
      const bf16(*lhs)[RS] = do_a ? sm.k[st] : sm.q[st];
      float acc[2][4];
      tile_product(acc, [&](int r, int cc) { return ld32(&lhs[r][cc]); },
                   [&](int r, int cc) { return ld32(&sm.g[st][r][cc]); }, gq, tq);
      if (do_a) {
        store_a(sm.A, acc, sm.b, gq, tq);
        __syncwarp();
        if (lane < CH)
          invert_column([&](int r, int m) { return sm.A[r][m]; }, lane,
                        [&](int r, int cc, bf16 x) { sm.inv[r][cc] = x; });
        __syncwarp();
      } else {
        store_m(acc, [&](int r, int cc, bf16 x) { sm.m[r][cc] = x; }, gq, tq);
      }
    }

    // ---- phase 3b: W^T = S kd^T and O1^T = S qd^T (value rows x tokens), S rounded to bf16
    float W[2][4], O1[2][4];
    state_products(W, O1, S, [&](int r, int cc) { return ld32(&sm.k[st][r][cc]); },
                   [&](int r, int cc) { return ld32(&sm.q[st][r][cc]); }, gq, tq);
    __syncthreads();  // sync3: INV, M visible

    // ---- phase 4: Vb = bf16((v - W) b); U = INV Vb; out = O1 + M U; S = S diag(E) + U^T kr
    const int vl = warp * 16 + gq;  // local value row of c0/c1 (c2/c3: +8)
    float vb[2][4];
    residual(vb, [&](int t, int r) { return sm.v[st][t][r]; }, W, sm.b, vl, tq);
    uint32_t va[4], ua[4];
    pack_tile(va, vb);
    float U[2][4];
    solve_u(U, va, [&](int r, int cc) { return ld32(&sm.inv[r][cc]); }, gq, tq);
    pack_tile(ua, U);
    out_tile(sm.o[warp], ua, [&](int r, int cc) { return ld32(&sm.m[r][cc]); }, O1, gq, tq);
    update_state(S, ua, sm.E, [&](int r, int cc) { return ld32(&sm.krT[r][cc]); }, gq, tq);
    __syncwarp();
    store_out(p, sm.o[warp], bos + (long long)c * CH, nv, hs, hoff, vw, lane);
  }

  // ---- final state
  if (p.ht != nullptr) store_state(S, p, sbase, vw + gq, tq);
}

extern "C" __global__ void __launch_bounds__(64) kda_fwd_w2(const KdaParams p) { kda_fwd_body<2>(p); }
extern "C" __global__ void __launch_bounds__(128) kda_fwd_w4(const KdaParams p) { kda_fwd_body<4>(p); }
