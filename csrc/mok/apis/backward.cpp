// mok::backward and mok::wgrad, the backward megakernel and the wgrad kernel as PyTorch operators (schemas:
// megatron_mok/kernel/ops.py). The backward launch of one rank mirrors its forward launch: pull reverse-combine,
// router gradient, fc1 recompute or saved h, SwiGLU backward, dgrad, push reverse-dispatch; the wgrad launch after it
// on the same stream reduces the layout-order rows it left into the expert weight gradients (and, with defer_home,
// the router gradient and the grad_x top-k sum).
#include <torch/library.h>

#include "apis/checks.h"
#include "host/launch_args.h"

namespace mok_api {
namespace {

constexpr const char* kBwd = "mok.backward";
constexpr const char* kWgrad = "mok.wgrad";

// peer_offsets of a symmetric region (comm.py: PeerRegion), in this order
enum BackwardOffset { kOffX, kOffIdx, kOffTopkW, kOffGradOut, kOffGradBuf, kOffSignal, kBackwardOffsets };

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weight,
    const at::Tensor& combine, at::TensorList w1, at::TensorList w2, at::TensorList w2t, const at::Tensor& grad_buf,
    const at::Tensor& xl, const at::Tensor& gyl, const at::Tensor& dh, const at::Tensor& act, const at::Tensor& err,
    at::IntArrayRef peer_bases, at::IntArrayRef peer_offsets, const std::optional<at::Tensor>& saved_h,
    at::TensorList fp8_weights, at::TensorList fp8_buffers, const std::optional<at::Tensor>& timeline,
    const std::optional<at::Tensor>& timeline_count, int64_t rank, int64_t epoch, int64_t comm_sms,
    int64_t ring_slots, int64_t minibatch, int64_t ctas, double timeout_ms, int64_t glu, double glu_clamp,
    double glu_offset, bool defer_home, bool x_kept, bool act_kept, int64_t stall_rank, int64_t stall_slot) {
  const auto [dev, T, H, K, L, F] = read_problem(kBwd, x, topk_idx, w1, w2);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"x", &x}, {"grad_out", &grad_out}}) {
    check_shape(kBwd, name, *t, at::kBFloat16, {T, H}, dev);
    check_contiguous(kBwd, name, *t);
  }
  check_shape(kBwd, "topk_idx", topk_idx, at::kInt, {T, K}, dev);
  check_shape(kBwd, "topk_weight", topk_weight, at::kFloat, {T, K}, dev);
  check_shape(kBwd, "combine", combine, at::kBFloat16, {T, K, H}, dev);
  check_shape(kBwd, "grad_buf", grad_buf, at::kBFloat16, {T, K, H}, dev);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"topk_idx", &topk_idx},
                         {"topk_weight", &topk_weight}, {"combine", &combine}, {"grad_buf", &grad_buf}})
    check_contiguous(kBwd, name, *t);
  check_shape(kBwd, "err", err, at::kInt, {16}, dev);
  for (int64_t e = 0; e < L; ++e) {
    const std::string s = "[" + std::to_string(e) + "]";
    check_shape(kBwd, "w1" + s, w1[e], at::kBFloat16, {2 * F, H}, dev);
    check_shape(kBwd, "w2" + s, w2[e], at::kBFloat16, {H, F}, dev);
    check_tma_rows(kBwd, "w1" + s, w1[e]);
    check_tma_rows(kBwd, "w2" + s, w2[e]);
  }
  // owner-side layout-order rows: their count is the owner capacity
  TORCH_CHECK_VALUE(xl.dim() == 2, kBwd, ": xl must be [rows, hidden], got ", describe(xl));
  const int64_t cap = xl.size(0);
  TORCH_CHECK_VALUE(cap >= 1, kBwd, ": the layout-order buffers need >= 1 row");
  for (auto [name, t, n] : {std::tuple<const char*, const at::Tensor*, int64_t>{"xl", &xl, H}, {"gyl", &gyl, H},
                            {"dh", &dh, 2 * F}, {"act", &act, F}}) {
    check_shape(kBwd, name, *t, at::kBFloat16, {cap, n}, dev);
    check_contiguous(kBwd, name, *t);
  }
  if (!saved_h.has_value()) {
    TORCH_CHECK_VALUE((int64_t)w2t.size() == L, kBwd, ": fc1 recompute reads W2^T: w2t must hold ", L,
                      " experts, got ", w2t.size());
    for (int64_t e = 0; e < L; ++e) {
      check_shape(kBwd, "w2t[" + std::to_string(e) + "]", w2t[e], at::kBFloat16, {F, H}, dev);
      check_contiguous(kBwd, "w2t[" + std::to_string(e) + "]", w2t[e]);
    }
  } else {
    check_tensor(kBwd, "saved_h", *saved_h, at::kBFloat16, 2, dev);
    TORCH_CHECK_VALUE(saved_h->size(0) >= cap && saved_h->size(1) == 2 * F && saved_h->is_contiguous(), kBwd,
                      ": saved_h must be contiguous [>= ", cap, ", ", 2 * F, "] (the forward's saved fc1 output), got ",
                      describe(*saved_h));
  }
  TORCH_CHECK_VALUE(!act_kept || saved_h.has_value(), kBwd,
                    ": act_kept needs saved_h (the recompute path writes act itself)");
  const bool fp8 = !fp8_weights.empty();
  if (fp8) {
    TORCH_CHECK_VALUE(saved_h.has_value(), kBwd,
                      ": the FP8 dgrad reads the forward's saved fc1 output: pass saved_h (fc1 recompute is bf16 only)");
    TORCH_CHECK_VALUE(H % 128 == 0 && F % 128 == 0, kBwd, ": the FP8 dgrad needs hidden (", H, ") and ffn (", F,
                      ") sizes multiples of 128");
    TORCH_CHECK_VALUE((int64_t)fp8_weights.size() == 4 * L && fp8_buffers.size() == 4, kBwd,
                      ": the FP8 dgrad takes 4 x L transposed weights / scales and 4 row buffers, got ",
                      fp8_weights.size(), " and ", fp8_buffers.size());
    const std::vector<std::pair<const char*, std::vector<int64_t>>> wshapes = {
        {"w2t_e4m3", {F, H}}, {"w2t_scale", {F / 128, H / 128}}, {"w1t_e4m3", {H, 2 * F}}, {"w1t_scale", {H / 128, 2 * F / 128}}};
    for (int k = 0; k < 4; ++k)
      for (int64_t e = 0; e < L; ++e) {
        const at::Tensor& t = fp8_weights[k * L + e];
        const std::string n = std::string(wshapes[k].first) + "[" + std::to_string(e) + "]";
        check_shape(kBwd, n, t, k % 2 ? at::kFloat : at::kFloat8_e4m3fn, wshapes[k].second, dev);
        check_contiguous(kBwd, n, t);
      }
    const std::vector<std::tuple<const char*, at::ScalarType, std::vector<int64_t>>> bshapes = {
        {"gyl_e4m3", at::kFloat8_e4m3fn, {cap, H}}, {"gyl_scale", at::kFloat, {cap, H / 128}},
        {"dh_e4m3", at::kFloat8_e4m3fn, {cap, 2 * F}}, {"dh_scale", at::kFloat, {cap, 2 * F / 128}}};
    for (int k = 0; k < 4; ++k) {
      check_shape(kBwd, std::get<0>(bshapes[k]), fp8_buffers[k], std::get<1>(bshapes[k]), std::get<2>(bshapes[k]), dev);
      check_contiguous(kBwd, std::get<0>(bshapes[k]), fp8_buffers[k]);
    }
  }
  const int R = check_ranks(kBwd, peer_bases, peer_offsets, kBackwardOffsets, rank, epoch, ring_slots, stall_rank,
                            stall_slot);
  if (R > 1) {
    const unsigned long long own = (unsigned long long)peer_bases[rank];
    TORCH_CHECK_VALUE(ptr(x) == own + peer_offsets[kOffX] && ptr(topk_idx) == own + peer_offsets[kOffIdx] &&
                          ptr(topk_weight) == own + peer_offsets[kOffTopkW] &&
                          ptr(grad_out) == own + peer_offsets[kOffGradOut] &&
                          ptr(grad_buf) == own + peer_offsets[kOffGradBuf],
                      kBwd, ": at EP > 1, x, topk_idx, topk_weight, grad_out and grad_buf must be this rank's "
                      "symmetric-region views");
  }
  check_timeline(kBwd, timeline, timeline_count, dev);

  const c10::cuda::CUDAGuard guard(dev);
  load_kernels_once(dev.index());
  check_sm_split(kBwd, dev.index(), comm_sms, ctas);
  at::Tensor grad_x = at::empty({T, H}, x.options());
  at::Tensor grad_w = at::empty({T, K}, x.options().dtype(at::kFloat));
  at::Tensor tpe = at::empty({L}, x.options().dtype(at::kInt));

  const std::vector<long long> Ts((size_t)R, (long long)T);  // equal on every rank (checked in the kernel)
  mok_host::MokBwdArgs a{};
  fill_rank_launch(a, R, L, H, F, K, dev, Ts, rank, epoch, comm_sms, ring_slots, minibatch, ctas, timeout_ms,
                   stall_rank, stall_slot, glu, glu_clamp, glu_offset, timeline, timeline_count);
  a.cap = cap;
  std::vector<unsigned long long> x_, idx_, w_, go_, gb_, sig_;
  if (R > 1) {
    x_ = peer_ptrs(peer_bases, peer_offsets[kOffX]);
    idx_ = peer_ptrs(peer_bases, peer_offsets[kOffIdx]);
    w_ = peer_ptrs(peer_bases, peer_offsets[kOffTopkW]);
    go_ = peer_ptrs(peer_bases, peer_offsets[kOffGradOut]);
    gb_ = peer_ptrs(peer_bases, peer_offsets[kOffGradBuf]);
    sig_ = peer_ptrs(peer_bases, peer_offsets[kOffSignal]);
  } else {
    x_ = {ptr(x)};
    idx_ = {ptr(topk_idx)};
    w_ = {ptr(topk_weight)};
    go_ = {ptr(grad_out)};
    gb_ = {ptr(grad_buf)};
  }
  const int rk = (int)rank;
  const std::vector<unsigned long long> comb_ = own_only(R, rk, ptr(combine)), gx_ = own_only(R, rk, ptr(grad_x)),
                                        gw_ = own_only(R, rk, ptr(grad_w)), tpe_ = own_only(R, rk, ptr(tpe)),
                                        xl_ = own_only(R, rk, ptr(xl)), gyl_ = own_only(R, rk, ptr(gyl)),
                                        dh_ = own_only(R, rk, ptr(dh)), act_ = own_only(R, rk, ptr(act)),
                                        sh_ = own_only(R, rk, ptr(saved_h));
  a.x = x_.data();
  a.idx = idx_.data();
  a.w = w_.data();
  a.grad_out = go_.data();
  a.combine = comb_.data();
  a.grad_buf = gb_.data();
  a.grad_x = gx_.data();
  a.grad_w = gw_.data();
  a.tpe = tpe_.data();
  a.xl = xl_.data();
  a.gyl = gyl_.data();
  a.dh = dh_.data();
  a.act = act_.data();
  a.signal = R > 1 ? sig_.data() : nullptr;
  const std::vector<unsigned long long> w1p = ptrs(w1), w2p = ptrs(w2), w2tp = ptrs(w2t);
  const std::vector<long long> w1ld = row_strides(w1), w2ld = row_strides(w2);
  a.w1 = w1p.data();
  a.w1_ld = w1ld.data();
  a.w2 = w2p.data();
  a.w2_ld = w2ld.data();
  a.w2t = saved_h.has_value() ? nullptr : w2tp.data();
  if (saved_h.has_value()) a.saved_h = sh_.data();
  std::vector<std::vector<unsigned long long>> f8w(4), f8b(4);
  if (fp8) {
    for (int k = 0; k < 4; ++k) {
      f8w[k] = ptrs(fp8_weights.slice(k * L, L));
      f8b[k] = own_only(R, rk, ptr(fp8_buffers[k]));
    }
    a.fp8 = 1;
    a.w2t8 = f8w[0].data();
    a.w2ts = f8w[1].data();
    a.w1t8 = f8w[2].data();
    a.w1ts = f8w[3].data();
    a.gyl8 = f8b[0].data();
    a.gys = f8b[1].data();
    a.dh8 = f8b[2].data();
    a.dhs = f8b[3].data();
  }
  a.defer_home = defer_home ? 1 : 0;
  a.x_kept = x_kept ? 1 : 0;
  a.act_kept = act_kept ? 1 : 0;

  launch_with_workspace(kBwd, a, &mok_host::backward_workspace_bytes, &mok_host::backward_launch, err, dev);
  return {grad_x, grad_w, tpe};
}

void wgrad(const at::Tensor& tokens_per_expert, const at::Tensor& xl, const at::Tensor& gyl, const at::Tensor& dh,
           const at::Tensor& act, at::TensorList grad_w1, at::TensorList grad_w2, const at::Tensor& err,
           bool accumulate, int64_t rank, double timeout_ms, const std::optional<at::Tensor>& home_grad_out,
           const std::optional<at::Tensor>& home_combine, const std::optional<at::Tensor>& home_grad_buf,
           const std::optional<at::Tensor>& home_idx, const std::optional<at::Tensor>& home_grad_w,
           const std::optional<at::Tensor>& home_grad_x) {
  TORCH_CHECK_VALUE(xl.defined() && xl.is_cuda() && xl.dim() == 2, kWgrad, ": xl must be a 2-D CUDA tensor, got ",
                    xl.defined() ? describe(xl) : "nothing");
  const at::Device dev = xl.device();
  const int64_t cap = xl.size(0), H = xl.size(1);
  TORCH_CHECK_VALUE(act.dim() == 2, kWgrad, ": act must be [rows, ffn], got ", describe(act));
  const int64_t F = act.size(1);
  const int64_t L = tokens_per_expert.numel();
  check_shape(kWgrad, "tokens_per_expert", tokens_per_expert, at::kInt, {L}, dev);
  for (auto [name, t, n] : {std::tuple<const char*, const at::Tensor*, int64_t>{"xl", &xl, H}, {"gyl", &gyl, H},
                            {"dh", &dh, 2 * F}, {"act", &act, F}}) {
    check_shape(kWgrad, name, *t, at::kBFloat16, {cap, n}, dev);
    check_contiguous(kWgrad, name, *t);
  }
  check_shape(kWgrad, "err", err, at::kInt, {16}, dev);
  TORCH_CHECK_VALUE((int64_t)grad_w1.size() == L && (int64_t)grad_w2.size() == L, kWgrad, ": grad_w1 / grad_w2 must ",
                    "hold ", L, " expert gradients, got ", grad_w1.size(), " / ", grad_w2.size());
  std::vector<unsigned long long> g1((size_t)L), g2((size_t)L);
  std::vector<long long> g1ld((size_t)L), g2ld((size_t)L);
  for (int64_t e = 0; e < L; ++e) {
    const std::string s = "[" + std::to_string(e) + "]";
    check_shape(kWgrad, "grad_w1" + s, grad_w1[e], at::kFloat, {2 * F, H}, dev);
    check_shape(kWgrad, "grad_w2" + s, grad_w2[e], at::kFloat, {H, F}, dev);
    for (const at::Tensor* t : {&grad_w1[e], &grad_w2[e]})
      TORCH_CHECK_VALUE(t->stride(1) == 1 && t->stride(0) % 2 == 0 && ptr(*t) % 8 == 0, kWgrad, ": expert gradient ",
                        e, " needs unit inner stride, an even row stride and 8-byte alignment, got strides ",
                        t->strides());
    g1[e] = ptr(grad_w1[e]);
    g2[e] = ptr(grad_w2[e]);
    g1ld[e] = grad_w1[e].stride(0);
    g2ld[e] = grad_w2[e].stride(0);
  }
  const bool home = home_grad_x.has_value();
  TORCH_CHECK_VALUE(home_grad_out.has_value() == home && home_combine.has_value() == home &&
                        home_grad_buf.has_value() == home && home_idx.has_value() == home &&
                        home_grad_w.has_value() == home,
                    kWgrad, ": the home reductions take grad_out, combine, grad_buf, idx, grad_w and grad_x together");
  int64_t T = 0, K = 0;
  if (home) {
    T = home_grad_x->size(0);
    K = home_idx->dim() == 2 ? home_idx->size(1) : 0;
    check_shape(kWgrad, "home_grad_x", *home_grad_x, at::kBFloat16, {T, H}, dev);
    check_shape(kWgrad, "home_grad_out", *home_grad_out, at::kBFloat16, {T, H}, dev);
    check_shape(kWgrad, "home_idx", *home_idx, at::kInt, {T, K}, dev);
    check_shape(kWgrad, "home_combine", *home_combine, at::kBFloat16, {T, K, H}, dev);
    check_shape(kWgrad, "home_grad_buf", *home_grad_buf, at::kBFloat16, {T, K, H}, dev);
    check_shape(kWgrad, "home_grad_w", *home_grad_w, at::kFloat, {T, K}, dev);
    for (const at::Tensor* t : {&*home_grad_x, &*home_grad_out, &*home_idx, &*home_combine, &*home_grad_buf,
                                &*home_grad_w})
      check_contiguous(kWgrad, "a home-reduction tensor", *t);
  }

  const c10::cuda::CUDAGuard guard(dev);
  load_kernels_once(dev.index());
  mok_host::MokWgradArgs a{};
  a.np = 1;
  a.L = (int)L;
  a.H = (int)H;
  a.F = (int)F;
  a.rank0 = (int)rank;
  a.device = dev.index();
  a.accumulate = accumulate ? 1 : 0;
  a.timeout_ms = timeout_ms;
  a.cap = cap;
  const unsigned long long tpe_ = ptr(tokens_per_expert), xl_ = ptr(xl), gyl_ = ptr(gyl), dh_ = ptr(dh),
                           act_ = ptr(act);
  a.tpe = &tpe_;
  a.xl = &xl_;
  a.gyl = &gyl_;
  a.dh = &dh_;
  a.act = &act_;
  a.gw1 = g1.data();
  a.gw1_ld = g1ld.data();
  a.gw2 = g2.data();
  a.gw2_ld = g2ld.data();
  const long long hT = T;
  const unsigned long long hgo = ptr(home_grad_out), hc = ptr(home_combine), hgb = ptr(home_grad_buf),
                           hi = ptr(home_idx), hgw = ptr(home_grad_w), hgx = ptr(home_grad_x);
  if (home) {
    a.K = (int)K;
    a.home_parts = 1;
    a.h_T = &hT;
    a.h_grad_out = &hgo;
    a.h_combine = &hc;
    a.h_grad_buf = &hgb;
    a.h_idx = &hi;
    a.h_grad_w = &hgw;
    a.h_grad_x = &hgx;
  }
  launch_with_workspace(kWgrad, a, &mok_host::wgrad_workspace_bytes, &mok_host::wgrad_launch, err, dev);
}

}  // namespace

TORCH_LIBRARY_IMPL(mok, CUDA, m) {
  m.impl("backward", &backward);
  m.impl("wgrad", &wgrad);
}

}  // namespace mok_api
