// Tile pairs for 2-CTA clusters (MOK_CLUSTER=2, forward): the two compute CTAs of a cluster take one
// work ticket together and run one tile each, so that a weight tile both need is read from L2 once and
// multicast into both CTAs' shared memory (TMA .multicast::cluster, cluster_pair.cuh).
//
// Why: under the H200's power cap a launch's clock follows the bytes it moves per FLOP (scripts/NOTES-kernel.md,
// seventh session: dense mm 1526-1676 MHz, the MoK kernels 1397-1477 MHz at the same ~690 W). A 128 x 256 tile
// reads 16 KB of activations and 32 KB of weights per K block; a pair sharing the weights reads 2 x 16 + 32
// = 64 KB for two tiles instead of 96 KB (a third less L2 -> SM traffic).
//
// Units of one minibatch and GEMM stage (fc1 or fc2, ntc n-tiles), per processing-order segment inside the
// minibatch (n row blocks, enumerated in segment order like find_mtile):
//   * pairs of row blocks (2p, 2p + 1), p < n / 2, for every n-tile: same expert and n-tile, different rows ->
//     share_b (the weight tile is multicast: each CTA loads one half of it);
//   * an odd segment's last row block, n-tiles (2c, 2c + 1): the same rows, different weights -> no sharing;
//     each CTA loads its own operands; with ntc odd the last unit's second tile is none (a pass: that CTA's
//     stages go round without data for one tile's K loop). ntc = F / 128 for fc1, ceil(H / 256) for fc2: odd
//     for F = 384 or 1408 (11 n-tiles), H = 2304, tiny models; the shipped configs have 16 / 28, 12 / 16, 6 / 8.
//     A pass costs one CTA one tile per odd segment tail per stage (~0.4 % with 11 n-tiles and 5 % odd tails).
// units = sum_s (n_s / 2) * ntc + (n_s % 2) * ceil(ntc / 2) per stage. Every tile of the minibatch is in
// exactly one unit (tests/test_pair_tiles.py checks this on the host build of these functions).
#pragma once
#include "common.cuh"

namespace mok {

struct PairUnit {
  int seg;        // processing-order segment of both tiles
  int mt[2];      // row block in the minibatch (find_mtile's numbering) of CTA 0's / CTA 1's tile
  int nt[2];      // n-tile; nt[1] = -1: CTA 1 has no tile in this unit (a pass)
  int row0[2];    // first processing-order row
  int rows[2];    // valid rows (<= kBM)
  int share_b;    // 1: same expert and n-tile, the weight tile is multicast
};

// Units of a row range [a, b) (one minibatch) for a stage of ntc n-tiles. off: segment offsets [NS + 1].
__host__ __device__ inline int count_pair_units(const int* off, int NS, int a, int b, int ntc) {
  int n_units = 0;
  for (int s = 0; s < NS; ++s) {
    const int s0 = a > off[s] ? a : off[s];
    const int s1 = b < off[s + 1] ? b : off[s + 1];
    if (s1 <= s0) continue;
    const int n = (s1 - s0 + kBM - 1) / kBM;
    n_units += (n / 2) * ntc + (n % 2) * ((ntc + 1) / 2);
  }
  return n_units;
}

// Unit u of [a, b) (see above); false if there are fewer than u + 1 units.
__host__ __device__ inline bool find_pair_unit(const int* off, int NS, int a, int b, int u, int ntc, PairUnit& pu) {
  int lo = 0, hi = NS - 1;  // first segment that ends after a (find_mtile's start, so mt numbers agree)
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (off[mid + 1] > a) hi = mid; else lo = mid + 1;
  }
  int mt_base = 0;
  for (int s = lo; s < NS && off[s] < b; ++s) {
    const int s0 = a > off[s] ? a : off[s];
    const int s1 = b < off[s + 1] ? b : off[s + 1];
    if (s1 <= s0) continue;
    const int n = (s1 - s0 + kBM - 1) / kBM;
    const int paired = (n / 2) * ntc;
    const int units = paired + (n % 2) * ((ntc + 1) / 2);
    if (u < units) {
      pu.seg = s;
      if (u < paired) {
        const int p = u / ntc;
        for (int h = 0; h < 2; ++h) {
          pu.mt[h] = mt_base + 2 * p + h;
          pu.nt[h] = u % ntc;
          pu.row0[h] = s0 + (2 * p + h) * kBM;
          pu.rows[h] = s1 - pu.row0[h] < kBM ? s1 - pu.row0[h] : kBM;
        }
        pu.share_b = 1;
      } else {
        const int c = u - paired;
        const int r0 = s0 + (n - 1) * kBM;  // the segment's last row block
        for (int h = 0; h < 2; ++h) {
          pu.mt[h] = mt_base + n - 1;
          pu.nt[h] = 2 * c + h < ntc ? 2 * c + h : -1;
          pu.row0[h] = r0;
          pu.rows[h] = s1 - r0;
        }
        pu.share_b = 0;
      }
      return true;
    }
    u -= units;
    mt_base += n;
  }
  return false;
}

}  // namespace mok
