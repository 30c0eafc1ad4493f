// Host side of the forward library: the forward megakernel's launcher (one rank's launch; host/launch_args.h),
// every CUDA call checked, and the unit kernels' launchers (host/unit_entry_points.cuh: the FP8 block-scaled grouped
// GEMM and weight-gradient GEMM, the FP8 weight and token-block quantisers, the MXFP8 row quantiser).
#include "forward/forward_kernel.cuh"
#include "host/host_launch.h"
#include "host/launch_args.h"
#include "host/persistent_launch.h"
#include "gemm/fp8_gemm.cuh"
#include "gemm/fp8_wgrad_gemm.cuh"
#include "quant/fp8_token_quant.cuh"
#include "quant/fp8_weight_quant.cuh"
#include "quant/mxfp8_quant.cuh"

#include <algorithm>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>


namespace {

using namespace mok_host;

struct WsLayout {
  size_t tmaps, ranks, wscale, src_ptrs, ring, ring_scale, act, act_scale, xq, xs, layout, local_rank, expert_total,
      expert_off, zero_begin, counters, chunk_counts, zero_end, total;
  long long layout_cap;
  int num_chunks, total_entries, mt_max, mb_cap, E;
};

bool validate(const MokLaunchArgs* a, char* eb, int el) {
  if (!rank_launch_ok(a, eb, el)) return false;
  if (a->comm_sms < 0)
    return !write_err(eb, el, "comm_sms=%d must be >= 0 (0: pull on the compute SMs' spare warps)", a->comm_sms);
  if (a->fp8 && (a->H % 128 || a->F % 128))
    return !write_err(eb, el, "fp8 needs H and F multiples of 128 (block scales), got H=%d F=%d", a->H, a->F);
  if ((a->keep_x != 0) != (a->keep_act != 0)) return !write_err(eb, el, "keep_x and keep_act go together");
  if (a->keep_x && a->fp8) return !write_err(eb, el, "kept expert input rows are bf16: not with the fp8 kernel");
  if (a->fp8 && a->R > 1 && (!a->xq || !a->xs))
    return !write_err(eb, el,
                      "an FP8 per-rank launch needs every rank's source-quantised copy xq / xs in its symmetric region "
                      "(PeerBuffers with fp8_sources=True)");
  if (a->keep_x && (a->keep_rows < a->minibatch || a->keep_rows % a->minibatch))
    return !write_err(eb, el, "keep_rows=%lld must be a positive multiple of minibatch_tokens=%d", a->keep_rows,
                      a->minibatch);
  if (a->keep_x && a->keep_rows / a->minibatch >= (1 << 24))
    return !write_err(eb, el, "keep_rows=%lld holds >= 2^24 minibatches of %d rows", a->keep_rows, a->minibatch);
  if (a->raster < -1 || a->raster > 64)
    return !write_err(eb, el, "kernel.tile_raster must be an integer in [0, 64] (or unset), got %d", a->raster);
  return true;
}

// Rank partitions of one launch: always this launch's own rank (the device code can run several partitions in one
// grid; the product launches one rank per launch, EP 1 included).
constexpr int launch_parts(const MokLaunchArgs*) { return 1; }

// Whether this launch meets peer ranks (signal pads, peers' source-quantised copies): EP > 1.
bool has_peers(const MokLaunchArgs* a) { return a->R > 1; }

// Rows of one ring slot: the largest minibatch (ring_buffer.cuh: mb_begin); with kept rows the ring is
// the caller's layout-order buffer, whose "slots" are minibatch-sized pieces of it.
int slot_rows(const MokLaunchArgs* a) { return a->keep_x ? a->minibatch : a->minibatch + mok::kBM - 1; }

WsLayout plan(const MokLaunchArgs* a) {
  WsLayout w{};
  w.E = a->R * a->L;
  const int np = launch_parts(a);
  long long entries = 0;
  int chunks = 0;
  for (int r = 0; r < a->R; ++r) {
    entries += a->T[r] * a->K;
    chunks += (int)((a->T[r] + mok::kChunkTokens - 1) / mok::kChunkTokens);
  }
  w.total_entries = (int)entries;
  w.num_chunks = chunks;
  w.layout_cap = entries > 0 ? entries : 1;
  w.mb_cap = (int)std::max<long long>(1, (entries + a->minibatch - 1) / a->minibatch);
  // a minibatch holds < minibatch + kBM rows (its boundaries sit on its experts' tile grids, ring_buffer.cuh)
  const int mb_rows = a->minibatch + mok::kBM - 1;
  w.mt_max = (mb_rows + mok::kBM - 1) / mok::kBM + std::min(a->L, mb_rows) - 1;
  // kept rows: the caller's buffers are the ring (one slot per minibatch), none in the workspace
  const size_t S = a->keep_x ? 0 : a->ring_slots, M = slot_rows(a);
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t o = off; off = align_up(off + bytes, 1024); return o; };
  w.tmaps = take((size_t)(3 * np * a->L + 2 * np) * sizeof(CUtensorMap));
  w.ranks = take((size_t)a->R * sizeof(mok::RankTable));
  w.wscale = take((size_t)np * a->L * 2 * sizeof(void*));  // staged with the maps and rank table (before ring)
  const bool srcq = a->fp8;  // every rank's source-quantised copy: P.xq / P.xs tables
  w.src_ptrs = take(srcq ? (size_t)a->R * 2 * sizeof(void*) : 0);  // (staged too)
  w.ring = take((size_t)np * S * M * a->H * (a->fp8 ? 1 : 2));
  w.ring_scale = take(a->fp8 ? (size_t)np * S * M * (a->H / 128) * 4 : 0);
  w.act = take((size_t)np * S * M * a->F * (a->fp8 ? 1 : 2));
  w.act_scale = take(a->fp8 ? (size_t)np * S * M * (a->F / 128) * 4 : 0);
  long long tokens = 0;
  for (int r = 0; r < a->R; ++r) tokens += a->T[r];
  // FP8 at EP 1: the tokens' e4m3 rows and scales live here (EP > 1: in the symmetric regions, a->xq / a->xs)
  const bool src_copy_here = srcq && !has_peers(a);
  w.xq = take(src_copy_here ? (size_t)std::max<long long>(tokens, 1) * a->H : 0);
  w.xs = take(src_copy_here ? (size_t)std::max<long long>(tokens, 1) * (a->H / 128) * 4 : 0);
  w.layout = take((size_t)np * (size_t)w.layout_cap * sizeof(int2));
  w.local_rank = take((size_t)std::max<long long>(entries, 1) * 4);
  w.expert_total = take((size_t)w.E * 4);
  w.expert_off = take((size_t)np * (a->L + 1) * 4);
  w.zero_begin = off;
  w.counters = take((size_t)mok::ctr_count(np, w.mb_cap, w.mt_max) * 4);
  w.chunk_counts = take((size_t)w.E * std::max(chunks, 1) * 4);
  w.zero_end = off;
  w.total = off;
  return w;
}

int smem_bytes(int E) { return std::max(mok::compute_smem_bytes(), E * 4 + 64) + 1024; }

// The forward kernel's instances, indexed by (fp8) + 2 * (SwiGLU variant): see forward_launch.
using ForwardKernel = void (*)(const mok::Params);
const ForwardKernel kForwardKernels[4] = {mok::mok_forward_kernel<false, 0>,
                                          mok::mok_forward_kernel<true, 0>,
                                          mok::mok_forward_kernel<false, mok::kFeatGlu>,
                                          mok::mok_forward_kernel<true, mok::kFeatGlu>};

}  // namespace

namespace mok_host {

int load_forward_kernels(int device, char* errbuf, int errlen) {
  const void* kernels[] = {reinterpret_cast<const void*>(kForwardKernels[0]),
                           reinterpret_cast<const void*>(kForwardKernels[1]),
                           reinterpret_cast<const void*>(kForwardKernels[2]),
                           reinterpret_cast<const void*>(kForwardKernels[3]),
                           reinterpret_cast<const void*>(mok::fp8::mok_fp8_gemm_kernel),
                           reinterpret_cast<const void*>(mok::fp8::mok_fp8_wgrad_kernel),
                           reinterpret_cast<const void*>(mok::mok_fp8_quantize_tokens_kernel),
                           reinterpret_cast<const void*>(mok::mok_fp8_quantize_weight_kernel),
                           reinterpret_cast<const void*>(mok::mok_mxfp8_quantize_rows_kernel),
                           reinterpret_cast<const void*>(mok::param_copy_kernel)};
  return load_kernels(device, kernels, sizeof(kernels) / sizeof(kernels[0]), errbuf, errlen);
}

long long forward_workspace_bytes(const MokLaunchArgs* a, char* errbuf, int errlen) {
  if (!validate(a, errbuf, errlen)) return -1;
  return (long long)plan(a).total;
}

// One launch of the forward kernel for rank a->rank of a->R (R > 1: peers met through their signal pads).
int forward_launch(const MokLaunchArgs* a, cudaStream_t stream, char* errbuf, int errlen) {
  if (!validate(a, errbuf, errlen)) return 1;
  const int np = launch_parts(a);
  const int rank0 = a->rank;
  // saved_h holds saved_h_rows rows per owner (a capacity: the kernel reports an owner routed more rows)
  if (a->saved_h && a->saved_h_rows < 1)
    return write_err(errbuf, errlen, "saved_h buffer needs >= 1 row, got %lld", a->saved_h_rows);
  if (!rank_peers_ok(a, errbuf, errlen)) return 1;
  PersistentGrid grid;
  if (persistent_grid(a->device, np, a->ctas_per_rank, a->comm_sms, &grid, errbuf, errlen)) return 1;
  const int cpr = grid.cpr;
  const WsLayout ws = plan(a);
  if (a->workspace_bytes < ws.total)
    return write_err(errbuf, errlen, "workspace too small: %llu < %zu", a->workspace_bytes, ws.total);
  const int smem = smem_bytes(ws.E);
  // The lean kernel instance (kFeat 0) unless this launch runs the SwiGLU variant (kFeatGlu: a clamped / offset
  // SwiGLU model runs as fast as a plain one; common.cuh: FwdFeature)
  const ForwardKernel kernel = kForwardKernels[(a->fp8 ? 1 : 0) + (a->glu ? 2 : 0)];
  if (check_coresident(reinterpret_cast<const void*>(kernel), a->device, smem, np, grid, errbuf, errlen)) return 1;

  uint8_t* wsp = reinterpret_cast<uint8_t*>(a->workspace);
  // Host staging of tensor maps + rank table (one H2D copy) from the pinned staging pool
  // (host_launch.h), so the copy is truly asynchronous and no launch waits for an earlier one's copy.
  StagingLease stg;
  if (const char* msg = stg.acquire(ws.ring, stream)) return write_err(errbuf, errlen, "%s", msg);
  uint8_t* host = stg->host;
  memset(host, 0, ws.ring);
  CUtensorMap* maps = reinterpret_cast<CUtensorMap*>(host + ws.tmaps);
  const int L = a->L, H = a->H, F = a->F, M = a->minibatch, SR = slot_rows(a);
  const int S = a->keep_x ? (int)(a->keep_rows / M) : a->ring_slots;  // kept rows: a slot per minibatch
  const bool keep = a->keep_x != 0;
  if (a->fp8 && (!a->w1s || !a->w2s)) return write_err(errbuf, errlen, "fp8 launch needs the weight scales w1s / w2s");
  const float** wsc = reinterpret_cast<const float**>(host + ws.wscale);
  for (int g = 0; a->fp8 && g < np * L; ++g) {  // e4m3 weights: 1-byte maps, 128-element (= 128 B) K boxes
    const uint8_t* w1 = reinterpret_cast<const uint8_t*>(a->w1[g]);
    const uint8_t* w2 = reinterpret_cast<const uint8_t*>(a->w2[g]);
    if (!w1 || !w2 || !a->w1s[g] || !a->w2s[g])
      return write_err(errbuf, errlen, "fp8 expert %d: null weight or scale pointer", rank0 * L + g);
    wsc[2 * g] = reinterpret_cast<const float*>(a->w1s[g]);
    wsc[2 * g + 1] = reinterpret_cast<const float*>(a->w2s[g]);
    const int ge = rank0 * L + g;  // global expert index (error text)
    if (!encode_2d_u8(&maps[3 * g + 0], w1, H, F, a->w1_ld[g], mok::kBKf8, mok::kFc1ActCols, errbuf, errlen,
                      "fp8 w1 gate", ge))
      return 1;
    if (!encode_2d_u8(&maps[3 * g + 1], w1 + (size_t)F * a->w1_ld[g], H, F, a->w1_ld[g], mok::kBKf8, mok::kFc1ActCols,
                      errbuf, errlen, "fp8 w1 up", ge))
      return 1;
    if (!encode_2d_u8(&maps[3 * g + 2], w2, F, H, a->w2_ld[g], mok::kBKf8, mok::kBN, errbuf, errlen, "fp8 w2", ge))
      return 1;
  }
  for (int g = 0; !a->fp8 && g < np * L; ++g) {  // experts of this launch's ranks (w1/w2 hold exactly these)
    const __nv_bfloat16* w1 = reinterpret_cast<const __nv_bfloat16*>(a->w1[g]);
    const __nv_bfloat16* w2 = reinterpret_cast<const __nv_bfloat16*>(a->w2[g]);
    const int ge = rank0 * L + g;  // global expert index (error text)
    if (!encode_2d(&maps[3 * g + 0], w1, H, F, a->w1_ld[g], mok::kBK, mok::kFc1ActCols, errbuf, errlen, "w1 gate", ge))
      return 1;
    if (!encode_2d(&maps[3 * g + 1], w1 + (size_t)F * a->w1_ld[g], H, F, a->w1_ld[g], mok::kBK, mok::kFc1ActCols,
                   errbuf, errlen, "w1 up", ge))
      return 1;
    if (!encode_2d(&maps[3 * g + 2], w2, F, H, a->w2_ld[g], mok::kBK, mok::kBN, errbuf, errlen, "w2", ge)) return 1;
  }
  for (int p = 0; a->fp8 && p < np; ++p) {
    const uint8_t* ring = wsp + ws.ring + (size_t)p * S * SR * H;
    const uint8_t* act = wsp + ws.act + (size_t)p * S * SR * F;
    if (!encode_2d_u8(&maps[3 * np * L + 2 * p], ring, H, (unsigned long long)S * SR, H, mok::kBKf8, mok::kBM, errbuf,
                      errlen, "fp8 ring"))
      return 1;
    if (!encode_2d_u8(&maps[3 * np * L + 2 * p + 1], act, F, (unsigned long long)S * SR, F, mok::kBKf8, mok::kBM,
                      errbuf, errlen, "fp8 act"))
      return 1;
  }
  for (int p = 0; !a->fp8 && p < np; ++p) {
    const __nv_bfloat16* ring = reinterpret_cast<const __nv_bfloat16*>(keep ? a->keep_x : (unsigned long long)(wsp + ws.ring)) + (size_t)p * S * SR * H;
    const __nv_bfloat16* act = reinterpret_cast<const __nv_bfloat16*>(keep ? a->keep_act : (unsigned long long)(wsp + ws.act)) + (size_t)p * S * SR * F;
    if (!encode_2d(&maps[3 * np * L + 2 * p], ring, H, (unsigned long long)S * SR, H, mok::kBK, mok::kBM, errbuf,
                   errlen, "ring"))
      return 1;
    if (!encode_2d(&maps[3 * np * L + 2 * p + 1], act, F, (unsigned long long)S * SR, F, mok::kBK, mok::kBM, errbuf,
                   errlen, "act"))
      return 1;
  }
  if (a->fp8) {  // [R] e4m3 rows, then [R] scales: rank r's source-quantised copy
    uint8_t** xq = reinterpret_cast<uint8_t**>(host + ws.src_ptrs);
    float** xs = reinterpret_cast<float**>(xq + a->R);
    long long row = 0;  // EP 1: the rank's rows in the workspace copy
    for (int r = 0; r < a->R; ++r) {
      if (has_peers(a)) {
        if (!a->xq[r] || !a->xs[r])
          return write_err(errbuf, errlen, "source-quantised copy of rank %d (xq / xs) is null", r);
        xq[r] = reinterpret_cast<uint8_t*>(a->xq[r]);
        xs[r] = reinterpret_cast<float*>(a->xs[r]);
      } else {
        xq[r] = wsp + ws.xq + (size_t)row * H;
        xs[r] = reinterpret_cast<float*>(wsp + ws.xs) + (size_t)row * (H / 128);
      }
      row += a->T[r];
    }
  }
  mok::RankTable* rt = reinterpret_cast<mok::RankTable*>(host + ws.ranks);
  long long entry_base = 0;
  int chunk_base = 0;
  for (int r = 0; r < a->R; ++r) {
    rt[r].x = reinterpret_cast<const __nv_bfloat16*>(a->x[r]);
    rt[r].idx = reinterpret_cast<const int*>(a->idx[r]);
    rt[r].w = reinterpret_cast<const float*>(a->w[r]);
    rt[r].out = reinterpret_cast<__nv_bfloat16*>(a->out[r]);
    rt[r].combine = reinterpret_cast<__nv_bfloat16*>(a->combine[r]);
    rt[r].tokens_per_expert = reinterpret_cast<int*>(a->tpe[r]);
    rt[r].signal = has_peers(a) ? reinterpret_cast<unsigned*>(a->signal[r]) : nullptr;
    rt[r].saved_h = a->saved_h ? reinterpret_cast<__nv_bfloat16*>(a->saved_h[r]) : nullptr;
    rt[r].T = (int)a->T[r];
    rt[r].entry_base = (int)entry_base;
    rt[r].chunk_base = chunk_base;
    entry_base += a->T[r] * a->K;
    chunk_base += (int)((a->T[r] + mok::kChunkTokens - 1) / mok::kChunkTokens);
  }

  mok::Params P{};
  P.R = a->R; P.L = L; P.E = ws.E; P.H = H; P.F = F; P.K = a->K;
  P.rank0 = rank0; P.nparts = np; P.peer_sync = has_peers(a) ? 1 : 0; P.epoch = a->epoch;
  P.comm_sms = a->comm_sms; P.ctas_per_rank = cpr; P.ring_slots = S; P.minibatch = M;
  P.slot_rows = SR; P.kept_layout = keep ? 1 : 0;
  P.mt_max = ws.mt_max;
  P.mb_cap = ws.mb_cap;
  P.raster = a->raster >= 0 ? a->raster : (a->fp8 ? 0 : 16);  // validated; -1: the measured default (above)
  P.debug = a->debug;
  P.glu = a->glu;  // validated; picks the SwiGLU-variant instance
  P.glu_clamp = a->glu_clamp;
  P.glu_offset = a->glu_offset;
  P.nt1 = (F + mok::kFc1ActCols - 1) / mok::kFc1ActCols;
  P.nt2 = (H + mok::kBN - 1) / mok::kBN;
  P.num_chunks = ws.num_chunks; P.total_entries = ws.total_entries;
  P.stall_rank = a->stall_rank; P.stall_slot = a->stall_slot;
  P.timeout_ns = (unsigned long long)(a->timeout_ms > 0 ? a->timeout_ms * 1e6 : 1e10);
  P.layout_cap = ws.layout_cap;
  P.owner_rows = LLONG_MAX;  // without saved h or kept rows no row buffer is owner-sized
  if (a->saved_h) P.owner_rows = a->saved_h_rows;
  if (keep) P.owner_rows = std::min<long long>(P.owner_rows, a->keep_rows);
  P.ranks = reinterpret_cast<const mok::RankTable*>(wsp + ws.ranks);
  P.tmaps = reinterpret_cast<const CUtensorMap*>(wsp + ws.tmaps);
  P.ring = reinterpret_cast<__nv_bfloat16*>(keep ? a->keep_x : (unsigned long long)(wsp + ws.ring));
  P.act = reinterpret_cast<__nv_bfloat16*>(keep ? a->keep_act : (unsigned long long)(wsp + ws.act));
  P.layout = reinterpret_cast<int2*>(wsp + ws.layout);
  P.local_rank = reinterpret_cast<int*>(wsp + ws.local_rank);
  P.chunk_counts = reinterpret_cast<int*>(wsp + ws.chunk_counts);
  P.expert_total = reinterpret_cast<int*>(wsp + ws.expert_total);
  P.expert_off = reinterpret_cast<int*>(wsp + ws.expert_off);
  P.counters = reinterpret_cast<unsigned*>(wsp + ws.counters);
  if (a->fp8) {
    P.wscale = reinterpret_cast<const float* const*>(wsp + ws.wscale);
    P.ring_scale = reinterpret_cast<float*>(wsp + ws.ring_scale);
    P.act_scale = reinterpret_cast<float*>(wsp + ws.act_scale);
    P.xq = reinterpret_cast<uint8_t* const*>(wsp + ws.src_ptrs);
    P.xs = reinterpret_cast<float* const*>(wsp + ws.src_ptrs) + a->R;
  }
  P.err = reinterpret_cast<int*>(a->err);
  P.timeline = reinterpret_cast<mok::TimelineEvent*>(a->timeline);
  P.timeline_count = reinterpret_cast<unsigned*>(a->timeline_count);
  P.timeline_cap = a->timeline ? a->timeline_cap : 0;
  if (a->timeline && (a->timeline_cap < 1 || !a->timeline_count))
    return write_err(errbuf, errlen, "timeline buffer needs timeline_cap >= 1 and a count array");

  const LaunchState state{&stg, wsp, ws.ring, ws.zero_begin, ws.zero_end, P.err, a->timeline ? P.timeline_count : nullptr};
  return launch_persistent(kernel, P, (unsigned)(np * cpr), smem, stream, state, errbuf, errlen);
}

}  // namespace mok_host

#include "host/unit_entry_points.cuh"
