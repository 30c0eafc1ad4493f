// Push combine and the final top-k weighted sum.
//
// push: the fc2 epilogue writes each finished y row (bf16) straight into the home rank's
//       combine buffer combine_buf[r][t, k, :] (r, t, k from the layout entry). In real EP this is a
//       store through the home rank's peer pointer; with several partitions in one launch it is the per-rank table pointer.
// reduce: once every rank's compute SMs are done (counter), each rank's comm warps and compute
//       consumer warps compute out[r][t] = bf16( sum_k w[t,k] * float(combine_buf[r][t,k]) ),
//       fp32, k ascending, unused slots (idx == -1) skipped, rows with no valid k -> 0.
#pragma once
#include "common.cuh"

namespace mok {

// Quad transpose of packed bf16x2 words: lane l of a quad holds word w_j (columns 8j+2l, 8j+2l+1 of
// chunks j = 0..3 of one row); afterwards lane l holds all 8 columns of chunk l (one 16-byte store).
// Two butterfly steps (lane xor 1, then xor 2), each swapping two words with the partner: 4 shuffles
// and 12 selects. (A rotation by lane index took 4 shuffles too but ~40 selects and compares: every
// epilogue runs 8-16 of these per row pair, on the issue slots the other warpgroup's MMAs also need.)
__device__ __forceinline__ uint4 quad_transpose(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int lane) {
  const bool odd = lane & 1, high = lane & 2;
  // step 1, partner lane ^ 1: the odd lane takes the partner's w1 / w3 as its w0 / w2, the even one the
  // partner's w0 / w2 as its w1 / w3 (2 x 2 blocks transposed)
  uint32_t a = __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 1);
  uint32_t b = __shfl_xor_sync(0xffffffffu, odd ? w2 : w3, 1);
  if (odd) { w0 = a; w2 = b; } else { w1 = a; w3 = b; }
  // step 2, partner lane ^ 2: the upper lane takes the partner's w2 / w3 as its w0 / w1, the lower one
  // the partner's w0 / w1 as its w2 / w3
  a = __shfl_xor_sync(0xffffffffu, high ? w0 : w2, 2);
  b = __shfl_xor_sync(0xffffffffu, high ? w1 : w3, 2);
  if (high) { w0 = a; w1 = b; } else { w2 = a; w3 = b; }
  return make_uint4(w0, w1, w2, w3);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One output row of a 64x256 WGMMA accumulator fragment (columns col_base + 8*j + 2*(lane%4) + {0,1},
// values acc[4j + 2h], acc[4j + 2h + 1]) pushed as 16-byte stores to dst (nullptr: row not valid;
// all lanes must still call, the transpose uses shuffles). Columns >= ncols are skipped.
__device__ __forceinline__ void store_row_frag256(__nv_bfloat16* dst, int col_base, int ncols, const float* acc,
                                                  int h, int lane) {
#pragma unroll
  for (int j0 = 0; j0 < 32; j0 += 4) {
    const uint4 v = quad_transpose(pack_bf16x2(acc[4 * j0 + 2 * h], acc[4 * j0 + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 1) + 2 * h], acc[4 * (j0 + 1) + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 2) + 2 * h], acc[4 * (j0 + 2) + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 3) + 2 * h], acc[4 * (j0 + 3) + 2 * h + 1]), lane);
    const int c = col_base + 8 * (j0 + (lane & 3));
    if (dst != nullptr && c < ncols) *reinterpret_cast<uint4*>(dst + c) = v;
  }
}

// One token's output row out[t] = bf16(sum_k w[t,k] * combine[t,k,:]) (fp32, k ascending, unused slots
// skipped), by one warp. Each lane sums VP 8-column vectors (v, v + 32, ...) at a time over 8 k at a time:
// 8 * VP loads of 16 B in flight per lane. The pass is bandwidth-bound (K x H bf16 read per token), so
// bytes in flight set its speed (one vector per lane left it at about half the device's copy rate): the
// consumer warps, with 224 registers after setmaxnreg, take VP = 4; the comm warps (launch bound, 168)
// VP = 2. The k order of the fp32 sum is the same for every VP (results bit-identical).
template <int VP>
__device__ __forceinline__ void sum_token(const Params& P, const RankTable& rt, int t, int lane) {
  constexpr int KB = 8;  // k rows in flight per vector
  const int H = P.H, K = P.K, nv = H / 8;  // vectors per row
  const int* idx = rt.idx + (long long)t * K;
  const float* w = rt.w + (long long)t * K;
  const uint4* cb = reinterpret_cast<const uint4*>(rt.combine + (long long)t * K * H);
  uint4* out = reinterpret_cast<uint4*>(rt.out + (long long)t * H);
  for (int v0 = lane; v0 < nv; v0 += 32 * VP) {
    float acc[VP][8];
#pragma unroll
    for (int h = 0; h < VP; ++h)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += KB) {  // KB rows x VP vectors in flight, then accumulate in k order
      uint4 d[VP][KB];
      float wk[KB];
#pragma unroll
      for (int u = 0; u < KB; ++u) {
        const int k = k0 + u;
        const bool ok = k < K && idx[k] >= 0;
        wk[u] = ok ? w[k] : 0.f;
#pragma unroll
        for (int h = 0; h < VP; ++h)
          d[h][u] = ok && v0 + 32 * h < nv ? cb[(long long)k * nv + v0 + 32 * h] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < KB; ++u) {
        if (k0 + u >= K || !(idx[k0 + u] >= 0)) continue;
#pragma unroll
        for (int h = 0; h < VP; ++h) {
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&d[h][u]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(p[i]);
            acc[h][2 * i] = fmaf(wk[u], f.x, acc[h][2 * i]);
            acc[h][2 * i + 1] = fmaf(wk[u], f.y, acc[h][2 * i + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < VP; ++h) {
      if (v0 + 32 * h >= nv) break;
      uint4 o;
      __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) po[i] = __floats2bfloat162_rn(acc[h][2 * i], acc[h][2 * i + 1]);
      out[v0 + 32 * h] = o;
    }
  }
}

// The final sum of every token of home rank q, tokens dealt statically: worker = warp index among this
// rank's participating warps, nworkers = their number.
template <int VP>
__device__ __forceinline__ void combine_reduce(const Params& P, int q, int worker, int nworkers) {
  const int lane = threadIdx.x & 31;
  const RankTable rt = P.ranks[q];
  for (int t = worker; t < rt.T; t += nworkers) sum_token<VP>(P, rt, t, lane);
}

}  // namespace mok
