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
  if (p.cu_seqlens != nullptr) {
    long long a = p.cu_seqlens[n], e = p.cu_seqlens[n + 1];
    a = a < 0 ? 0 : (a > p.total_tokens ? p.total_tokens : a);
    e = e < a ? a : (e > p.total_tokens ? p.total_tokens : e);
    bos = a;
    len = e - a;
  } else {
    bos = (long long)n * p.seq_len;
    len = p.seq_len;
  }
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
    const long long t0 = bos + (long long)c * CH;
    const long long rem = len - (long long)c * CH;
    const int nv = rem < CH ? static_cast<int>(rem) : CH;
    for (int i = tid; i < 3 * 256; i += NT) {
      const int which = i >> 8, r = (i >> 4) & 15, cc = i & 15;
      const bf16* src = which == 0 ? p.q : (which == 1 ? p.k : p.g);
      bf16* dst = which == 0 ? &sm.q[st][r][cc * 8] : (which == 1 ? &sm.k[st][r][cc * 8] : &sm.g[st][r][cc * 8]);
      const bool ok = r < nv;
      cp_async16(dst, ok ? src + (t0 + r) * hs + hoff + cc * 8 : src, ok ? 16 : 0);
    }
    constexpr int VCH = VS / 8;
    for (int i = tid; i < CH * VCH; i += NT) {
      const int r = i / VCH, cc = i % VCH;
      const bool ok = r < nv;
      cp_async16(&sm.v[st][r][cc * 8], ok ? p.v + (t0 + r) * hs + hoff + v0 + cc * 8 : p.v, ok ? 16 : 0);
    }
    cp_async_commit();
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
    {
      constexpr int RPW = 2 * CH / NW;  // rows per warp; unrolled so the shuffle chains interleave
      float ss[RPW];
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        const int r = warp + rr * NW;
        const bf16* row = r < CH ? &sm.q[st][r][0] : &sm.k[st][r - CH][0];
        const uint2 raw = *reinterpret_cast<const uint2*>(row + lane * 4);
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 b2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        float x = a.x * a.x;
        x = fmaf(a.y, a.y, x);
        x = fmaf(b2.x, b2.x, x);
        ss[rr] = fmaf(b2.y, b2.y, x);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) ss[rr] += __shfl_xor_sync(0xffffffffu, ss[rr], o);
      if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
          const int r = warp + rr * NW;
          const float rn = rsqrtf(ss[rr] + 1e-6f);
          if (r < CH) sm.rnq[r] = rn; else sm.rnk[r - CH] = rn;
        }
      }
    }
    if (tid < CH) sm.b[tid] = tid < nv ? sigmoidf_(beta_raw) : 0.f;

    float G[CPT][CH];
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int ch = tid + j * NT;
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        // pad rows hold zeros (cp.async zero-fill): computing them is safe; select, don't branch
        const float y = exp_a * (__bfloat162float(sm.g[st][i][ch]) + dtb[j]);
        const float gam = lb2 * sigmoidf_(y);
        acc += i < nv ? gam : 0.f;
        G[j][i] = acc;
      }
    }
    __syncthreads();  // sync1: norms visible

    // ---- phase 2: decayed keys/queries in place (q->qd, k->kd, g->ki), krT, E
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
      const int ch = tid + j * NT;
      const float gt = G[j][CH - 1];
      sm.E[ch] = ex2(gt);
      float kv[CH], qv[CH];  // all loads first: the in-place stores below must not serialize them
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        kv[i] = __bfloat162float(sm.k[st][i][ch]) * sm.rnk[i];
        qv[i] = __bfloat162float(sm.q[st][i][ch]) * sm.rnq[i] * p.scale;
      }
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const float kn = kv[i];
        const float qn = qv[i];
        const float e = ex2(G[j][i]);
        sm.k[st][i][ch] = __float2bfloat16_rn(kn * e);
        sm.q[st][i][ch] = __float2bfloat16_rn(qn * e);
        sm.g[st][i][ch] = __float2bfloat16_rn(kn * ex2(-G[j][i]));
        sm.krT[ch][i] = __float2bfloat16_rn(kn * ex2(gt - G[j][i]));
      }
    }
    __syncthreads();  // sync2: kd, qd, ki, krT, E visible

    const bf16(*kd)[RS] = sm.k[st];
    const bf16(*qd)[RS] = sm.q[st];
    const bf16(*ki)[RS] = sm.g[st];
    const float zero4[4] = {0.f, 0.f, 0.f, 0.f};

    // ---- phase 3a: A = diag(b) strict_lower(kd ki^T) and its inverse (warp 0); M (warp 1)
    if (warp < 2) {
      const bool do_a = warp == 0;
      const bf16(*lhs)[RS] = do_a ? kd : qd;
      float acc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
      auto product = [&]() {
#pragma unroll
        for (int kb = 0; kb < 8; ++kb) {
          const int kc = kb * 16 + 2 * tq;
          const uint32_t a0 = ld32(&lhs[gq][kc]), a1 = ld32(&lhs[gq + 8][kc]);
          const uint32_t a2 = ld32(&lhs[gq][kc + 8]), a3 = ld32(&lhs[gq + 8][kc + 8]);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const uint32_t b0 = ld32(&ki[nt * 8 + gq][kc]), b1 = ld32(&ki[nt * 8 + gq][kc + 8]);
            mma(acc[nt], a0, a1, a2, a3, b0, b1, acc[nt]);
          }
        }
      };
      product();
      if (do_a) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = gq + 8 * (e >> 1), col = nt * 8 + 2 * tq + (e & 1);
            sm.A[row][col] = col < row ? acc[nt][e] * sm.b[row] : 0.f;
          }
        __syncwarp();
        if (lane < CH) {
          const int jc = lane;
          float x[CH];
#pragma unroll
          for (int i = 0; i < CH; ++i) {
            float s = i == jc ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) s = fmaf(-sm.A[i][m], x[m], s);
            x[i] = s;
          }
#pragma unroll
          for (int i = 0; i < CH; ++i) sm.inv[i][jc] = __float2bfloat16_rn(x[i]);
        }
        __syncwarp();
      } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = gq + 8 * (e >> 1), col = nt * 8 + 2 * tq + (e & 1);
            sm.m[row][col] = __float2bfloat16_rn(col <= row ? acc[nt][e] : 0.f);
          }
      }
    }

    // ---- phase 3b: W^T = S kd^T and O1^T = S qd^T (value rows x tokens), S rounded to bf16
    float W[2][4], O1[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) W[nt][e] = O1[nt][e] = 0.f;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const uint32_t a0 = pack(S[2 * kb][0], S[2 * kb][1]);
      const uint32_t a1 = pack(S[2 * kb][2], S[2 * kb][3]);
      const uint32_t a2 = pack(S[2 * kb + 1][0], S[2 * kb + 1][1]);
      const uint32_t a3 = pack(S[2 * kb + 1][2], S[2 * kb + 1][3]);
      const int kc = kb * 16 + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int tr = nt * 8 + gq;
        mma(W[nt], a0, a1, a2, a3, ld32(&kd[tr][kc]), ld32(&kd[tr][kc + 8]), W[nt]);
        mma(O1[nt], a0, a1, a2, a3, ld32(&qd[tr][kc]), ld32(&qd[tr][kc + 8]), O1[nt]);
      }
    }
    __syncthreads();  // sync3: INV, M visible

    // ---- phase 4: Vb = bf16((v - W) b); U = INV Vb; out = O1 + M U; S = S diag(E) + U^T kr
    const int vl = warp * 16 + gq;  // local value row of c0/c1 (c2/c3: +8)
    float vb[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * tq + (e & 1);
        const float vv = __bfloat162float(sm.v[st][tok][vl + 8 * (e >> 1)]);
        vb[nt][e] = (vv - W[nt][e]) * sm.b[tok];
      }
    const uint32_t va0 = pack(vb[0][0], vb[0][1]), va1 = pack(vb[0][2], vb[0][3]);
    const uint32_t va2 = pack(vb[1][0], vb[1][1]), va3 = pack(vb[1][2], vb[1][3]);
    float U[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int ir = nt * 8 + gq;
      mma(U[nt], va0, va1, va2, va3, ld32(&sm.inv[ir][2 * tq]), ld32(&sm.inv[ir][2 * tq + 8]), zero4);
    }
    const uint32_t ua0 = pack(U[0][0], U[0][1]), ua1 = pack(U[0][2], U[0][3]);
    const uint32_t ua2 = pack(U[1][0], U[1][1]), ua3 = pack(U[1][2], U[1][3]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int ir = nt * 8 + gq;
      float O[4];
      mma(O, ua0, ua1, ua2, ua3, ld32(&sm.m[ir][2 * tq]), ld32(&sm.m[ir][2 * tq + 8]), O1[nt]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * tq + (e & 1);
        sm.o[warp][tok][gq + 8 * (e >> 1)] = __float2bfloat16_rn(O[e]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int col = nt * 8 + 2 * tq;
      const float e0 = sm.E[col], e1 = sm.E[col + 1];
      const float cin[4] = {S[nt][0] * e0, S[nt][1] * e1, S[nt][2] * e0, S[nt][3] * e1};
      const int kr = nt * 8 + gq;
      mma(S[nt], ua0, ua1, ua2, ua3, ld32(&sm.krT[kr][2 * tq]), ld32(&sm.krT[kr][2 * tq + 8]), cin);
    }
    __syncwarp();
    {
      const int tok = lane >> 1, half = lane & 1;
      if (tok < nv) {
        const uint4 val = *reinterpret_cast<const uint4*>(&sm.o[warp][tok][8 * half]);
        *reinterpret_cast<uint4*>(p.out + (bos + (long long)c * CH + tok) * hs + hoff + vw + 8 * half) = val;
      }
    }
  }

  // ---- final state
  if (p.ht != nullptr) store_state(S, p, sbase, vw + gq, tq);
}

extern "C" __global__ void __launch_bounds__(64) kda_fwd_w2(const KdaParams p) { kda_fwd_body<2>(p); }
extern "C" __global__ void __launch_bounds__(128) kda_fwd_w4(const KdaParams p) { kda_fwd_body<4>(p); }
