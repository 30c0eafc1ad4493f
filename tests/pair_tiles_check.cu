// Host-side check of the 2-CTA cluster tile pairs (csrc/mok/pair_tiles.cuh) against the forward's row-block
// enumeration (ring_buffer.cuh: mb_begin / count_mtiles / find_mtile): built with nvcc and run on the CPU by
// tests/test_pair_tiles.py. Over random segment tables (empty, short, long and partial segments) and
// minibatch sizes, every (row block, n-tile) of every minibatch must be in exactly one unit, with the rows
// find_mtile gives it; units that share the weight tile pair two row blocks of one segment at one n-tile;
// the others pair two n-tiles of one row block (the second may be a pass only as the stage's last odd n-tile).
#include "pair_tiles.cuh"
#include "ring_buffer.cuh"

#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace mok;

static unsigned rng_state = 12345u;
static int rnd(int n) {  // [0, n)
  rng_state = rng_state * 1664525u + 1013904223u;
  return (int)((rng_state >> 8) % (unsigned)n);
}

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      std::printf("FAIL case %d: ", case_id);              \
      std::printf(__VA_ARGS__);                            \
      std::printf("\n");                                   \
      return 1;                                            \
    }                                                      \
  } while (0)

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 2000;
  long long units_seen = 0, shared = 0, passes = 0;
  for (int case_id = 0; case_id < cases; ++case_id) {
    const int NS = 1 + rnd(40);
    std::vector<int> off(NS + 1, 0);
    for (int s = 0; s < NS; ++s) {
      const int kind = rnd(5);  // empty, short, a few tiles, many tiles, exact tiles
      const int len = kind == 0 ? 0 : kind == 1 ? 1 + rnd(127) : kind == 2 ? rnd(600) : kind == 3 ? rnd(5000) : 128 * rnd(9);
      off[s + 1] = off[s] + len;
    }
    const int N = off[NS];
    const int M = 1 + rnd(case_id % 3 == 0 ? 300 : 6000);
    const int ntcs[] = {1, 2, 3, 7, 16, 28};
    const int ntc = ntcs[rnd(6)];
    const int nmb = num_minibatches(N, M);
    for (int mb = 0; mb < nmb; ++mb) {
      const int a = mb_begin(off.data(), NS, M, mb), b = mb_begin(off.data(), NS, M, mb + 1);
      const int cnt = count_mtiles(off.data(), NS, a, b);
      const int nu = count_pair_units(off.data(), NS, a, b, ntc);
      std::vector<int> seen((size_t)cnt * ntc, 0);
      for (int u = 0; u < nu; ++u) {
        PairUnit pu;
        CHECK(find_pair_unit(off.data(), NS, a, b, u, ntc, pu), "mb %d: unit %d of %d not found", mb, u, nu);
        ++units_seen;
        shared += pu.share_b;
        for (int h = 0; h < 2; ++h) {
          if (pu.nt[h] < 0) {
            CHECK(h == 1 && !pu.share_b && pu.nt[0] == ntc - 1 && ntc % 2 == 1,
                  "mb %d unit %d: a pass where none belongs (nt %d, ntc %d)", mb, u, pu.nt[0], ntc);
            ++passes;
            continue;
          }
          CHECK(pu.mt[h] >= 0 && pu.mt[h] < cnt && pu.nt[h] < ntc, "mb %d unit %d: tile (%d, %d) out of %d x %d", mb,
                u, pu.mt[h], pu.nt[h], cnt, ntc);
          int e = -1, row0 = -1, rows = -1;
          CHECK(find_mtile(off.data(), NS, a, b, pu.mt[h], e, row0, rows), "mb %d: row block %d missing", mb, pu.mt[h]);
          CHECK(e == pu.seg && row0 == pu.row0[h] && rows == pu.rows[h],
                "mb %d unit %d half %d: (seg %d, row %d, rows %d) but find_mtile says (%d, %d, %d)", mb, u, h, pu.seg,
                pu.row0[h], pu.rows[h], e, row0, rows);
          ++seen[(size_t)pu.mt[h] * ntc + pu.nt[h]];
        }
        if (pu.share_b)
          CHECK(pu.mt[1] == pu.mt[0] + 1 && pu.nt[1] == pu.nt[0] && pu.rows[0] == kBM,
                "mb %d unit %d: a shared unit must pair a full row block with the next one at one n-tile", mb, u);
        else
          CHECK(pu.mt[1] == pu.mt[0] && pu.nt[0] % 2 == 0 && (pu.nt[1] < 0 || pu.nt[1] == pu.nt[0] + 1),
                "mb %d unit %d: an unshared unit must pair n-tiles (2c, 2c + 1) of one row block", mb, u);
      }
      PairUnit extra;
      CHECK(!find_pair_unit(off.data(), NS, a, b, nu, ntc, extra), "mb %d: a unit past the count", mb);
      for (int t = 0; t < cnt * ntc; ++t)
        CHECK(seen[t] == 1, "mb %d: tile (%d, %d) is in %d units", mb, t / ntc, t % ntc, seen[t]);
    }
  }
  std::printf("ok: %d cases, %lld units (%lld shared, %lld passes)\n", cases, units_seen, shared, passes);
  return 0;
}
