// Launchers of the forward library's unit kernels (included once, by host/forward.cu): the FP8
// block-scaled grouped GEMM (gemm/fp8_gemm.cuh) and weight-gradient GEMM (gemm/fp8_wgrad_gemm.cuh) with its
// operands' quantiser (quant/fp8_token_quant.cuh), the FP8 weight quantiser (quant/fp8_weight_quant.cuh), the
// MXFP8 row quantiser (quant/mxfp8_quant.cuh) and the routing conversion (routing/topk_from_map.cuh). Host code; every CUDA call checked.
#pragma once
#include "gemm/fp8_gemm.cuh"
#include "gemm/fp8_wgrad_gemm.cuh"
#include "host/host_launch.h"
#include "host/launch_args.h"
#include "quant/fp8_token_quant.cuh"
#include "quant/fp8_weight_quant.cuh"
#include "quant/mxfp8_quant.cuh"
#include "routing/topk_from_map.cuh"

// =================================================================================================
// FP8 block-scaled grouped GEMM (gemm/fp8_gemm.cuh): the unit kernel of the FP8 path
// =================================================================================================

namespace {

// The Params fields a unit kernel reads (mbar_wait's timeout and error record): one rank, no peers.
mok::Params unit_base_params(int L, double timeout_ms, unsigned long long err) {
  mok::Params p{};
  p.R = 1;
  p.L = L;
  p.nparts = 1;
  p.stall_rank = p.stall_slot = -1;
  p.timeout_ns = (unsigned long long)(timeout_ms > 0 ? timeout_ms * 1e6 : 1e10);
  p.err = reinterpret_cast<int*>(err);
  return p;
}

// A kernel's dynamic shared-memory limit raised once per device (cached[64]: the size set, by device).
template <class Kernel>
cudaError_t max_dynamic_smem_once(Kernel kernel, int bytes, int device, int* cached) {
  if (cached[device & 63] == bytes) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) cached[device & 63] = bytes;
  return e;
}

struct F8Ws {
  size_t tmaps, ws_ptrs, mtiles, total;
  long long num_mtiles;
};

bool fp8_validate(const MokFp8GemmArgs* a, char* eb, int el) {
  if (a->L < 1 || a->L > MOK_MAX_LOCAL_EXPERTS) return !write_err(eb, el, "L=%d out of range", a->L);
  if (a->N < 128 || a->N % 128) return !write_err(eb, el, "N=%d must be a positive multiple of 128", a->N);
  if (a->K < 128 || a->K % 128) return !write_err(eb, el, "K=%d must be a positive multiple of 128", a->K);
  if (a->rows < 0 || a->rows >= (1LL << 31)) return !write_err(eb, el, "rows=%lld out of range", a->rows);
  long long sum = 0;
  for (int e = 0; e < a->L; ++e) {
    if (a->counts[e] < 0) return !write_err(eb, el, "counts[%d] < 0", e);
    sum += a->counts[e];
  }
  if (sum > a->rows) return !write_err(eb, el, "expert rows sum to %lld > %lld rows of x", sum, a->rows);
  return true;
}

F8Ws fp8_plan(const MokFp8GemmArgs* a) {
  F8Ws w{};
  for (int e = 0; e < a->L; ++e) w.num_mtiles += (a->counts[e] + mok::fp8::kF8BM - 1) / mok::fp8::kF8BM;
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t o = off; off = align_up(off + bytes, 128); return o; };
  w.tmaps = take((size_t)(1 + a->L) * sizeof(CUtensorMap));
  w.ws_ptrs = take((size_t)a->L * sizeof(void*));
  w.mtiles = take((size_t)std::max<long long>(w.num_mtiles, 1) * sizeof(int4));
  w.total = off;
  return w;
}

}  // namespace

namespace mok_host {

long long fp8_gemm_workspace_bytes(const MokFp8GemmArgs* a, char* errbuf, int errlen) {
  if (!fp8_validate(a, errbuf, errlen)) return -1;
  return (long long)fp8_plan(a).total;
}

int fp8_gemm_launch(const MokFp8GemmArgs* a, cudaStream_t stream, char* errbuf, int errlen) {
  if (!fp8_validate(a, errbuf, errlen)) return 1;
  MOK_CUDA_CHECK(cudaSetDevice(a->device));
  int num_sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, a->device));
  const F8Ws ws = fp8_plan(a);
  if (a->workspace_bytes < ws.total)
    return write_err(errbuf, errlen, "fp8 gemm workspace too small: %llu < %zu", a->workspace_bytes, ws.total);
  if (ws.num_mtiles == 0) return 0;  // no rows: nothing to write
  if (!a->xq || !a->xs || !a->out) return write_err(errbuf, errlen, "fp8 gemm: x / scales / out pointer is null");
  StagingLease stg;
  if (const char* msg = stg.acquire(ws.total, stream)) return write_err(errbuf, errlen, "%s", msg);
  uint8_t* host = stg->host;
  memset(host, 0, ws.total);
  CUtensorMap* maps = reinterpret_cast<CUtensorMap*>(host + ws.tmaps);
  const int L = a->L, N = a->N, K = a->K;
  if (!encode_2d_u8(&maps[0], reinterpret_cast<void*>(a->xq), K, a->rows, K, mok::fp8::kF8BK, mok::fp8::kF8BM,
                    errbuf, errlen, "fp8 xq"))
    return 1;
  const float** wsp = reinterpret_cast<const float**>(host + ws.ws_ptrs);
  for (int e = 0; e < L; ++e) {
    if (!a->wq[e] || !a->ws[e]) return write_err(errbuf, errlen, "fp8 gemm: expert %d weight / scale pointer is null", e);
    if (!encode_2d_u8(&maps[1 + e], reinterpret_cast<void*>(a->wq[e]), K, N, K, mok::fp8::kF8BK, mok::fp8::kF8BN,
                      errbuf, errlen, "fp8 wq"))
      return 1;
    wsp[e] = reinterpret_cast<const float*>(a->ws[e]);
  }
  int4* mt = reinterpret_cast<int4*>(host + ws.mtiles);
  long long row = 0, i = 0;
  for (int e = 0; e < L; ++e) {
    for (long long r = 0; r < a->counts[e]; r += mok::fp8::kF8BM)
      mt[i++] = make_int4(e, (int)(row + r), (int)std::min<long long>(mok::fp8::kF8BM, a->counts[e] - r), 0);
    row += a->counts[e];
  }
  uint8_t* dev = reinterpret_cast<uint8_t*>(a->workspace);
  mok::fp8::F8GemmParams P{};
  P.base = unit_base_params(L, a->timeout_ms, a->err);
  P.N = N;
  P.K = K;
  P.n_tiles = N / mok::fp8::kF8BN;
  const long long tiles = ws.num_mtiles * P.n_tiles;
  if (tiles >= (1LL << 31)) return write_err(errbuf, errlen, "fp8 gemm: %lld tiles", tiles);
  P.num_tiles = (int)tiles;
  P.mtiles = reinterpret_cast<const int4*>(dev + ws.mtiles);
  P.tm = reinterpret_cast<const CUtensorMap*>(dev + ws.tmaps);
  P.xs = reinterpret_cast<const float*>(a->xs);
  P.ws = reinterpret_cast<const float* const*>(dev + ws.ws_ptrs);
  P.out = reinterpret_cast<__nv_bfloat16*>(a->out);
  const int smem = mok::fp8::fp8_gemm_smem_bytes() + 1024;  // + the 1024-B alignment of the stages
  static int cached_smem[64] = {0};
  MOK_CUDA_CHECK(max_dynamic_smem_once(mok::fp8::mok_fp8_gemm_kernel, smem, a->device, cached_smem));
  MOK_CUDA_CHECK(stg.upload(dev, ws.total, stream));
  const unsigned grid = (unsigned)std::min<long long>(num_sms, tiles);
  mok::fp8::mok_fp8_gemm_kernel<<<grid, mok::kThreads, (size_t)smem, stream>>>(P);
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host


// =================================================================================================
// FP8 K-grouped weight-gradient GEMM (gemm/fp8_wgrad_gemm.cuh)
// =================================================================================================

namespace {

struct W8Ws {
  size_t tmaps, out_ptrs, total;
};

bool fp8_wgrad_validate(const MokFp8WgradArgs* a, char* eb, int el) {
  if (a->L < 1 || a->L > MOK_MAX_LOCAL_EXPERTS) return !write_err(eb, el, "L=%d out of range", a->L);
  if (a->M < 128 || a->M % 128) return !write_err(eb, el, "M=%d must be a positive multiple of 128", a->M);
  if (a->N < 128 || a->N % 128) return !write_err(eb, el, "N=%d must be a positive multiple of 128", a->N);
  if (a->ktot < 0 || a->ktot % 128 || a->ktot >= (1LL << 31))
    return !write_err(eb, el, "%lld token columns: must be a multiple of 128 below 2^31", a->ktot);
  const long long tiles = (long long)a->L * (a->M / 128) * (a->N / 128);
  if (tiles >= (1LL << 31)) return !write_err(eb, el, "fp8 wgrad: %lld tiles", tiles);
  return true;
}

W8Ws fp8_wgrad_plan(const MokFp8WgradArgs* a) {
  W8Ws w{};
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t o = off; off = align_up(off + bytes, 128); return o; };
  w.tmaps = take(2 * sizeof(CUtensorMap));
  w.out_ptrs = take((size_t)a->L * sizeof(void*));
  w.total = off;
  return w;
}

}  // namespace

namespace mok_host {

long long fp8_wgrad_workspace_bytes(const MokFp8WgradArgs* a, char* errbuf, int errlen) {
  if (!fp8_wgrad_validate(a, errbuf, errlen)) return -1;
  return (long long)fp8_wgrad_plan(a).total;
}

int fp8_wgrad_launch(const MokFp8WgradArgs* a, cudaStream_t stream, char* errbuf, int errlen) {
  if (!fp8_wgrad_validate(a, errbuf, errlen)) return 1;
  MOK_CUDA_CHECK(cudaSetDevice(a->device));
  int num_sms = 0;
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, a->device));
  const W8Ws ws = fp8_wgrad_plan(a);
  if (a->workspace_bytes < ws.total)
    return write_err(errbuf, errlen, "fp8 wgrad workspace too small: %llu < %zu", a->workspace_bytes, ws.total);
  const bool reads = a->ktot > 0;  // without token columns every expert's gradient is zero: no map to encode
  if (!a->counts || (reads && (!a->a || !a->b || !a->sa || !a->sb)) || (a->sa | a->sb) % 16)
    return write_err(errbuf, errlen, "fp8 wgrad: counts, operand or scale pointer null or not 16-byte aligned");
  StagingLease stg;
  if (const char* msg = stg.acquire(ws.total, stream)) return write_err(errbuf, errlen, "%s", msg);
  uint8_t* host = stg->host;
  memset(host, 0, ws.total);
  CUtensorMap* maps = reinterpret_cast<CUtensorMap*>(host + ws.tmaps);
  if (reads && (!encode_2d_u8(&maps[0], reinterpret_cast<void*>(a->a), a->ktot, a->M, a->ktot, mok::fp8::kF8BK,
                              mok::fp8::kF8BM, errbuf, errlen, "fp8 wgrad a") ||
                !encode_2d_u8(&maps[1], reinterpret_cast<void*>(a->b), a->ktot, a->N, a->ktot, mok::fp8::kF8BK,
                              mok::fp8::kF8BN, errbuf, errlen, "fp8 wgrad b")))
    return 1;
  float** outp = reinterpret_cast<float**>(host + ws.out_ptrs);
  for (int e = 0; e < a->L; ++e) {
    if (!a->out[e] || a->out[e] % 8) return write_err(errbuf, errlen, "fp8 wgrad: out[%d] null or not 8-byte aligned", e);
    outp[e] = reinterpret_cast<float*>(a->out[e]);
  }
  uint8_t* dev = reinterpret_cast<uint8_t*>(a->workspace);
  mok::fp8::F8WgradParams P{};
  P.base = unit_base_params(a->L, a->timeout_ms, a->err);
  P.M = a->M;
  P.N = a->N;
  P.L = a->L;
  P.m_tiles = a->M / mok::fp8::kF8BM;
  P.n_tiles = a->N / mok::fp8::kF8BN;
  P.num_tiles = a->L * P.m_tiles * P.n_tiles;  // validated below 2^31
  P.ktot = a->ktot;
  P.counts = reinterpret_cast<const int*>(a->counts);
  P.tm = reinterpret_cast<const CUtensorMap*>(dev + ws.tmaps);
  P.sa = reinterpret_cast<const float*>(a->sa);
  P.sb = reinterpret_cast<const float*>(a->sb);
  P.out = reinterpret_cast<float* const*>(dev + ws.out_ptrs);
  P.accumulate = a->accumulate ? 1 : 0;
  const int smem = mok::fp8::fp8_wgrad_smem_bytes() + 1024;  // + the 1024-B alignment of the stages
  static int cached_smem[64] = {0};
  MOK_CUDA_CHECK(max_dynamic_smem_once(mok::fp8::mok_fp8_wgrad_kernel, smem, a->device, cached_smem));
  MOK_CUDA_CHECK(stg.upload(dev, ws.total, stream));
  const unsigned grid = (unsigned)std::min(num_sms, P.num_tiles);
  mok::fp8::mok_fp8_wgrad_kernel<<<grid, mok::kThreads, (size_t)smem, stream>>>(P);
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host


// =================================================================================================
// FP8 quantisation along the tokens (quant/fp8_token_quant.cuh): the FP8 wgrad unit's operands
// =================================================================================================
namespace mok_host {

int fp8_quantize_tokens(const void* rows, long long ld, long long nrows, int F, int L, const int* counts, void* q,
                        float* s, long long kcap, int* err, int device, cudaStream_t stream, char* errbuf, int errlen) {
  const unsigned long long r = reinterpret_cast<uintptr_t>(rows), qa = reinterpret_cast<uintptr_t>(q);
  if (F < 128 || F % 128) return write_err(errbuf, errlen, "fp8 token rows: %d columns, not a positive multiple of 128", F);
  if (L < 1 || L > MOK_MAX_LOCAL_EXPERTS) return write_err(errbuf, errlen, "fp8 token rows: L=%d out of range", L);
  if (nrows < 0 || ld < F || ld % 8)
    return write_err(errbuf, errlen, "fp8 token rows: %lld rows with row stride %lld (>= %d, a multiple of 8)", nrows,
                     ld, F);
  const long long need = token_major_capacity(nrows, L);
  if (kcap < need || kcap % 128 || kcap / 128 >= (1LL << 31))
    return write_err(errbuf, errlen, "fp8 token rows: %lld token columns, %lld rows of %d experts need %lld", kcap,
                     nrows, L, need);
  // no rows: the rows pointer may be null (the kernel still checks that every count is 0, and reads no row)
  if ((nrows > 0 && (!r || r % 16)) || !qa || !s || !counts || !err || qa % 16)
    return write_err(errbuf, errlen, "fp8 token rows: null or not 16-byte aligned rows / output / count pointer");
  MOK_CUDA_CHECK(cudaSetDevice(device));
  mok::TokenQuantParams P{unit_base_params(L, 0.0, reinterpret_cast<uintptr_t>(err)),
                          reinterpret_cast<const __nv_bfloat16*>(rows), ld, nrows, F, L, counts,
                          reinterpret_cast<uint8_t*>(q), s, kcap};
  mok::mok_fp8_quantize_tokens_kernel<<<dim3((unsigned)(kcap / 128), (unsigned)(F / 128)), mok::kTqThreads, 0,
                                        stream>>>(P);
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host


// =================================================================================================
// FP8 weight quantisation (quant/fp8_weight_quant.cuh): once per optimizer step, bit-identical to the oracle
// =================================================================================================
namespace mok_host {

int fp8_quantize_weight(const void* wp, long long ld, int N, int K, void* qp, float* sp, int device, cudaStream_t stream,
                        char* errbuf, int errlen) {
  const unsigned long long w = reinterpret_cast<uintptr_t>(wp), q = reinterpret_cast<uintptr_t>(qp),
                           s = reinterpret_cast<uintptr_t>(sp);
  if (N < 128 || K < 128 || N % 128 || K % 128)
    return write_err(errbuf, errlen, "fp8 weight [%d, %d]: both sizes must be positive multiples of 128", N, K);
  if (ld < K || ld % 8) return write_err(errbuf, errlen, "fp8 weight: row stride %lld must be >= K and a multiple of 8", ld);
  if (!w || !q || !s || w % 16 || q % 16)
    return write_err(errbuf, errlen, "fp8 weight: null or not 16-byte aligned weight / output pointer");
  MOK_CUDA_CHECK(cudaSetDevice(device));
  mok::mok_fp8_quantize_weight_kernel<<<dim3((unsigned)(K / 128), (unsigned)(N / 128)), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(w), ld, K, reinterpret_cast<uint8_t*>(q), reinterpret_cast<float*>(s));
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host


// =================================================================================================
// MXFP8 rows (quant/mxfp8_quant.cuh): the Blackwell recipe's quantiser as a unit, runnable on any arch
// =================================================================================================
namespace mok_host {

// sf_layout: 0 row-major [M][H/32] bytes; 1 the sm_100 MMA's scale-factor layout (sf_bytes: its size,
// rows padded to 128 and scales per row to 4 -- megatron_mok/mxfp8.py sm100_sf_bytes).
int mxfp8_quantize_rows(const void* xp, long long ld, int M, int H, void* qp, void* sfp, long long sf_bytes,
                        int sf_layout, int device, cudaStream_t stream, char* errbuf, int errlen) {
  const unsigned long long x = reinterpret_cast<uintptr_t>(xp), q = reinterpret_cast<uintptr_t>(qp),
                           sf = reinterpret_cast<uintptr_t>(sfp);
  if (M < 0 || H < 32 || H % 32)
    return write_err(errbuf, errlen, "mxfp8 rows [%d, %d]: H must be a positive multiple of 32", M, H);
  if (ld < H || ld % 8) return write_err(errbuf, errlen, "mxfp8 rows: row stride %lld must be >= H and a multiple of 8", ld);
  if (sf_layout != mok::kMxScalesRowMajor && sf_layout != mok::kMxScalesSm100)
    return write_err(errbuf, errlen, "mxfp8 rows: scale layout %d is not 0 (row-major) or 1 (sm_100)", sf_layout);
  const long long nkb = H / 32;
  const long long need = sf_layout == mok::kMxScalesRowMajor ? (long long)M * nkb
                                                             : (long long)((M + 127) / 128) * ((nkb + 3) / 4) * 512;
  if (sf_bytes < need)
    return write_err(errbuf, errlen, "mxfp8 rows: scale buffer of %lld bytes, the layout needs %lld", sf_bytes, need);
  if (M == 0) return 0;
  if (!x || !q || !sf || x % 16 || q % 8)
    return write_err(errbuf, errlen, "mxfp8 rows: null or misaligned pointer (x 16-byte, q 8-byte)");
  MOK_CUDA_CHECK(cudaSetDevice(device));
  const int blocks = (int)std::min<long long>(((long long)M + 7) / 8, 65535);
  mok::mok_mxfp8_quantize_rows_kernel<<<blocks, 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x), ld, M, H, reinterpret_cast<uint8_t*>(q), reinterpret_cast<uint8_t*>(sf),
      sf_layout);
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

int topk_from_map(const void* map, const void* probs, int probs_bf16, long long T, int E, int K, int* idx, void* w,
                  int device, cudaStream_t stream, char* errbuf, int errlen) {
  if (T < 0 || E < 1 || K < 1) return write_err(errbuf, errlen, "routing map [%lld, %d] to top-%d: bad sizes", T, E, K);
  if (T == 0) return 0;
  if (!map || !probs || !idx || !w) return write_err(errbuf, errlen, "routing map to top-k: null pointer");
  MOK_CUDA_CHECK(cudaSetDevice(device));
  const long long blocks = (T + 7) / 8;  // 8 warps of 256 threads, a token each
  if (blocks > 0x7fffffffLL) return write_err(errbuf, errlen, "routing map to top-k: %lld tokens is too many", T);
  const bool* m = reinterpret_cast<const bool*>(map);
  if (probs_bf16)
    mok::mok_topk_from_map_kernel<<<(unsigned)blocks, 256, 0, stream>>>(
        m, reinterpret_cast<const __nv_bfloat16*>(probs), T, E, K, idx, reinterpret_cast<__nv_bfloat16*>(w));
  else
    mok::mok_topk_from_map_kernel<<<(unsigned)blocks, 256, 0, stream>>>(m, reinterpret_cast<const float*>(probs), T, E,
                                                                        K, idx, reinterpret_cast<float*>(w));
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host
