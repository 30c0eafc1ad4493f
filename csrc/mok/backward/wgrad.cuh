// Expert weight gradients (wgrad) of the MoK backward, from the layout-order buffers the dgrad kernel
// leaves on each owner rank (expert-major rows, experts back to back):
//   dW1_e = dH_e^T @ x_e   [2F, H]        dW2_e = gy_e^T @ act_e   [H, F]
// bf16 operands, fp32 accumulation, fp32 output: stored, or added into Megatron's main_grad
// (gradient-accumulation fusion) without a separate add pass.
//
// The reduction runs over rows, so both operands are read as stored: [64 cols x 64 rows] TMA boxes
// with the 128-byte swizzle are MN-major WGMMA operands (no transposed copies). Persistent, one CTA per
// SM, the dgrad kernel's pipeline shape: one TMA producer warp + two consumer warpgroups, [128 x 256]
// tiles, BK = 64 rows, kStages-deep smem ring. Tiles come from an atomic ticket counter in expert-major
// order, row block fastest, so the tiles running at once share their B columns in L2.
//
// An expert's rows do not end on a 64-row boundary and the maps span the whole buffer, so in an
// expert's last K block the consumers zero the rows past its end (they belong to the next expert or
// were never written) before the WGMMAs read the stage. No per-expert tensor maps, no host sync.
//
// Home-side reductions (home_parts > 0, after a dgrad launch with defer_home): the producer warpgroup's
// warps 1-3, idle otherwise, compute the router-weight gradient and the grad_x top-k sum of those home
// ranks (home_reduce.cuh) while the consumers run the wgrad tiles.
#pragma once
#include "backward/bwd_common.cuh"
#include "backward/home_reduce.cuh"

namespace mok {
namespace bwd {

struct WgradOut {
  float* ptr;  // fp32 [M, N] rows with stride ld (dW1: [2F, H], dW2: [H, F])
  long long ld;
};

struct WgradParams {
  Params base;               // timeout / error fields only (mbar_wait, record_error)
  int np, L, H, F;
  int rank0;                 // rank of partition 0 (error reports)
  int accumulate;            // 1: out += result (main_grad), 0: out = result
  int mt1, nt1, mt2, nt2;    // tile grid per expert: dW1 [ceil(2F/128) x ceil(H/256)], dW2 [ceil(H/128) x ceil(F/256)]
  unsigned total;            // np * L * (mt1 * nt1 + mt2 * nt2) tickets
  long long cap;             // rows of each layout-order buffer
  const CUtensorMap* tm;     // [np][4]: xl [cap, H], gyl [cap, H], dh [cap, 2F], act [cap, F]; [64 x 64] boxes
  const int* const* tpe;     // [np] -> int32[L] rows per local expert (written by the dgrad kernel)
  const WgradOut* out1;      // [np * L] dW1
  const WgradOut* out2;      // [np * L] dW2
  unsigned* ticket;          // zeroed per launch
  int K;                     // top-k (home reductions)
  int home_parts;            // home ranks whose router grad / grad_x this launch computes (0: none)
  const HomeRank* home;      // [home_parts]
  unsigned* home_cursor;     // [2 * home_parts]: next router-grad entry, next grad_x token (zeroed per launch)
};

enum WgradKind : int { kWgExit = 0, kWgW1 = 1, kWgW2 = 2 };

struct WTile {
  int kind, p, e, m, n;
  int row0, rows;  // the expert's rows in the layout-order buffers
};

struct WSmem {
  uint8_t* stages;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* info_full;
  uint64_t* info_empty;
  WTile* info;
};

constexpr int kWgBoxBytes = 64 * kBK * 2;  // one [64 cols x 64 rows] bf16 box: 8 KB

__host__ __device__ constexpr int wgrad_smem_bytes() {
  return kStages * kStageBytes + (2 * kStages + 4) * 8 + 2 * (int)sizeof(WTile) + 64;
}

__device__ __forceinline__ WSmem wgrad_carve(uint8_t* smem) {
  WSmem s;
  s.stages = smem;
  s.full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  s.empty = s.full + kStages;
  s.info_full = s.empty + kStages;
  s.info_empty = s.info_full + 2;
  s.info = reinterpret_cast<WTile*>(s.info_empty + 2);
  return s;
}

// A operand map (columns = the tile's M) and B operand map (columns = N) of a tile kind.
__device__ __forceinline__ const CUtensorMap* wg_map_a(const WgradParams& P, int kind, int p) {
  return P.tm + 4 * p + (kind == kWgW1 ? 2 : 1);  // dh | gyl
}
__device__ __forceinline__ const CUtensorMap* wg_map_b(const WgradParams& P, int kind, int p) {
  return P.tm + 4 * p + (kind == kWgW1 ? 0 : 3);  // xl | act
}

// Warp 0 of the producer warpgroup: takes tickets, publishes the tile to the consumers, lane 0 issues
// the TMA loads (A: two [64 m x 64 rows] boxes, one per consumer warpgroup; B: four [64 n x 64 rows]).
__device__ void wgrad_producer(const WgradParams& P, const WSmem& sm, int lane) {
  const unsigned per_expert = (unsigned)(P.mt1 * P.nt1 + P.mt2 * P.nt2);
  const unsigned per_part = per_expert * (unsigned)P.L;
  int st = 0, ii = 0;
  uint32_t ph = 0, iph = 0;
  while (true) {
    WTile ti{};
    ti.kind = kWgExit;
    unsigned tk = 0;
    if (lane == 0) tk = aborted(P.base) ? P.total : atomicAdd(P.ticket, 1u);
    tk = __shfl_sync(0xffffffffu, tk, 0);
    if (tk < P.total) {
      const int p = (int)(tk / per_part);
      const int e = (int)((tk % per_part) / per_expert);
      int v = (int)(tk % per_expert);
      ti.p = p;
      ti.e = e;
      if (v < P.mt1 * P.nt1) {
        ti.kind = kWgW1;
        ti.m = v % P.mt1;
        ti.n = v / P.mt1;
      } else {
        v -= P.mt1 * P.nt1;
        ti.kind = kWgW2;
        ti.m = v % P.mt2;
        ti.n = v / P.mt2;
      }
      // the expert's first row: sum of the earlier experts' counts (warp-parallel; L2-resident)
      const int* tpe = P.tpe[p];
      long long s = 0;
      for (int i = lane; i < e; i += 32) s += tpe[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const int rows = tpe[e];
      if (rows < 0 || s < 0 || s + rows > P.cap) {  // counts not from a finished dgrad launch
        if (lane == 0) record_error(P.base, kErrBadShape, P.rank0 + p, e, kPhaseWgrad, P.cap, s + rows, rows);
        ti.kind = kWgExit;
      } else {
        ti.row0 = (int)s;
        ti.rows = rows;
      }
    }
    if (lane == 0) {
      mbar_wait(P.base, &sm.info_empty[ii], iph ^ 1u, ti.p, 1);
      sm.info[ii] = ti;
      Barrier::arrive(&sm.info_full[ii]);
    }
    if (++ii == 2) { ii = 0; iph ^= 1u; }
    if (ti.kind == kWgExit) return;
    if (lane == 0) {
      const CUtensorMap* ma = wg_map_a(P, ti.kind, ti.p);
      const CUtensorMap* mb = wg_map_b(P, ti.kind, ti.p);
      const int nk = ceil_div(ti.rows, kBK);
      for (int kb = 0; kb < nk; ++kb) {
        mbar_wait(P.base, &sm.empty[st], ph ^ 1u, ti.p, 2);
        uint8_t* s_a = sm.stages + st * kStageBytes;
        uint8_t* s_b = s_a + kATileBytes;
        const int row = ti.row0 + kb * kBK;
        Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
        for (int b = 0; b < 2; ++b) tma_load_2d(ma, &sm.full[st], s_a + b * kWgBoxBytes, ti.m * kBM + 64 * b, row);
        for (int b = 0; b < 4; ++b) tma_load_2d(mb, &sm.full[st], s_b + b * kWgBoxBytes, ti.n * kBN + 64 * b, row);
        if (++st == kStages) { st = 0; ph ^= 1u; }
      }
    }
    __syncwarp();
  }
}

// Zero rows [valid, 64) of this warpgroup's share of a stage: its A box and two of the four B boxes
// (rows are whole 128-byte lines: the swizzle only permutes 16-byte chunks inside a line).
__device__ __forceinline__ void wgrad_zero_tail(uint8_t* stage, int wgc, int valid, int lt) {
  const int lines = kBK - valid;
  const int per_box = lines * 8;  // uint4 per box
  for (int i = lt; i < 3 * per_box; i += 128) {
    const int b = i / per_box, j = i % per_box;
    uint8_t* box = b == 0 ? stage + wgc * kWgBoxBytes : stage + kATileBytes + (2 * wgc + b - 1) * kWgBoxBytes;
    reinterpret_cast<uint4*>(box + valid * 128)[j] = make_uint4(0, 0, 0, 0);
  }
}

__device__ void wgrad_consumer(const WgradParams& P, const WSmem& sm, int wgc) {
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  float acc[128];
  int st = 0, ii = 0;
  uint32_t ph = 0, iph = 0;
  while (true) {
    mbar_wait(P.base, &sm.info_full[ii], iph, -1, 3);
    const WTile ti = sm.info[ii];
    named_bar_sync(2 + wgc, 128);
    if (lt == 0) Barrier::arrive(&sm.info_empty[ii]);
    if (++ii == 2) { ii = 0; iph ^= 1u; }
    if (ti.kind == kWgExit) break;

    const int nk = ceil_div(ti.rows, kBK);
    int prev = 0;
    for (int kb = 0; kb < nk; ++kb) {
      mbar_wait(P.base, &sm.full[st], ph, ti.p, 4);
      uint8_t* stage = sm.stages + st * kStageBytes;
      const int valid = ti.rows - kb * kBK;
      if (valid < kBK) {  // the expert's last block: rows past its end must not contribute
        wgrad_zero_tail(stage, wgc, valid, lt);
        fence_view_async_shared();
        named_bar_sync(1, 256);  // both warpgroups read every box of the stage
      }
      const uint64_t da = make_smem_desc_sw128_mn(stage + wgc * kWgBoxBytes);
      const uint64_t db = make_smem_desc_sw128_mn(stage + kATileBytes);
      fence_acc(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_64x256x16_mnmn(da + kMnDescK16Step * kk, db + kMnDescK16Step * kk, acc, (kb > 0) || (kk > 0));
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
      fence_acc(acc);
      if (kb > 0 && lt == 0) Barrier::arrive(&sm.empty[prev]);
      prev = st;
      if (++st == kStages) { st = 0; ph ^= 1u; }
    }
    cute::warpgroup_wait<0>();
    fence_acc(acc);
    if (nk > 0 && lt == 0) Barrier::arrive(&sm.empty[prev]);
    if (nk == 0) {
      if (P.accumulate) continue;  // an expert without rows adds nothing
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    }

    // epilogue: fp32 rows straight from the fragments (lane quad -> 32 contiguous bytes per row)
    const bool w1 = ti.kind == kWgW1;
    const WgradOut o = (w1 ? P.out1 : P.out2)[ti.p * P.L + ti.e];
    const int Mtot = w1 ? 2 * P.F : P.H, Ntot = w1 ? P.H : P.F;
    const int r_lo = ti.m * kBM + wgc * 64 + warp_in_wg * 16 + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_lo + 8 * h;
      if (r >= Mtot) continue;
      float* row = o.ptr + (long long)r * o.ld;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int c = ti.n * kBN + 8 * j + 2 * (lane & 3);
        if (c >= Ntot) continue;  // Ntot is a multiple of 64: pairs never straddle the edge
        const float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        if (P.accumulate)
          red_add_f32x2(row + c, v);
        else
          *reinterpret_cast<float2*>(row + c) = v;
      }
    }
  }
}

// Warps 1-3 of the producer warpgroup: every home rank's router-grad entries, then its grad_x tokens,
// each item to the next free warp of the grid (56 registers here: 4 grad_buf rows in flight per lane).
__device__ void wgrad_home_work(const WgradParams& P) {
  const int lane = threadIdx.x & 31;
  for (int p = 0; p < P.home_parts; ++p) {
    const HomeRank h = P.home[p];
    const long long entries = (long long)h.T * P.K;
    for (long long e; (e = next_item(&P.home_cursor[2 * p], lane)) < entries;) router_grad_entry(h, e, P.K, P.H, lane);
  }
  for (int p = 0; p < P.home_parts; ++p) {
    const HomeRank h = P.home[p];
    for (long long t; (t = next_item(&P.home_cursor[2 * p + 1], lane)) < h.T;) grad_x_token<4>(h, (int)t, P.K, P.H, lane);
  }
}

// The dgrad launch before this one failed (its error record is set): its buffers hold no valid rows.
// Every output becomes NaN (also main_grad, and the deferred home reductions' grad_w / grad_x), so a
// training step stops at Megatron's NaN check of the gradients even when the error record is read
// lazily, after the step; the record names the cause.
__device__ void wgrad_poison(const WgradParams& P) {
  const float nan = __int_as_float(0x7fc00000);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (int p = 0; p < P.home_parts; ++p) {
    const HomeRank h = P.home[p];
    for (long long i = tid; i < (long long)h.T * P.K; i += stride) h.grad_w[i] = nan;
    const __nv_bfloat16 bnan = __float2bfloat16(nan);
    for (long long i = tid; i < (long long)h.T * P.H; i += stride) h.grad_x[i] = bnan;
  }
  const long long n1 = 2LL * P.F * P.H, n2 = (long long)P.H * P.F;
  const long long per_expert = n1 + n2;
  const long long total = per_expert * P.np * P.L;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int g = (int)(i / per_expert);
    long long j = i % per_expert;
    const bool w1 = j < n1;
    if (!w1) j -= n1;
    const int cols = w1 ? P.H : P.F;
    const WgradOut o = (w1 ? P.out1 : P.out2)[g];
    o.ptr[(j / cols) * o.ld + j % cols] = nan;
  }
}

__global__ void __launch_bounds__(kThreads, 1) mok_wgrad_kernel(const __grid_constant__ WgradParams P) {
  __shared__ int s_abort;
  if (threadIdx.x == 0) s_abort = aborted(P.base) ? 1 : 0;
  __syncthreads();
  if (s_abort) {
    wgrad_poison(P);
    return;
  }
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const WSmem sm = wgrad_carve(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&sm.full[s], 1);
      Barrier::init(&sm.empty[s], 2);
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(&sm.info_full[i], 1);
      Barrier::init(&sm.info_empty[i], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if (threadIdx.x < 32)
      wgrad_producer(P, sm, threadIdx.x);
    else if (P.home_parts > 0)
      wgrad_home_work(P);
  } else {
    setmaxnreg_inc<224>();
    wgrad_consumer(P, sm, wg - 1);
  }
}

}  // namespace bwd
}  // namespace mok
