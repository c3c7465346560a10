// kda_bwd_chunk.cu, launches 4 and 5: the per-chunk gradients and the finish.
#pragma once

// hi + lo bf16 fragments of fp32 values: a product of two split operands is three mma (lo lo dropped).
__device__ __forceinline__ void split2(uint32_t& hi, uint32_t& lo, float x0, float x1) {
  hi = pack(x0, x1);
  lo = pack(lo_of(x0), lo_of(x1));
}

// A fragments (m = row, k = column) of a 16 x 16 fp32 tile read as f(row, col).
template <class F>
__device__ __forceinline__ void afrag16(uint32_t (&hi)[4], uint32_t (&lo)[4], F f, int gq, int tq) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = gq + 8 * (r & 1), col = 2 * tq + 8 * (r >> 1);
    split2(hi[r], lo[r], f(row, col), f(row, col + 1));
  }
}

// acc += A B with A, B both split (3 mma).
__device__ __forceinline__ void mma3(float (&acc)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                     uint32_t bh0, uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma(acc, ah[0], ah[1], ah[2], ah[3], bh0, bh1, acc);
  mma(acc, ah[0], ah[1], ah[2], ah[3], bl0, bl1, acc);
  mma(acc, al[0], al[1], al[2], al[3], bh0, bh1, acc);
}

// [16][128] bf16 tiles with swizzled 16-byte units (unit u of row r at u ^ zs(r)): conflict-free for 4-byte
// [gq][2tq] accesses and for the two rows' 16-byte reads of a quarter warp.
__device__ __forceinline__ int zs(int r) { return (r & 7) ^ ((r & 1) << 2); }
__device__ __forceinline__ int zi(int r, int c) { return r * KD + (((c >> 3) ^ zs(r)) << 3) + (c & 7); }
// [16][16] fp32 tiles, columns swizzled by 8 on row bit 1: conflict-free 8-byte [gq][2tq] and [i][j] accesses.
__device__ __forceinline__ int fz(int r, int c) { return r * CH + (c ^ (((r >> 1) & 1) << 3)); }

// A fragments of a swizzled 16 x 16 fp32 tile (8-byte loads).
__device__ __forceinline__ void afrag16z(uint32_t (&hi)[4], uint32_t (&lo)[4], const float* m, int gq, int tq) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float2 v = *reinterpret_cast<const float2*>(m + fz(gq + 8 * (r & 1), 2 * tq + 8 * (r >> 1)));
    split2(hi[r], lo[r], v.x, v.y);
  }
}

struct __align__(16) ChunkSmem {
  // [token][value row] (zi): dU (hi), Wr, dU (lo); dO, dv, U hi, U lo (U = X diag(b) Wr split once: its bf16
  // rounding costs dg accuracy)
  bf16 t[3][CH * KD];
  bf16 z[4][CH * KD];
  bf16 raw[3][CH * KD];  // q, k, g of the chunk (zi)
  float G[CH][FS];      // cumulative log2 decay
  float qgm[CH][FS];    // q_hat scale 2^(G - Gm), Gm = G of token 7 (halves the exponent range)
  float kgm[CH][FS];    // k_hat 2^(G - Gm)
  float kim[CH][FS];    // k_hat 2^(Gm - G)
  float dgs[CH][FS];    // d G per token (until phase D: Wr's lo part, bf16 zi)
  float am[CH][CH + 1]; // A = strict_lower(k k^T decayed), unscaled by b
  float x[CH][CH + 1];  // X = (I + diag(b) A)^-1
  float xb[CH * CH];    // X diag(b), fz
  float dm[CH * CH];    // dM (j <= i), fz
  float dt[CH][CH + 1]; // dT, then dX
  float y[CH][CH + 1];  // X^T dX
  float da[CH * CH];    // dA (l < j), fz
  float tp[CH][CH + 1]; // products summed into db
  float tp2[CH][CH + 1];
  float pb[2][8][CH * CH];  // per-warp partial 16 x 16 products (A; dM and dT), fz
  float dgn[KD];        // d G of the chunk's last token from the end state
  float dot[8][CH][2];  // per warp: q . dq_hat, k . dk_hat of each token
  float b[CH], db[CH], rq[CH], rk[CH], pal[8];
};

#define CHUNK_SMEM 111008
static_assert(sizeof(ChunkSmem) == CHUNK_SMEM, "chunk_smem_bytes in src/launch/bwd.rs");

extern "C" __global__ void __launch_bounds__(256, 2) kdab_chunk(const KdaBwdParams p) {
  extern __shared__ __align__(16) unsigned char chunk_raw[];
  ChunkSmem& s = *reinterpret_cast<ChunkSmem*>(chunk_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int H = p.num_heads;
  const long long slot = blockIdx.x / H;
  const int h = (int)(blockIdx.x % H);
  int n;
  if (p.cu_seqlens != nullptr) {
    int lo = 0, hi = p.num_seqs - 1;  // largest n with slot0(n) <= slot
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (clamp_cu(p, mid) / CH + mid <= slot) lo = mid; else hi = mid - 1;
    }
    n = lo;
  } else {
    n = (int)(slot / ((p.seq_len + CH - 1) / CH));
  }
  long long bos, len, slot0;
  bseq(p, n, bos, len, slot0);
  const long long c = slot - slot0;
  const size_t sh = (size_t)slot * H + h;
  if (c < 0 || c * CH >= len) {  // unused slot (block-uniform): no partial sums
    if (p.fused && tid < PART_W) p.part[sh * PART_W + tid] = 0.f;
    return;
  }
  const long long rem = len - c * CH;
  const int nv = rem < CH ? (int)rem : CH;
  const bool last = rem <= CH;  // the sequence's last chunk
  const long long t0 = bos + c * CH;
  const long long hs = (long long)H * KD, qhs = (long long)p.qk_heads * KD;
  const int hq = h / (H / p.qk_heads);

  bf16* wrlo = reinterpret_cast<bf16*>(&s.dgs[0][0]);
  // ---- loads: thread (r, cc) = (tid / 16, tid % 16) copies 16 bytes of row r of each of the 9 tiles
  {
    const bf16* wu = p.wu + sh * 4 * CH * KD;
    const int r = tid >> 4, cc = (tid & 15) * 8;
    const bool ok = r < nv;
    const long long to = (t0 + r) * hs + (long long)h * KD + cc, tq_ = (t0 + r) * qhs + (long long)hq * KD + cc;
    cp_async16(&s.z[0][zi(r, cc)], ok ? p.dout + to : p.q, ok ? 16 : 0);
    cp_async16(&s.t[0][zi(r, cc)], wu + (CH + r) * KD + cc, 16);
    cp_async16(&s.z[1][zi(r, cc)], ok ? p.dv + to : p.q, ok ? 16 : 0);
    cp_async16(&s.t[1][zi(r, cc)], wu + r * KD + cc, 16);
    cp_async16(&s.raw[0][zi(r, cc)], ok ? p.q + tq_ : p.q, ok ? 16 : 0);
    cp_async16(&s.raw[1][zi(r, cc)], ok ? p.k + tq_ : p.q, ok ? 16 : 0);
    cp_async16(&s.raw[2][zi(r, cc)], ok ? p.g + to : p.q, ok ? 16 : 0);
    cp_async16(&s.t[2][zi(r, cc)], wu + (2 * CH + r) * KD + cc, 16);
    cp_async16(&wrlo[zi(r, cc)], wu + (3 * CH + r) * KD + cc, 16);
    cp_async_commit();
  }
  // the transposed states (B fragments of the products over the value rows) into L2 now
  const bf16* s0t = p.sst + sh * KD * KD;
  const bf16* dst_ = p.dss + sh * KD * KD;
  for (int i = tid; i < 2 * KD * KD * 2 / 128; i += 256) {
    const char* a = reinterpret_cast<const char*>(i < KD * KD * 2 / 128 ? s0t : dst_) + (i % (KD * KD * 2 / 128)) * 128;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
  }
  cp_async_wait_all();
  __syncthreads();

  // ---- norms (the four rows of a warp interleaved), b, gate cumsum and the decayed rows (fp32)
  {
    row_norms<8>([&](int r) { return &s.raw[r < CH ? 0 : 1][(r & 15) * KD]; },
                 [&](int r, float rn) { (r < CH ? s.rq : s.rk)[r & 15] = rn; }, warp, lane);
    if (tid < CH) s.b[tid] = tid < nv ? sigmoidf_(__bfloat162float(p.beta[(t0 + tid) * H + h])) : 0.f;
  }
  __syncthreads();
  {  // channel tid % 128, tokens [8 hf, 8 hf + 8) with hf = tid / 128 (warp-uniform); both halves sum the
     // first 8 gates (G_7)
    const int ch = tid & (KD - 1), hf = tid >> 7;
    const float exp_a = __expf(p.a_log[h]), dtb = p.dt_bias[h * KD + ch];
    const float lb2 = p.lower_bound * 1.4426950408889634f;
    float G[8], acc = 0.f, gm = 0.f;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      if (i == 8 && hf == 0) break;
      const float gam = lb2 * sigmoidf_(exp_a * (__bfloat162float(s.raw[2][zi(i, ch)]) + dtb));
      acc += i < nv ? gam : 0.f;
      if (i == 7) gm = acc;
      if (i < 8) G[i] = acc;
      else G[i - 8] = acc;
    }
#pragma unroll
    for (int ii = 0; ii < 8; ++ii) {
      const int i = 8 * hf + ii;
      const float kv = __bfloat162float(s.raw[1][zi(i, ch)]) * s.rk[i];
      const float qv = __bfloat162float(s.raw[0][zi(i, ch)]) * s.rq[i] * p.scale;
      const float ep = ex2(G[ii] - gm), em = ex2(gm - G[ii]);
      s.G[i][ch] = G[ii];
      s.qgm[i][ch] = qv * ep;
      s.kgm[i][ch] = kv * ep;
      s.kim[i][ch] = kv * em;
    }
  }
  __syncthreads();
  {  // A partial over this warp's 16 channels: kgm kim^T, split operands
    const int kc = 16 * warp + 2 * tq;
    uint32_t ah[4], al[4];
    afrag16(ah, al, [&](int r, int cc) { return s.kgm[r][kc - 2 * tq + cc]; }, gq, tq);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int l = nt * 8 + gq;
      uint32_t bh0, bl0, bh1, bl1;
      split2(bh0, bl0, s.kim[l][kc], s.kim[l][kc + 1]);
      split2(bh1, bl1, s.kim[l][kc + 8], s.kim[l][kc + 9]);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      mma3(acc, ah, al, bh0, bh1, bl0, bl1);
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        *reinterpret_cast<float2*>(&s.pb[0][warp][fz(gq + 4 * e, nt * 8 + 2 * tq)]) = make_float2(acc[e], acc[e + 1]);
    }
  }
  __syncthreads();
  {
    const int j = tid >> 4, l = tid & 15;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) a += s.pb[0][w][fz(j, l)];
    s.am[j][l] = l < j ? a : 0.f;
  }
  __syncthreads();
  if (tid < CH) {  // column tid of X by forward substitution
    const int jc = tid;
    float xv[CH];
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      float v = i == jc ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) v = fmaf(-s.b[i] * s.am[i][m], xv[m], v);
      xv[i] = v;
      s.x[i][jc] = v;
      s.xb[fz(i, jc)] = v * s.b[jc];
    }
  }
  __syncthreads();
  const int lj = lane >> 3, lr = (lane & 7) + 8 * (lj & 1), lc = 8 * (lj >> 1);  // ldmatrix.trans rows
  {  // U = (X diag(b)) Wr, this warp's 16 value rows: X b and Wr split
    uint32_t ah[4], al[4], bw[4];
    afrag16z(ah, al, s.xb, gq, tq);
    uint32_t bwl[4];
    ldsm_x4_t(bw, &s.t[1][zi(lr, 16 * warp + lc)]);
    ldsm_x4_t(bwl, &wrlo[zi(lr, 16 * warp + lc)]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      mma3(acc, ah, al, bw[2 * nt], bw[2 * nt + 1], bwl[2 * nt], bwl[2 * nt + 1]);
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int row = gq + 8 * (e >> 1), col = 16 * warp + nt * 8 + 2 * tq;
        split2(*reinterpret_cast<uint32_t*>(&s.z[2][zi(row, col)]), *reinterpret_cast<uint32_t*>(&s.z[3][zi(row, col)]), acc[e],
               acc[e + 1]);
      }
    }
  }
  __syncthreads();
  {  // partials over this warp's 16 value rows: dM = dO U^T (U split), dT = (dU hi + lo) Wr^T
    const int kc = 16 * warp + 2 * tq;
    const uint32_t o0 = ld32(&s.z[0][zi(gq, kc)]), o1 = ld32(&s.z[0][zi(gq + 8, kc)]);
    const uint32_t o2 = ld32(&s.z[0][zi(gq, kc + 8)]), o3 = ld32(&s.z[0][zi(gq + 8, kc + 8)]);
    const uint32_t h0 = ld32(&s.t[0][zi(gq, kc)]), h1 = ld32(&s.t[0][zi(gq + 8, kc)]);
    const uint32_t h2 = ld32(&s.t[0][zi(gq, kc + 8)]), h3 = ld32(&s.t[0][zi(gq + 8, kc + 8)]);
    const uint32_t l0 = ld32(&s.t[2][zi(gq, kc)]), l1 = ld32(&s.t[2][zi(gq + 8, kc)]);
    const uint32_t l2 = ld32(&s.t[2][zi(gq, kc + 8)]), l3 = ld32(&s.t[2][zi(gq + 8, kc + 8)]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int j = nt * 8 + gq;
      const uint32_t uh0 = ld32(&s.z[2][zi(j, kc)]), ul0 = ld32(&s.z[3][zi(j, kc)]);
      const uint32_t uh1 = ld32(&s.z[2][zi(j, kc + 8)]), ul1 = ld32(&s.z[3][zi(j, kc + 8)]);
      float dmv[4] = {0.f, 0.f, 0.f, 0.f}, dtv[4] = {0.f, 0.f, 0.f, 0.f};
      mma(dmv, o0, o1, o2, o3, uh0, uh1, dmv);
      mma(dmv, o0, o1, o2, o3, ul0, ul1, dmv);
      const uint32_t w0 = ld32(&s.t[1][zi(j, kc)]), w1 = ld32(&s.t[1][zi(j, kc + 8)]);
      mma(dtv, h0, h1, h2, h3, w0, w1, dtv);
      mma(dtv, l0, l1, l2, l3, w0, w1, dtv);
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int o = fz(gq + 4 * e, nt * 8 + 2 * tq);
        *reinterpret_cast<float2*>(&s.pb[0][warp][o]) = make_float2(dmv[e], dmv[e + 1]);
        *reinterpret_cast<float2*>(&s.pb[1][warp][o]) = make_float2(dtv[e], dtv[e + 1]);
      }
    }
  }

  // ---- products over the value rows on mma: warp w owns key channels [16w, 16w + 16)
  float dqd[2][4] = {}, dkd[2][4] = {}, dkr[2][4] = {};
  float gn2[2] = {0.f, 0.f};  // sum over this lane's value rows of dS S0 (channel 16w + 8nt + gq)
  // The contraction index of k-step kb is permuted: lane tq's k pairs (2tq, 2tq + 1) and (2tq + 8,
  // 2tq + 9) are value rows vb + 4 (kb & 1) + (0, 1) and + (2, 3), vb = 32 (kb >> 1) + 8 tq, so one
  // 16-byte load per operand row covers two k-steps (A and B permuted alike: the sum is the same).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 bs[2][2], bd[2][2];
#pragma unroll
    for (int m2 = 0; m2 < 2; ++m2)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        // key row 16w + 8nt + gq, value columns vb .. vb + 7 (vb = 32 (2 half + m2) + 8 tq) of the tiled layout
        const size_t o = (size_t)(2 * (2 * half + m2) + (tq >> 1)) * (KD * 16) + (size_t)(16 * warp + nt * 8 + gq) * 16 +
                         8 * (tq & 1);
        bs[m2][nt] = __ldg(reinterpret_cast<const uint4*>(s0t + o));
        bd[m2][nt] = __ldg(reinterpret_cast<const uint4*>(dst_ + o));
      }
#pragma unroll
    for (int m2 = 0; m2 < 2; ++m2) {
      const int vb = 32 * (2 * half + m2) + 8 * tq;
      const uint4 o0 = *reinterpret_cast<const uint4*>(&s.z[0][zi(gq, vb)]);
      const uint4 o1 = *reinterpret_cast<const uint4*>(&s.z[0][zi(gq + 8, vb)]);
      const uint4 w0 = *reinterpret_cast<const uint4*>(&s.z[1][zi(gq, vb)]);
      const uint4 w1 = *reinterpret_cast<const uint4*>(&s.z[1][zi(gq + 8, vb)]);
      const uint4 h0 = *reinterpret_cast<const uint4*>(&s.z[2][zi(gq, vb)]);
      const uint4 h1 = *reinterpret_cast<const uint4*>(&s.z[2][zi(gq + 8, vb)]);
      const uint4 l0 = *reinterpret_cast<const uint4*>(&s.z[3][zi(gq, vb)]);
      const uint4 l1 = *reinterpret_cast<const uint4*>(&s.z[3][zi(gq + 8, vb)]);
#pragma unroll
      for (int odd = 0; odd < 2; ++odd) {
        const uint32_t ao[4] = {odd ? o0.z : o0.x, odd ? o1.z : o1.x, odd ? o0.w : o0.y, odd ? o1.w : o1.y};
        const uint32_t aw[4] = {odd ? w0.z : w0.x, odd ? w1.z : w1.x, odd ? w0.w : w0.y, odd ? w1.w : w1.y};
        const uint32_t uh[4] = {odd ? h0.z : h0.x, odd ? h1.z : h1.x, odd ? h0.w : h0.y, odd ? h1.w : h1.y};
        const uint32_t ul[4] = {odd ? l0.z : l0.x, odd ? l1.z : l1.x, odd ? l0.w : l0.y, odd ? l1.w : l1.y};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint4 sb = bs[m2][nt], db = bd[m2][nt];
          const uint32_t s0 = odd ? sb.z : sb.x, s1 = odd ? sb.w : sb.y;
          const uint32_t d0 = odd ? db.z : db.x, d1 = odd ? db.w : db.y;
          mma(dqd[nt], ao[0], ao[1], ao[2], ao[3], s0, s1, dqd[nt]);
          mma(dkd[nt], aw[0], aw[1], aw[2], aw[3], s0, s1, dkd[nt]);
          mma(dkr[nt], uh[0], uh[1], uh[2], uh[3], d0, d1, dkr[nt]);
          mma(dkr[nt], ul[0], ul[1], ul[2], ul[3], d0, d1, dkr[nt]);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const uint32_t sv = hf ? s1 : s0, dv = hf ? d1 : d0;
            const float2 sf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv));
            const float2 df = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dv));
            gn2[nt] = fmaf(sf.x, df.x, fmaf(sf.y, df.y, gn2[nt]));
          }
        }
      }
    }
  }
  {  // d G_last from S_n = S0 diag(E) + ...: E sum_v dS S0 (this warp's channels)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float v = gn2[nt];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      const int ch = 16 * warp + nt * 8 + gq;
      if (last) {  // the last chunk: from the state pass's fp32 start state (or 0 without dht)
        v = 0.f;
        if (p.dht != nullptr)
#pragma unroll
          for (int rt = 0; rt < 8; ++rt) v += p.dgl[(((size_t)n * H + h) * 8 + rt) * KD + ch];
      }
      if (tq == 0) s.dgn[ch] = v * ex2(s.G[CH - 1][ch]);
    }
  }
  __syncthreads();
  {
    const int i = tid >> 4, j = tid & 15;
    float m = 0.f, t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      m += s.pb[0][w][fz(i, j)];
      t += s.pb[1][w][fz(i, j)];
    }
    s.dm[fz(i, j)] = j <= i ? m : 0.f;
    s.dt[i][j] = j <= i ? t : 0.f;
  }
  __syncthreads();

  // ---- WY backward (16 x 16, fp32): dX = dT diag(b), db += diag(X^T dT), dL = -X^T dX X^T
  {
    const int i = tid >> 4, j = tid & 15;
    const float dtv = s.dt[i][j];
    s.tp[i][j] = s.x[i][j] * dtv;
    s.dt[i][j] = dtv * s.b[j];
  }
  __syncthreads();
  {
    const int i = tid >> 4, j = tid & 15;
    float a = 0.f;
#pragma unroll
    for (int l = 0; l < CH; ++l) a = fmaf(s.x[l][i], s.dt[l][j], a);
    s.y[i][j] = a;
  }
  __syncthreads();
  {
    const int jr = tid >> 4, l = tid & 15;
    float dl = 0.f;
    if (l < jr) {
#pragma unroll
      for (int r = 0; r < CH; ++r) dl = fmaf(-s.y[jr][r], s.x[l][r], dl);
    }
    s.tp2[jr][l] = dl * s.am[jr][l];
    s.da[fz(jr, l)] = dl * s.b[jr];
  }
  __syncthreads();
  if (tid < CH) {
    float a = 0.f;
#pragma unroll
    for (int r = 0; r < CH; ++r) a += s.tp[r][tid] + s.tp2[tid][r];
    s.db[tid] = a;
    if (tid < nv && !p.fused) p.acc[((t0 + tid) * H + h) * ACC_W + 3 * KD] = a;
    if (tid < nv && p.fused) {
      const float bb = s.b[tid];
      p.dbeta[(t0 + tid) * H + h] = __float2bfloat16(a * bb * (1.f - bb));
    }
  }

  // ---- d q_hat, d k_hat, d G of this lane's 8 (token, channel) elements
  float gn_part[2][2] = {}, dqh[2][4], dkh[2][4];
  const float scale = p.scale;
  // sums over the chunk's tokens j: dM KIm, dM^T QGm, dA KIm, dA^T KGm (split operands)
  float sm1[2][4] = {}, sm2[2][4] = {}, sa1[2][4] = {}, sa2[2][4] = {};
  {
    uint32_t mh[4], ml[4], mth[4], mtl[4], dh[4], dl[4], dth[4], dtl[4];
    afrag16z(mh, ml, s.dm, gq, tq);
    afrag16(mth, mtl, [&](int r, int cc) { return s.dm[fz(cc, r)]; }, gq, tq);
    afrag16z(dh, dl, s.da, gq, tq);
    afrag16(dth, dtl, [&](int r, int cc) { return s.da[fz(cc, r)]; }, gq, tq);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int ch = 16 * warp + nt * 8 + gq;
      uint32_t bh[3][2], bl[3][2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = 2 * tq + 8 * hf;
        split2(bh[0][hf], bl[0][hf], s.kim[j][ch], s.kim[j + 1][ch]);
        split2(bh[1][hf], bl[1][hf], s.qgm[j][ch], s.qgm[j + 1][ch]);
        split2(bh[2][hf], bl[2][hf], s.kgm[j][ch], s.kgm[j + 1][ch]);
      }
      mma3(sm1[nt], mh, ml, bh[0][0], bh[0][1], bl[0][0], bl[0][1]);
      mma3(sm2[nt], mth, mtl, bh[1][0], bh[1][1], bl[1][0], bl[1][1]);
      mma3(sa1[nt], dh, dl, bh[0][0], bh[0][1], bl[0][0], bl[0][1]);
      mma3(sa2[nt], dth, dtl, bh[2][0], bh[2][1], bl[2][0], bl[2][1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = gq + 8 * (e >> 1), ch = 16 * warp + nt * 8 + 2 * tq + (e & 1);
      const float gi = s.G[i][ch], gm = s.G[7][ch], gl = s.G[CH - 1][ch];
      const float eg = ex2(gi), ep = ex2(gi - gm), em = ex2(gm - gi), er = ex2(gl - gi);
      const float qs = s.qgm[i][ch] * em, kn = s.kgm[i][ch] * em;
      const float dqm = ep * sm1[nt][e], dkm = em * sm2[nt][e], dka1 = ep * sa1[nt][e], dka2 = em * sa2[nt][e];
      const float xq = dqd[nt][e], xk = -dkd[nt][e], xr = dkr[nt][e];
      const float dqs = eg * xq + dqm;
      const float dk = eg * xk + er * xr + dkm + dka1 + dka2;
      const float krx = kn * er * xr;
      const float dG = qs * eg * xq + kn * eg * xk - krx + qs * dqm - kn * dkm + kn * dka1 - kn * dka2;
      gn_part[nt][e & 1] += krx;
      s.dgs[i][ch] = dG;
      dqh[nt][e] = scale * dqs;
      dkh[nt][e] = dk;
      if (i < nv && !p.fused) {
        float* a = p.acc + ((t0 + i) * H + h) * ACC_W;
        a[ch] = dqh[nt][e];
        a[KD + ch] = dk;
      }
    }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = gn_part[nt][e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      gn_part[nt][e] = v;
    }
  __syncwarp();
  if (gq == 0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) s.dgn[16 * warp + nt * 8 + 2 * tq + e] += gn_part[nt][e];
  }
  __syncwarp();
  {  // d gamma_j = sum_{i >= j} d G_i (+ d G_last); fused: the gate chain rule. Lane: channel
     // 16w + (lane & 15), tokens [8 hf, 8 hf + 8) with hf = lane >> 4.
    const int ch = 16 * warp + (lane & 15), hf = lane >> 4;
    const float ea = __expf(p.a_log[h]), dtb = p.dt_bias[h * KD + ch], lb = p.lower_bound;
    float loc = 0.f;
#pragma unroll
    for (int j = 8 * hf; j < 8 * hf + 8; ++j) loc += s.dgs[j][ch];
    const float upper = __shfl_sync(0xffffffffu, loc, (lane & 15) + 16);
    float run = s.dgn[ch] + (hf ? 0.f : upper), pdt = 0.f, pal = 0.f;
#pragma unroll
    for (int jj = 7; jj >= 0; --jj) {
      const int j = 8 * hf + jj;
      run += s.dgs[j][ch];
      if (j >= nv) continue;
      if (!p.fused) {
        p.acc[((t0 + j) * H + h) * ACC_W + 2 * KD + ch] = run;
      } else {
        const float x = ea * (__bfloat162float(s.raw[2][zi(j, ch)]) + dtb);
        const float sg = sigmoidf_(x);
        const float dx = run * lb * sg * (1.f - sg);
        p.dg[(t0 + j) * hs + (long long)h * KD + ch] = __float2bfloat16(dx * ea);
        pdt += dx * ea;
        pal += dx * x;
      }
    }
    if (p.fused) {
      pdt += __shfl_xor_sync(0xffffffffu, pdt, 16);
      if (lane < 16) p.part[sh * PART_W + ch] = pdt;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) pal += __shfl_xor_sync(0xffffffffu, pal, o);
      if (lane == 0) s.pal[warp] = pal;
    }
  }
  if (!p.fused) return;  // block-uniform
  // ---- fused finish: L2-norm backward of q and k (token dots over the 8 warps' channels)
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = gq + 8 * hr;
    float pq = 0.f, pk = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int ch = 16 * warp + nt * 8 + 2 * tq + e;
        pq = fmaf(__bfloat162float(s.raw[0][zi(i, ch)]), dqh[nt][2 * hr + e], pq);
        pk = fmaf(__bfloat162float(s.raw[1][zi(i, ch)]), dkh[nt][2 * hr + e], pk);
      }
    pq += __shfl_xor_sync(0xffffffffu, pq, 1);
    pq += __shfl_xor_sync(0xffffffffu, pq, 2);
    pk += __shfl_xor_sync(0xffffffffu, pk, 1);
    pk += __shfl_xor_sync(0xffffffffu, pk, 2);
    if (tq == 0) {
      s.dot[warp][i][0] = pq;
      s.dot[warp][i][1] = pk;
    }
  }
  __syncthreads();
  if (tid == 0) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) a += s.pal[w];
    p.part[sh * PART_W + KD] = a;
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = gq + 8 * hr;
    if (i >= nv) continue;
    float dq_dot = 0.f, dk_dot = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      dq_dot += s.dot[w][i][0];
      dk_dot += s.dot[w][i][1];
    }
    const float rq = s.rq[i], rk = s.rk[i];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int ch = 16 * warp + nt * 8 + 2 * tq;
      const float q0 = __bfloat162float(s.raw[0][zi(i, ch)]), q1 = __bfloat162float(s.raw[0][zi(i, ch + 1)]);
      const float k0 = __bfloat162float(s.raw[1][zi(i, ch)]), k1 = __bfloat162float(s.raw[1][zi(i, ch + 1)]);
      const float cq = rq * rq * rq * dq_dot, ck = rk * rk * rk * dk_dot;
      const size_t o = (size_t)(t0 + i) * qhs + (size_t)hq * KD + ch;
      *reinterpret_cast<__nv_bfloat162*>(p.dq + o) =
          __floats2bfloat162_rn(rq * dqh[nt][2 * hr] - q0 * cq, rq * dqh[nt][2 * hr + 1] - q1 * cq);
      *reinterpret_cast<__nv_bfloat162*>(p.dk + o) =
          __floats2bfloat162_rn(rk * dkh[nt][2 * hr] - k0 * ck, rk * dkh[nt][2 * hr + 1] - k1 * ck);
    }
  }
}

// Fused path: ddt_bias and dA_log of head blockIdx.x, summed over the chunk slots' partials.
extern "C" __global__ void __launch_bounds__(128) kdab_reduce(KdaBwdParams p, int slots) {
  __shared__ float red[4];
  const int h = blockIdx.x, c = threadIdx.x;
  const float* part = p.part + (size_t)h * PART_W;
  const size_t stride = (size_t)p.num_heads * PART_W;
  float a = 0.f, al = 0.f;
  for (int sl = 0; sl < slots; ++sl) a += part[sl * stride + c];
  for (int sl = c; sl < slots; sl += 128) al += part[sl * stride + KD];
  p.ddt_bias[h * KD + c] = a;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) al += __shfl_xor_sync(0xffffffffu, al, o);
  if ((c & 31) == 0) red[c >> 5] = al;
  __syncthreads();
  if (c == 0) p.da_log[h] = red[0] + red[1] + red[2] + red[3];
}

#define FIN_TOK 64  // tokens per kda_bwd_finish block

__device__ __forceinline__ float block_sum128(float x, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
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
      const float sg = 1.f / (1.f + expf(-x));
      const float dx = a[2 * KD + c] * lb * sg * (1.f - sg);
      p.dg[(t * p.num_heads + h) * KD + c] = __float2bfloat16(dx * ea);
      if (gi < 8) {
        ddtb[gi] += dx * ea;
        dal_log[gi] += dx * x;
      } else {
        atomicAdd(&p.ddt_bias[h * KD + c], dx * ea);
        atomicAdd(&p.da_log[h], dx * x);
      }
      if (c == 0) {
        const float b = 1.f / (1.f + expf(-__bfloat162float(p.beta[t * p.num_heads + h])));
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
