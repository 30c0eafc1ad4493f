// bf16 K loop of one consumer warpgroup's 64 rows of a tile, shared by the forward's fc1 / fc2 tiles
// (forward/expert_ffn.cuh) and the backward's dgrad stages (backward/bwd_gemm.cuh). Stages: SW128 [128 rows x 64]
// A (this warpgroup's 64 rows at wgc * 64) and [N rows x 64] B per K block (kBK = 64), filled by the kernel's TMA
// producer (full / empty mbarriers).
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"
#include "gemm/gemm_sm90.cuh"

namespace mok {

// acc (+)= A_kb B_kb^T over nk K blocks: per block one group of four m64nNk16 WGMMAs (N = 256: acc[128], or 128:
// acc[64]; B K-major, or MN-major as stored with kBMn), one group kept in flight (wait<1>). after_issue(kb) runs
// once block kb's group is in flight (held releases flushed there, their fences hidden by the MMAs); block kb-1's
// stage goes back to the producer once its group has landed. prev: the last stage used, carried across the loops
// of one tile; the caller drains the last group (wait<0>) and releases prev.
template <int kN, bool kBMn = false, class Smem, class Hook = NoHook>
__device__ __forceinline__ void bf16_kloop(const Params& P, int q, const Smem& sm, int wgc, int nk, float* acc, int& st,
                                           uint32_t& ph, int& prev, Hook after_issue = Hook{}) {
  static_assert(kN == 256 || (kN == 128 && !kBMn), "bf16 K loop: m64n256 (B K- or MN-major) or m64n128 (B K-major)");
  const int lt = threadIdx.x & 127;
  for (int kb = 0; kb < nk; ++kb) {
    mbar_wait(P, &sm.full[st], ph, q, 4);
    const uint8_t* a_s = sm.stages + st * kStageBytes + wgc * (64 * kBK * 2);
    const uint8_t* b_s = sm.stages + st * kStageBytes + kATileBytes;
    const uint64_t da = make_smem_desc_sw128(a_s);
    const uint64_t db = kBMn ? make_smem_desc_sw128_mn(b_s) : make_smem_desc_sw128(b_s);
    if constexpr (kN == 256) fence_acc(acc);
    else fence_acc64(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      if constexpr (kN == 128)
        wgmma_64x128x16(da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), acc, (kb > 0) || (kk > 0));
      else if constexpr (kBMn)
        wgmma_64x256x16_bmn(da + (uint64_t)(2 * kk), db + kMnDescK16Step * kk, acc, (kb > 0) || (kk > 0));
      else
        wgmma_64x256x16(da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), acc, (kb > 0) || (kk > 0));
    }
    cute::warpgroup_commit_batch();
    after_issue(kb);
    cute::warpgroup_wait<1>();
    if constexpr (kN == 256) fence_acc(acc);
    else fence_acc64(acc);
    if (kb > 0 && lt == 0) release_stage(sm, prev);
    prev = st;
    if (++st == kStages) { st = 0; ph ^= 1u; }
  }
}

}  // namespace mok
