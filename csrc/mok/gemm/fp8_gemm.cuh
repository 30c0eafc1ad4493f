// FP8 (e4m3) grouped GEMM with DeepSeek-V3 block scales, the FP8 path's unit kernel (tested and benchmarked alone):
//   out[r, n] = sum_kb ( sum_{k in kb} xq[r, k] * wq_e[n, k] ) * xs[r, kb] * ws_e[n / 128, kb]
// for the rows r of each expert e (segments back to back from row 0), bf16 output. xs: one fp32 scale
// per 1 x 128 activation block, ws: one per 128 x 128 weight block (megatron_mok/fp8.py is the oracle).
//
// The unit the fused FP8 expert FFN will be built from: TMA loads of [128 rows x 128 B] boxes (one
// SW128 row = 128 e4m3 = one scale block along K), WGMMA m64n128k32 e4m3 x e4m3 -> fp32 (FP8 WGMMA has
// K-major operands only), and scale promotion: each 128-wide K block's product lands in one of two temporaries,
// in turn, and is added to the fp32 accumulator with its two scales while the next block's MMAs run (64 x 3
// registers per consumer thread: why the tile is 128 x 128, not 128 x 256). 1 TMA producer thread + 2 consumer
// warpgroups, kF8Stages-deep ring, tiles assigned statically (tile = blockIdx.x + i * gridDim.x), so producer and
// consumers walk the same list without an info ring. tests/gpu/test_fp8_gemm.py checks it against the
// FP8 recipe oracle.
#pragma once
#include "common.cuh"
#include "gemm/gemm_sm90.cuh"
#include "comm/timeout.cuh"

namespace mok {
namespace fp8 {

constexpr int kF8BM = 128;  // rows per tile (2 consumer warpgroups x 64)
constexpr int kF8BN = 128;  // output columns per tile = one weight scale block
constexpr int kF8BK = 128;  // e4m3 per K step = 128 B = one SW128 row = one scale block
constexpr int kF8Stages = 6;
constexpr int kF8ATile = kF8BM * kF8BK;  // 16 KB
constexpr int kF8BTile = kF8BN * kF8BK;  // 16 KB
constexpr int kF8StageBytes = kF8ATile + kF8BTile;

// d[64] (+)= A(64 x 32 e4m3, smem, K-major) * B(128 x 32 e4m3, smem, K-major)^T: wgmma_64x128x32_e4m3
// (gemm_sm90.cuh)
__device__ __forceinline__ void fence_acc64_f8(float* d) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(d[i]);
}

struct F8GemmParams {
  Params base;              // timeout / error fields (mbar_wait)
  int N, K;                 // output columns, reduction length (multiples of 128)
  int n_tiles;              // N / 128
  int num_tiles;            // m-tiles x n_tiles
  const int4* mtiles;       // [num_mtiles] {expert, first row, rows (<= 128), 0}
  const CUtensorMap* tm;    // [0]: xq [rows, K]; [1 + e]: wq_e [N, K]   (uint8, [128 x 128] boxes, SW128)
  const float* xs;          // [rows, K / 128]
  const float* const* ws;   // [L] -> [N / 128, K / 128]
  __nv_bfloat16* out;       // [rows, N]
};

__host__ __device__ constexpr int fp8_gemm_smem_bytes() { return kF8Stages * kF8StageBytes + 2 * kF8Stages * 8 + 64; }

__device__ void fp8_producer(const F8GemmParams& P, uint8_t* stages, uint64_t* full, uint64_t* empty) {
  const int nk = P.K / kF8BK;
  int st = 0;
  uint32_t ph = 0;
  for (int t = blockIdx.x; t < P.num_tiles; t += gridDim.x) {
    const int4 mt = P.mtiles[t / P.n_tiles];
    const int nt = t % P.n_tiles;
    for (int kb = 0; kb < nk; ++kb) {
      mbar_wait(P.base, &empty[st], ph ^ 1u, -1, 2);
      uint8_t* s = stages + st * kF8StageBytes;
      Barrier::arrive_and_expect_tx(&full[st], (uint32_t)kF8StageBytes);
      tma_load_2d(P.tm, &full[st], s, kb * kF8BK, mt.y);
      tma_load_2d(P.tm + 1 + mt.x, &full[st], s + kF8ATile, kb * kF8BK, nt * kF8BN);
      if (++st == kF8Stages) { st = 0; ph ^= 1u; }
    }
  }
}

// The MMAs of one landed K block of a consumer warpgroup (wgc: its 64 rows of the A tile at s, the B tile at
// s + kF8ATile): four m64n128k32 into t (the block's product, written fresh), committed as one group. Shared with
// the weight-gradient unit (gemm/fp8_wgrad_gemm.cuh).
__device__ __forceinline__ void fp8_block_mmas(const uint8_t* s, int wgc, float* t) {
  const uint64_t da = make_smem_desc_sw128(s + wgc * (64 * kF8BK));
  const uint64_t db = make_smem_desc_sw128(s + kF8ATile);
  fence_acc64_f8(t);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kF8BK / 32; ++kk)  // k32 step = 32 B = 2 descriptor units
    wgmma_64x128x32_e4m3(da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), t, kk > 0);
  cute::warpgroup_commit_batch();
}

// One K block of a consumer warpgroup: wait for its stage and issue its MMAs into t.
__device__ __forceinline__ void fp8_issue_block(const F8GemmParams& P, const uint8_t* stages, uint64_t* full, int wgc,
                                                int st, uint32_t ph, float* t) {
  mbar_wait(P.base, &full[st], ph, -1, 4);
  fp8_block_mmas(stages + st * kF8StageBytes, wgc, t);
}

// acc += t * (row scale x block scale): the promotion of one landed K block.
__device__ __forceinline__ void fp8_promote(float* acc, const float* t, float s0, float s1) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] = fmaf(t[4 * j + 0], s0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(t[4 * j + 1], s0, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(t[4 * j + 2], s1, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(t[4 * j + 3], s1, acc[4 * j + 3]);
  }
}

// Two products in turn (tmp0 for even K blocks, tmp1 for odd): block kb's group is issued before block kb-1's
// is promoted (wait<1>), so the promotion's FMAs run under this warpgroup's own MMAs, not only the other's.
__device__ void fp8_consumer(const F8GemmParams& P, uint8_t* stages, uint64_t* full, uint64_t* empty, int wgc) {
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  const int nk = P.K / kF8BK;
  float acc[64], tmp0[64], tmp1[64];
  int st = 0;
  uint32_t ph = 0;
  for (int t = blockIdx.x; t < P.num_tiles; t += gridDim.x) {
    const int4 mt = P.mtiles[t / P.n_tiles];
    const int nt = t % P.n_tiles;
    const int r0 = wgc * 64 + warp_in_wg * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two tile rows
    const float* xs0 = P.xs + (long long)(mt.y + r0) * nk;
    const float* xs1 = P.xs + (long long)(mt.y + r1) * nk;
    const float* wsb = P.ws[mt.x] + (long long)nt * nk;
    // block kb's combined scales (rows past the expert: scale 0, not stored)
    auto scales = [&](int kb, float& s0, float& s1) {
      const float sb = wsb[kb];
      s0 = (r0 < mt.z ? xs0[kb] : 0.0f) * sb;
      s1 = (r1 < mt.z ? xs1[kb] : 0.0f) * sb;
    };
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    // Issue block kb into t (its stage and scales noted in the block's slot b), and promote landed blocks.
    int stg[2];
    float sc0[2], sc1[2];
    auto issue = [&](int kb, float* t, int b) {
      scales(kb, sc0[b], sc1[b]);
      fp8_issue_block(P, stages, full, wgc, st, ph, t);
      stg[b] = st;
      if (++st == kF8Stages) { st = 0; ph ^= 1u; }
    };
    auto promote = [&](float* t, int b) {
      fence_acc64_f8(t);
      if (lt == 0) Barrier::arrive(&empty[stg[b]]);
      fp8_promote(acc, t, sc0[b], sc1[b]);
    };
    // Four K blocks per round, straight-line: ptxas tracks which group a wait<1> retires only within one basic
    // block; across a loop's back edge it serialises the MMAs (C7514), so each round ends drained.
    int kb = 0;
    for (; kb + 4 <= nk; kb += 4) {
      issue(kb, tmp0, 0);
      issue(kb + 1, tmp1, 1);
      cute::warpgroup_wait<1>();
      promote(tmp0, 0);
      issue(kb + 2, tmp0, 0);
      cute::warpgroup_wait<1>();
      promote(tmp1, 1);
      issue(kb + 3, tmp1, 1);
      cute::warpgroup_wait<1>();
      promote(tmp0, 0);
      cute::warpgroup_wait<0>();
      promote(tmp1, 1);
    }
    for (; kb < nk; ++kb) {  // the K blocks past the last round, one at a time
      issue(kb, tmp0, 0);
      cute::warpgroup_wait<0>();
      promote(tmp0, 0);
    }
    // epilogue: bf16 pairs, rows of this expert only
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      if (r >= mt.z) continue;
      __nv_bfloat16* row = P.out + (long long)(mt.y + r) * P.N + nt * kF8BN;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        *reinterpret_cast<__nv_bfloat162*>(row + 8 * j + 2 * (lane & 3)) = v;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) mok_fp8_gemm_kernel(const __grid_constant__ F8GemmParams P) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kF8Stages * kF8StageBytes);
  uint64_t* empty = full + kF8Stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kF8Stages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if (threadIdx.x == 0) fp8_producer(P, smem, full, empty);
  } else {
    setmaxnreg_inc<224>();
    fp8_consumer(P, smem, full, empty, wg - 1);
  }
}

}  // namespace fp8
}  // namespace mok
