// FP8 (e4m3) quantisation along the tokens, the operands of the FP8 weight gradients (DeepSeek-V3's recipe: the
// scaling block runs along each GEMM's reduction dimension, for wgrad the tokens). Layout-order bf16 rows [rows, F]
// (experts back to back from row 0, counts[e] rows each, counts on the device) -> the FP8 wgrad unit's operand
// (gemm/fp8_wgrad_gemm.cuh) in the token-major layout (gemm/token_major.cuh): e4m3 [F, kcap], and fp32 scales
// [kcap / 128, F], one per 128 tokens of a column.
// The same numbers as megatron_mok/fp8.py token_major_operand (scale and 1 / scale as quant/fp8_quant.cuh makes them).
//
// One CTA of 256 threads per (128-token block, 128 columns): a thread loads 8 consecutive tokens of 8 columns
// (16-byte loads, a token row's 256 B read by 16 threads), the columns' amax is reduced through shared memory, and
// the e4m3 block is transposed in shared memory (8-byte chunks XOR-swizzled by column group: conflict-free writes)
// and stored as 128-byte column runs. The CTA finds its expert from the counts itself (expert_prefixes), so no host
// sync and no second launch.
#pragma once
#include "common.cuh"
#include "mok_limits.h"
#include "gemm/token_major.cuh"
#include "quant/fp8_quant.cuh"

namespace mok {

constexpr int kTqThreads = 256;

struct TokenQuantParams {
  Params base;                // the error record (check_token_counts)
  const __nv_bfloat16* rows;  // [nrows, F], row stride ld (elements, a multiple of 8)
  long long ld, nrows;
  int F, L;                   // F a multiple of 128
  const int* counts;          // device [L] rows per expert
  uint8_t* q;                 // [F, kcap] e4m3
  float* s;                   // [kcap / 128, F]
  long long kcap;             // token columns (a multiple of 128)
};

__global__ void __launch_bounds__(kTqThreads) mok_fp8_quantize_tokens_kernel(const __grid_constant__ TokenQuantParams P) {
  __shared__ long long pr[MOK_MAX_LOCAL_EXPERTS + 1];
  __shared__ int pb[MOK_MAX_LOCAL_EXPERTS + 1];
  __shared__ float red[16][128];                     // per token group: the columns' partial amax
  __shared__ float inv[128];                         // 1 / scale per column
  __shared__ __align__(16) uint8_t qt[128 * 128];   // the e4m3 block, [column][token], 8-byte chunks swizzled
  __shared__ int s_e;
  const int blk = blockIdx.x, col0 = blockIdx.y * 128, t = threadIdx.x;
  expert_prefixes<kTqThreads>(P.counts, P.L, pr, pb);
  if (!check_token_counts<kTqThreads>(P.base, P.counts, P.L, pr, pb, P.nrows)) {
    // counts past the rows (reported in the error record, read lazily): NaN scales, so a wgrad that runs on these
    // operands before the error is read makes NaN gradients, which stop a training step, not plausible ones
    if (t < 128) P.s[(long long)blk * P.F + col0 + t] = __int_as_float(0x7fc00000);
    return;
  }
  if (blk >= pb[P.L]) return;  // past every expert's blocks: columns no expert owns stay as they are
  if (2 * t < P.L && pb[2 * t] <= blk && blk < pb[2 * t + 1]) s_e = 2 * t;
  if (2 * t + 1 < P.L && pb[2 * t + 1] <= blk && blk < pb[2 * t + 2]) s_e = 2 * t + 1;
  __syncthreads();
  const int e = s_e;
  const long long row0 = pr[e] + 128LL * (blk - pb[e]);
  const long long valid = min(128LL, pr[e + 1] - row0);
  const int g = t & 15, tq = t >> 4;  // columns col0 + 8 g .. + 8, tokens 8 tq .. + 8 of the block
  float v[8][8];                       // [token][column]
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int tok = 8 * tq + i;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (tok < valid) raw = __ldg(reinterpret_cast<const uint4*>(P.rows + (row0 + tok) * P.ld + col0 + 8 * g));
    bf16x8_to_float(raw, v[i]);
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i][k]));
    red[tq][8 * g + k] = m;
  }
  __syncthreads();
  if (t < 128) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = fmaxf(m, red[j][t]);
    const float scale = block_scale(m);
    inv[t] = inv_scale(scale);
    P.s[(long long)blk * P.F + col0 + t] = scale;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int c = 8 * g + k;
    const float r = inv[c];
    const uint2 w = make_uint2(e4m3x2(v[0][k] * r, v[1][k] * r) | e4m3x2(v[2][k] * r, v[3][k] * r) << 16,
                               e4m3x2(v[4][k] * r, v[5][k] * r) | e4m3x2(v[6][k] * r, v[7][k] * r) << 16);
    *reinterpret_cast<uint2*>(qt + c * 128 + 8 * (tq ^ g)) = w;  // chunk tq of column c, swizzled by its group g
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // 128 columns x 8 chunks of 16 B
    const int idx = t + kTqThreads * r, c = idx >> 3, u = idx & 7, cg = c >> 3;
    // logical chunks 2u, 2u + 1 sit in the 16-byte unit u ^ (cg >> 1), swapped when cg is odd
    uint4 w = *reinterpret_cast<const uint4*>(qt + c * 128 + 16 * (u ^ (cg >> 1)));
    if (cg & 1) w = make_uint4(w.z, w.w, w.x, w.y);
    *reinterpret_cast<uint4*>(P.q + (long long)(col0 + c) * P.kcap + 128LL * blk + 16 * u) = w;
  }
}

}  // namespace mok
