// FP8 K loop of one 128 x 256 tile (two consumer warpgroups of 64 rows), shared by the forward kernel's
// fc1 / fc2 tiles (expert_ffn.cuh) and the backward kernel's dgrad stages (backward/bwd_gemm.cuh).
// Smem: the kernel's carve of the stage ring (fields stages, full, empty), filled by a TMA producer with
// [128 rows x 128 e4m3] A and [256 rows x 128 e4m3] B per stage (SW128, one scale block per K step).
#pragma once
#include "common.cuh"
#include "fp8_quant.cuh"
#include "gemm_sm90.cuh"
#include "timeout.cuh"

namespace mok {

// FP8 K loop of one tile: acc = sum_kb P_kb * sa[row, kb] * sb[col block, kb] (see rescale_half).
// sa0 / sa1: this thread's two rows' activation scales ([*, nkb] fp32, written in this kernel: read
// through L2), nullptr for rows past the tile; sb0 / sb1: the two column blocks' weight scales
// ([*, nkb], nullptr past the matrix). Each K block is one WGMMA group of four m64n256k32 (A read once
// for both 128-column scale blocks); before block kb's group the accumulator waits for block kb-1's
// (wait<0>) and is rescaled to block kb's scales, per row and per 128-column half.
//
// Why wait<0> and not a group per half with wait<1>: ptxas does not track which in-flight group writes
// which registers; an FMUL on a half whose group has landed while the other half's group still runs
// makes it serialise every wgmma of the kernel (warning C7514: each wgmma waits for the previous one).
// One drain per K block per warpgroup is cheap by comparison: the other consumer warpgroup's group keeps
// the tensor cores busy meanwhile.
// after_issue(kb) runs once block kb's group is in flight (held counter releases are flushed there, see
// deferred_release.cuh; the forward's fc2 tiles resolve their push rows at block 1).
//
// issued (optional, kStages mbarriers of 4 arrivals; nullptr = off): the second warpgroup issues a stage's
// group only after the first one's four warps have issued theirs on the same stage. Both warpgroups wait
// for the same stage, so unordered they issue together, the tensor cores interleave the two groups, both
// land at once and both drain and rescale while the tensor cores idle; ordered -- if the tensor cores run
// queued groups in issue order -- the first group lands while the second still runs and the first
// warpgroup's rescale hides behind it (measured: 2.6-4.6 % faster, far less than that would give; see order 2). The barrier's phase moves with
// the stage's (the first warpgroup can be at most the ring ahead: a stage is refilled only once both have
// released it), so the stage ring's phase bit `ph` is its phase too -- provided the first warpgroup arrives
// on every use of a stage, also on stages a caller takes outside this loop (the dgrad's g / u stages).
//
// after_landing (issue order 2, MOK_FP8_ISSUE_ORDER=2): the first warpgroup arrives once its group has
// landed (after its wait<0>) instead of once it is issued. Order 1 helps only if the tensor cores run the
// two queued groups one after the other; if they interleave them, both still land together. Order 2
// makes the second group start after the first has finished, whatever the tensor cores do with queued
// groups: the first warpgroup's rescale and its next issue overlap the second group, and the second
// warpgroup's rescale the first's next group. Its cost: the tensor cores wait for the barrier's signal
// before each second group (~tens of cycles) if nothing else is queued. Same results (the barrier only
// orders issues); timed against order 1 with bench_fp8.py --ab-env MOK_FP8_ISSUE_ORDER=2.
//
// Measured on the H200 (2026-12-05) and dropped: a strict ping-pong (each warpgroup issuing only once the
// other's previous group had landed) made the FP8 forward 14 % slower -- every hand-off leaves the tensor
// cores idle; committing each block as two halves and letting the second warpgroup go once the first half
// had landed was 1-3 % slower than order 1.
//
// Ablation build only, MOK_DEBUG bit 64: no drain per K block (wait<1> after the issue as in the bf16 loop;
// no rescale, results wrong; the issue orders fall back to order 1's signal): the FP8 tensor-core rate of
// this loop without the promotion, an upper bound for the issue orders (H200: 0.907 vs 1.115 us per fc1 K
// block of the ablation build's baseline; without only the FMULs, bit 32: 0.974 us).
//
// Stage st of the ring is free for its producer again (the forward's ComputeSmem has its own overload,
// expert_ffn.cuh: with 2-CTA clusters the partner's empty barrier hears of it too).
template <class Smem>
__device__ __forceinline__ void release_stage(const Smem& sm, int st) {
  Barrier::arrive(&sm.empty[st]);
}
struct NoHook {
  __device__ __forceinline__ void operator()(int) const {}
};
template <class Smem, class Hook = NoHook>
__device__ __forceinline__ void ffn_kloop_fp8(const Params& P, int q, const Smem& sm, int wgc, int nk,
                                              const float* sa0, const float* sa1, const float* sb0,
                                              const float* sb1, float* acc, int& st, uint32_t& ph,
                                              Hook after_issue = Hook{}, uint64_t* issued = nullptr,
                                              bool after_landing = false) {
  const int lt = threadIdx.x & 127;
  const bool no_drain = MOK_DBG(64);  // ablation build only (see above)
  if (no_drain) after_landing = false;
  // this warp of the first warpgroup signals `issued`: after its issue (order 1) or its landing (order 2)
  const bool signal_issue = issued != nullptr && wgc == 0 && (lt & 31) == 0 && !after_landing;
  const bool signal_landing = issued != nullptr && wgc == 0 && (lt & 31) == 0 && after_landing;
  // Scales are loaded one K block ahead (an L2 round trip per block would otherwise stall the promotion),
  // at the top of the block before its drain, so they have the drain and the previous block to land in.
  // (The tenth session moved the loads behind each tile's first issue to spare the tile start one L2 round
  // trip; side by side on the H100 that tree's FP8 tiles took 2.9 % (fc1) / 4.9 % (fc2) longer than the tree
  // with this schedule -- the move being the likeliest of its FP8 changes to cost that, this schedule is
  // back: scripts/NOTES-kernel.md, eleventh session.)
  float pa0 = 1.f, pa1 = 1.f, pb0 = 1.f, pb1 = 1.f;  // the previous block's scales
  float na0 = sa0 ? __ldcg(sa0) : 1.f, na1 = sa1 ? __ldcg(sa1) : 1.f;
  float nb0 = sb0 ? __ldg(sb0) : 1.f, nb1 = sb1 ? __ldg(sb1) : 1.f;
  int prev = 0;
  for (int kb = 0; kb < nk; ++kb) {
    const float a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
    if (kb + 1 < nk) {
      na0 = sa0 ? __ldcg(sa0 + kb + 1) : 1.f;
      na1 = sa1 ? __ldcg(sa1 + kb + 1) : 1.f;
      nb0 = sb0 ? __ldg(sb0 + kb + 1) : 1.f;
      nb1 = sb1 ? __ldg(sb1 + kb + 1) : 1.f;
    }
    if (kb > 0 && !no_drain) {
      cute::warpgroup_wait<0>();  // block kb-1 has landed: promote it to block kb's scales
      fence_acc(acc);
      if (signal_landing) Barrier::arrive(&issued[prev]);  // the second warpgroup may issue block kb-1
      if (!MOK_DBG(32)) {  // ablation build only: the drain without the promotion's FMULs (results wrong)
        rescale_half(acc, __fdividef(pa0 * pb0, a0 * b0), __fdividef(pa1 * pb0, a1 * b0));
        rescale_half(acc + 64, __fdividef(pa0 * pb1, a0 * b1), __fdividef(pa1 * pb1, a1 * b1));
      }
      if (lt == 0) release_stage(sm, prev);
    }
    MOK_PROGRESS(0x25000000u | (unsigned)(kb & 0xFFFF));
    mbar_wait(P, &sm.full[st], ph, q, 4);
    MOK_PROGRESS(0x26000000u | (unsigned)(kb & 0xFFFF));
    if (issued != nullptr && wgc == 1) mbar_wait(P, &issued[st], ph, q, 7);  // after the first warpgroup's group
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
    if (signal_issue) Barrier::arrive(&issued[st]);  // this warp's part issued
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
  if (signal_landing) Barrier::arrive(&issued[prev]);
  if (lt == 0) release_stage(sm, prev);
  rescale_half(acc, pa0 * pb0, pa1 * pb0);
  rescale_half(acc + 64, pa0 * pb1, pa1 * pb1);
}

}  // namespace mok
