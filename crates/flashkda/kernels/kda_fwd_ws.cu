// KDA forward in two launches through a device workspace (same math and rounding points as
// kda_fwd.cu, so `reference::emulated` covers it).
//
// kda_prep: fully parallel, one block per (16-token chunk slot, head). Everything that does not
// depend on the state (norms, sigmoid(beta), gate cumsum, kd/qd/kr, E, A -> INV, M) is written
// as one 13888-byte record per (slot, head), already in the swizzled shared-memory layout.
// kda_state_w{1,2,4}: the sequential pass. One block = (sequence, head, 16*NW value rows), NW
// warps each holding 16 state rows in fp32 mma accumulators. Per chunk one thread issues TMA bulk
// copies (record + the block's v rows) ST chunks ahead on an mbarrier; warps only do the
// state-dependent matmuls, so the per-chunk critical path is short and 128/(16*NW) blocks per
// chain fill the GPU.
#include "kda_common.cuh"

#define REC_BYTES 13888
#define R_KD 0      // bf16 [16][128], 16-byte chunks xor-swizzled by row & 7
#define R_QD 4096   // bf16 [16][128], same swizzle
#define R_KR 8192   // bf16 krT [128][16], 8-element halves swapped when (row >> 2) & 1
#define R_INV 12288 // bf16 [16][16], half swizzle
#define R_M 12800   // bf16 [16][16], half swizzle
#define R_E 13312   // f32 [128]
#define R_B 13824   // f32 [16]

__device__ __forceinline__ int swz128(int r, int c) { return r * KD + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7); }
__device__ __forceinline__ int swz16(int r, int c) { return r * 16 + ((((c >> 3) ^ ((r >> 2) & 1))) << 3) + (c & 7); }

// Sequence n of the slot space: fixed length -> n * chunks_per_seq; varlen -> cu[n] / 16 + n
// (a sequence of len tokens needs ceil(len/16) slots, and floor(a/16) + ceil(len/16) <=
// floor((a+len)/16) + 1, so slots never overlap; total <= T/16 + N).
struct SeqInfo {
  long long bos, len, slot0;
};

__device__ __forceinline__ long long clamp_cu(const KdaParams& p, int n) {
  long long a = p.cu_seqlens[n];
  return a < 0 ? 0 : (a > p.total_tokens ? p.total_tokens : a);
}

__device__ __forceinline__ SeqInfo seq_info(const KdaParams& p, int n) {
  SeqInfo s;
  if (p.cu_seqlens != nullptr) {
    const long long a = clamp_cu(p, n);
    long long e = clamp_cu(p, n + 1);
    e = e < a ? a : e;
    s.bos = a;
    s.len = e - a;
    s.slot0 = a / CH + n;
  } else if (p.seg_chunks > 0) {
    // segment n of a fixed-length batch: same slots as the unsegmented layout
    const long long cps = (p.seq_len + CH - 1) / CH;
    const long long b = n / p.segs_per_seq, sg = n % p.segs_per_seq;
    const long long off = sg * p.seg_chunks * CH;
    const long long rem = p.seq_len - off;
    const long long sl = (long long)p.seg_chunks * CH;
    s.bos = b * p.seq_len + off;
    s.len = rem < 0 ? 0 : (rem < sl ? rem : sl);
    s.slot0 = b * cps + sg * p.seg_chunks;
  } else {
    const long long cps = (p.seq_len + CH - 1) / CH;
    s.bos = (long long)n * p.seq_len;
    s.len = p.seq_len;
    s.slot0 = (long long)n * cps;
  }
  return s;
}

struct __align__(16) PrepSmem {
  unsigned char rec[REC_BYTES];
  bf16 q[CH][RS];
  bf16 k[CH][RS];
  bf16 g[CH][RS];  // raw g, then ki in place
  float A[CH][CH + 1];
  float rnq[CH];
  float rnk[CH];
};

extern "C" __global__ void __launch_bounds__(128) kda_prep(const KdaParams p) {
  constexpr int NT = 128, NW = 4;
  __shared__ PrepSmem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long slot = blockIdx.x;
  const int h = blockIdx.y;

  // which sequence owns this slot
  int n;
  if (p.cu_seqlens != nullptr) {
    int lo = 0, hi = p.num_seqs - 1;  // largest n with slot0(n) <= slot
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (clamp_cu(p, mid) / CH + mid <= slot) lo = mid; else hi = mid - 1;
    }
    n = lo;
  } else {
    const long long cps = (p.seq_len + CH - 1) / CH;
    n = static_cast<int>(slot / cps);
  }
  const SeqInfo si = seq_info(p, n);
  const long long c = slot - si.slot0;
  if (c < 0 || c * CH >= si.len) return;  // unused slot (block-uniform)
  const long long rem = si.len - c * CH;
  const int nv = rem < CH ? static_cast<int>(rem) : CH;
  const long long t0 = si.bos + c * CH;
  const long long hs = (long long)H * KD;
  const long long hoff = (long long)h * KD;
  const long long qhs = (long long)p.qk_heads * KD;                // GVA: q/k of head h / group
  const long long qhoff = (long long)(h / (H / p.qk_heads)) * KD;

  for (int i = tid; i < 3 * 256; i += NT) {
    const int which = i >> 8, r = (i >> 4) & 15, cc = i & 15;
    const bf16* src = which == 0 ? p.q : (which == 1 ? p.k : p.g);
    bf16* dst = which == 0 ? &sm.q[r][cc * 8] : (which == 1 ? &sm.k[r][cc * 8] : &sm.g[r][cc * 8]);
    const bool ok = r < nv;
    const long long off = which == 2 ? (t0 + r) * hs + hoff : (t0 + r) * qhs + qhoff;
    cp_async16(dst, ok ? src + off + cc * 8 : src, ok ? 16 : 0);
  }
  cp_async_commit();
  const float beta_raw = (tid < nv) ? __bfloat162float(p.beta[(t0 + tid) * H + h]) : 0.f;
  const float exp_a = __expf(p.a_log[h]);
  const float lb2 = p.lower_bound * 1.4426950408889634f;
  const float dtb = p.dt_bias[hoff + tid];
  float* rec_b = reinterpret_cast<float*>(sm.rec + R_B);
  float* rec_e = reinterpret_cast<float*>(sm.rec + R_E);
  bf16* kd = reinterpret_cast<bf16*>(sm.rec + R_KD);
  bf16* qd = reinterpret_cast<bf16*>(sm.rec + R_QD);
  bf16* krT = reinterpret_cast<bf16*>(sm.rec + R_KR);
  bf16* inv = reinterpret_cast<bf16*>(sm.rec + R_INV);
  bf16* mm = reinterpret_cast<bf16*>(sm.rec + R_M);
  cp_async_wait_all();
  __syncthreads();

  // ---- norms, beta sigmoid, gate cumsum (as kda_fwd.cu)
  row_norms<NW>([&](int r) { return r < CH ? &sm.q[r][0] : &sm.k[r - CH][0]; },
                [&](int r, float rn) { if (r < CH) sm.rnq[r] = rn; else sm.rnk[r - CH] = rn; }, warp, lane);
  if (tid < CH) rec_b[tid] = tid < nv ? sigmoidf_(beta_raw) : 0.f;
  float G[CH];
  gate_cumsum(G, sm.g, tid, exp_a, dtb, lb2, nv);
  __syncthreads();  // norms and b visible

  // ---- decayed keys/queries (channel tid): kd, qd, krT into the record, ki in place of g
  {
    const int ch = tid;
    const float gt = G[CH - 1];
    rec_e[ch] = ex2(gt);
    float kv[CH], qv[CH];
    normed_channel(kv, qv, sm.k, sm.q, sm.rnk, sm.rnq, ch, p.scale);
    uint32_t kr[CH / 2];
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const float e = ex2(G[i]);
      kd[swz128(i, ch)] = __float2bfloat16_rn(kv[i] * e);
      qd[swz128(i, ch)] = __float2bfloat16_rn(qv[i] * e);
      sm.g[i][ch] = __float2bfloat16_rn(kv[i] * ex2(-G[i]));
    }
#pragma unroll
    for (int i = 0; i < CH; i += 2)
      kr[i / 2] = pack(kv[i] * ex2(gt - G[i]), kv[i + 1] * ex2(gt - G[i + 1]));
    const int sw = (ch >> 2) & 1;
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * sw]) = make_uint4(kr[0], kr[1], kr[2], kr[3]);
    *reinterpret_cast<uint4*>(&krT[ch * 16 + 8 * (sw ^ 1)]) = make_uint4(kr[4], kr[5], kr[6], kr[7]);
  }
  __syncthreads();  // kd, qd, ki visible

  // ---- A = diag(b) strict_lower(kd ki^T) and INV (warp 0); M (warp 1)
  if (warp < 2) {
    const bool do_a = warp == 0;
    const bf16* lhs = do_a ? kd : qd;
    float acc[2][4];
    tile_product(acc, [&](int r, int cc) { return ld32(&lhs[swz128(r, cc)]); },
                 [&](int r, int cc) { return ld32(&sm.g[r][cc]); }, gq, tq);
    if (do_a) {
      store_a(sm.A, acc, rec_b, gq, tq);
      __syncwarp();
      if (lane < CH)
        invert_column([&](int r, int m) { return sm.A[r][m]; }, lane,
                      [&](int r, int cc, bf16 x) { inv[swz16(r, cc)] = x; });
    } else {
      store_m(acc, [&](int r, int cc, bf16 x) { mm[swz16(r, cc)] = x; }, gq, tq);
    }
  }
  __syncthreads();  // record complete

  uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(p.ws) +
                                        (size_t)(slot * H + h) * REC_BYTES);
  const uint4* src = reinterpret_cast<const uint4*>(sm.rec);
  for (int i = tid; i < REC_BYTES / 16; i += NT) dst[i] = src[i];
}

// ---- mbarrier + TMA bulk copy helpers
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// dynamic shared memory of kda_state_w<NW> (mirrored in launch.rs)
#define STATE_SMEM(NW, ST) ((ST) * (REC_BYTES + CH * 16 * (NW) * 2) + (NW) * CH * TS * 2 + 8 * (ST))

// TRANS (context parallelism, first pass): each segment runs twice from its start, as blocks
// [0, SLICES) with the real v from a zero state (the particular solution P) and as blocks
// [SLICES, 2 SLICES) with v = 0 from the identity (the transition M: S_end = S_start M + P);
// no output; both land in ht as [segment, H, 2, 128, 128] fp32.
template <int NW, int ST, bool TRANS>
__device__ __forceinline__ void state_body(const KdaParams& p) {
  constexpr int VS = 16 * NW;
  constexpr int SLICES = KD / VS;
  constexpr int PARTS = TRANS ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* recs = smem_raw;                                      // [ST][REC_BYTES]
  bf16* vs = reinterpret_cast<bf16*>(smem_raw + ST * REC_BYTES);       // [ST][CH][VS]
  bf16* os = vs + ST * CH * VS;                                        // [NW][CH][TS]
  uint64_t* bars = reinterpret_cast<uint64_t*>(os + NW * CH * TS);     // [ST]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long bid = blockIdx.x;
  const int slice = static_cast<int>(bid % SLICES);
  const int part = static_cast<int>((bid / SLICES) % PARTS);  // 1: the transition M
  const int h = static_cast<int>((bid / (SLICES * PARTS)) % H);
  const int n = static_cast<int>(bid / (SLICES * PARTS * (long long)H));
  const SeqInfo si = seq_info(p, n);
  const long long bos = si.bos, len = si.len;
  const int v0 = slice * VS;
  const int vw = v0 + warp * 16;
  const long long hs = (long long)H * KD;
  const long long hoff = (long long)h * KD;
  const int nchunks = static_cast<int>((len + CH - 1) / CH);
  const unsigned char* ws = reinterpret_cast<const unsigned char*>(p.ws);

  auto nvalid = [&](int c) -> int {
    const long long rem = len - (long long)c * CH;
    return rem < CH ? static_cast<int>(rem) : CH;
  };
  // one thread: record + the block's v rows of chunk c into stage c % ST
  auto issue = [&](int c) {
    const int st = c % ST, nv = nvalid(c);
    const uint32_t bar = smem_u32(&bars[st]);
    const bool with_v = part == 0;
    mbar_expect_tx(bar, REC_BYTES + (with_v ? nv * VS * 2 : 0));
    bulk_g2s(smem_u32(recs + st * REC_BYTES), ws + (size_t)((si.slot0 + c) * H + h) * REC_BYTES, REC_BYTES, bar);
    const long long t0 = bos + (long long)c * CH;
    if (with_v)
      for (int r = 0; r < nv; ++r)
      bulk_g2s(smem_u32(vs + (st * CH + r) * VS), p.v + (t0 + r) * hs + hoff + v0, VS * 2, bar);
  };

  if (tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(smem_u32(&bars[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int c = 0; c < ST && c < nchunks; ++c) issue(c);

  float S[16][4];
  const size_t sbase = (((size_t)n * H + h) * PARTS + part) * KD * KD;
  if (TRANS) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int col = nt * 8 + 2 * tq, r0 = vw + gq;
      const float one = part == 1 ? 1.f : 0.f;
      S[nt][0] = r0 == col ? one : 0.f;
      S[nt][1] = r0 == col + 1 ? one : 0.f;
      S[nt][2] = r0 + 8 == col ? one : 0.f;
      S[nt][3] = r0 + 8 == col + 1 ? one : 0.f;
    }
  } else {
    load_state(S, p, sbase, vw + gq, tq);
  }

  bf16(*ow)[TS] = reinterpret_cast<bf16(*)[TS]>(os + warp * CH * TS);
  for (int c = 0; c < nchunks; ++c) {
    const int st = c % ST, nv = nvalid(c);
    mbar_wait(smem_u32(&bars[st]), static_cast<uint32_t>((c / ST) & 1));
    const unsigned char* rec = recs + st * REC_BYTES;
    const bf16* kd = reinterpret_cast<const bf16*>(rec + R_KD);
    const bf16* qd = reinterpret_cast<const bf16*>(rec + R_QD);
    const bf16* krT = reinterpret_cast<const bf16*>(rec + R_KR);
    const bf16* inv = reinterpret_cast<const bf16*>(rec + R_INV);
    const bf16* mm = reinterpret_cast<const bf16*>(rec + R_M);
    const float* E = reinterpret_cast<const float*>(rec + R_E);
    const float* b = reinterpret_cast<const float*>(rec + R_B);
    const bf16* vst = vs + st * CH * VS;

    // W^T = S kd^T, O1^T = S qd^T (value rows x tokens), S rounded to bf16
    float W[2][4], O1[2][4];
    state_products(W, O1, S, [&](int r, int cc) { return ld32(&kd[swz128(r, cc)]); },
                   [&](int r, int cc) { return ld32(&qd[swz128(r, cc)]); }, gq, tq);

    // Vb = bf16((v - W) b) (pad tokens selected to 0: their v rows are stale); U = INV Vb
    const int vl = warp * 16 + gq;
    float vb[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * tq + (e & 1);
        const float vv = part == 0 ? __bfloat162float(vst[tok * VS + vl + 8 * (e >> 1)]) : 0.f;
        vb[nt][e] = tok < nv ? (vv - W[nt][e]) * b[tok] : 0.f;
      }
    uint32_t va[4], ua[4];
    pack_tile(va, vb);
    float U[2][4];
    solve_u(U, va, [&](int r, int cc) { return ld32(&inv[swz16(r, cc)]); }, gq, tq);
    pack_tile(ua, U);
    // out = O1 + M U
    if (!TRANS) out_tile(ow, ua, [&](int r, int cc) { return ld32(&mm[swz16(r, cc)]); }, O1, gq, tq);
    // S = S diag(E) + U^T kr
    update_state(S, ua, E, [&](int r, int cc) { return ld32(&krT[swz16(r, cc)]); }, gq, tq);
    __syncwarp();
    if (!TRANS) store_out(p, ow, bos + (long long)c * CH, nv, hs, hoff, vw, lane);
    // every warp is done with stage st (and with its o tile): refill it ST chunks ahead
    if (NW > 1) __syncthreads(); else __syncwarp();
    if (tid == 0 && c + ST < nchunks) issue(c + ST);
  }

  if (p.ht != nullptr) store_state(S, p, sbase, vw + gq, tq);
}

// Context-parallel scan: S_start(segment 0) = h0 (or 0), S_start(s + 1) = S_start(s) M_s + P_s,
// in fp32, for SCAN_ROWS value rows of one (sequence, head) per block; writes every segment's
// start state (fp32, read by the second state pass) and the final state (ht, in its dtype).
struct ScanParams {
  const float* pm;   // [B * segs, H, 2, 128, 128]: P then M
  float* starts;     // [B * segs, H, 128, 128]
  const void* h0;    // [B, H, 128, 128] or null
  void* ht;          // [B, H, 128, 128] or null
  int state_fp32;
  int num_heads;
  int segs;
};

#define SCAN_ROWS 16
// dynamic shared memory of kda_cp_scan: M and P rows of two segments (double buffer) + the rows
#define SCAN_SMEM ((2 * (KD * KD + SCAN_ROWS * KD) + SCAN_ROWS * KD) * 4)
extern "C" __global__ void __launch_bounds__(256) kda_cp_scan(const ScanParams p) {
  extern __shared__ __align__(16) float scan_smem[];
  float* mbuf = scan_smem;                          // [2][KD][KD]
  float* pbuf = mbuf + 2 * KD * KD;                 // [2][SCAN_ROWS][KD]
  float (*srow)[KD] = reinterpret_cast<float (*)[KD]>(pbuf + 2 * SCAN_ROWS * KD);
  constexpr int RPT = SCAN_ROWS / 2;  // rows per thread
  const int tid = threadIdx.x, c = tid & (KD - 1), rg = tid >> 7;
  const int H = p.num_heads;
  const int bh = blockIdx.x, h = bh % H, b = bh / H;
  const int rowb = blockIdx.y * SCAN_ROWS;
  const int row0 = rowb + rg * RPT;
  const size_t hd2 = (size_t)KD * KD;
  // M_s and this block's rows of P_s into buffer s & 1 (16-byte cp.async, all threads)
  auto prefetch = [&](int s) {
    const size_t seg = (size_t)b * p.segs + s;
    const float* P = p.pm + ((seg * H + h) * 2) * hd2;
    const float* M = P + hd2;
    float* md = mbuf + (s & 1) * KD * KD;
    float* pd = pbuf + (s & 1) * SCAN_ROWS * KD;
    for (int i = tid; i < KD * KD / 4; i += 256) cp_async16(md + 4 * i, M + 4 * i, 16);
    for (int i = tid; i < SCAN_ROWS * KD / 4; i += 256) cp_async16(pd + 4 * i, P + (size_t)rowb * KD + 4 * i, 16);
    cp_async_commit();
  };
  const int last = p.ht == nullptr ? p.segs - 1 : p.segs;  // steps that need M and P
  if (last > 0) prefetch(0);
  float acc[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const size_t i = (size_t)bh * hd2 + (size_t)(row0 + r) * KD + c;
    if (p.h0 == nullptr) acc[r] = 0.f;
    else if (p.state_fp32) acc[r] = static_cast<const float*>(p.h0)[i];
    else acc[r] = __bfloat162float(static_cast<const bf16*>(p.h0)[i]);
  }
  for (int s = 0; s < p.segs; ++s) {
    const size_t seg = (size_t)b * p.segs + s;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      p.starts[(seg * H + h) * hd2 + (size_t)(row0 + r) * KD + c] = acc[r];
      srow[rg * RPT + r][c] = acc[r];
    }
    if (s >= last) break;
    cp_async_wait_all();
    __syncthreads();  // buffer s & 1 and srow visible; buffer (s + 1) & 1 free
    if (s + 1 < last) prefetch(s + 1);
    const float* md = mbuf + (s & 1) * KD * KD;
    const float* pd = pbuf + (s & 1) * SCAN_ROWS * KD;
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r] = pd[(rg * RPT + r) * KD + c];
#pragma unroll 16
    for (int k = 0; k < KD; ++k) {
      const float m = md[k * KD + c];
#pragma unroll
      for (int r = 0; r < RPT; ++r) acc[r] = fmaf(srow[rg * RPT + r][k], m, acc[r]);
    }
    __syncthreads();  // srow and buffer s & 1 reused next step
  }
  if (p.ht != nullptr) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const size_t i = (size_t)bh * hd2 + (size_t)(row0 + r) * KD + c;
      if (p.state_fp32) static_cast<float*>(p.ht)[i] = acc[r];
      else static_cast<bf16*>(p.ht)[i] = __float2bfloat16_rn(acc[r]);
    }
  }
}
static_assert(SCAN_SMEM == 155648, "update launch.rs");

static_assert(STATE_SMEM(1, 2) == 29584, "update launch.rs");
static_assert(STATE_SMEM(2, 4) == 61216, "update launch.rs");
static_assert(STATE_SMEM(4, 4) == 66848, "update launch.rs");
static_assert(STATE_SMEM(4, 3) == 50904, "update launch.rs");
extern "C" __global__ void __launch_bounds__(32) kda_state_w1(const KdaParams p) { state_body<1, 2, false>(p); }
extern "C" __global__ void __launch_bounds__(64) kda_state_w2(const KdaParams p) { state_body<2, 4, false>(p); }
extern "C" __global__ void __launch_bounds__(128) kda_state_w4(const KdaParams p) { state_body<4, 4, false>(p); }
extern "C" __global__ void __launch_bounds__(128) kda_cp_transition_w4(const KdaParams p) { state_body<4, 4, true>(p); }
// 3 stages: 4 blocks fit one SM's shared memory (the segmented passes run many blocks per SM)
extern "C" __global__ void __launch_bounds__(128, 4) kda_cp_transition_w4s3(const KdaParams p) { state_body<4, 3, true>(p); }
extern "C" __global__ void __launch_bounds__(128, 4) kda_cp_state_w4s3(const KdaParams p) { state_body<4, 3, false>(p); }
