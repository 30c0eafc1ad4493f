// Push combine and the final top-k weighted sum.
//
// push: the fc2 epilogue writes each finished y row (bf16) straight into the home rank's
//       combine buffer combine_buf[r][t, k, :] (r, t, k from the layout entry). In real EP this is a
//       store through the home rank's peer pointer; with several partitions in one launch it is the per-rank table pointer.
// reduce: once every rank's compute SMs are done (counter), each rank's comm warps and compute
//       consumer warps compute out[r][t] = bf16( sum_k w[t,k] * float(combine_buf[r][t,k]) ),
//       fp32, k ascending, unused slots (idx == -1) skipped, rows with no valid k -> 0.
#pragma once
#include "common.cuh"
#include "comm/ring_buffer.cuh"
#include "timeline.cuh"
#include "comm/timeout.cuh"

namespace mok {

// Quad transpose of packed bf16x2 words: lane l of a quad holds word w_j (columns 8j+2l, 8j+2l+1 of
// chunks j = 0..3 of one row); afterwards lane l holds all 8 columns of chunk l (one 16-byte store).
// Two butterfly steps (lane xor 1, then xor 2), each swapping two words with the partner: 4 shuffles
// and 12 selects. (A rotation by lane index took 4 shuffles too but ~40 selects and compares: every
// epilogue runs 8-16 of these per row pair, on the issue slots the other warpgroup's MMAs also need.)
__device__ __forceinline__ uint4 quad_transpose(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int lane) {
  const bool odd = lane & 1, high = lane & 2;
  // step 1, partner lane ^ 1: the odd lane takes the partner's w1 / w3 as its w0 / w2, the even one the
  // partner's w0 / w2 as its w1 / w3 (2 x 2 blocks transposed)
  uint32_t a = __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 1);
  uint32_t b = __shfl_xor_sync(0xffffffffu, odd ? w2 : w3, 1);
  if (odd) { w0 = a; w2 = b; } else { w1 = a; w3 = b; }
  // step 2, partner lane ^ 2: the upper lane takes the partner's w2 / w3 as its w0 / w1, the lower one
  // the partner's w0 / w1 as its w2 / w3
  a = __shfl_xor_sync(0xffffffffu, high ? w0 : w2, 2);
  b = __shfl_xor_sync(0xffffffffu, high ? w1 : w3, 2);
  if (high) { w0 = a; w1 = b; } else { w2 = a; w3 = b; }
  return make_uint4(w0, w1, w2, w3);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One output row of a 64x256 WGMMA accumulator fragment (columns col_base + 8*j + 2*(lane%4) + {0,1},
// values acc[4j + 2h], acc[4j + 2h + 1]) pushed as 16-byte stores to dst (nullptr: row not valid;
// all lanes must still call, the transpose uses shuffles). Columns >= ncols are skipped.
__device__ __forceinline__ void store_row_frag256(__nv_bfloat16* dst, int col_base, int ncols, const float* acc,
                                                  int h, int lane) {
#pragma unroll
  for (int j0 = 0; j0 < 32; j0 += 4) {
    const uint4 v = quad_transpose(pack_bf16x2(acc[4 * j0 + 2 * h], acc[4 * j0 + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 1) + 2 * h], acc[4 * (j0 + 1) + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 2) + 2 * h], acc[4 * (j0 + 2) + 2 * h + 1]),
                                   pack_bf16x2(acc[4 * (j0 + 3) + 2 * h], acc[4 * (j0 + 3) + 2 * h + 1]), lane);
    const int c = col_base + 8 * (j0 + (lane & 3));
    if (dst != nullptr && c < ncols) *reinterpret_cast<uint4*>(dst + c) = v;
  }
}

// One token's output row out[t] = bf16(sum_k w[t,k] * combine[t,k,:]) (fp32, k ascending, unused slots
// skipped), by one warp. Each lane sums VP 8-column vectors (v, v + 32, ...) at a time over KB k at a time:
// KB * VP loads of 16 B in flight per lane. The pass is bandwidth-bound (K x H bf16 read per token), so
// bytes in flight set its speed (one vector per lane left it at about half the device's copy rate): the
// consumer warps, with 224 registers after setmaxnreg, take VP = 4; the comm warps (launch bound, 168)
// VP = 2; the producer warpgroup's in-SM pull warps (56) VP = 1, KB = 4. The k order of the fp32 sum is
// the same for every VP / KB (results bit-identical). [vb, ve): the 8-column vectors to sum (all: 0, H / 8).
template <int VP, int KB>
__device__ __forceinline__ void sum_token(const Params& P, const RankTable& rt, int t, int lane, int vb, int ve) {
  const int H = P.H, K = P.K, nv = ve;
  const int* idx = rt.idx + (long long)t * K;
  const float* w = rt.w + (long long)t * K;
  const uint4* cb = reinterpret_cast<const uint4*>(rt.combine + (long long)t * K * H);
  uint4* out = reinterpret_cast<uint4*>(rt.out + (long long)t * H);
  const int nvr = H / 8;  // vectors per combine row
  for (int v0 = vb + lane; v0 < nv; v0 += 32 * VP) {
    float acc[VP][8];
#pragma unroll
    for (int h = 0; h < VP; ++h)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += KB) {  // KB rows x VP vectors in flight, then accumulate in k order
      uint4 d[VP][KB];
      float wk[KB];
#pragma unroll
      for (int u = 0; u < KB; ++u) {
        const int k = k0 + u;
        const bool ok = k < K && idx[k] >= 0;
        wk[u] = ok ? w[k] : 0.f;
#pragma unroll
        for (int h = 0; h < VP; ++h)
          d[h][u] = ok && v0 + 32 * h < nv ? cb[(long long)k * nvr + v0 + 32 * h] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < KB; ++u) {
        if (k0 + u >= K || !(idx[k0 + u] >= 0)) continue;
#pragma unroll
        for (int h = 0; h < VP; ++h) {
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&d[h][u]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(p[i]);
            acc[h][2 * i] = fmaf(wk[u], f.x, acc[h][2 * i]);
            acc[h][2 * i + 1] = fmaf(wk[u], f.y, acc[h][2 * i + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < VP; ++h) {
      if (v0 + 32 * h >= nv) break;
      uint4 o;
      __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) po[i] = __floats2bfloat162_rn(acc[h][2 * i], acc[h][2 * i + 1]);
      out[v0 + 32 * h] = o;
    }
  }
}

// The final sum of every token of home rank q, tokens dealt statically: worker = warp index among this
// rank's participating warps, nworkers = their number.
template <int VP, int KB = 8>
__device__ __forceinline__ void combine_reduce(const Params& P, int q, int worker, int nworkers) {
  const int lane = threadIdx.x & 31;
  const RankTable rt = P.ranks[q];
  for (int t = worker; t < rt.T; t += nworkers) sum_token<VP, KB>(P, rt, t, lane, 0, P.H / 8);
}

// Every compute CTA of this launch has finished (ctr_compute_done; its acquire, by the calling thread).
__device__ __forceinline__ bool all_compute_done(const Params& P) {
  return ld_acquire_gpu(ctr_compute_done(P)) >= (unsigned)(P.nparts * (P.ctas_per_rank - P.comm_sms));
}

// Token chunks (B = P.macrobatches > 1, EP 1): the sums of chunk J's tokens (token_done == J, schedule.cuh),
// by whichever warps come, in units of a quarter row (kSumParts per token): each warp grabs G units at a
// time from the chunk's cursor, so the warps that start early (chunk_sums) and the ones that join at the
// end (after compute done) share what is left, and every unit is summed exactly once. Quarter rows, so a
// slow early warp (56 registers: ~20 us a unit) holds the kernel's end up by little once it stops
// grabbing: early warps stop (early_stop) as soon as compute is done and the fast final warps take over.
constexpr int kSumParts = 4;
template <int VP, int KB, int G>
__device__ __forceinline__ void sum_chunk(const Params& P, int q, int J, bool early_stop) {
  static_assert(G <= 32, "a grab's chunk numbers are read by one lane each");
  const int lane = threadIdx.x & 31;
  const RankTable rt = P.ranks[q];
  const int* done = P.token_done + rt.entry_base / P.K;
  unsigned* cursor = P.chunk_cursor + (long long)part(P, q) * P.macrobatches + J;
  const int nv = P.H / 8, per = (nv + kSumParts - 1) / kSumParts;
  // a token's chunk is never before its own token chunk (its rows sit at or past that chunk's cuts), so
  // chunk J's tokens lie before the end of token chunk J (EP 1: chunk order = token order, schedule_scan)
  const int B = P.macrobatches;
  const int tend = J + 1 >= B ? rt.T
                              : min(rt.T, (int)(((long long)(J + 1) * P.num_chunks + B - 1) / B) * kChunkTokens);
  const long long uend = (long long)tend * kSumParts;
  while (true) {
    long long u0 = 0;
    if (lane == 0) u0 = (early_stop && all_compute_done(P)) ? uend : (long long)atomicAdd(cursor, (unsigned)G);
    u0 = __shfl_sync(0xffffffffu, u0, 0);
    if (u0 >= uend) break;
    // the grab's chunk numbers read together (written in this kernel: through L2), then its units in order
    const bool mine = lane < G && u0 + lane < uend && __ldcg(done + (u0 + lane) / kSumParts) == J;
    unsigned todo = __ballot_sync(0xffffffffu, mine);
    while (todo) {  // runs of consecutive units of one token as one range (a whole row: one pass per 32*VP)
      int g = __ffs(todo) - 1;
      todo &= todo - 1;
      const long long u = u0 + g;
      const int p0 = (int)(u % kSumParts);
      int p1 = p0 + 1;
      while (p1 < kSumParts && g + 1 < 32 && ((todo >> (g + 1)) & 1u)) {
        ++g;
        ++p1;
        todo &= ~(1u << g);
      }
      sum_token<VP, KB>(P, rt, (int)(u / kSumParts), lane, p0 * per, min(nv, p1 * per));
    }
  }
}

// Every chunk's leftover units, then the last chunk's, once every rank's pushes have landed (the final
// sum with token chunks: warps of the early sums may still be finishing a unit).
template <int VP, int KB = 8>
__device__ __forceinline__ void sum_all_chunks(const Params& P, int q) {
  for (int J = 0; J < P.macrobatches; ++J) sum_chunk<VP, KB, kSumParts>(P, q, J, false);
}

// Token chunks: the sums of chunks 0 .. B-2, each once every minibatch holding rows of its segments has
// pushed them, by warps idle by then (the comm SMs' after their pulls, or the in-SM pull warps) while the
// later chunks' GEMMs run; what they have not done by the end, the final sum's warps do (sum_all_chunks).
// Returns false on an abort (error recorded by the waiter).
template <int VP, int KB>
__device__ bool chunk_sums(const Params& P, int q) {
  const int B = P.macrobatches, ns = P.nseg, M = P.minibatch;
  const int lane = threadIdx.x & 31;
  const int* off = seg_table(P, q);
  const int nmb = num_minibatches(off[ns], M);
  int i = 0;  // minibatches seen done
  for (int J = 0; J + 1 < B; ++J) {
    // compute done: the final sum's warps take everything left (sum_all_chunks), faster than these
    // (lane 0 reads, the warp follows: lanes reading on their own could disagree)
    const int stop = __shfl_sync(0xffffffffu, lane == 0 && all_compute_done(P), 0);
    if (stop) return true;
    const int end = off[(J + 1) * P.L];  // processing-order end of chunk J's segments
    int ok = 1;
    if (lane == 0)  // every minibatch that starts before `end` (the last may hold rows of chunk J + 1 too)
      for (; i < nmb && mb_begin(off, ns, M, i) < end; ++i)
        if (!wait_mb_done(P, q, i, kPhaseChunkDone, 2)) { ok = 0; break; }  // secondary, as the final sum's wait
    __syncwarp();  // the other lanes' reads of the pushed rows after lane 0's acquire
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (!ok) return false;
    const unsigned long long t0 = P.timeline != nullptr ? globaltimer_ns() : 0ull;
    sum_chunk<VP, KB, 1>(P, q, J, true);  // one unit a grab: a slow warp holds back little when it stops
    if (P.timeline != nullptr && lane == 0) timeline_record(P, kTlCombine, (unsigned)J, t0, globaltimer_ns());
  }
  return true;
}

}  // namespace mok
