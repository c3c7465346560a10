// KDA backward (issue 13): gradients of <dout, out> + <dht, final_state> with respect to q, k, v, the
// raw gate g, the beta logits, A_log, dt_bias and the initial state (the math of
// `reference::recurrence_grad_f64`, in fp32).
//
// The value rows of the state are independent chains (row i of S only meets v[i], dout[i] and the
// shared q, k, alpha, beta), so `kda_bwd_rows` gives each warp one row (4 key channels per lane, fp32)
// and each block 16 rows of one (sequence, head). It walks the sequence forward once, saving the row
// every CK (16 or 64) tokens in the workspace (checkpoints), then walks the chunks backwards: from a chunk's
// checkpoint it recomputes the 16-token sub-chunk starts (registers), then per sub-chunk the state
// before every token (registers), and runs the token backward in reverse. The sums over value rows
// (d q_hat, d k_hat, d alpha per channel, d beta per token) go through shared-memory atomics per
// sub-chunk and then global fp32 atomics into the workspace; `kda_bwd_finish` turns them into the
// input gradients (L2-norm backward, fused gate chain, beta sigmoid) and reduces dA_log, ddt_bias.
//
// Bytes saved for backward: none beyond the forward's inputs (the states are recomputed).
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

// Mirrored by `BwdKernelParams` in src/launch/bwd.rs (size checked by a test there).
struct KdaBwdParams {
  const bf16* q;        // [T, Hqk, 128]
  const bf16* k;
  const bf16* v;        // [T, H, 128]
  const bf16* g;
  const bf16* beta;     // [T, H] logits
  const float* a_log;   // [H]
  const float* dt_bias; // [H, 128]
  const void* h0;       // [N, H, 128, 128] or null (zeros)
  const long long* cu_seqlens;
  const bf16* dout;     // [T, H, 128]
  const void* dht;      // [N, H, 128, 128] or null (zeros)
  bf16* dq;             // [T, Hqk, 128]
  bf16* dk;
  bf16* dv;             // [T, H, 128]
  bf16* dg;
  bf16* dbeta;          // [T, H]
  float* da_log;        // [H], zeroed by the launcher
  float* ddt_bias;      // [H, 128], zeroed by the launcher
  void* dh0;            // [N, H, 128, 128] or null
  float* ckpt;          // workspace: [slots, H, 128, 128] row checkpoints
  float* acc;           // workspace: [T, H, ACC_W] row sums (zeroed by the launcher)
  long long seq_len;
  long long total_tokens;
  int num_heads;
  int qk_heads;
  int num_seqs;
  int state_fp32;       // h0 / dht (the forward's states)
  int dh0_fp32;
  float scale;
  float lower_bound;
  int pad_;
};

#define KD 128
#ifndef KDA_BWD_SUB
#define KDA_BWD_SUB 16
#endif
#define SUB KDA_BWD_SUB  // tokens per sub-chunk (states kept in registers): 16, or 8 (kda_bwd_s8.cu)
#define MIN_BLOCKS (SUB == 8 ? 2 : 1)  // 8: 64 registers, two blocks per SM
#define ROWS 16         // value rows (warps) per block
#define ACC_W (3 * KD + 4)  // per token: dqh[128], dkh[128], dalpha[128], dbeta_raw, 3 pad (float4 rows)

__device__ __forceinline__ void seq_range(const KdaBwdParams& p, int n, long long& bos, long long& len) {
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
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + __expf(-x)); }

// Lane l holds channels l, l + 32, l + 64, l + 96 (conflict-free shared memory, coalesced global).
__device__ __forceinline__ void load4(float (&x)[4], const bf16* p) {
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = __bfloat162float(p[32 * e]);
}

__device__ __forceinline__ void load_state4(float (&x)[4], const void* base, int fp32, size_t off) {
  if (base == nullptr) {
    x[0] = x[1] = x[2] = x[3] = 0.f;
  } else if (fp32) {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = static_cast<const float*>(base)[off + 32 * e];
  } else {
    load4(x, static_cast<const bf16*>(base) + off);
  }
}

// Shared memory of one block: the staged sub-chunk and the row sums.
struct BwdSmem {
  float kh[SUB][KD];     // normalised k
  float qh[SUB][KD];     // normalised q
  float al[SUB][KD];     // alpha = exp(lb * sigmoid(a (g + dt_bias)))
  float beta[SUB];       // sigmoid(beta logit)
  float v[SUB][ROWS];    // this block's value rows
  float dout[SUB][ROWS];
  // per-warp (row) contributions of two tokens, summed over the rows by plain loads (float
  // atomics on shared memory are compare-and-swap loops, slow under contention)
  __align__(16) float part[2][ROWS][ACC_W];
};

static_assert(sizeof(BwdSmem) == (3 * SUB * KD + SUB + 2 * SUB * ROWS + 2 * ROWS * ACC_W) * 4,
              "rows_smem_bytes in src/launch/bwd.rs");

// Warp w prepares token t0 + w of the sub-chunk (nt tokens; the rest zero: alpha 1, k 0, beta 0,
// which leaves the state unchanged).
__device__ __forceinline__ void stage(BwdSmem& s, const KdaBwdParams& p, long long t0, int nt, int h, int row0,
                                      int warp, int lane) {
  for (int i = warp; i < SUB; i += ROWS) {
    const int c = lane;
    if (i < nt) {
      const long long t = t0 + i;
      const int hq = h / (p.num_heads / p.qk_heads);
      float q[4], k[4], g[4];
      load4(q, p.q + (t * p.qk_heads + hq) * KD + c);
      load4(k, p.k + (t * p.qk_heads + hq) * KD + c);
      load4(g, p.g + (t * p.num_heads + h) * KD + c);
      float sq = warp_sum(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3]);
      float sk = warp_sum(k[0] * k[0] + k[1] * k[1] + k[2] * k[2] + k[3] * k[3]);
      const float rq = 1.f / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
      const float a = expf(p.a_log[h]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s.qh[i][c + 32 * j] = q[j] * rq;
        s.kh[i][c + 32 * j] = k[j] * rk;
        const float x = a * (g[j] + p.dt_bias[h * KD + c + 32 * j]);
        s.al[i][c + 32 * j] = expf(p.lower_bound * sigm(x));
      }
      if (lane == 0) s.beta[i] = sigm(__bfloat162float(p.beta[t * p.num_heads + h]));
      if (lane < ROWS) {
        s.v[i][lane] = __bfloat162float(p.v[(t * p.num_heads + h) * KD + row0 + lane]);
        s.dout[i][lane] = p.dout == nullptr ? 0.f : __bfloat162float(p.dout[(t * p.num_heads + h) * KD + row0 + lane]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s.qh[i][c + 32 * j] = 0.f;
        s.kh[i][c + 32 * j] = 0.f;
        s.al[i][c + 32 * j] = 1.f;
      }
      if (lane == 0) s.beta[i] = 0.f;
      if (lane < ROWS) { s.v[i][lane] = 0.f; s.dout[i][lane] = 0.f; }
    }
  }
}

// One token forward on a row: S = S * alpha; pred = S.k; u = beta (v - pred); S += u k. Returns pred.
__device__ __forceinline__ float fwd_token(float (&S)[4], const BwdSmem& s, int i, int r, int c) {
  float k[4], part = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    k[e] = s.kh[i][c + 32 * e];
    S[e] *= s.al[i][c + 32 * e];
    part += S[e] * k[e];
  }
  const float pred = warp_sum(part);
  const float u = s.beta[i] * (s.v[i][r] - pred);
#pragma unroll
  for (int e = 0; e < 4; ++e) S[e] += u * k[e];
  return pred;
}

// CK: tokens per checkpoint (16: the sub-chunk starts are the checkpoints; 64: 4x less workspace,
// the sub-chunk starts recomputed from each checkpoint).
template <int CK>
__device__ __forceinline__ void rows_body(const KdaBwdParams& p) {
  constexpr int NSUB = CK / SUB;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdSmem& s = *reinterpret_cast<BwdSmem*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chain = blockIdx.x;  // sequence * H + head
  const int n = chain / p.num_heads, h = chain % p.num_heads;
  const int row0 = blockIdx.y * ROWS;
  const int r = warp, vi = row0 + warp;  // this warp's row
  const int c = lane;
  long long bos, len;
  seq_range(p, n, bos, len);
  const size_t hd2 = (size_t)KD * KD;
  const size_t sbase = ((size_t)n * p.num_heads + h) * hd2 + (size_t)vi * KD + c;
  const long long nck = (len + CK - 1) / CK;
  const long long slot0 = bos / CK + n;
  for (int e = threadIdx.x; e < 2 * ROWS * ACC_W; e += blockDim.x) (&s.part[0][0][0])[e] = 0.f;

  // 1. forward, saving the row at the start of every CK-token chunk
  float S[4];
  load_state4(S, p.h0, p.state_fp32, sbase);
  for (long long j = 0; j < nck; ++j) {
    float* ck = p.ckpt + ((size_t)(slot0 + j) * p.num_heads + h) * hd2 + (size_t)vi * KD + c;
#pragma unroll
    for (int e = 0; e < 4; ++e) ck[32 * e] = S[e];
    if (j == nck - 1) break;  // the last chunk's end state is not needed
    for (int sc = 0; sc < NSUB; ++sc) {
      const long long t0 = bos + j * CK + sc * SUB;
      __syncthreads();
      stage(s, p, t0, SUB, h, row0, warp, lane);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < SUB; ++i) fwd_token(S, s, i, r, c);
    }
  }

  // 2. backward over the chunks in reverse
  float dS[4];
  load_state4(dS, p.dht, p.state_fp32, sbase);
  const float scale = p.scale;
  for (long long j = nck - 1; j >= 0; --j) {
    const long long cs = bos + j * CK;
    const long long clen = (len - j * CK) < CK ? (len - j * CK) : CK;
    const int nsub = (int)((clen + SUB - 1) / SUB);
    const float* ck = p.ckpt + ((size_t)(slot0 + j) * p.num_heads + h) * hd2 + (size_t)vi * KD + c;
    float starts[NSUB][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) S[e] = ck[32 * e];
#pragma unroll
    for (int sc = 0; sc < NSUB; ++sc) {
#pragma unroll
      for (int e = 0; e < 4; ++e) starts[sc][e] = S[e];
      if (sc + 1 < nsub) {
        __syncthreads();
        stage(s, p, cs + sc * SUB, SUB, h, row0, warp, lane);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < SUB; ++i) fwd_token(S, s, i, r, c);
      }
    }
#pragma unroll
    for (int sc = NSUB - 1; sc >= 0; --sc) {
      if (sc >= nsub) continue;
      const long long t0 = cs + sc * SUB;
      const int nt = (int)((clen - sc * SUB) < SUB ? (clen - sc * SUB) : SUB);
      __syncthreads();
      stage(s, p, t0, nt, h, row0, warp, lane);
      __syncthreads();
      // states before every token, and the predictions
      float S0[SUB][4], pred[SUB];
#pragma unroll
      for (int e = 0; e < 4; ++e) S[e] = starts[sc][e];
#pragma unroll
      for (int i = 0; i < SUB; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) S0[i][e] = S[e];
        pred[i] = fwd_token(S, s, i, r, c);
      }
      // token backward in reverse (padded tokens: alpha 1, k 0, beta 0, dout 0 leave dS unchanged)
#pragma unroll
      for (int i = SUB - 1; i >= 0; --i) {
        const float al[4] = {s.al[i][c], s.al[i][c + 32], s.al[i][c + 64], s.al[i][c + 96]};
        const float k[4] = {s.kh[i][c], s.kh[i][c + 32], s.kh[i][c + 64], s.kh[i][c + 96]};
        const float q[4] = {s.qh[i][c], s.qh[i][c + 32], s.qh[i][c + 64], s.qh[i][c + 96]};
        const float b = s.beta[i], res = s.v[i][r] - pred[i], u = b * res, od = scale * s.dout[i][r];
        float s1[4], dqh[4], dkh[4], dal[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s1[e] = S0[i][e] * al[e];
          dqh[e] = od * (s1[e] + u * k[e]);
          dS[e] += od * q[e];
        }
        const float du = warp_sum(dS[0] * k[0] + dS[1] * k[1] + dS[2] * k[2] + dS[3] * k[3]);
        const float dp = -b * du;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dkh[e] = u * dS[e] + dp * s1[e];
          const float ds1 = dS[e] + dp * k[e];
          dal[e] = ds1 * S0[i][e];
          dS[e] = ds1 * al[e];
        }
        const bool live = i < nt;  // padded tokens contribute nothing
        float* part = s.part[i & 1][warp];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          part[c + 32 * e] = live ? dqh[e] : 0.f;
          part[KD + c + 32 * e] = live ? dkh[e] : 0.f;
          part[2 * KD + c + 32 * e] = live ? dal[e] : 0.f;
        }
        if (lane == 0) {
          part[3 * KD] = live ? du * res : 0.f;
          if (live) p.dv[((t0 + i) * p.num_heads + h) * KD + vi] = __float2bfloat16(b * du);
        }
        if ((i & 1) == 0) {
          // tokens i and i + 1: sum the rows' contributions, one float4 global atomic each
          __syncthreads();
          for (int e = threadIdx.x; e < 2 * (ACC_W / 4); e += blockDim.x) {
            const int tk = i + e / (ACC_W / 4), f = 4 * (e % (ACC_W / 4));
            if (tk < nt) {
              float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
              for (int w = 0; w < ROWS; ++w) {
                const float4 x = *reinterpret_cast<const float4*>(&s.part[tk & 1][w][f]);
                sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
              }
              atomicAdd(reinterpret_cast<float4*>(p.acc + ((t0 + tk) * p.num_heads + h) * ACC_W + f), sum);
            }
          }
          __syncthreads();
        }
      }
    }
  }
  if (p.dh0 != nullptr) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (p.dh0_fp32) {
        static_cast<float*>(p.dh0)[sbase + 32 * e] = dS[e];
      } else {
        static_cast<bf16*>(p.dh0)[sbase + 32 * e] = __float2bfloat16(dS[e]);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(ROWS * 32, MIN_BLOCKS) kda_bwd_rows_c16(KdaBwdParams p) { rows_body<16>(p); }
extern "C" __global__ void __launch_bounds__(ROWS * 32, MIN_BLOCKS) kda_bwd_rows_c64(KdaBwdParams p) { rows_body<64>(p); }

#define FIN_TOK 64  // tokens per kda_bwd_finish block

__device__ __forceinline__ float block_sum128(float x, float* red) {
  x = warp_sum(x);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  return red[0] + red[1] + red[2] + red[3];
}

// Grid (token blocks, q/k heads), 128 threads (one per channel): dq, dk (L2-norm backward of the
// row sums, summed over the value heads of a GVA group), dg, dbeta, and this block's share of
// ddt_bias and dA_log.
extern "C" __global__ void __launch_bounds__(128) kda_bwd_finish(KdaBwdParams p) {
  __shared__ float red[4];
  const int c = threadIdx.x;
  const int hq = blockIdx.y;
  const int group = p.num_heads / p.qk_heads;
  const long long t_begin = (long long)blockIdx.x * FIN_TOK;
  const long long t_end = t_begin + FIN_TOK < p.total_tokens ? t_begin + FIN_TOK : p.total_tokens;
  const float lb = p.lower_bound;
  float ddtb[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // group <= 8 kept in registers
  float dal_log[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (long long t = t_begin; t < t_end; ++t) {
    float dqh = 0.f, dkh = 0.f;
    for (int gi = 0; gi < group; ++gi) {
      const int h = hq * group + gi;
      const float* a = p.acc + (t * p.num_heads + h) * ACC_W;
      dqh += a[c];
      dkh += a[KD + c];
      const float ea = expf(p.a_log[h]);
      const float x = ea * (__bfloat162float(p.g[(t * p.num_heads + h) * KD + c]) + p.dt_bias[h * KD + c]);
      const float sg = sigm(x);
      const float alpha = expf(lb * sg);
      const float dx = a[2 * KD + c] * alpha * lb * sg * (1.f - sg);
      p.dg[(t * p.num_heads + h) * KD + c] = __float2bfloat16(dx * ea);
      if (gi < 8) {
        ddtb[gi] += dx * ea;
        dal_log[gi] += dx * x;
      } else {
        atomicAdd(&p.ddt_bias[h * KD + c], dx * ea);
        atomicAdd(&p.da_log[h], dx * x);
      }
      if (c == 0) {
        const float b = sigm(__bfloat162float(p.beta[t * p.num_heads + h]));
        p.dbeta[t * p.num_heads + h] = __float2bfloat16(a[3 * KD] * b * (1.f - b));
      }
    }
    const size_t qo = ((size_t)t * p.qk_heads + hq) * KD + c;
    const float q = __bfloat162float(p.q[qo]), k = __bfloat162float(p.k[qo]);
    const float sq = block_sum128(q * q, red), dq_dot = block_sum128(q * dqh, red);
    const float sk = block_sum128(k * k, red), dk_dot = block_sum128(k * dkh, red);
    const float rq = 1.f / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
    p.dq[qo] = __float2bfloat16(rq * dqh - q * rq * rq * rq * dq_dot);
    p.dk[qo] = __float2bfloat16(rk * dkh - k * rk * rk * rk * dk_dot);
  }
  for (int gi = 0; gi < group && gi < 8; ++gi) {
    const int h = hq * group + gi;
    atomicAdd(&p.ddt_bias[h * KD + c], ddtb[gi]);
    const float s = block_sum128(dal_log[gi], red);
    if (c == 0) atomicAdd(&p.da_log[h], s);
  }
}
