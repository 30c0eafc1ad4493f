// FP8 (e4m3) K-grouped GEMM of the weight gradients, DeepSeek-V3's recipe (one scale per 128 tokens of every row):
//   out_e[m, n] (+)= sum_kb ( sum_{k in kb} a[m, k] * b[n, k] ) * sa[kb, m] * sb[kb, n]
// over the token blocks kb of expert e. a [M, Ktot] and b [N, Ktot] are in the token-major layout
// (gemm/token_major.cuh: the reduction runs along the tokens, and FP8 WGMMA reads K-major operands only), the
// experts' token counts on the device (every CTA derives each expert's blocks from them: no host sync);
// sa [Ktot / 128, M], sb [Ktot / 128, N]; fp32 output, stored or added into (main_grad). megatron_mok/fp8.py
// fp8_wgrad_grouped is the oracle.
//
// Unlike the forward's, the scale factor differs along both dimensions of the output tile (a row scale times a
// column scale), so a thread's 64 accumulators need 2 row and 32 column scales per K block: they travel with the
// stage (two 512-B vectors by bulk copy on the stage's barrier) and are read with LDS before the block's MMAs.
// Per K block a consumer warpgroup issues four m64n128k32 into a fresh product, drains, releases the stage (each
// warp on its own: the empty barrier counts 8 warps) and promotes: one FMUL (row x column scale) and one FFMA per
// element. The promotion overlaps the other warpgroup's MMAs. 128 x 128 tiles, 1 TMA producer thread + 2 consumer
// warpgroups, kW8Stages-deep ring, tiles assigned statically in bands (wgrad_tile): every
// expert's M / 128 x N / 128 output tiles, an expert without tokens storing zeros (or skipped when accumulating).
// tests/gpu/test_fp8_wgrad_gemm.py checks it against the oracle.
#pragma once
#include "common.cuh"
#include "gemm/fp8_gemm.cuh"
#include "gemm/gemm_sm90.cuh"
#include "gemm/token_major.cuh"
#include "mok_limits.h"
#include "comm/timeout.cuh"

namespace mok {
namespace fp8 {

constexpr int kW8Stages = 6;
constexpr int kW8ScaleBytes = 128 * 4;  // one K block's scales of a tile's 128 rows (or columns)
constexpr int kW8StageBytes = kF8ATile + kF8BTile + 2 * kW8ScaleBytes;  // 33 KB: keeps the tiles 1024-B aligned
static_assert(kW8StageBytes % 1024 == 0, "SW128 tiles need 1024-B aligned stages");

struct F8WgradParams {
  Params base;                // timeout / error fields (mbar_wait, record_error)
  int m_tiles, n_tiles;       // M / 128, N / 128
  int M, N, L;                // output rows and columns (the scale vectors' lengths), experts
  int num_tiles;              // L x m_tiles x n_tiles
  long long ktot;             // token columns of a and b
  const int* counts;          // device [L] tokens per expert
  const CUtensorMap* tm;      // [0]: a [M, Ktot], [1]: b [N, Ktot]  (uint8, [128 x 128] boxes, SW128)
  const float* sa;            // [Ktot / 128, M]
  const float* sb;            // [Ktot / 128, N]
  float* const* out;          // [L] -> [M, N] fp32
  int accumulate;             // 1: out += product, 0: out = product
};

__host__ __device__ constexpr int fp8_wgrad_smem_bytes() { return kW8Stages * kW8StageBytes + 2 * kW8Stages * 8 + 64; }

// Tile t of the static list: expert e's output tile (mt, nt) over its K blocks [kb0, kb0 + nk). An expert's tiles go
// in bands of kW8BandRows tile rows, m fastest within a band, so that the tiles running at once share their a and b
// tiles in L2 (n fastest along one tile row at a time read every b tile once per tile row: 2-4 % slower).
constexpr int kW8BandRows = 8;
struct W8Tile {
  int e, mt, nt, kb0, nk;
};
__device__ __forceinline__ W8Tile wgrad_tile(const F8WgradParams& P, const int* pb, int t) {
  const int per_expert = P.m_tiles * P.n_tiles;
  const int e = t / per_expert, r = t % per_expert;
  const int band = r / (kW8BandRows * P.n_tiles), i = r % (kW8BandRows * P.n_tiles);
  const int rows = min(kW8BandRows, P.m_tiles - band * kW8BandRows);  // the last band may be narrower
  return {e, band * kW8BandRows + i % rows, i / rows, pb[e], pb[e + 1] - pb[e]};
}
// A tile with nothing to do: no tokens, and its gradient is added into (stored tiles write their zeros).
__device__ __forceinline__ bool wgrad_skip(const F8WgradParams& P, const W8Tile& w) { return P.accumulate && !w.nk; }

__device__ void fp8_wgrad_producer(const F8WgradParams& P, const int* pb, uint8_t* stages, uint64_t* full,
                                   uint64_t* empty) {
  int st = 0;
  uint32_t ph = 0;
  for (int t = blockIdx.x; t < P.num_tiles; t += gridDim.x) {
    const W8Tile w = wgrad_tile(P, pb, t);
    if (wgrad_skip(P, w)) continue;
    for (int kb = w.kb0; kb < w.kb0 + w.nk; ++kb) {
      mbar_wait(P.base, &empty[st], ph ^ 1u, -1, 2);
      uint8_t* s = stages + st * kW8StageBytes;
      Barrier::arrive_and_expect_tx(&full[st], (uint32_t)kW8StageBytes);
      tma_load_2d(P.tm, &full[st], s, kb * kF8BK, w.mt * kF8BM);
      tma_load_2d(P.tm + 1, &full[st], s + kF8ATile, kb * kF8BK, w.nt * kF8BN);
      cute::SM90_BULK_COPY_G2S::copy(P.sa + (long long)kb * P.M + w.mt * kF8BM, &full[st], s + kF8ATile + kF8BTile,
                                     kW8ScaleBytes);
      cute::SM90_BULK_COPY_G2S::copy(P.sb + (long long)kb * P.N + w.nt * kF8BN, &full[st],
                                     s + kF8ATile + kF8BTile + kW8ScaleBytes, kW8ScaleBytes);
      if (++st == kW8Stages) { st = 0; ph ^= 1u; }
    }
  }
}

__device__ void fp8_wgrad_consumer(const F8WgradParams& P, const int* pb, uint8_t* stages, uint64_t* full,
                                   uint64_t* empty, int wgc) {
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  const int r0 = wgc * 64 + warp_in_wg * 16 + (lane >> 2);  // this thread's two tile rows: r0, r0 + 8
  const int c0 = 2 * (lane & 3);                            // and its columns: 8 j + c0 + {0, 1}, j < 16
  float acc[64], prod[64];
  int st = 0;
  uint32_t ph = 0;
  for (int t = blockIdx.x; t < P.num_tiles; t += gridDim.x) {
    const W8Tile w = wgrad_tile(P, pb, t);
    if (wgrad_skip(P, w)) continue;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int i = 0; i < w.nk; ++i) {
      mbar_wait(P.base, &full[st], ph, -1, 4);
      const uint8_t* s = stages + st * kW8StageBytes;
      // this block's scales, read before the MMAs so their latency hides under them
      const float* ssa = reinterpret_cast<const float*>(s + kF8ATile + kF8BTile);
      const float* ssb = ssa + 128;
      const float sr0 = ssa[r0], sr1 = ssa[r0 + 8];
      float2 sc[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) sc[j] = *reinterpret_cast<const float2*>(ssb + 8 * j + c0);
      fp8_block_mmas(s, wgc, prod);
      cute::warpgroup_wait<0>();
      fence_acc64_f8(prod);
      // the stage (tiles and scales) is read: free it before promoting, so the producer refills it sooner
      __syncwarp();  // every lane's scale reads ordered before lane 0's release
      if (lane == 0) Barrier::arrive(&empty[st]);
      if (++st == kW8Stages) { st = 0; ph ^= 1u; }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[4 * j + 0] = fmaf(prod[4 * j + 0], sr0 * sc[j].x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(prod[4 * j + 1], sr0 * sc[j].y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(prod[4 * j + 2], sr1 * sc[j].x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(prod[4 * j + 3], sr1 * sc[j].y, acc[4 * j + 3]);
      }
    }
    // epilogue: fp32 pairs into the expert's gradient (every tile row is a real row: M and N are multiples of 128)
    float* out = P.out[w.e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* row = out + (long long)(w.mt * kF8BM + r0 + 8 * h) * P.N + w.nt * kF8BN + c0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        if (P.accumulate)
          red_add_f32x2(row + 8 * j, v);
        else
          *reinterpret_cast<float2*>(row + 8 * j) = v;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) mok_fp8_wgrad_kernel(const __grid_constant__ F8WgradParams P) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int pb[MOK_MAX_LOCAL_EXPERTS + 1];  // each expert's first 128-token block
  // Aligned by pointer arithmetic on smem_raw, not through an integer: through one the compiler loses the shared
  // space and reads each stage's scales with generic loads (with them and without the bands above, the unit took
  // 1.13-1.29x this time on an H100; the bands alone are 2-4 % of it).
  uint8_t* smem = smem_raw + ((1024u - (uint32_t)(reinterpret_cast<uintptr_t>(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kW8Stages * kW8StageBytes);
  uint64_t* empty = full + kW8Stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kW8Stages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], 8);  // every consumer warp releases on its own
    }
    cutlass::arch::fence_barrier_init();
  }
  expert_prefixes<kThreads>(P.counts, P.L, nullptr, pb);  // ends with __syncthreads
  // the experts' blocks must lie within the operands (a TMA box past them reads zeros: a silently wrong gradient)
  if (!check_token_counts<kThreads>(P.base, P.counts, P.L, nullptr, pb, P.ktot)) return;
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) fp8_wgrad_producer(P, pb, smem, full, empty);
  } else {
    setmaxnreg_inc<232>();
    fp8_wgrad_consumer(P, pb, smem, full, empty, wg - 1);
  }
}

}  // namespace fp8
}  // namespace mok
