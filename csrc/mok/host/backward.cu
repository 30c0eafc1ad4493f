// Host side of the backward library: the launchers of the backward megakernel (backward/backward_kernel.cuh; one
// rank's launch) and of the wgrad kernel (backward/wgrad.cuh), every CUDA call checked (host/launch_args.h).
#include "backward/backward_kernel.cuh"
#include "host/host_launch.h"
#include "host/launch_args.h"
#include "host/persistent_launch.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>


namespace {

using namespace mok_host;

struct BwdWs {
  size_t tmaps, ranks, branks, wscale, layout, local_rank, expert_total, expert_off, zero_begin, counters, chunk_counts,
      zero_end, total;
  int num_chunks, total_entries, mt_max, mb_cap, E;
};

bool validate(const MokBwdArgs* a, char* eb, int el) {
  if (!rank_launch_ok(a, eb, el)) return false;
  if (a->comm_sms < 1) return !write_err(eb, el, "comm_sms=%d must be >= 1", a->comm_sms);
  if (a->fp8 && (a->H % 128 || a->F % 128))
    return !write_err(eb, el, "fp8 dgrad: hidden H=%d and ffn F=%d must be multiples of 128 (block scales)", a->H,
                      a->F);
  // cap: rows of each owner's layout-order buffers, a capacity (>= entries: dropless worst case); the
  // kernel reports an owner that the routing sends more rows (kErrCapacity) before writing any
  if (a->cap < 1) return !write_err(eb, el, "cap=%lld must be >= 1", a->cap);
  return true;
}

// The backward kernel's instances, indexed by (fp8) + 2 * (SwiGLU variant).
using BackwardKernel = void (*)(mok::bwd::BwdParams);
const BackwardKernel kBackwardKernels[4] = {
    mok::bwd::mok_backward_kernel<false, false>, mok::bwd::mok_backward_kernel<true, false>,
    mok::bwd::mok_backward_kernel<false, true>, mok::bwd::mok_backward_kernel<true, true>};

// Rank partitions of one launch: this launch's own rank (as the forward's; EP 1 included).
constexpr int launch_parts(const MokBwdArgs*) { return 1; }

// Whether this launch meets peer ranks through their signal pads: EP > 1.
bool has_peers(const MokBwdArgs* a) { return a->R > 1; }

BwdWs plan(const MokBwdArgs* a) {
  BwdWs w{};
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
  w.mb_cap = (int)std::max<long long>(1, (entries + a->minibatch - 1) / a->minibatch);
  w.mt_max = (a->minibatch + mok::kBM - 1) / mok::kBM + std::min(a->L, a->minibatch) - 1;
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t o = off; off = align_up(off + bytes, 1024); return o; };
  w.tmaps = take((size_t)(4 * np * a->L + 5 * np) * sizeof(CUtensorMap));
  w.ranks = take((size_t)a->R * sizeof(mok::RankTable));
  w.branks = take((size_t)a->R * sizeof(mok::bwd::BwdRank));
  w.wscale = take((size_t)2 * np * a->L * sizeof(void*));  // FP8 dgrad: weight block-scale table
  w.layout = take((size_t)np * (size_t)a->cap * sizeof(int2));
  w.local_rank = take((size_t)std::max<long long>(entries, 1) * 4);
  w.expert_total = take((size_t)w.E * 4);
  w.expert_off = take((size_t)np * (a->L + 1) * 4);
  w.zero_begin = off;
  w.counters = take((size_t)mok::bwd::bwd_ctr_count(np, w.mb_cap, w.mt_max) * 4);
  w.chunk_counts = take((size_t)w.E * std::max(chunks, 1) * 4);
  w.zero_end = off;
  w.total = off;
  return w;
}

}  // namespace

namespace mok_host {

int load_backward_kernels(int device, char* errbuf, int errlen) {
  const void* kernels[] = {reinterpret_cast<const void*>(kBackwardKernels[0]),
                           reinterpret_cast<const void*>(kBackwardKernels[1]),
                           reinterpret_cast<const void*>(kBackwardKernels[2]),
                           reinterpret_cast<const void*>(kBackwardKernels[3]),
                           reinterpret_cast<const void*>(mok::bwd::mok_wgrad_kernel),
                           reinterpret_cast<const void*>(mok::param_copy_kernel)};
  return load_kernels(device, kernels, sizeof(kernels) / sizeof(kernels[0]), errbuf, errlen);
}

long long backward_workspace_bytes(const MokBwdArgs* a, char* errbuf, int errlen) {
  if (!validate(a, errbuf, errlen)) return -1;
  return (long long)plan(a).total;
}

// One launch of the backward kernel for rank a->rank of a->R (R > 1: peers met through their signal pads).
int backward_launch(const MokBwdArgs* a, cudaStream_t stream, char* errbuf, int errlen) {
  if (!validate(a, errbuf, errlen)) return 1;
  const int np = launch_parts(a);
  const int rank0 = a->rank;
  if (!rank_peers_ok(a, errbuf, errlen)) return 1;
  if (has_peers(a))
    for (int r = 0; r < a->R; ++r)
      if (!a->x[r] || !a->idx[r] || !a->w[r] || !a->grad_out[r] || !a->grad_buf[r])
        return write_err(errbuf, errlen, "per-rank launch: rank %d's x / idx / w / grad_out / grad_buf peer pointer "
                         "is null", r);
  if (a->fp8) {
    if (!a->saved_h) return write_err(errbuf, errlen, "fp8 dgrad needs the forward's saved fc1 output (saved_h)");
    if (!a->w2t8 || !a->w2ts || !a->w1t8 || !a->w1ts || !a->gyl8 || !a->gys || !a->dh8 || !a->dhs)
      return write_err(errbuf, errlen, "fp8 dgrad: a weight (w2t8/w2ts/w1t8/w1ts) or buffer (gyl8/gys/dh8/dhs) array "
                       "is missing");
  }
  if (a->act_kept && !a->saved_h)
    return write_err(errbuf, errlen, "act_kept needs saved_h (the recompute path writes act in its stage-1 epilogue)");
  PersistentGrid grid;
  if (persistent_grid(a->device, np, a->ctas_per_rank, a->comm_sms, &grid, errbuf, errlen)) return 1;
  const int cpr = grid.cpr;
  const BwdWs ws = plan(a);
  if (a->workspace_bytes < ws.total)
    return write_err(errbuf, errlen, "workspace too small: %llu < %zu", a->workspace_bytes, ws.total);
  const int smem = std::max(mok::bwd::bwd_compute_smem_bytes(), ws.E * 4 + 64) + 1024;
  const int variant = (a->fp8 ? 1 : 0) + (a->glu ? 2 : 0);
  const BackwardKernel kernel = kBackwardKernels[variant];
  if (check_coresident(reinterpret_cast<const void*>(kernel), a->device, smem, np, grid, errbuf, errlen)) return 1;

  uint8_t* wsp = reinterpret_cast<uint8_t*>(a->workspace);
  const size_t hbytes = ws.layout;  // tensor maps + rank tables
  StagingLease stg;
  if (const char* msg = stg.acquire(hbytes, stream)) return write_err(errbuf, errlen, "%s", msg);
  uint8_t* host = stg->host;
  memset(host, 0, hbytes);
  CUtensorMap* maps = reinterpret_cast<CUtensorMap*>(host + ws.tmaps);
  const int L = a->L, H = a->H, F = a->F;
  const float** wsc = reinterpret_cast<const float**>(host + ws.wscale);
  for (int g = 0; g < np * L; ++g) {  // experts of this launch's ranks (w1 / w2 / w2t hold exactly these)
    const __nv_bfloat16* w1 = reinterpret_cast<const __nv_bfloat16*>(a->w1[g]);
    const __nv_bfloat16* w2 = reinterpret_cast<const __nv_bfloat16*>(a->w2[g]);
    if (!encode_2d(&maps[4 * g + 0], w1, H, F, a->w1_ld[g], mok::kBK, 128, errbuf, errlen, "w1 gate")) return 1;
    if (!encode_2d(&maps[4 * g + 1], w1 + (size_t)F * a->w1_ld[g], H, F, a->w1_ld[g], mok::kBK, 128, errbuf, errlen,
                   "w1 up"))
      return 1;
    if (a->saved_h) {  // saved h: W2 [H, F] read MN-major in [64 f x 64 h] boxes (256-column stage-1 tiles)
      if (!encode_2d(&maps[4 * g + 2], w2, F, H, a->w2_ld[g], 64, mok::kBK, errbuf, errlen, "w2")) return 1;
    } else {  // recompute: W2^T [F, H] K-major in [64 h x 128 f] boxes (128-column stage-1 tiles)
      if (!a->w2t || !a->w2t[g]) return write_err(errbuf, errlen, "recompute path needs W2^T of expert %d", g);
      const __nv_bfloat16* w2t = reinterpret_cast<const __nv_bfloat16*>(a->w2t[g]);
      if (!encode_2d(&maps[4 * g + 2], w2t, H, F, H, mok::kBK, 128, errbuf, errlen, "w2^T")) return 1;
    }
    // W1 [2F, H] read MN-major in [64 h x 64 j] boxes (stage 2: dX = dH @ W1)
    if (!encode_2d(&maps[4 * g + 3], w1, H, 2 * F, a->w1_ld[g], 64, mok::kBK, errbuf, errlen, "w1 (MN-major)"))
      return 1;
    if (a->fp8) {  // replaces the W2 / W1 maps: W^T e4m3, K-major, [128 B x 256 rows] boxes
      if (!a->w2t8[g] || !a->w2ts[g] || !a->w1t8[g] || !a->w1ts[g])
        return write_err(errbuf, errlen, "fp8 dgrad: expert %d's transposed e4m3 weight or scales pointer is null", g);
      if (!encode_2d_u8(&maps[4 * g + 2], reinterpret_cast<void*>(a->w2t8[g]), H, F, H, mok::kBKf8, mok::kBN, errbuf,
                        errlen, "w2^T e4m3") ||
          !encode_2d_u8(&maps[4 * g + 3], reinterpret_cast<void*>(a->w1t8[g]), 2 * F, H, 2 * F, mok::kBKf8, mok::kBN,
                        errbuf, errlen, "w1^T e4m3"))
        return 1;
      wsc[2 * g + 0] = reinterpret_cast<const float*>(a->w2ts[g]);
      wsc[2 * g + 1] = reinterpret_cast<const float*>(a->w1ts[g]);
    }
  }
  const unsigned long long cap = (unsigned long long)a->cap;
  for (int p = 0; p < np; ++p) {
    const int q = rank0 + p;
    CUtensorMap* rm = &maps[4 * np * L + 5 * p];
    if (!encode_2d(&rm[0], reinterpret_cast<void*>(a->xl[q]), H, cap, H, mok::kBK, mok::kBM, errbuf, errlen, "xl"))
      return 1;
    if (!encode_2d(&rm[1], reinterpret_cast<void*>(a->gyl[q]), H, cap, H, mok::kBK, mok::kBM, errbuf, errlen, "gyl"))
      return 1;
    if (!encode_2d(&rm[2], reinterpret_cast<void*>(a->dh[q]), 2 * F, cap, 2 * F, mok::kBK, mok::kBM, errbuf, errlen,
                   "dh"))
      return 1;
    // (home buffers of a rank without tokens may be empty tensors with null data pointers)
    if (!a->xl[q] || !a->gyl[q] || !a->dh[q] || !a->act[q] || !a->tpe[q] || (a->saved_h && !a->saved_h[q]))
      return write_err(errbuf, errlen, "rank %d: an owner-side buffer pointer (xl/gyl/dh/act/tpe/saved_h) is null", q);
    if (!encode_2d(&rm[4], reinterpret_cast<void*>(a->dh[q]), 2 * F, cap, 2 * F, mok::kBK, 64, errbuf, errlen,
                   "dh (64-row boxes)"))
      return 1;
    if (a->saved_h && !encode_2d(&rm[3], reinterpret_cast<void*>(a->saved_h[q]), 2 * F, cap, 2 * F, mok::kBK,
                                 mok::kBM, errbuf, errlen, "saved_h"))
      return 1;
    if (a->fp8) {  // replaces gyl / dh as the A operands: e4m3 [128 B x 128 rows] boxes
      if (!a->gyl8[q] || !a->gys[q] || !a->dh8[q] || !a->dhs[q])
        return write_err(errbuf, errlen, "fp8 dgrad: rank %d: a buffer pointer (gyl8/gys/dh8/dhs) is null", q);
      if (!encode_2d_u8(&rm[1], reinterpret_cast<void*>(a->gyl8[q]), H, cap, H, mok::kBKf8, mok::kBM, errbuf, errlen,
                        "gyl8") ||
          !encode_2d_u8(&rm[2], reinterpret_cast<void*>(a->dh8[q]), 2 * F, cap, 2 * F, mok::kBKf8, mok::kBM, errbuf,
                        errlen, "dh8"))
        return 1;
    }
  }
  mok::RankTable* rt = reinterpret_cast<mok::RankTable*>(host + ws.ranks);
  mok::bwd::BwdRank* br = reinterpret_cast<mok::bwd::BwdRank*>(host + ws.branks);
  long long entry_base = 0;
  int chunk_base = 0;
  for (int r = 0; r < a->R; ++r) {
    rt[r].x = reinterpret_cast<const __nv_bfloat16*>(a->x[r]);
    rt[r].idx = reinterpret_cast<const int*>(a->idx[r]);
    rt[r].w = reinterpret_cast<const float*>(a->w[r]);
    rt[r].out = reinterpret_cast<__nv_bfloat16*>(a->grad_x[r]);
    rt[r].combine = reinterpret_cast<__nv_bfloat16*>(a->grad_buf[r]);  // schedule zeroes its idx==-1 rows
    rt[r].tokens_per_expert = reinterpret_cast<int*>(a->tpe[r]);
    rt[r].T = (int)a->T[r];
    rt[r].entry_base = (int)entry_base;
    rt[r].chunk_base = chunk_base;
    entry_base += a->T[r] * a->K;
    chunk_base += (int)((a->T[r] + mok::kChunkTokens - 1) / mok::kChunkTokens);
    br[r].grad_out = reinterpret_cast<const __nv_bfloat16*>(a->grad_out[r]);
    br[r].combine = reinterpret_cast<const __nv_bfloat16*>(a->combine[r]);
    br[r].grad_buf = reinterpret_cast<__nv_bfloat16*>(a->grad_buf[r]);
    br[r].grad_x = reinterpret_cast<__nv_bfloat16*>(a->grad_x[r]);
    br[r].grad_w = reinterpret_cast<float*>(a->grad_w[r]);
    br[r].xl = reinterpret_cast<__nv_bfloat16*>(a->xl[r]);
    br[r].gyl = reinterpret_cast<__nv_bfloat16*>(a->gyl[r]);
    br[r].dh = reinterpret_cast<__nv_bfloat16*>(a->dh[r]);
    br[r].act = reinterpret_cast<__nv_bfloat16*>(a->act[r]);
    br[r].saved_h = a->saved_h ? reinterpret_cast<const __nv_bfloat16*>(a->saved_h[r]) : nullptr;
    if (a->fp8) {  // owner-side: only this launch's ranks need them (per-rank launch: the others may be 0)
      br[r].gyl8 = reinterpret_cast<uint8_t*>(a->gyl8[r]);
      br[r].gys = reinterpret_cast<float*>(a->gys[r]);
      br[r].dh8 = reinterpret_cast<uint8_t*>(a->dh8[r]);
      br[r].dhs = reinterpret_cast<float*>(a->dhs[r]);
    }
    rt[r].signal = has_peers(a) ? reinterpret_cast<unsigned*>(a->signal[r]) : nullptr;
  }

  mok::bwd::BwdParams P{};
  mok::Params& B = P.base;
  B.R = a->R; B.L = L; B.E = ws.E; B.H = H; B.F = F; B.K = a->K;
  B.rank0 = rank0; B.nparts = np; B.peer_sync = has_peers(a) ? 1 : 0; B.epoch = a->epoch;
  B.comm_sms = a->comm_sms; B.ctas_per_rank = cpr; B.ring_slots = a->ring_slots; B.minibatch = a->minibatch;
  B.mt_max = ws.mt_max;
  B.mb_cap = ws.mb_cap;
  B.num_chunks = ws.num_chunks; B.total_entries = ws.total_entries;
  B.stall_rank = a->stall_rank; B.stall_slot = a->stall_slot;
  B.timeout_ns = (unsigned long long)(a->timeout_ms > 0 ? a->timeout_ms * 1e6 : 1e10);
  B.glu = a->glu;
  B.glu_clamp = a->glu_clamp;
  B.glu_offset = a->glu_offset;
  B.layout_cap = a->cap;
  B.owner_rows = a->cap;
  B.ranks = reinterpret_cast<const mok::RankTable*>(wsp + ws.ranks);
  B.layout = reinterpret_cast<int2*>(wsp + ws.layout);
  B.local_rank = reinterpret_cast<int*>(wsp + ws.local_rank);
  B.chunk_counts = reinterpret_cast<int*>(wsp + ws.chunk_counts);
  B.expert_total = reinterpret_cast<int*>(wsp + ws.expert_total);
  B.expert_off = reinterpret_cast<int*>(wsp + ws.expert_off);
  B.counters = reinterpret_cast<unsigned*>(wsp + ws.counters);
  B.err = reinterpret_cast<int*>(a->err);
  if (a->timeline && (a->timeline_cap < 1 || !a->timeline_count))
    return write_err(errbuf, errlen, "timeline buffer needs timeline_cap >= 1 and a count array");
  B.timeline = reinterpret_cast<mok::TimelineEvent*>(a->timeline);
  B.timeline_count = reinterpret_cast<unsigned*>(a->timeline_count);
  B.timeline_cap = a->timeline ? a->timeline_cap : 0;
  P.br = reinterpret_cast<const mok::bwd::BwdRank*>(wsp + ws.branks);
  B.wscale = a->fp8 ? reinterpret_cast<const float* const*>(wsp + ws.wscale) : nullptr;
  P.tm = reinterpret_cast<const CUtensorMap*>(wsp + ws.tmaps);
  P.ctr = B.counters;
  P.nt1 = a->saved_h ? (F + 255) / 256 : (F + 127) / 128;  // stage-1 tile width: see bwd_consumer_saved
  P.nt2 = (H + mok::kBN - 1) / mok::kBN;
  P.t1 = ws.mt_max * P.nt1;
  P.tickets_per_mb = ws.mt_max * (P.nt1 + P.nt2);
  P.defer_home = a->defer_home ? 1 : 0;
  P.x_kept = a->x_kept ? 1 : 0;
  P.act_kept = a->act_kept ? 1 : 0;

  const LaunchState state{&stg, wsp, hbytes, ws.zero_begin, ws.zero_end, reinterpret_cast<int*>(a->err),
                          a->timeline ? B.timeline_count : nullptr};
  return launch_persistent(kernel, P, (unsigned)(np * cpr), smem, stream, state, errbuf, errlen);
}

}  // namespace mok_host

// =================================================================================================
// wgrad (backward/wgrad.cuh): dW1 = dH^T x, dW2 = gy^T act per local expert, after the dgrad launch
// =================================================================================================

namespace {

struct WgradWs {
  size_t tmaps, tpe, out1, out2, home, ticket, total;
};

WgradWs wgrad_plan(const MokWgradArgs* a) {
  WgradWs w{};
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t o = off; off = align_up(off + bytes, 128); return o; };
  w.tmaps = take((size_t)4 * a->np * sizeof(CUtensorMap));
  w.tpe = take((size_t)a->np * sizeof(void*));
  w.out1 = take((size_t)a->np * a->L * sizeof(mok::bwd::WgradOut));
  w.out2 = take((size_t)a->np * a->L * sizeof(mok::bwd::WgradOut));
  w.home = take((size_t)std::max(a->home_parts, 1) * sizeof(mok::bwd::HomeRank));
  w.ticket = take(64 + (size_t)8 * std::max(a->home_parts, 0));  // ticket, then the home cursors
  w.total = off;
  return w;
}

bool wgrad_validate(const MokWgradArgs* a, char* eb, int el) {
  if (a->np < 1 || a->np > MOK_MAX_RANKS) return !write_err(eb, el, "np=%d out of [1, %d]", a->np, MOK_MAX_RANKS);
  if (a->L < 1 || a->L > MOK_MAX_LOCAL_EXPERTS) return !write_err(eb, el, "L=%d out of range", a->L);
  if (a->H < 64 || a->H % 64) return !write_err(eb, el, "hidden H=%d must be a positive multiple of 64", a->H);
  if (a->F < 64 || a->F % 64) return !write_err(eb, el, "ffn F=%d must be a positive multiple of 64", a->F);
  if (a->cap < 1 || a->cap >= (1LL << 31)) return !write_err(eb, el, "cap=%lld out of [1, 2^31)", a->cap);
  if (a->home_parts < 0 || a->home_parts > MOK_MAX_RANKS)
    return !write_err(eb, el, "home_parts=%d out of [0, %d]", a->home_parts, MOK_MAX_RANKS);
  if (a->home_parts > 0 && (a->K < 1 || a->K > 64)) return !write_err(eb, el, "top-k K=%d out of [1, 64]", a->K);
  return true;
}

}  // namespace

namespace mok_host {

long long wgrad_workspace_bytes(const MokWgradArgs* a, char* errbuf, int errlen) {
  if (!wgrad_validate(a, errbuf, errlen)) return -1;
  return (long long)wgrad_plan(a).total;
}

int wgrad_launch(const MokWgradArgs* a, cudaStream_t stream, char* errbuf, int errlen) {
  if (!wgrad_validate(a, errbuf, errlen)) return 1;
  MOK_CUDA_CHECK(cudaSetDevice(a->device));
  int num_sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, a->device));
  const WgradWs ws = wgrad_plan(a);
  if (a->workspace_bytes < ws.total)
    return write_err(errbuf, errlen, "wgrad workspace too small: %llu < %zu", a->workspace_bytes, ws.total);
  const int np = a->np, L = a->L, H = a->H, F = a->F;
  StagingLease stg;
  if (const char* msg = stg.acquire(ws.ticket, stream)) return write_err(errbuf, errlen, "%s", msg);
  uint8_t* host = stg->host;
  memset(host, 0, ws.ticket);
  uint8_t* wsp = reinterpret_cast<uint8_t*>(a->workspace);
  CUtensorMap* maps = reinterpret_cast<CUtensorMap*>(host + ws.tmaps);
  const unsigned long long cap = (unsigned long long)a->cap;
  const int** tpe = reinterpret_cast<const int**>(host + ws.tpe);
  for (int p = 0; p < np; ++p) {
    if (!a->tpe[p] || !a->xl[p] || !a->gyl[p] || !a->dh[p] || !a->act[p])
      return write_err(errbuf, errlen, "wgrad: partition %d: a buffer pointer (tpe/xl/gyl/dh/act) is null", p);
    CUtensorMap* m = &maps[4 * p];  // [64 cols x 64 rows] boxes: MN-major operands of a reduction over rows
    if (!encode_2d(&m[0], reinterpret_cast<void*>(a->xl[p]), H, cap, H, 64, mok::kBK, errbuf, errlen, "wgrad xl") ||
        !encode_2d(&m[1], reinterpret_cast<void*>(a->gyl[p]), H, cap, H, 64, mok::kBK, errbuf, errlen, "wgrad gyl") ||
        !encode_2d(&m[2], reinterpret_cast<void*>(a->dh[p]), 2 * F, cap, 2 * F, 64, mok::kBK, errbuf, errlen,
                   "wgrad dh") ||
        !encode_2d(&m[3], reinterpret_cast<void*>(a->act[p]), F, cap, F, 64, mok::kBK, errbuf, errlen, "wgrad act"))
      return 1;
    tpe[p] = reinterpret_cast<const int*>(a->tpe[p]);
  }
  mok::bwd::WgradOut* o1 = reinterpret_cast<mok::bwd::WgradOut*>(host + ws.out1);
  mok::bwd::WgradOut* o2 = reinterpret_cast<mok::bwd::WgradOut*>(host + ws.out2);
  for (int g = 0; g < np * L; ++g) {
    if (!a->gw1[g] || !a->gw2[g] || a->gw1[g] % 8 || a->gw2[g] % 8)
      return write_err(errbuf, errlen, "wgrad: expert %d: output pointer null or not 8-byte aligned", g);
    if (a->gw1_ld[g] < H || a->gw1_ld[g] % 2 || a->gw2_ld[g] < F || a->gw2_ld[g] % 2)
      return write_err(errbuf, errlen, "wgrad: expert %d: output row strides %lld / %lld (need >= %d / %d, even)", g,
                       a->gw1_ld[g], a->gw2_ld[g], H, F);
    o1[g].ptr = reinterpret_cast<float*>(a->gw1[g]);
    o1[g].ld = a->gw1_ld[g];
    o2[g].ptr = reinterpret_cast<float*>(a->gw2[g]);
    o2[g].ld = a->gw2_ld[g];
  }

  mok::bwd::HomeRank* hr = reinterpret_cast<mok::bwd::HomeRank*>(host + ws.home);
  for (int p = 0; p < a->home_parts; ++p) {
    // the home cursors are 32-bit and count (token, k) entries
    if (a->h_T[p] < 0 || a->h_T[p] * a->K >= (1LL << 31))
      return write_err(errbuf, errlen, "wgrad: home rank %d: T=%lld x K=%d entries out of range", p, a->h_T[p], a->K);
    if (a->h_T[p] > 0 && (!a->h_grad_out[p] || !a->h_combine[p] || !a->h_grad_buf[p] || !a->h_idx[p] ||
                          !a->h_grad_w[p] || !a->h_grad_x[p]))
      return write_err(errbuf, errlen, "wgrad: home rank %d: a reduction buffer pointer is null", p);
    hr[p].grad_out = reinterpret_cast<const __nv_bfloat16*>(a->h_grad_out[p]);
    hr[p].combine = reinterpret_cast<const __nv_bfloat16*>(a->h_combine[p]);
    hr[p].grad_buf = reinterpret_cast<const __nv_bfloat16*>(a->h_grad_buf[p]);
    hr[p].idx = reinterpret_cast<const int*>(a->h_idx[p]);
    hr[p].grad_w = reinterpret_cast<float*>(a->h_grad_w[p]);
    hr[p].grad_x = reinterpret_cast<__nv_bfloat16*>(a->h_grad_x[p]);
    hr[p].T = (int)a->h_T[p];
  }

  mok::bwd::WgradParams P{};
  P.base.R = np;
  P.base.L = L;
  P.base.H = H;
  P.base.F = F;
  P.base.nparts = np;
  P.base.stall_rank = P.base.stall_slot = -1;
  P.base.timeout_ns = (unsigned long long)(a->timeout_ms > 0 ? a->timeout_ms * 1e6 : 1e10);
  P.base.err = reinterpret_cast<int*>(a->err);
  P.np = np;
  P.rank0 = a->rank0;
  P.L = L;
  P.H = H;
  P.F = F;
  P.accumulate = a->accumulate ? 1 : 0;
  P.mt1 = (2 * F + mok::kBM - 1) / mok::kBM;
  P.nt1 = (H + mok::kBN - 1) / mok::kBN;
  P.mt2 = (H + mok::kBM - 1) / mok::kBM;
  P.nt2 = (F + mok::kBN - 1) / mok::kBN;
  const long long total = (long long)np * L * (P.mt1 * P.nt1 + P.mt2 * P.nt2);
  if (total >= (1LL << 32)) return write_err(errbuf, errlen, "wgrad: %lld tiles overflow the ticket counter", total);
  P.total = (unsigned)total;
  P.cap = a->cap;
  P.tm = reinterpret_cast<const CUtensorMap*>(wsp + ws.tmaps);
  P.tpe = reinterpret_cast<const int* const*>(wsp + ws.tpe);
  P.out1 = reinterpret_cast<const mok::bwd::WgradOut*>(wsp + ws.out1);
  P.out2 = reinterpret_cast<const mok::bwd::WgradOut*>(wsp + ws.out2);
  P.ticket = reinterpret_cast<unsigned*>(wsp + ws.ticket);
  P.K = a->K;
  P.home_parts = std::max(a->home_parts, 0);
  P.home = reinterpret_cast<const mok::bwd::HomeRank*>(wsp + ws.home);
  P.home_cursor = reinterpret_cast<unsigned*>(wsp + ws.ticket + 64);

  const int smem = mok::bwd::wgrad_smem_bytes() + 1024;
  static int cached_smem[64] = {0};
  const int dslot = a->device & 63;
  if (cached_smem[dslot] != smem) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(mok::bwd::mok_wgrad_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cached_smem[dslot] = smem;
  }
  MOK_CUDA_CHECK(stg.upload(wsp, ws.ticket, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(wsp + ws.ticket, 0, ws.total - ws.ticket, stream));
  const unsigned grid = (unsigned)std::min<long long>(num_sms, std::max<long long>(total, 1));
  mok::bwd::mok_wgrad_kernel<<<grid, mok::kThreads, (size_t)smem, stream>>>(P);
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host
