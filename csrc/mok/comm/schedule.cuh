// In-kernel schedule: from all ranks' topk_idx build, for every owner rank q, the expert-major layout
//   rows of local expert e ordered by (src_rank asc, token asc, k asc), experts concatenated,
// plus tokens_per_expert. Three phases separated by grid barriers (no host sync, no extra launches):
//   A  one warp per chunk of kChunkTokens tokens: per-expert counts of the chunk and each entry's
//      rank among same-expert entries of its chunk (warp match_any, entries in (t,k) order).
//      Also validates indices and zeroes combine rows of unused (-1) slots.
//   B  one warp per expert: exclusive scan of the chunk counts over chunks (chunks are ordered by
//      (src rank, token)), giving each chunk's base inside the expert; expert totals.
//   C  every CTA derives the expert offsets of every owner (smem), then writes the layout rows of the
//      owners that run in this launch (its own rank in a per-rank launch; every rank when one launch runs them all).
//      An owner whose total exceeds P.owner_rows (its row buffers' capacity) is recorded as kErrCapacity;
//      the kernels check for it after the following grid barrier, before any row buffer is written.
// A per-rank launch reads every rank's topk_idx through peer pointers and repeats A/B for all ranks:
// the owner needs every source's routing to know what to pull, and it costs T*K*4 bytes per peer.
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"

namespace mok {

__device__ __forceinline__ int chunk_to_rank(const Params& P, int g) {
  int r = 0;
  while (r + 1 < P.R && P.ranks[r + 1].chunk_base <= g) ++r;
  return r;
}

// Entries of a chunk a warp reads ahead (kSchedBatch x 32 idx loads in flight): phases A and C walk a
// chunk (kChunkTokens x K entries) in groups of 32, and one dependent global round trip per group (idx,
// then the counts) made the schedule latency-bound -- a few dozen warps each waiting ~2 L2 round trips
// per group, while the rest of the grid waits at the next grid barrier.
constexpr int kSchedBatch = 4;

// The routing entries [e0, e1) of chunk g (kChunkTokens tokens x K of source rank r).
__device__ __forceinline__ void chunk_entries(const Params& P, const RankTable& rt, int g, int& e0, int& e1) {
  const int c = g - rt.chunk_base;
  const int t0 = c * kChunkTokens;
  e0 = t0 * P.K;
  e1 = min(rt.T, t0 + kChunkTokens) * P.K;
}

// This lane's routing entries b0 + 32u + lane (u < kSchedBatch) of a chunk ending at e1, all loads in
// flight together (-1 past the chunk).
__device__ __forceinline__ void read_entries_ahead(const RankTable& rt, int b0, int e1, int lane, int (&exs)[kSchedBatch]) {
#pragma unroll
  for (int u = 0; u < kSchedBatch; ++u) {
    const int ent = b0 + 32 * u + lane;
    exs[u] = ent < e1 ? rt.idx[ent] : -1;
  }
}

// Phase A. s_cnt: dynamic smem of cnt_ints ints (>= MOK_MAX_EXPERTS, static_assert at the callers),
// free during the schedule. Each counting warp keeps its chunk's per-expert counts in E ints of its own
// there (an L2 read-modify-write per group of 32 entries before), and writes the nonzero ones out to
// chunk_counts (zeroed per launch) when its chunk is done. With many experts fewer warps per CTA count
// (min(kWarps, cnt_ints / E): at least 6 for MOK_MAX_EXPERTS); which warp counts which chunk does not
// change any result.
static __device__ void schedule_count(const Params& P, int* s_cnt, int cnt_ints) {
  const int lane = threadIdx.x & 31;
  const int wpc = min(kWarps, cnt_ints / max(P.E, 1));  // counting warps per CTA
  const int wid = threadIdx.x >> 5;
  if (wid >= wpc) return;
  const int gwarp = blockIdx.x * wpc + wid;
  const int nwarps = gridDim.x * wpc;
  int* wcnt = s_cnt + wid * P.E;
  for (int e = lane; e < P.E; e += 32) wcnt[e] = 0;  // zero again by the write-out of each chunk
  __syncwarp();
  for (int g = gwarp; g < P.num_chunks; g += nwarps) {
    const int r = chunk_to_rank(P, g);
    const RankTable rt = P.ranks[r];
    int e0, e1;
    chunk_entries(P, rt, g, e0, e1);
    for (int b0 = e0; b0 < e1; b0 += 32 * kSchedBatch) {
      int exs[kSchedBatch];
      read_entries_ahead(rt, b0, e1, lane, exs);
#pragma unroll
      for (int u = 0; u < kSchedBatch; ++u) {
        const int base = b0 + 32 * u;
        if (base >= e1) break;  // warp-uniform
        const int ent = base + lane;
        int ex = exs[u];
        if (ent < e1 && (ex < -1 || ex >= P.E)) {
          record_error(P, kErrBadIndex, r, ent / P.K, kPhaseSchedule, P.E, ex, ent % P.K);
          ex = -1;
        }
        const bool valid = ex >= 0;  // (ent >= e1: ex = -1)
        const unsigned same = __match_any_sync(0xffffffffu, valid ? ex : -1);
        const unsigned lt = (1u << lane) - 1u;
        int prev = 0;
        if (valid) prev = wcnt[ex];
        __syncwarp();
        if (valid) {
          P.local_rank[rt.entry_base + ent] = prev + __popc(same & lt);
          if ((same & lt) == 0) wcnt[ex] = prev + __popc(same);
        }
        __syncwarp();
        // zero the combine rows of unused slots (idx == -1): combine_buf is defined as 0 there
        // (only the home rank's own launch writes its combine buffer)
        unsigned inval = __ballot_sync(0xffffffffu, ent < e1 && !valid && in_launch(P, r));
        while (inval) {
          const int src = __ffs(inval) - 1;
          inval &= inval - 1;
          const long long row = base + src;
          uint4* dst = reinterpret_cast<uint4*>(rt.combine + row * P.H);
          for (int v = lane; v < P.H / 8; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __syncwarp();
    for (int e = lane; e < P.E; e += 32) {  // the chunk's nonzero counts out (chunk_counts is zero elsewhere)
      const int n = wcnt[e];
      if (n != 0) {
        P.chunk_counts[(long long)e * P.num_chunks + g] = n;
        wcnt[e] = 0;
      }
    }
    __syncwarp();  // before the next chunk counts
  }
}

// Phase B
static __device__ void schedule_scan(const Params& P) {
  const int lane = threadIdx.x & 31;
  const int gwarp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nwarps = gridDim.x * kWarps;
  for (int e = gwarp; e < P.E; e += nwarps) {
    int* cc = P.chunk_counts + (long long)e * P.num_chunks;
    int running = 0;
    for (int base = 0; base < P.num_chunks; base += 32) {
      const int i = base + lane;
      const int v = i < P.num_chunks ? cc[i] : 0;
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      if (i < P.num_chunks) cc[i] = running + incl - v;
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) P.expert_total[e] = running;
  }
}

// Phase C. s_start: dynamic smem, >= E ints.
static __device__ void schedule_place(const Params& P, int* s_start) {
  for (int e = threadIdx.x; e < P.E; e += blockDim.x) s_start[e] = P.expert_total[e];
  __syncthreads();
  if (threadIdx.x < P.R) {
    const int q = threadIdx.x;
    const bool mine = blockIdx.x == 0 && in_launch(P, q);
    int run = 0;
    for (int e = 0; e < P.L; ++e) {
      const int tot = s_start[q * P.L + e];
      s_start[q * P.L + e] = run;
      if (mine) {
        P.expert_off[part(P, q) * (P.L + 1) + e] = run;
        P.ranks[q].tokens_per_expert[e] = tot;
      }
      run += tot;
    }
    if (mine) P.expert_off[part(P, q) * (P.L + 1) + P.L] = run;
    // every launch sees every owner's total (all ranks' routing is read), so every rank reports the
    // same overflow and leaves after the next grid barrier: no rank waits for a peer that left
    if (blockIdx.x == 0 && run > P.owner_rows) record_error(P, kErrCapacity, q, -1, kPhaseSchedule, P.owner_rows, run, 0);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int gwarp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nwarps = gridDim.x * kWarps;
  for (int g = gwarp; g < P.num_chunks; g += nwarps) {
    const int r = chunk_to_rank(P, g);
    const RankTable rt = P.ranks[r];
    int e0, e1;
    chunk_entries(P, rt, g, e0, e1);
    // kSchedBatch groups at a time, in three sweeps (idx; then counts and ranks; then the stores), so each
    // sweep's loads are in flight together: the layout stores may alias the loads as far as the compiler
    // knows, so one loop per entry would serialise two round trips per group
    for (int b0 = e0; b0 < e1; b0 += 32 * kSchedBatch) {
      int exs[kSchedBatch];
      read_entries_ahead(rt, b0, e1, lane, exs);
      long long pos[kSchedBatch];
#pragma unroll
      for (int u = 0; u < kSchedBatch; ++u) {
        const int ent = b0 + 32 * u + lane;
        const int ex = exs[u];
        pos[u] = -1;
        // (invalid indices were recorded in phase A; another launch lays out its own experts)
        if (ex < 0 || ex >= P.E || !in_launch(P, ex / P.L)) continue;
        pos[u] = (long long)s_start[ex] + P.chunk_counts[(long long)ex * P.num_chunks + g] +
                 P.local_rank[rt.entry_base + ent];
      }
#pragma unroll
      for (int u = 0; u < kSchedBatch; ++u) {
        const int ent = b0 + 32 * u + lane;
        if (pos[u] >= 0 && pos[u] < P.layout_cap)
          P.layout[(long long)part(P, exs[u] / P.L) * P.layout_cap + pos[u]] = make_int2(r, ent);
      }
    }
  }
}

}  // namespace mok
