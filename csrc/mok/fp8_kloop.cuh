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
// ---------------------------------------------------------------------------------------------------------
// Pipelined halves (a build with MOK_FP8_KLOOP=2): the same sum as ffn_kloop_fp8 below, but each K
// block is two groups of four m64n128k32 -- L (acc[0, 64): columns 0-127, weight scale block sb0) and H
// (acc[64, 128): columns 128-255, sb1) -- and a half is promoted while the other half's group runs:
//
//   L_kb issued; wait<1> (H_kb-1 landed, L_kb runs); rescale H; H_kb issued; wait<1> (L_kb landed, H_kb
//   runs); rescale L; L_kb+1 issued; ...
//
// so this warpgroup's tensor-core queue never empties for a promotion. ptxas tracks which group a
// wait<1> retires only inside straight-line code: a group still in flight across a loop back edge makes it
// serialise every wgmma of the kernel (C7514, measured in the third session's first try and again in a
// proxy). So the loop runs U blocks unrolled per iteration and drains (wait<0>) once at its end: per U
// blocks one drain and the promotion of one half (64 FMULs) are exposed, instead of U drains and U x 128
// FMULs. A remainder of nk % U blocks runs one block per iteration. Same arithmetic per element as
// ffn_kloop_fp8 (same FMULs, same MMAs per element), so the same bits.
// The cost: A is read from smem twice per K step (once per half) instead of once.
struct Fp8SplitState {
  const float *sa0, *sa1;
  long long sa_step;
  const float *sb0, *sb1;
  int nk;
  float pa0 = 1.f, pa1 = 1.f, pb0 = 1.f, pb1 = 1.f;  // the scales acc is in units of (the last block's)
  float na0 = 1.f, na1 = 1.f, nb0 = 1.f, nb1 = 1.f;  // the next block's, loaded one block ahead
  __device__ __forceinline__ void load(int kb) {
    if (kb < nk) {
      na0 = sa0 ? __ldcg(sa0 + kb * sa_step) : 1.f;
      na1 = sa1 ? __ldcg(sa1 + kb * sa_step) : 1.f;
      nb0 = sb0 ? __ldg(sb0 + kb) : 1.f;
      nb1 = sb1 ? __ldg(sb1 + kb) : 1.f;
    }
  }
};
__device__ __forceinline__ void fence_acc_half(float* d) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(d[i]);
}
// one half's group of block kb on stage st: A rows of this warpgroup, B rows [128 * half, +128)
__device__ __forceinline__ void issue_fp8_half(const uint8_t* stage, int wgc, int half, float* d, bool first_block) {
  const uint64_t da = make_smem_desc_sw128(stage + wgc * (64 * kBKf8));
  const uint64_t db = make_smem_desc_sw128(stage + kATileBytes + half * (128 * kBKf8));
  fence_acc_half(d);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kBKf8 / 32; ++kk)
    wgmma_64x128x32_e4m3(da + (uint64_t)(2 * kk), db + (uint64_t)(2 * kk), d, !first_block || (kk > 0));
  cute::warpgroup_commit_batch();
  fence_acc_half(d);
}
// U blocks [k0, k0 + U) with nothing in flight on entry and on exit (see above).
template <int U, class Smem, class Hook>
__device__ __forceinline__ void fp8_split_blocks(const Params& P, int q, const Smem& sm, int wgc, int k0,
                                                 Fp8SplitState& s, float* acc, int& st, uint32_t& ph,
                                                 Hook& after_issue, uint64_t* issued, bool after_landing) {
  const int lt = threadIdx.x & 127;
  const bool signal = issued != nullptr && wgc == 0 && (lt & 31) == 0;
  bool stalled = false;  // a stage wait timed out (recorded): trap once nothing is in flight
  int prev = 0;
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int kb = k0 + j;
    const float a0 = s.na0, a1 = s.na1, b0 = s.nb0, b1 = s.nb1;
    s.load(kb + 1);
    const float fl0 = __fdividef(s.pa0 * s.pb0, a0 * b0), fl1 = __fdividef(s.pa1 * s.pb0, a1 * b0);
    const float fh0 = __fdividef(s.pa0 * s.pb1, a0 * b1), fh1 = __fdividef(s.pa1 * s.pb1, a1 * b1);
    MOK_PROGRESS(0x25000000u | (unsigned)(kb & 0xFFFF));
    bool ok = mbar_wait_in_flight(P, &sm.full[st], ph, q, 4);
    MOK_PROGRESS(0x26000000u | (unsigned)(kb & 0xFFFF));
    if (issued != nullptr && wgc == 1) ok = mbar_wait_in_flight(P, &issued[st], ph, q, 7) && ok;
    stalled |= !ok;
    const uint8_t* stage = sm.stages + st * kStageBytes;
    if (j > 0) {
      cute::warpgroup_wait<1>();  // L of block kb-1 has landed, H of block kb-1 runs
      fence_acc_half(acc);
    }
    // block 0: acc is discarded (its first WGMMA overwrites it). At j == 0 nothing is in flight and both
    // halves are promoted here: ptxas injects a wait before an FMUL on registers that a WGMMA of an
    // earlier loop iteration wrote while another group is in flight (C7517), even after a wait<0>.
    rescale_half(acc, fl0, fl1);
    if (j == 0) {
      rescale_half(acc + 64, fh0, fh1);
      fence_acc_half(acc + 64);  // the FMULs stay here, not sunk behind the first half's WGMMAs
    }
    issue_fp8_half(stage, wgc, 0, acc, kb == 0);
    if (signal && !after_landing) Barrier::arrive(&issued[st]);
    if (j > 0) {
      cute::warpgroup_wait<1>();  // H of block kb-1 has landed, L of block kb runs
      fence_acc_half(acc + 64);
      if (signal && after_landing) Barrier::arrive(&issued[prev]);
      if (lt == 0) release_stage(sm, prev);
    }
    if (j > 0) rescale_half(acc + 64, fh0, fh1);
    issue_fp8_half(stage, wgc, 1, acc + 64, kb == 0);
    after_issue(kb);
    s.pa0 = a0; s.pa1 = a1; s.pb0 = b0; s.pb1 = b1;
    prev = st;
    if (++st == kStages) { st = 0; ph ^= 1u; }
  }
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  if (stalled) fatal_trap();
  if (signal && after_landing) Barrier::arrive(&issued[prev]);
  if (lt == 0) release_stage(sm, prev);
}
template <int U, class Smem, class Hook>
__device__ __forceinline__ void ffn_kloop_fp8_split(const Params& P, int q, const Smem& sm, int wgc, int nk,
                                                    const float* sa0, const float* sa1, long long sa_step,
                                                    const float* sb0, const float* sb1, float* acc, int& st,
                                                    uint32_t& ph, Hook& after_issue, uint64_t* issued,
                                                    bool after_landing) {
  Fp8SplitState s{sa0, sa1, sa_step, sb0, sb1, nk};
  s.load(0);
  int kb = 0;
  for (; kb + U <= nk; kb += U) fp8_split_blocks<U>(P, q, sm, wgc, kb, s, acc, st, ph, after_issue, issued, after_landing);
  for (; kb < nk; ++kb) fp8_split_blocks<1>(P, q, sm, wgc, kb, s, acc, st, ph, after_issue, issued, after_landing);
  rescale_half(acc, s.pa0 * s.pb0, s.pa1 * s.pb0);
  rescale_half(acc + 64, s.pa0 * s.pb1, s.pa1 * s.pb1);
}

// The K loop a build holds (MOK_FP8_KLOOP, set by megatron_mok/kernel/build.py from the variable of the
// same name: 0 one drained m64n256 group per K block, below; 2 pipelined halves, ffn_kloop_fp8_split). A
// build-time choice: with both loops behind a runtime branch, their accumulators join and ptxas serialises
// every wgmma (C7515).
#ifndef MOK_FP8_KLOOP
#define MOK_FP8_KLOOP 0
#endif
static_assert(MOK_FP8_KLOOP == 0 || MOK_FP8_KLOOP == 2, "MOK_FP8_KLOOP must be 0 or 2");

template <class Smem, class Hook = NoHook>
__device__ __forceinline__ void ffn_kloop_fp8(const Params& P, int q, const Smem& sm, int wgc, int nk,
                                              const float* sa0, const float* sa1, long long sa_step,
                                              const float* sb0, const float* sb1, float* acc, int& st, uint32_t& ph,
                                              Hook after_issue = Hook{}, uint64_t* issued = nullptr,
                                              bool after_landing = false) {
  if constexpr (MOK_FP8_KLOOP == 2) {
    ffn_kloop_fp8_split<2>(P, q, sm, wgc, nk, sa0, sa1, sa_step, sb0, sb1, acc, st, ph, after_issue, issued,
                           after_landing);
    return;
  }
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
  const float *ka0 = sa0, *ka1 = sa1;  // MOK_FP8_SCALE_KMAJOR: the last loaded block's scale (one step per block)
  float nb0 = sb0 ? __ldg(sb0) : 1.f, nb1 = sb1 ? __ldg(sb1) : 1.f;
  int prev = 0;
  for (int kb = 0; kb < nk; ++kb) {
    const float a0 = na0, a1 = na1, b0 = nb0, b1 = nb1;
    if (kb + 1 < nk) {
      if constexpr (MOK_FP8_SCALE_KMAJOR) {  // a step of sa_step floats per block (the default: 1, below)
        if (sa0) na0 = __ldcg(ka0 += sa_step);
        if (sa1) na1 = __ldcg(ka1 += sa_step);
      } else {
        na0 = sa0 ? __ldcg(sa0 + kb + 1) : 1.f;
        na1 = sa1 ? __ldcg(sa1 + kb + 1) : 1.f;
      }
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
