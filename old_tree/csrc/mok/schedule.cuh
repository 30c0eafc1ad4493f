// In-kernel schedule: from all ranks' topk_idx build, for every owner rank q, the expert-major layout
//   rows of local expert e ordered by (src_rank asc, token asc, k asc), experts concatenated,
// plus tokens_per_expert. Three phases separated by grid barriers (no host sync, no extra launches):
//   A  one warp per chunk of kChunkTokens tokens: per-expert counts of the chunk and each entry's
//      rank among same-expert entries of its chunk (warp match_any, entries in (t,k) order).
//      Also validates indices and zeroes combine rows of unused (-1) slots.
//   B  one warp per expert: exclusive scan of the chunk counts over chunks (chunks are ordered by
//      (src rank, token)), giving each chunk's base inside the expert; expert totals.
//   C  every CTA derives the expert offsets of every owner (smem), then writes the layout rows of the
//      owners that run in this launch (all of them in emulated EP, its own rank in a per-rank launch).
//      An owner whose total exceeds P.owner_rows (its row buffers' capacity) is recorded as kErrCapacity;
//      the kernels check for it after the following grid barrier, before any row buffer is written.
// A per-rank launch reads every rank's topk_idx through peer pointers and repeats A/B for all ranks:
// the owner needs every source's routing to know what to pull, and it costs T*K*4 bytes per peer.
#pragma once
#include "common.cuh"
#include "timeout.cuh"

namespace mok {

__device__ __forceinline__ int chunk_to_rank(const Params& P, int g) {
  int r = 0;
  while (r + 1 < P.R && P.ranks[r + 1].chunk_base <= g) ++r;
  return r;
}

// Phase A
__device__ void schedule_count(const Params& P) {
  const int lane = threadIdx.x & 31;
  const int gwarp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nwarps = gridDim.x * kWarps;
  for (int g = gwarp; g < P.num_chunks; g += nwarps) {
    const int r = chunk_to_rank(P, g);
    const RankTable rt = P.ranks[r];
    const int c = g - rt.chunk_base;
    const int t0 = c * kChunkTokens;
    const int t1 = min(rt.T, t0 + kChunkTokens);
    const int e0 = t0 * P.K, e1 = t1 * P.K;
    for (int base = e0; base < e1; base += 32) {
      const int ent = base + lane;
      int ex = -1;
      bool valid = false;
      if (ent < e1) {
        ex = rt.idx[ent];
        if (ex < -1 || ex >= P.E) {
          record_error(P, kErrBadIndex, r, ent / P.K, kPhaseSchedule, P.E, ex, ent % P.K);
          ex = -1;
        }
        valid = ex >= 0;
      }
      const unsigned same = __match_any_sync(0xffffffffu, valid ? ex : -1);
      const unsigned lt = (1u << lane) - 1u;
      int prev = 0;
      if (valid) prev = P.chunk_counts[(long long)ex * P.num_chunks + g];
      __syncwarp();
      if (valid) {
        P.local_rank[rt.entry_base + ent] = prev + __popc(same & lt);
        if ((same & lt) == 0) P.chunk_counts[(long long)ex * P.num_chunks + g] = prev + __popc(same);
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
}

// Phase B
__device__ void schedule_scan(const Params& P) {
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
__device__ void schedule_place(const Params& P, int* s_start) {
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
    const int c = g - rt.chunk_base;
    const int e0 = c * kChunkTokens * P.K;
    const int e1 = min(rt.T, (c + 1) * kChunkTokens) * P.K;
    for (int ent = e0 + lane; ent < e1; ent += 32) {
      const int ex = rt.idx[ent];
      if (ex < 0 || ex >= P.E) continue;
      const int q = ex / P.L;
      if (!in_launch(P, q)) continue;  // another launch lays out its own experts
      const long long pos = (long long)s_start[ex] + P.chunk_counts[(long long)ex * P.num_chunks + g] +
                            P.local_rank[rt.entry_base + ent];
      if (pos < P.layout_cap) P.layout[(long long)part(P, q) * P.layout_cap + pos] = make_int2(r, ent);
    }
  }
}

}  // namespace mok
