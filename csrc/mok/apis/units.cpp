// The unit kernels as PyTorch operators (schemas: megatron_mok/kernel/ops.py): the FP8 weight quantiser (once per
// optimizer step), the FP8 block-scaled grouped GEMM and weight-gradient GEMM with its token-block quantiser, and the
// MXFP8 row quantiser (units the megakernels fuse; run
// alone by their tests and benchmarks), and the routing conversion in front of every layer call.
#include <torch/autograd.h>
#include <torch/library.h>

#include "apis/checks.h"
#include "mok_limits.h"
#include "host/launch_args.h"

namespace mok_api {
namespace {

std::tuple<at::Tensor, at::Tensor> fp8_quantize_weight(const at::Tensor& w) {
  constexpr const char* kOp = "mok.fp8_quantize_weight";
  TORCH_CHECK_VALUE(w.defined() && w.is_cuda(), kOp, ": w must be a CUDA tensor");
  check_tensor(kOp, "w", w, at::kBFloat16, 2, w.device());
  check_tma_rows(kOp, "w", w);
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK_VALUE(N % 128 == 0 && K % 128 == 0 && N > 0 && K > 0, kOp, ": w ", describe(w),
                    " must be positive multiples of 128 in both dimensions");
  const c10::cuda::CUDAGuard guard(w.device());
  load_kernels_once(w.device().index());
  at::Tensor q = at::empty({N, K}, w.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s = at::empty({N / 128, K / 128}, w.options().dtype(at::kFloat));
  char eb[kErrLen] = {0};
  check_launch(mok_host::fp8_quantize_weight(w.data_ptr(), w.stride(0), (int)N, (int)K, q.data_ptr(),
                                             s.data_ptr<float>(), w.device().index(),
                                             c10::cuda::getCurrentCUDAStream(w.device().index()).stream(), eb, kErrLen),
               kOp, eb);
  return {q, s};
}

void fp8_grouped_gemm(const at::Tensor& xq, const at::Tensor& xs, at::TensorList wq, at::TensorList ws,
                      at::IntArrayRef counts, const at::Tensor& out, const at::Tensor& err, double timeout_ms) {
  constexpr const char* kOp = "mok.fp8_grouped_gemm";
  TORCH_CHECK_VALUE(xq.defined() && xq.is_cuda() && xq.dim() == 2, kOp, ": xq must be a 2-D CUDA tensor, got ",
                    xq.defined() ? describe(xq) : "nothing");
  const at::Device dev = xq.device();
  const int64_t rows = xq.size(0), K = xq.size(1);
  const int64_t L = (int64_t)wq.size();
  TORCH_CHECK_VALUE(K % 128 == 0 && K > 0, kOp, ": K=", K, " must be a positive multiple of 128");
  TORCH_CHECK_VALUE(L >= 1 && (int64_t)ws.size() == L && (int64_t)counts.size() == L, kOp,
                    ": wq, ws and counts need one entry per expert, got ", wq.size(), ", ", ws.size(), ", ",
                    counts.size());
  check_shape(kOp, "xq", xq, at::kFloat8_e4m3fn, {rows, K}, dev);
  check_shape(kOp, "xs", xs, at::kFloat, {rows, K / 128}, dev);
  TORCH_CHECK_VALUE(wq[0].dim() == 2, kOp, ": wq[0] must be [N, K], got ", describe(wq[0]));
  const int64_t N = wq[0].size(0);
  TORCH_CHECK_VALUE(N % 128 == 0 && N > 0, kOp, ": weights must be [N, K] with N a positive multiple of 128, got ",
                    describe(wq[0]));
  check_shape(kOp, "out", out, at::kBFloat16, {rows, N}, dev);
  check_shape(kOp, "err", err, at::kInt, {16}, dev);
  for (const at::Tensor* t : {&xq, &xs, &out}) check_contiguous(kOp, "xq / xs / out", *t);
  std::vector<unsigned long long> wqp((size_t)L), wsp((size_t)L);
  long long sum = 0;
  for (int64_t e = 0; e < L; ++e) {
    const std::string s = "[" + std::to_string(e) + "]";
    check_shape(kOp, "wq" + s, wq[e], at::kFloat8_e4m3fn, {N, K}, dev);
    check_shape(kOp, "ws" + s, ws[e], at::kFloat, {N / 128, K / 128}, dev);
    check_contiguous(kOp, "wq" + s, wq[e]);
    check_contiguous(kOp, "ws" + s, ws[e]);
    TORCH_CHECK_VALUE(counts[e] >= 0, kOp, ": counts[", e, "] = ", counts[e], " < 0");
    sum += counts[e];
    wqp[e] = ptr(wq[e]);
    wsp[e] = ptr(ws[e]);
  }
  TORCH_CHECK_VALUE(sum <= rows, kOp, ": counts sum to ", sum, " rows, x has ", rows);
  const c10::cuda::CUDAGuard guard(dev);
  load_kernels_once(dev.index());
  const std::vector<long long> cnt(counts.begin(), counts.end());
  mok_host::MokFp8GemmArgs a{};
  a.L = (int)L;
  a.N = (int)N;
  a.K = (int)K;
  a.device = dev.index();
  a.rows = rows;
  a.counts = cnt.data();
  a.xq = ptr(xq);
  a.xs = ptr(xs);
  a.wq = wqp.data();
  a.ws = wsp.data();
  a.out = ptr(out);
  a.timeout_ms = timeout_ms;
  launch_with_workspace(kOp, a, &mok_host::fp8_gemm_workspace_bytes, &mok_host::fp8_gemm_launch, err, dev);
}

// out[e] (+)= a_e b_e^T over expert e's token columns (gemm/fp8_wgrad_gemm.cuh): a / b e4m3 in the token-major
// layout (gemm/token_major.cuh), one fp32 scale per 128 tokens of each row, counts: device int32 [L] tokens per
// expert (the kernel checks that their blocks fit the token columns)
void fp8_wgrad_gemm(const at::Tensor& a, const at::Tensor& sa, const at::Tensor& b, const at::Tensor& sb,
                    const at::Tensor& counts, at::TensorList out, const at::Tensor& err, bool accumulate,
                    double timeout_ms) {
  constexpr const char* kOp = "mok.fp8_wgrad_gemm";
  TORCH_CHECK_VALUE(a.defined() && a.is_cuda() && a.dim() == 2, kOp, ": a must be a 2-D CUDA tensor, got ",
                    a.defined() ? describe(a) : "nothing");
  TORCH_CHECK_VALUE(b.defined() && b.dim() == 2, kOp, ": b must be a 2-D tensor, got ",
                    b.defined() ? describe(b) : "nothing");
  const at::Device dev = a.device();
  const int64_t M = a.size(0), ktot = a.size(1), N = b.size(0), L = (int64_t)out.size();
  TORCH_CHECK_VALUE(M % 128 == 0 && M > 0 && N % 128 == 0 && N > 0, kOp, ": a ", describe(a), " and b ", describe(b),
                    " need row counts that are positive multiples of 128");
  TORCH_CHECK_VALUE(ktot % 128 == 0, kOp, ": ", ktot, " token columns must be a multiple of 128");
  TORCH_CHECK_VALUE(L >= 1 && counts.defined() && counts.dim() == 1 && counts.size(0) == L, kOp,
                    ": out and counts need one entry per expert, got ", out.size(), " and ",
                    counts.defined() ? describe(counts) : "nothing");
  check_shape(kOp, "a", a, at::kFloat8_e4m3fn, {M, ktot}, dev);
  check_shape(kOp, "b", b, at::kFloat8_e4m3fn, {N, ktot}, dev);
  check_shape(kOp, "sa", sa, at::kFloat, {ktot / 128, M}, dev);
  check_shape(kOp, "sb", sb, at::kFloat, {ktot / 128, N}, dev);
  check_shape(kOp, "counts", counts, at::kInt, {L}, dev);
  check_shape(kOp, "err", err, at::kInt, {16}, dev);
  check_contiguous(kOp, "a", a);
  check_contiguous(kOp, "b", b);
  check_contiguous(kOp, "sa", sa);
  check_contiguous(kOp, "sb", sb);
  check_contiguous(kOp, "counts", counts);
  std::vector<unsigned long long> outp((size_t)L);
  for (int64_t e = 0; e < L; ++e) {
    const std::string s = "out[" + std::to_string(e) + "]";
    check_shape(kOp, s, out[e], at::kFloat, {M, N}, dev);
    check_contiguous(kOp, s, out[e]);
    outp[e] = ptr(out[e]);
  }
  const c10::cuda::CUDAGuard guard(dev);
  load_kernels_once(dev.index());
  mok_host::MokFp8WgradArgs args{};
  args.L = (int)L;
  args.M = (int)M;
  args.N = (int)N;
  args.device = dev.index();
  args.ktot = ktot;
  args.counts = ptr(counts);
  args.a = ptr(a);
  args.sa = ptr(sa);
  args.b = ptr(b);
  args.sb = ptr(sb);
  args.out = outp.data();
  args.accumulate = accumulate ? 1 : 0;
  args.timeout_ms = timeout_ms;
  launch_with_workspace(kOp, args, &mok_host::fp8_wgrad_workspace_bytes, &mok_host::fp8_wgrad_launch, err, dev);
}

// Layout-order bf16 rows [rows, F] of L experts (counts: device int32 [L]) -> the FP8 wgrad unit's operand: e4m3
// [F, kcap] token-contiguous with each expert padded to 128 tokens, fp32 scales [kcap / 128, F]
std::tuple<at::Tensor, at::Tensor> fp8_quantize_tokens(const at::Tensor& rows, const at::Tensor& counts, int64_t kcap,
                                                       const at::Tensor& err) {
  constexpr const char* kOp = "mok.fp8_quantize_tokens";
  TORCH_CHECK_VALUE(rows.defined() && rows.is_cuda(), kOp, ": rows must be a CUDA tensor");
  check_tensor(kOp, "rows", rows, at::kBFloat16, 2, rows.device());
  check_tma_rows(kOp, "rows", rows);
  TORCH_CHECK_VALUE(counts.defined() && counts.dim() == 1, kOp, ": counts must be 1-D, one entry per expert");
  check_tensor(kOp, "counts", counts, at::kInt, 1, rows.device());
  check_contiguous(kOp, "counts", counts);
  const int64_t F = rows.size(1);
  TORCH_CHECK_VALUE(F % 128 == 0 && F > 0, kOp, ": rows ", describe(rows), " need a positive multiple of 128 columns");
  TORCH_CHECK_VALUE(kcap >= 0 && kcap % 128 == 0, kOp, ": kcap=", kcap, " must be a multiple of 128");
  check_shape(kOp, "err", err, at::kInt, {16}, rows.device());
  const c10::cuda::CUDAGuard guard(rows.device());
  load_kernels_once(rows.device().index());
  at::Tensor q = at::empty({F, kcap}, rows.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor sc = at::empty({kcap / 128, F}, rows.options().dtype(at::kFloat));
  char eb[kErrLen] = {0};
  check_launch(mok_host::fp8_quantize_tokens(rows.data_ptr(), rows.stride(0), rows.size(0), (int)F,
                                             (int)counts.size(0), counts.data_ptr<int>(), q.data_ptr(),
                                             sc.data_ptr<float>(), kcap, err.data_ptr<int>(), rows.device().index(),
                                             c10::cuda::getCurrentCUDAStream(rows.device().index()).stream(), eb,
                                             kErrLen),
               kOp, eb);
  return {q, sc};
}

// scale_layout 0: row-major UE8M0 [M, H / 32]; 1: the sm_100 MMA's scale-factor layout as flat bytes
std::tuple<at::Tensor, at::Tensor> mxfp8_quantize_rows(const at::Tensor& x, int64_t scale_layout) {
  constexpr const char* kOp = "mok.mxfp8_quantize_rows";
  TORCH_CHECK_VALUE(x.defined() && x.is_cuda(), kOp, ": x must be a CUDA tensor");
  check_tensor(kOp, "x", x, at::kBFloat16, 2, x.device());
  check_tma_rows(kOp, "x", x);
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK_VALUE(H % 32 == 0 && H > 0, kOp, ": H=", H, " must be a positive multiple of 32");
  TORCH_CHECK_VALUE(scale_layout == 0 || scale_layout == 1, kOp, ": scale_layout must be 0 (row) or 1 (sm100), got ",
                    scale_layout);
  const int64_t nkb = H / 32;
  const int64_t sf_bytes = scale_layout == 0 ? M * nkb : ((M + 127) / 128) * ((nkb + 3) / 4) * 512;
  const c10::cuda::CUDAGuard guard(x.device());
  load_kernels_once(x.device().index());
  at::Tensor q = at::empty({M, H}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor sf = scale_layout == 0 ? at::empty({M, nkb}, x.options().dtype(at::kByte))
                                    : at::zeros({sf_bytes}, x.options().dtype(at::kByte));
  char eb[kErrLen] = {0};
  check_launch(mok_host::mxfp8_quantize_rows(x.data_ptr(), x.stride(0), (int)M, (int)H, q.data_ptr(), sf.data_ptr(),
                                             sf_bytes, (int)scale_layout, x.device().index(),
                                             c10::cuda::getCurrentCUDAStream(x.device().index()).stream(), eb, kErrLen),
               kOp, eb);
  return {q, sf};
}

// Megatron's dense routing -> the kernels' top-k form (routing/topk_from_map.cuh), one launch
std::tuple<at::Tensor, at::Tensor> topk_from_routing_map(const at::Tensor& routing_map, const at::Tensor& probs,
                                                         int64_t topk) {
  constexpr const char* kOp = "mok.topk_from_routing_map";
  TORCH_CHECK_VALUE(routing_map.defined() && routing_map.is_cuda() && routing_map.dim() == 2, kOp,
                    ": routing_map must be a 2-D CUDA tensor, got ", routing_map.defined() ? describe(routing_map) : "nothing");
  const at::Device dev = routing_map.device();
  const int64_t T = routing_map.size(0), E = routing_map.size(1);
  TORCH_CHECK_VALUE(routing_map.scalar_type() == at::kBool, kOp, ": routing_map must be bool, got ", describe(routing_map));
  TORCH_CHECK_VALUE(probs.defined() && (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kBFloat16),
                    kOp, ": probs must be float32 or bfloat16, got ", probs.defined() ? describe(probs) : "nothing");
  check_shape(kOp, "probs", probs, probs.scalar_type(), {T, E}, dev);
  check_contiguous(kOp, "routing_map", routing_map);
  check_contiguous(kOp, "probs", probs);
  TORCH_CHECK_VALUE(E >= 1 && E <= (1 << 20), kOp, ": ", E, " experts is out of [1, 2^20]");
  TORCH_CHECK_VALUE(topk >= 1 && topk <= 1024, kOp, ": topk=", topk, " is out of [1, 1024]");
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor idx = at::empty({T, topk}, routing_map.options().dtype(at::kInt));
  at::Tensor w = at::empty({T, topk}, probs.options());
  char eb[kErrLen] = {0};
  check_launch(mok_host::topk_from_map(routing_map.data_ptr(), probs.data_ptr(), probs.scalar_type() == at::kBFloat16,
                                       T, (int)E, (int)topk, idx.data_ptr<int>(), w.data_ptr(), dev.index(),
                                       c10::cuda::getCurrentCUDAStream(dev.index()).stream(), eb, kErrLen),
               kOp, eb);
  return {idx, w};
}

// The routing conversion's gradient, here rather than in Python: the op runs in front of every layer call, and a
// formula registered in Python puts a Python autograd layer on the host's path each time. probs' gradient: each slot's
// gradient at its expert's column; slots without an expert (-1, OVER_ROUTED) add nothing, not even a NaN.
class TopkFromRoutingMap : public torch::autograd::Function<TopkFromRoutingMap> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& routing_map,
                                                const at::Tensor& probs, int64_t topk) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mok::topk_from_routing_map", "")
                               .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>();
    at::AutoDispatchBelowADInplaceOrView below;  // the device implementation (or the fake one while tracing)
    auto [idx, w] = op.call(routing_map, probs, topk);
    ctx->save_for_backward({idx});
    ctx->saved_data["num_experts"] = routing_map.sym_size(1);  // symbolic sizes: torch.compile keeps T dynamic
    ctx->mark_non_differentiable({idx});
    ctx->set_materialize_grads(false);  // no zeros made for the ids' (or an unused weight's) gradient
    return {idx, w};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor idx = ctx->get_saved_variables()[0];
    const at::Tensor& grad_w = grads[1];
    if (!grad_w.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const c10::SymInt experts = ctx->saved_data["num_experts"].toSymInt();
    const at::Tensor valid = idx.ge(0);
    const at::Tensor cols = at::where(valid, idx, 0).to(at::kLong);
    at::Tensor grad = at::zeros_symint({idx.sym_size(0), experts}, grad_w.options());
    grad.scatter_add_(1, cols, at::where(valid, grad_w, 0));
    return {at::Tensor(), grad, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> topk_from_routing_map_autograd(const at::Tensor& routing_map,
                                                                  const at::Tensor& probs, int64_t topk) {
  auto out = TopkFromRoutingMap::apply(routing_map, probs, topk);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(mok, Autograd, m) { m.impl("topk_from_routing_map", &topk_from_routing_map_autograd); }

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("fp8_quantize_weight", &fp8_quantize_weight);
  m.impl("fp8_grouped_gemm", &fp8_grouped_gemm);
  m.impl("fp8_wgrad_gemm", &fp8_wgrad_gemm);
  m.impl("fp8_quantize_tokens", &fp8_quantize_tokens);
  m.impl("mxfp8_quantize_rows", &mxfp8_quantize_rows);
  m.impl("topk_from_routing_map", &topk_from_routing_map);
}

}  // namespace mok_api
