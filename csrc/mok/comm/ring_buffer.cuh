// Ring buffer protocol between the comm (dispatch) SMs and the compute (expert FFN) SMs of one rank.
//
//   minibatch i = rows [mb_begin(i), mb_begin(i+1)) of rank q's expert-major layout (may span experts),
//                 i < nmb = ceil(N_q / M); boundary i is i*M rounded down to the kBM-row tile grid of the
//                 expert it falls in, so a minibatch holds < M + kBM rows (P.slot_rows = M + kBM - 1).
//   slot s = i % S, round j = i / S
//   ready[q][i]      : +1 by each pulling CTA after it copied its share of minibatch i into slot s.
//                      Compute may read slot s for minibatch i once ready >= comm_sms (minibatch 0, and
//                      every minibatch of the in-SM pull (comm_sms 0): >= ctas_per_rank, pull_dispatch.cuh).
//   fc1_done[q][i][mt]: +1 per consumer warpgroup per finished fc1 n-tile of row block mt (each signals
//                      its own 64 rows); fc2 of (i, mt) needs kConsumerWGs * nt1.
//   mb_done[q][i]    : +1 per consumer warpgroup per finished fc2 tile of minibatch i (its pushes are
//                      written). Slot s is free for minibatch i+S once mb_done[i] == kConsumerWGs * nt2 *
//                      (row blocks of i)
//                      -> the dispatch of minibatch i+S refills it (ring smaller than the batch).
// Work tickets (per rank, handed out by an atomic counter in order; dense: expert_ffn.cuh ffn_producer):
//   minibatch i owns cnt_i * (nt1 + nt2) consecutive tickets, cnt_i = its row blocks (count_mtiles);
//   u = ticket - first ticket of i:  u < cnt_i*nt1 -> fc1 tile (raster 0: mt = u / nt1, nt = u % nt1)
//                                    else          -> fc2 tile (mt, nt over nt2)
// Row blocks ("m-tiles") of a minibatch: each expert segment inside the minibatch split into kBM-row tiles, in
// expert order; mt_max = ceil(slot_rows / kBM) + min(L, slot_rows) - 1 bounds their number.
// Only an expert's last row block can be partial: a boundary never cuts a tile in two (with fixed
// i*M boundaries the DeepSeek-V3 slice, 32 experts, ran ~3 % more tiles at M = 2048).
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"

namespace mok {

struct TileInfo {
  int kind;      // 0 = exit, 1 = fc1, 2 = fc2
  int mb;        // minibatch
  int slot;
  int round;
  int mt, nt;
  int expert;    // local expert id
  int row0;      // first layout row of the tile (its ring rows: slot_row)
  int rows;      // valid rows (<= kBM)
  int mb_start;  // first layout row of the minibatch
  int lrow0;     // first layout row of the tile as the saved h, push rows and kept rows read it (= row0)
  int nk;        // K blocks (stages) of the tile
};

// off: smem copy of expert_off[q][0..L]. Returns false if minibatch has fewer than mt+1 row blocks.
__host__ __device__ __forceinline__ bool find_mtile(const int* off, int L, int a, int b, int mt, int& e_out,
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
__host__ __device__ __forceinline__ int count_mtiles(const int* off, int L, int a, int b) {
  int n = 0;
  for (int e = 0; e < L; ++e) {
    const int s0 = max(a, off[e]);
    const int s1 = min(b, off[e + 1]);
    if (s1 > s0) n += (s1 - s0 + kBM - 1) / kBM;
  }
  return n;
}

__host__ __device__ __forceinline__ int num_minibatches(int N, int M) { return (N + M - 1) / M; }

// First layout row of minibatch i (off = expert offsets [L + 1], N = off[L]): i*M rounded down to the
// kBM-row tile grid of its expert; N for i >= num_minibatches. Non-decreasing in i, and
// mb_begin(i + 1) - mb_begin(i) < M + kBM. megatron_mok/layout.py: minibatches(..., tile_rows=128).
__host__ __device__ __forceinline__ int mb_begin(const int* off, int L, int M, int i) {
  const int N = off[L];
  const long long p = (long long)i * M;
  if (p >= N) return N;
  int lo = 0, hi = L - 1;  // the expert holding row p: the last e with off[e] <= p
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= p) lo = mid; else hi = mid - 1;
  }
  return off[lo] + (int)((p - off[lo]) / kBM) * kBM;
}

// Expert offsets of owner q ([L + 1], schedule_place).
__device__ __forceinline__ const int* expert_offsets(const Params& P, int q) {
  return P.expert_off + part(P, q) * (P.L + 1);
}

// Row of rank q's ring (and of its activation / scale rows: same [nparts][S][slot_rows] indexing) that
// holds layout row v (= lrow) of minibatch i (first row a): the ring holds a minibatch from its slot's first
// row; kept rows (P.kept_layout: the ring is the owner's layout-order buffer, one slot per minibatch) sit at
// their layout rows.
__device__ __forceinline__ long long slot_row(const Params& P, int q, int i, int a, int v, int lrow) {
  if (P.kept_layout) return (long long)part(P, q) * P.ring_slots * P.slot_rows + lrow;
  return (long long)(part(P, q) * P.ring_slots + i % P.ring_slots) * P.slot_rows + (v - a);
}

// Minibatch i's fc2 tiles have all pushed their rows (its mb_done counter), reported as `phase` on a timeout.
__device__ __forceinline__ bool wait_mb_done(const Params& P, int q, int i, int phase) {
  const int M = P.minibatch, L = P.L;
  const int* off = expert_offsets(P, q);
  const unsigned need =
      (unsigned)(kConsumerWGs * P.nt2 * count_mtiles(off, L, mb_begin(off, L, M, i), mb_begin(off, L, M, i + 1)));
  return wait_counter_geq(P, ctr_mb_done(P, q, i), need, q, i % P.ring_slots, phase);
}

}  // namespace mok
