// Ring buffer protocol between the comm (dispatch) SMs and the compute (expert FFN) SMs of one rank.
//
//   minibatch i = rows [i*M, min((i+1)*M, N_q)) of rank q's expert-major layout (may span experts)
//   slot s = i % S, round j = i / S
//   ready[q][i]      : +1 by each pulling CTA after it copied its share of minibatch i into slot s.
//                      Compute may read slot s for minibatch i once ready >= comm_sms (minibatch 0, and
//                      every minibatch of the in-SM pull (comm_sms 0): >= ctas_per_rank, pull_dispatch.cuh).
//   fc1_done[q][i][mt]: +1 per finished fc1 n-tile of row block mt; fc2 of (i, mt) needs nt1.
//   mb_done[q][i]    : +1 per finished fc2 tile of minibatch i (its combine pushes are written).
//                      Slot s is free for minibatch i+S once mb_done[i] == nt2 * (row blocks of i)
//                      -> the dispatch of minibatch i+S refills it (ring smaller than the batch).
// Work tickets (per rank, handed out by an atomic counter in order):
//   ticket = i * tickets_per_mb + u,  u < mt_max*nt1 -> fc1 tile (mt = u / nt1, nt = u % nt1)
//                                     else           -> fc2 tile (mt, nt over nt2)
// Row blocks ("m-tiles") of a minibatch: each expert segment inside the minibatch split into
// kBM-row tiles, in expert order; mt_max = ceil(M / kBM) + min(L, M) - 1 bounds their number.
#pragma once
#include "common.cuh"

namespace mok {

struct TileInfo {
  int kind;      // 0 = exit, 1 = fc1, 2 = fc2
  int mb;        // minibatch
  int slot;
  int round;
  int mt, nt;
  int expert;    // local expert id
  int row0;      // first layout row of the tile
  int rows;      // valid rows (<= kBM)
  int mb_start;  // first layout row of the minibatch
  int pad[2];
};

// off: smem copy of expert_off[q][0..L]. Returns false if minibatch has fewer than mt+1 row blocks.
__device__ __forceinline__ bool find_mtile(const int* off, int L, int a, int b, int mt, int& e_out,
                                           int& row0, int& rows) {
  // first expert whose segment ends after a
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (off[mid + 1] > a) hi = mid; else lo = mid + 1;
  }
  for (int e = lo; e < L && off[e] < b; ++e) {
    const int s0 = max(a, off[e]);
    const int s1 = min(b, off[e + 1]);
    if (s1 <= s0) continue;
    const int nt = (s1 - s0 + kBM - 1) / kBM;
    if (mt < nt) {
      e_out = e;
      row0 = s0 + mt * kBM;
      rows = min(kBM, s1 - row0);
      return true;
    }
    mt -= nt;
  }
  return false;
}

// number of row blocks (m-tiles) of layout rows [a, b)
__device__ __forceinline__ int count_mtiles(const int* off, int L, int a, int b) {
  int n = 0;
  for (int e = 0; e < L; ++e) {
    const int s0 = max(a, off[e]);
    const int s1 = min(b, off[e + 1]);
    if (s1 > s0) n += (s1 - s0 + kBM - 1) / kBM;
  }
  return n;
}

__device__ __forceinline__ int num_minibatches(int N, int M) { return (N + M - 1) / M; }

// Row of rank q's ring slot s (and of its activation / scale rows: same [nparts][S][M] indexing) that
// holds the slot's first row.
__device__ __forceinline__ long long slot_first_row(const Params& P, int q, int s) {
  return (long long)(part(P, q) * P.ring_slots + s) * P.minibatch;
}

}  // namespace mok
