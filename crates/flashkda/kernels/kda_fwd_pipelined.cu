// KDA forward, software-pipelined variant of kda_fwd.cu (same math, same rounding points).
//
// One block = (sequence, head, 64 value rows), 4 warps, fp32 state in mma accumulators. Iteration c
// overlaps the key-side prep of chunk c+1 (norms, gate cumsum, decayed keys) with the
// state-dependent work of chunk c, so each chunk step costs two barriers instead of four and the
// prep's MUFU/ALU latency hides behind the tensor-core chain. Raw inputs are triple-buffered
// (cp.async two chunks ahead of the state); prep outputs that outlive an iteration are double-buffered.
#include "kda_common.cuh"

#define PIPE_NW 4
#define PIPE_SMEM_BYTES 65344  // sizeof(PipeSmem); launch.rs passes it as dynamic shared memory

struct __align__(16) PipeSmem {
  bf16 q[3][CH][RS];  // raw q, then qd in place
  bf16 k[3][CH][RS];  // raw k, then kd in place
  bf16 g[3][CH][RS];  // raw g, then ki in place
  bf16 v[3][CH][16 * PIPE_NW + 8];
  bf16 krT[2][KD][KRS];
  bf16 inv[CH][TS];
  bf16 m[CH][TS];
  bf16 o[PIPE_NW][CH][TS];
  float E[2][KD];
  float A[CH][CH + 1];
  float rnq[CH];
  float rnk[CH];
  float b[2][CH];
};
static_assert(sizeof(PipeSmem) == PIPE_SMEM_BYTES, "update PIPE_SMEM_BYTES and launch.rs");

extern "C" __global__ void __launch_bounds__(128) kda_fwd_pipe_w4(const KdaParams p) {
  constexpr int NW = PIPE_NW;
  constexpr int NT = NW * 32;
  constexpr int VS = 16 * NW;
  constexpr int SLICES = KD / VS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PipeSmem& sm = *reinterpret_cast<PipeSmem*>(smem_raw);

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
  const int vw = v0 + warp * 16;
  const long long hs = (long long)H * KD;
  const long long hoff = (long long)h * KD;

  float S[16][4];
  const size_t sbase = ((size_t)n * H + h) * KD * KD;
  load_state(S, p, sbase, vw + gq, tq);

  const float exp_a = __expf(p.a_log[h]);
  const float lb2 = p.lower_bound * 1.4426950408889634f;
  const float dtb = p.dt_bias[hoff + tid];  // one gate channel per thread (NT == KD)
  const int nchunks = static_cast<int>((len + CH - 1) / CH);

  auto nvalid = [&](int c) -> int {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? static_cast<int>(rem) : CH;
  };
  auto prefetch = [&](int c) {
    const int st = c % 3;
    prefetch_chunk<NT, VS>(sm.q[st], sm.k[st], sm.g[st], sm.v[st], p, bos + (long long)c * CH, nvalid(c), hs, hoff,
                           v0, tid);
  };
  auto load_beta = [&](int c) -> float {
    const long long rem = len - (long long)c * CH;
    if (tid < CH && tid < rem) return __bfloat162float(p.beta[(bos + (long long)c * CH + tid) * H + h]);
    return 0.f;
  };

  // prep, part 1 (chunk c): row norms, sigmoid(beta) into b[c&1], gate cumsum into G
  auto prep1 = [&](int c, float beta_raw, float (&G)[CH]) {
    const int st = c % 3, nv = nvalid(c);
    row_norms<NW>([&](int r) { return r < CH ? &sm.q[st][r][0] : &sm.k[st][r - CH][0]; },
                  [&](int r, float rn) { if (r < CH) sm.rnq[r] = rn; else sm.rnk[r - CH] = rn; }, warp, lane);
    if (tid < CH) sm.b[c & 1][tid] = tid < nv ? sigmoidf_(beta_raw) : 0.f;
    gate_cumsum(G, sm.g[st], tid, exp_a, dtb, lb2, nv);
  };

  // prep, part 2 (chunk c): qd, kd, ki in place; krT[c&1], E[c&1]
  auto prep2 = [&](int c, const float (&G)[CH]) {
    const int st = c % 3, par = c & 1;
    decay_channel(sm.q[st], sm.k[st], sm.g[st], sm.krT[par], sm.E[par], sm.rnq, sm.rnk, G, tid, p.scale);
  };

  float beta_next = 0.f;  // logits of the next chunk to prep
  if (nchunks > 0) {
    prefetch(0);
    const float beta0 = load_beta(0);
    cp_async_wait_all();
    __syncthreads();
    if (nchunks > 1) {
      prefetch(1);
      beta_next = load_beta(1);
    }
    float G[CH];
    prep1(0, beta0, G);
    __syncthreads();
    prep2(0, G);
  }

  for (int c = 0; c < nchunks; ++c) {
    const int st = c % 3, par = c & 1, nv = nvalid(c);
    const bool has_next = c + 1 < nchunks;
    const float beta_prep = beta_next;
    cp_async_wait_all();  // chunk c+1 landed
    __syncthreads();      // S0: prep of chunk c visible; chunk c-1 fully consumed
    if (c + 2 < nchunks) {
      prefetch(c + 2);
      beta_next = load_beta(c + 2);
    }

    // ---- P1: prep1(c+1) | A, INV (warp 0), M (warp 1) of c | W, O1 of c
    float G[CH];
    if (has_next) prep1(c + 1, beta_prep, G);
    __syncwarp();  // reconverge before mma.sync
    if (warp < 2) {
      const bool do_a = warp == 0;
      const bf16(*lhs)[RS] = do_a ? sm.k[st] : sm.q[st];
      float acc[2][4];
      tile_product(acc, [&](int r, int cc) { return ld32(&lhs[r][cc]); },
                   [&](int r, int cc) { return ld32(&sm.g[st][r][cc]); }, gq, tq);
      if (do_a) {
        store_a(sm.A, acc, sm.b[par], gq, tq);
        __syncwarp();
        if (lane < CH)
          invert_column([&](int r, int m) { return sm.A[r][m]; }, lane,
                        [&](int r, int cc, bf16 x) { sm.inv[r][cc] = x; });
        __syncwarp();
      } else {
        store_m(acc, [&](int r, int cc, bf16 x) { sm.m[r][cc] = x; }, gq, tq);
      }
    }
    float W[2][4], O1[2][4];
    state_products(W, O1, S, [&](int r, int cc) { return ld32(&sm.k[st][r][cc]); },
                   [&](int r, int cc) { return ld32(&sm.q[st][r][cc]); }, gq, tq);
    __syncthreads();  // S1: INV, M of c and norms of c+1 visible

    // ---- P2: prep2(c+1) | Vb, U, out, state update of c
    if (has_next) prep2(c + 1, G);
    __syncwarp();
    const int vl = warp * 16 + gq;
    float vb[2][4];
    residual(vb, [&](int t, int r) { return sm.v[st][t][r]; }, W, sm.b[par], vl, tq);
    uint32_t va[4], ua[4];
    pack_tile(va, vb);
    float U[2][4];
    solve_u(U, va, [&](int r, int cc) { return ld32(&sm.inv[r][cc]); }, gq, tq);
    pack_tile(ua, U);
    out_tile(sm.o[warp], ua, [&](int r, int cc) { return ld32(&sm.m[r][cc]); }, O1, gq, tq);
    update_state(S, ua, sm.E[par], [&](int r, int cc) { return ld32(&sm.krT[par][r][cc]); }, gq, tq);
    __syncwarp();
    store_out(p, sm.o[warp], bos + (long long)c * CH, nv, hs, hoff, vw, lane);
  }

  if (p.ht != nullptr) store_state(S, p, sbase, vw + gq, tq);
}
