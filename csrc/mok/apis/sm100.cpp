// mok::sm100_mxfp8_grouped_gemm, the Blackwell MXFP8 grouped expert GEMM unit as a PyTorch operator (schema:
// megatron_mok/kernel/ops.py; a library of its own, built for sm_100a).
#include <torch/library.h>

#include "apis/checks.h"
#include "sm100/mxfp8_grouped_gemm.h"

namespace mok_api {
namespace {

constexpr const char* kOp = "mok.sm100_mxfp8_grouped_gemm";

// scale bytes of the sm_100 layout for `rows` rows of `kblocks` 1 x 32 blocks (rows padded to 128, blocks to 4)
int64_t sf_bytes(int64_t rows, int64_t kblocks) { return (rows + 127) / 128 * ((kblocks + 3) / 4) * 512; }

void sm100_mxfp8_grouped_gemm(at::TensorList a, at::TensorList sfa, at::TensorList b, at::TensorList sfb,
                              at::TensorList out) {
  const size_t G = a.size();
  TORCH_CHECK_VALUE(G >= 1 && sfa.size() == G && b.size() == G && sfb.size() == G && out.size() == G, kOp, ": ", G,
                    " / ", sfa.size(), " / ", b.size(), " / ", sfb.size(), " / ", out.size(),
                    " a / sfa / b / sfb / out tensors: one of each per expert");
  TORCH_CHECK_VALUE(b[0].dim() == 2 && b[0].is_cuda(), kOp, ": b[0] must be a 2-D CUDA tensor [N, K], got ",
                    describe(b[0]));
  const at::Device dev = b[0].device();
  const int64_t N = b[0].size(0), K = b[0].size(1);
  std::vector<int> M(G);
  std::vector<const void*> A(G), B(G), SFA(G), SFB(G);
  std::vector<void*> D(G);
  for (size_t g = 0; g < G; ++g) {
    const std::string s = "[" + std::to_string(g) + "]";
    check_tensor(kOp, "a" + s, a[g], at::kFloat8_e4m3fn, 2, dev);
    const int64_t rows = a[g].size(0);
    check_shape(kOp, "a" + s, a[g], at::kFloat8_e4m3fn, {rows, K}, dev);
    check_shape(kOp, "b" + s, b[g], at::kFloat8_e4m3fn, {N, K}, dev);
    check_shape(kOp, "out" + s, out[g], at::kBFloat16, {rows, N}, dev);
    for (const at::Tensor* t : {&a[g], &b[g], &out[g]}) check_contiguous(kOp, "a / b / out" + s, *t);
    for (auto [name, t, r] : {std::tuple<const char*, const at::Tensor*, int64_t>{"sfa", &sfa[g], rows},
                              {"sfb", &sfb[g], N}}) {
      check_tensor(kOp, name + s, *t, at::kByte, 1, dev);
      TORCH_CHECK_VALUE(t->numel() >= sf_bytes(r, K / 32), kOp, ": ", name, s, " must hold ", sf_bytes(r, K / 32),
                        " bytes of sm_100-layout scales, got ", t->numel());
    }
    M[g] = (int)rows;
    A[g] = a[g].data_ptr();
    B[g] = b[g].data_ptr();
    SFA[g] = sfa[g].data_ptr();
    SFB[g] = sfb[g].data_ptr();
    D[g] = out[g].data_ptr();
  }
  const c10::cuda::CUDAGuard guard(dev);
  const long long nbytes = mok_host::sm100_mxfp8_gemm_workspace_bytes((int)G, M.data(), (int)N, (int)K, dev.index());
  TORCH_CHECK_VALUE(nbytes >= 0, kOp, ": unsupported shapes (N=", N, ", K=", K,
                    ": K a multiple of 128, N of 16)");
  at::Tensor ws = at::empty({std::max<long long>(nbytes, 1)}, b[0].options().dtype(at::kByte));
  char eb[kErrLen] = {0};
  check_launch(mok_host::sm100_mxfp8_grouped_gemm((int)G, M.data(), (int)N, (int)K, A.data(), B.data(), SFA.data(),
                                                  SFB.data(), D.data(), N, ws.data_ptr(), (unsigned long long)ws.numel(),
                                                  dev.index(), c10::cuda::getCurrentCUDAStream(dev.index()).stream(),
                                                  eb, kErrLen),
               kOp, eb);
}

}  // namespace

TORCH_LIBRARY_IMPL(mok, CUDA, m) { m.impl("sm100_mxfp8_grouped_gemm", &sm100_mxfp8_grouped_gemm); }

}  // namespace mok_api
