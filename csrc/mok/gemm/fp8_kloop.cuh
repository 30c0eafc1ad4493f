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
  // The consumer warps' own instructions, not the tensor cores, set this loop's pace (docs/performance.md,
  // section 3), so the loop keeps branches and 64-bit arithmetic out. Every scale pointer is made valid here:
  // a row past the tile reads its neighbour's scales (with neither row in the tile, the first weight block's),
  // a column block past the matrix the first block's -- finite values whose products are never stored.
  if (sa0 == nullptr) {
    sa0 = sb0;
    sa_step = 0;
  }
  if (sa1 == nullptr) sa1 = sa0;
  if (sb1 == nullptr) sb1 = sb0;
  // Stage 0's descriptor low words (this warpgroup's 64 A rows; the 256 B rows of both column blocks). The
  // warpgroup index and the stage pass through a lane-0 shuffle: ptxas then knows them warp-uniform and builds
  // the descriptors in uniform registers (two moves a block instead of a 64-bit add and a move per WGMMA operand).
  const uint32_t a_lo = smem_desc_sw128_lo(sm.stages + __shfl_sync(0xffffffffu, wgc, 0) * (64 * kBKf8));
  const uint32_t b_lo = smem_desc_sw128_lo(sm.stages + kATileBytes);
  // 32-bit offsets: the largest, (nk - 1) * sa_step, is below the scale array's element count (its bytes / 4)
  const int a_step = (int)sa_step;
  // Scales are loaded one K block ahead (an L2 round trip per block would otherwise stall the promotion),
  // at the top of the block before its drain, so they have the drain and the previous block to land in; the
  // last block loads its own again rather than branch. (Loading them behind each tile's first issue instead,
  // to spare the tile start one L2 round trip, made the FP8 tiles 2.9 % (fc1) / 4.9 % (fc2) longer side by
  // side on an H100.)
  float pa0 = 1.f, pa1 = 1.f, pb0 = 1.f, pb1 = 1.f;  // the previous block's scales
  float na0 = __ldcg(sa0), na1 = __ldcg(sa1), nb0 = __ldg(sb0), nb1 = __ldg(sb1);
  int prev = 0;
  for (int kb = 0; kb < nk; ++kb) {
    const float a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
    const int kn = min(kb + 1, nk - 1);
    const int ka = kn * a_step;  // K-block-major activation scales: one step per block
    na0 = __ldcg(sa0 + ka);
    na1 = __ldcg(sa1 + ka);
    nb0 = __ldg(sb0 + kn);
    nb1 = __ldg(sb1 + kn);
    const uint32_t off = (uint32_t)__shfl_sync(0xffffffffu, st, 0) * (uint32_t)(kStageBytes >> 4);  // stage st
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
    fence_acc(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kBKf8 / 32; ++kk)  // one k32 step = 32 B of each SW128 row
      wgmma_64x256x32_e4m3(sw128_desc(a_lo + off + 2 * kk), sw128_desc(b_lo + off + 2 * kk), acc, (kb > 0) || (kk > 0));
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
