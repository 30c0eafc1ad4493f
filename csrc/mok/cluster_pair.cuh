// 2-CTA clusters (MOK_CLUSTER=2, forward): the two compute CTAs of a cluster run the tiles of one work
// ticket (pair_tiles.cuh) and share the weight tile through TMA multicast. What couples the two CTAs:
//
//   * ticket mailbox: the leader's producer (cluster rank 0) draws the ticket, waits for BOTH tiles'
//     dependencies (ready / fc1_done counters) and sends {ticket, go} into the follower's shared memory
//     (st.shared::cluster, then a remote mbarrier arrive with release at cluster scope; the follower waits
//     with acquire at cluster scope). One side decides, so both producers walk the same tickets, the same
//     K blocks and the same stage indices -- also when an abort makes the leader send "exit": the stage
//     pipelines of both CTAs then still only wait for what the other one is sure to do, as in one CTA.
//   * stage ring: a stage of either CTA is refilled only when BOTH CTAs' consumers released it (empty
//     barriers count 4 arrivals: each consumer warpgroup arrives on its own CTA's and the partner's), since
//     the partner's multicast writes into it; each CTA's full barrier expects its whole 48 KB stage, of which
//     16 KB come from the partner's multicast in a shared unit (complete_tx may reach a full barrier before
//     its own producer's expect_tx: the tx-count may go negative, the phase cannot complete without that
//     producer's arrival).
//   * cluster barrier: after the barrier init (the partner's remote arrivals need initialised barriers) and
//     before a CTA exits (no remote arrival or multicast may target an exited CTA's shared memory). It counts
//     whole warps (see cluster_arrive): the producer's warp arrives with it once it is done; the warps that
//     never touch the partner's shared memory (warps 1-3) arrive on the second phase once their in-SM pulls
//     are over (at once without them): an arrival left pending while they pulled stalled the pulls
//     (expert_ffn.cuh: compute_role).
#pragma once
#include "common.cuh"
#include "gemm_sm90.cuh"
#include "timeout.cuh"

namespace mok {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Whole converged warps only (.aligned). The cluster barrier is a warp-level instruction on sm_90
// (UCGABAR_ARV / UCGABAR_WAIT); ptxas lowers the non-aligned PTX form to a divergence check whose slow path
// waits for the warp to converge. Measured on the H100: with lanes 1-31 of the producer's warp arriving
// while lane 0 still ran the producer loop, clustered launches never finished (scripts/diagnose_hang.py:
// lane 1 stuck before its arrival, the producer stuck before its own, the consumers in their wait).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// An arrival that publishes nothing (no fence: the warps that use it never wrote what the partner reads).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// Shared-memory address of the same variable in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t cluster_map(const void* local, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(r)
               : "r"((uint32_t)__cvta_generic_to_shared(local)), "r"(cta));
  return r;
}
// Arrive on the mbarrier at the same place in CTA `cta`; release at cluster scope (orders this thread's
// earlier accesses, also its shared::cluster stores, before the arrival).
__device__ __forceinline__ void remote_arrive_release(uint64_t* local_bar, uint32_t cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_map(local_bar, cta))
               : "memory");
}
// Parity wait on a local mbarrier that remote threads release at cluster scope (the ticket mailbox).
__device__ __forceinline__ bool mbar_try_wait_cluster(uint64_t* bar, uint32_t phase) {
  uint32_t ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.b32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"((uint32_t)__cvta_generic_to_shared(bar)), "r"(phase)
      : "memory");
  return ok != 0;
}
// As mbar_wait (timeout.cuh): the partner always sends (a ticket or "exit"), so this completes unless there
// is a bug; after the bug guard's time it records kErrInternal and traps. The guard is longer than the
// stage ring's: before sending, the leader may wait on two counters with twice the timeout each.
__device__ __forceinline__ void mbar_wait_cluster(const Params& P, uint64_t* bar, uint32_t phase, int rank, int what) {
  if (mbar_try_wait_cluster(bar, phase)) return;
  if (!spin_or_record(P, [&] { return mbar_try_wait_cluster(bar, phase); }, 6, phase, rank, what)) fatal_trap();
}

// The producers' ticket mailbox: 2 entries in the follower's shared memory; `full` lives in the follower
// (the leader arrives remotely), `empty` in the leader (the follower arrives remotely once it read the entry).
struct TicketBox {
  uint64_t* full;   // [2], count 1
  uint64_t* empty;  // [2], count 1
  int2* entry;      // [2] {ticket, go (1) / exit (0)}
};

// Leader: the n-th message (n counts from 0 in both producers).
__device__ __forceinline__ void ticket_send(const Params& P, const TicketBox& box, int n, unsigned ticket, int go, int q) {
  const int i = n & 1;
  const uint32_t ph = (uint32_t)(n >> 1) & 1u;
  mbar_wait_cluster(P, &box.empty[i], ph ^ 1u, q, 8);  // the follower read entry i's previous message
  asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(cluster_map(&box.entry[i], 1)), "r"(ticket), "r"(go)
               : "memory");
  remote_arrive_release(&box.full[i], 1);
}
// Follower: the n-th message.
__device__ __forceinline__ int2 ticket_receive(const Params& P, const TicketBox& box, int n, int q) {
  const int i = n & 1;
  const uint32_t ph = (uint32_t)(n >> 1) & 1u;
  mbar_wait_cluster(P, &box.full[i], ph, q, 9);
  int2 m;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
               : "=r"(m.x), "=r"(m.y)
               : "r"((uint32_t)__cvta_generic_to_shared(&box.entry[i]))
               : "memory");
  remote_arrive_release(&box.empty[i], 0);
  return m;
}

// Both CTAs of a cluster go on to their roles, or neither does (every thread of both calls this with its
// CTA's verdict): a CTA whose partner has left would wait for its stage releases until the bug guard traps.
// s_flag: a shared int at the same place in both CTAs.
__device__ __forceinline__ bool pair_agree(bool ok, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) *s_flag = ok ? 1 : 0;
  __syncwarp();  // converged warps for the aligned cluster barrier
  cluster_arrive();
  cluster_wait();
  // A CTA that failed may have left before grid barrier 3 (a per-CTA verdict), so only a CTA that passed it
  // reads the partner's flag -- then every CTA arrived at barrier 3 and the partner is still here.
  int other = 0;
  if (ok)
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(other) : "r"(cluster_map(s_flag, cluster_cta_rank() ^ 1u))
                 : "memory");
  __syncwarp();
  cluster_arrive();  // both have read before either moves on (and may exit or reuse s_flag)
  cluster_wait();
  return ok && other != 0;
}

// TMA 2-D load of a box into the same smem offset of both CTAs of the pair, completing on each one's
// barrier at the same offset.
__device__ __forceinline__ void tma_load_2d_pair(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1) {
  cute::SM90_TMA_LOAD_MULTICAST_2D::copy(map, bar, (uint16_t)0x3, 0x1000000000000000ull /*EVICT_NORMAL*/, smem, c0, c1);
}

}  // namespace mok
