// FP8 K loop of one 128 x 256 tile (two consumer warpgroups of 64 rows), shared by the forward kernel's
// fc1 / fc2 tiles (expert_ffn.cuh) and the backward kernel's dgrad stages (backward/bwd_gemm.cuh).
// Smem: the kernel's carve of the stage ring (fields stages, full, empty), filled by a TMA producer with
// [128 rows x 128 e4m3] A and [256 rows x 128 e4m3] B per stage (SW128, one scale block per K step).
#pragma once
#include "common.cuh"
#include "quant/fp8_quant.cuh"
#include "gemm/gemm_sm90.cuh"
#include "comm/timeout.cuh"

namespace mok {

// FP8 K loop of one tile: acc = sum_kb P_kb * sa[row, kb] * sb[col block, kb] (see rescale_half).
// sa0 / sa1: this thread's two rows' activation scales, block kb at sa0[kb * sa_step] (fp32, written in this
// kernel: read through L2), nullptr for rows past the tile; sb0 / sb1: the two column blocks' weight scales
// ([*, nkb], nullptr past the matrix). Each K block is one WGMMA group of four m64n256k32 (A read once
// for both 128-column scale blocks); before block kb's group the accumulator waits for block kb-1's
// (wait<0>) and is rescaled to block kb's scales, per row and per 128-column half.
//
// Why wait<0> and not a group per half with wait<1>: ptxas does not track which in-flight group writes
// which registers; an FMUL on a half whose group has landed while the other half's group still runs
// makes it serialise every wgmma of the kernel (warning C7514: each wgmma waits for the previous one).
// One drain per K block per warpgroup is cheap by comparison: the other consumer warpgroup's group keeps
// the tensor cores busy meanwhile. (Ordering the two warpgroups' issues, and pipelining each block as two
// halves, were measured and dropped: docs/design.md, "Tried and rejected".)
// after_issue(kb) runs once block kb's group is in flight (held counter releases are flushed there, see
// deferred_release.cuh; the forward's fc2 tiles resolve their push rows at block 1).
//
// Ablation build only, MOK_DEBUG bit 64: no drain per K block (wait<1> after the issue as in the bf16 loop;
// no rescale, results wrong): the FP8 tensor-core rate of this loop without the promotion (H200: 0.907 vs
// 1.115 us per fc1 K block of the ablation build's baseline; without only the FMULs, bit 32: 0.974 us).

template <class Smem, class Hook = NoHook>
__device__ __forceinline__ void ffn_kloop_fp8(const Params& P, int q, const Smem& sm, int wgc, int nk,
                                              const float* sa0, const float* sa1, long long sa_step,
                                              const float* sb0, const float* sb1, float* acc, int& st, uint32_t& ph,
                                              Hook after_issue = Hook{}) {
  const int lt = threadIdx.x & 127;
  const bool no_drain = MOK_DBG(64);  // ablation build only (see above)
  // Scales are loaded one K block ahead (an L2 round trip per block would otherwise stall the promotion),
  // at the top of the block before its drain, so they have the drain and the previous block to land in.
  // (Loading them behind each tile's first issue instead, to spare the tile start one L2 round trip, made the
  // FP8 tiles 2.9 % (fc1) / 4.9 % (fc2) longer side by side on an H100.)
  float pa0 = 1.f, pa1 = 1.f, pb0 = 1.f, pb1 = 1.f;  // the previous block's scales
  float na0 = sa0 ? __ldcg(sa0) : 1.f, na1 = sa1 ? __ldcg(sa1) : 1.f;
  const float *ka0 = sa0, *ka1 = sa1;  // the last loaded block's scale (K-block-major: one step per block)
  float nb0 = sb0 ? __ldg(sb0) : 1.f, nb1 = sb1 ? __ldg(sb1) : 1.f;
  int prev = 0;
  for (int kb = 0; kb < nk; ++kb) {
    const float a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
    if (kb + 1 < nk) {
      if (sa0) na0 = __ldcg(ka0 += sa_step);
      if (sa1) na1 = __ldcg(ka1 += sa_step);
      nb0 = sb0 ? __ldg(sb0 + kb + 1) : 1.f;
      nb1 = sb1 ? __ldg(sb1 + kb + 1) : 1.f;
    }
    if (kb > 0 && !no_drain) {
      cute::warpgroup_wait<0>();  // block kb-1 has landed: promote it to block kb's scales
      fence_acc(acc);
      if (!MOK_DBG(32)) {  // ablation build only: the drain without the promotion's FMULs (results wrong)
        rescale_half(acc, __fdividef(pa0 * pb0, a0 * b0), __fdividef(pa1 * pb0, a1 * b0));
        rescale_half(acc + 64, __fdividef(pa0 * pb1, a0 * b1), __fdividef(pa1 * pb1, a1 * b1));
      }
      if (lt == 0) release_stage(sm, prev);
    }
    mbar_wait(P, &sm.full[st], ph, q, 4);
    const uint8_t* a_s = sm.stages + st * kStageBytes + wgc * (64 * kBKf8);
    const uint8_t* b_s = sm.stages + st * kStageBytes + kATileBytes;
    const uint64_t da = make_smem_desc_sw128(a_s);
    fence_acc(acc);
    cute::warpgroup_arrive();
    const uint64_t db = make_smem_desc_sw128(b_s);  // 256 rows of 128 B: both column blocks
#pragma unroll
    for (int kk = 0; kk < kBKf8 / 32; ++kk)
      wgmma_64x256x32_e4m3(da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), acc, (kb > 0) || (kk > 0));
    cute::warpgroup_commit_batch();
    after_issue(kb);
    if (no_drain && kb > 0) {  // ablation: block kb-1 has landed while block kb runs
      cute::warpgroup_wait<1>();
      fence_acc(acc);
      if (lt == 0) release_stage(sm, prev);
    }
    pa0 = a0; pa1 = a1; pb0 = b0; pb1 = b1;
    prev = st;
    if (++st == kStages) { st = 0; ph ^= 1u; }
  }
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  if (lt == 0) release_stage(sm, prev);
  rescale_half(acc, pa0 * pb0, pa1 * pb0);
  rescale_half(acc + 64, pa0 * pb1, pa1 * pb1);
}

}  // namespace mok
