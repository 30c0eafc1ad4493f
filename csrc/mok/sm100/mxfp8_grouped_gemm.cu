// MXFP8 grouped expert GEMM for Blackwell (sm_100a): D_g[M_g, N] = A_g[M_g, K] * B_g[N, K]^T per expert g,
// e4m3 operands with one UE8M0 scale per 1 x 32 block along K (both operands K-major), fp32 accumulation
// in tensor memory, bf16 output. The Blackwell counterpart of the Hopper FP8 unit (../fp8_gemm.cuh): the
// building block the sm_100a megakernel's in-kernel FFN is to be made of, written against CUTLASS's
// sm_100 block-scaled collective (tcgen05.mma kind::mxf8f6f4, TMA, warp-specialised, persistent tile
// scheduler over the groups) rather than hand-rolled tcgen05 code that nothing here could run.
//
// Status: compiled for sm_100a on every CI run (tests/test_sm100_compile.py); it cannot run on the
// H200 we measure on, so its numerics are checked by nothing yet -- megatron_mok/mxfp8.py (mxfp8_linear)
// is the oracle for the first Blackwell run. The scales it reads are in the layout csrc/mok/quant/mxfp8_quant.cuh
// writes (kMxScalesSm100), verified against CUTLASS's layout on CPU.
//
// Host API (sm100/mxfp8_grouped_gemm.h, no torch; the PyTorch operator is apis/sm100.cpp).
// A[g]: [M_g, K] e4m3 row-major; B[g]: [N, K] e4m3 row-major (the expert weight); SFA[g] / SFB[g]: their
// scales in the sm_100 layout; D[g]: [M_g, ldd] bf16. K a multiple of 128, N of 16, M_g >= 0.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "sm100/mxfp8_grouped_gemm.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "host/host_launch.h"

#if !defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED)
#error "mxfp8_grouped_gemm.cu is the sm_100a unit: compile with -gencode=arch=compute_100a,code=sm_100a"
#endif

namespace mok::sm100 {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per expert
using ElementA = cutlass::mx_float8_t<cutlass::float_e4m3_t>;  // e4m3 + UE8M0 per 32 along K
using ElementB = cutlass::mx_float8_t<cutlass::float_e4m3_t>;
using ElementD = cutlass::bfloat16_t;
using ElementAcc = float;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // K x N column-major = the weight [N, K] row-major
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // 16 bytes of e4m3
constexpr int kAlignD = 8;    // 16 bytes of bf16

// One SM per MMA (1-CTA tcgen05), 128 x 256 tiles like the Hopper megakernel's, K step 128 (4 scale blocks)
using MmaTile = Shape<_128, _256, _128>;
using Cluster = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
    ElementAcc, ElementAcc, void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
    cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*,
    kAlignAB, ElementAcc, MmaTile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmMxf8f6f4Sm100>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = typename Kernel::InternalStrideA;
using StrideB = typename Kernel::InternalStrideB;
using StrideD = typename Kernel::InternalStrideD;
using LayoutSFA = typename Kernel::CollectiveMainloop::InternalLayoutSFA;
using LayoutSFB = typename Kernel::CollectiveMainloop::InternalLayoutSFB;
using SfConfig = typename Kernel::CollectiveMainloop::Sm1xxBlkScaledConfig;
using ElementSF = typename Kernel::ElementSF;
using ElementAData = typename Kernel::ElementA;  // the e4m3 data type behind mx_float8_t
using ElementBData = typename Kernel::ElementB;
using UnderlyingProblem = typename ProblemShape::UnderlyingProblemShape;

// Per-expert arrays the kernel reads from device memory, carved from the caller's workspace.
struct DeviceArrays {
  size_t problems, a, b, sfa, sfb, d, stride_a, stride_b, stride_d, layout_sfa, layout_sfb, total;
};

inline size_t align256(size_t v) { return (v + 255) & ~size_t(255); }

inline DeviceArrays carve(int G) {
  DeviceArrays w{};
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off = align256(off + bytes); return o; };
  w.problems = take(G * sizeof(UnderlyingProblem));
  w.a = take(G * sizeof(void*));
  w.b = take(G * sizeof(void*));
  w.sfa = take(G * sizeof(void*));
  w.sfb = take(G * sizeof(void*));
  w.d = take(G * sizeof(void*));
  w.stride_a = take(G * sizeof(StrideA));
  w.stride_b = take(G * sizeof(StrideB));
  w.stride_d = take(G * sizeof(StrideD));
  w.layout_sfa = take(G * sizeof(LayoutSFA));
  w.layout_sfb = take(G * sizeof(LayoutSFB));
  w.total = off;
  return w;
}

using mok_host::write_err;  // the launchers' error text (../host_launch.h)

inline bool check_shapes(int G, const int* M, int N, int K, char* errbuf, int errlen) {
  if (G < 1) return !write_err(errbuf, errlen, "mxfp8 grouped gemm: %d experts", G);
  if (K < 128 || K % 128) return !write_err(errbuf, errlen, "mxfp8 grouped gemm: K=%d must be a positive multiple of 128", K);
  if (N < 16 || N % 16) return !write_err(errbuf, errlen, "mxfp8 grouped gemm: N=%d must be a positive multiple of 16", N);
  for (int g = 0; g < G; ++g)
    if (M[g] < 0) return !write_err(errbuf, errlen, "mxfp8 grouped gemm: expert %d has M=%d rows", g, M[g]);
  return true;
}

// The Gemm arguments over device arrays at `ws`; `host` describes the groups (for the tile scheduler).
inline typename Gemm::Arguments make_args(int G, uint8_t* ws, const DeviceArrays& w, const UnderlyingProblem* host,
                                          int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;  // D = A B^T; no C operand (ElementC = void)
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {G, reinterpret_cast<UnderlyingProblem*>(ws + w.problems), host},
      {reinterpret_cast<const ElementAData**>(ws + w.a), reinterpret_cast<StrideA*>(ws + w.stride_a),
       reinterpret_cast<const ElementBData**>(ws + w.b), reinterpret_cast<StrideB*>(ws + w.stride_b),
       reinterpret_cast<const ElementSF**>(ws + w.sfa), reinterpret_cast<LayoutSFA*>(ws + w.layout_sfa),
       reinterpret_cast<const ElementSF**>(ws + w.sfb), reinterpret_cast<LayoutSFB*>(ws + w.layout_sfb)},
      {fusion, nullptr, nullptr, reinterpret_cast<ElementD**>(ws + w.d), reinterpret_cast<StrideD*>(ws + w.stride_d)},
      hw};
  return args;
}

}  // namespace mok::sm100

namespace mok_host {

long long sm100_mxfp8_gemm_workspace_bytes(int G, const int* M, int N, int K, int device) {
  using namespace mok::sm100;
  if (!check_shapes(G, M, N, K, nullptr, 0)) return -1;
  std::vector<UnderlyingProblem> host(G);
  for (int g = 0; g < G; ++g) host[g] = UnderlyingProblem(M[g], N, K);
  const DeviceArrays w = carve(G);
  const typename Gemm::Arguments args = make_args(G, nullptr, w, host.data(), device);
  return (long long)(w.total + align256(Gemm::get_workspace_size(args)));
}

int sm100_mxfp8_grouped_gemm(int G, const int* M, int N, int K, const void* const* A, const void* const* B,
                             const void* const* SFA, const void* const* SFB, void* const* D, long long ldd,
                             void* workspace, unsigned long long workspace_bytes, int device, cudaStream_t stream,
                             char* errbuf, int errlen) {
  using namespace mok::sm100;
  if (!check_shapes(G, M, N, K, errbuf, errlen)) return 1;
  if (ldd < N || ldd % 8) return write_err(errbuf, errlen, "mxfp8 grouped gemm: ldd=%lld must be >= N and a multiple of 8", ldd);
  std::vector<UnderlyingProblem> problems(G);
  std::vector<StrideA> sa(G);
  std::vector<StrideB> sb(G);
  std::vector<StrideD> sd(G);
  std::vector<LayoutSFA> lsa(G);
  std::vector<LayoutSFB> lsb(G);
  for (int g = 0; g < G; ++g) {
    if (M[g] > 0 && (!A[g] || !B[g] || !SFA[g] || !SFB[g] || !D[g]))
      return write_err(errbuf, errlen, "mxfp8 grouped gemm: expert %d has a null operand pointer", g);
    if (M[g] > 0 && (reinterpret_cast<uintptr_t>(A[g]) % 16 || reinterpret_cast<uintptr_t>(B[g]) % 16 ||
                     reinterpret_cast<uintptr_t>(D[g]) % 16))
      return write_err(errbuf, errlen, "mxfp8 grouped gemm: expert %d: A, B and D must be 16-byte aligned (TMA)", g);
    problems[g] = UnderlyingProblem(M[g], N, K);
    sa[g] = cutlass::make_cute_packed_stride(StrideA{}, {M[g], K, 1});
    sb[g] = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
    sd[g] = cutlass::make_cute_packed_stride(StrideD{}, {M[g], (int)ldd, 1});
    lsa[g] = SfConfig::tile_atom_to_shape_SFA(cute::make_shape(M[g], N, K, 1));
    lsb[g] = SfConfig::tile_atom_to_shape_SFB(cute::make_shape(M[g], N, K, 1));
  }
  const DeviceArrays w = carve(G);
  uint8_t* ws = reinterpret_cast<uint8_t*>(workspace);
  typename Gemm::Arguments args = make_args(G, ws, w, problems.data(), device);
  const size_t need = w.total + align256(Gemm::get_workspace_size(args));
  if (!workspace || workspace_bytes < need)
    return write_err(errbuf, errlen, "mxfp8 grouped gemm: workspace of %llu bytes, needs %zu", workspace_bytes, need);
  std::vector<uint8_t> host(w.total, 0);  // every per-expert array, one host-to-device copy
  auto put = [&](size_t off, const void* src, size_t bytes) { std::memcpy(host.data() + off, src, bytes); };
  put(w.problems, problems.data(), G * sizeof(UnderlyingProblem));
  put(w.a, A, G * sizeof(void*));
  put(w.b, B, G * sizeof(void*));
  put(w.sfa, SFA, G * sizeof(void*));
  put(w.sfb, SFB, G * sizeof(void*));
  put(w.d, D, G * sizeof(void*));
  put(w.stride_a, sa.data(), G * sizeof(StrideA));
  put(w.stride_b, sb.data(), G * sizeof(StrideB));
  put(w.stride_d, sd.data(), G * sizeof(StrideD));
  put(w.layout_sfa, lsa.data(), G * sizeof(LayoutSFA));
  put(w.layout_sfb, lsb.data(), G * sizeof(LayoutSFB));
  cudaError_t e = cudaSetDevice(device);
  // pageable source: the copy completes before this call returns, so `host` may go out of scope
  if (e == cudaSuccess) e = cudaMemcpyAsync(ws, host.data(), w.total, cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return write_err(errbuf, errlen, "mxfp8 grouped gemm: %s", cudaGetErrorString(e));
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    return write_err(errbuf, errlen, "mxfp8 grouped gemm: CUTLASS cannot run this problem (%s)", cutlassGetStatusString(st));
  st = gemm.initialize(args, ws + w.total, stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    return write_err(errbuf, errlen, "mxfp8 grouped gemm: launch failed (%s)", cutlassGetStatusString(st));
  e = cudaGetLastError();
  if (e != cudaSuccess) return write_err(errbuf, errlen, "mxfp8 grouped gemm: %s", cudaGetErrorString(e));
  return 0;
}

}  // namespace mok_host
