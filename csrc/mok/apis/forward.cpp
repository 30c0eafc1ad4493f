// mok::forward, the forward megakernel as a PyTorch operator (schema: megatron_mok/kernel/ops.py): one rank's launch
// of the fused MoE forward. At EP 1 every buffer is a plain tensor; at EP > 1 the tokens, routing and combine rows
// live in the ranks' symmetric regions, reached through peer_bases + peer_offsets (megatron_mok/kernel/comm.py).
#include <torch/library.h>

#include "apis/checks.h"
#include "host/launch_args.h"

namespace mok_api {
namespace {

constexpr const char* kOp = "mok.forward";

// peer_offsets of a symmetric region (comm.py: PeerRegion), in this order
enum ForwardOffset { kOffX, kOffIdx, kOffCombine, kOffSignal, kOffXq, kOffXs, kForwardOffsets };

void check_experts(at::TensorList w1, at::TensorList w2, at::TensorList w1s, at::TensorList w2s, int64_t H, int64_t F,
                   bool fp8, const at::Device& dev) {
  const int64_t L = (int64_t)w1.size();
  if (!fp8) {
    TORCH_CHECK_VALUE(w1s.empty() && w2s.empty(), kOp, ": bf16 expert weights take no block scales");
    for (int64_t e = 0; e < L; ++e) {
      const std::string n1 = "w1[" + std::to_string(e) + "]", n2 = "w2[" + std::to_string(e) + "]";
      check_shape(kOp, n1, w1[e], at::kBFloat16, {2 * F, H}, dev);
      check_shape(kOp, n2, w2[e], at::kBFloat16, {H, F}, dev);
      check_tma_rows(kOp, n1, w1[e]);
      check_tma_rows(kOp, n2, w2[e]);
    }
    return;
  }
  TORCH_CHECK_VALUE(H % 128 == 0 && F % 128 == 0, kOp, ": FP8 needs hidden and ffn sizes multiples of 128, got ", H,
                    " and ", F);
  TORCH_CHECK_VALUE((int64_t)w1s.size() == L && (int64_t)w2s.size() == L, kOp, ": FP8 weights need one block-scale ",
                    "tensor per expert and matrix: ", L, " experts, got ", w1s.size(), " / ", w2s.size());
  for (int64_t e = 0; e < L; ++e) {
    const std::string s = "[" + std::to_string(e) + "]";
    check_shape(kOp, "w1" + s, w1[e], at::kFloat8_e4m3fn, {2 * F, H}, dev);
    check_shape(kOp, "w2" + s, w2[e], at::kFloat8_e4m3fn, {H, F}, dev);
    check_shape(kOp, "w1_scale" + s, w1s[e], at::kFloat, {2 * F / 128, H / 128}, dev);
    check_shape(kOp, "w2_scale" + s, w2s[e], at::kFloat, {H / 128, F / 128}, dev);
    for (const at::Tensor* t : {&w1[e], &w2[e], &w1s[e], &w2s[e]}) check_contiguous(kOp, "an FP8 expert tensor" + s, *t);
  }
}

std::tuple<at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weight, at::TensorList w1,
    at::TensorList w2, at::TensorList w1_scale, at::TensorList w2_scale, const at::Tensor& combine,
    const at::Tensor& err, at::IntArrayRef peer_bases, at::IntArrayRef peer_offsets,
    const std::optional<at::Tensor>& saved_h, const std::optional<at::Tensor>& keep_x,
    const std::optional<at::Tensor>& keep_act, const std::optional<at::Tensor>& timeline,
    const std::optional<at::Tensor>& timeline_count, int64_t rank, int64_t epoch, int64_t comm_sms, int64_t ring_slots,
    int64_t minibatch, int64_t ctas, double timeout_ms, int64_t glu, double glu_clamp, double glu_offset,
    int64_t raster, int64_t debug, int64_t stall_rank, int64_t stall_slot) {
  const auto [dev, T, H, K, L, F] = read_problem(kOp, x, topk_idx, w1, w2);
  const bool fp8 = w1[0].scalar_type() == at::kFloat8_e4m3fn;
  check_shape(kOp, "x", x, at::kBFloat16, {T, H}, dev);
  check_contiguous(kOp, "x", x);
  check_shape(kOp, "topk_idx", topk_idx, at::kInt, {T, K}, dev);
  check_contiguous(kOp, "topk_idx", topk_idx);
  check_shape(kOp, "topk_weight", topk_weight, at::kFloat, {T, K}, dev);
  check_contiguous(kOp, "topk_weight", topk_weight);
  check_shape(kOp, "combine", combine, at::kBFloat16, {T, K, H}, dev);
  check_contiguous(kOp, "combine", combine);
  check_shape(kOp, "err", err, at::kInt, {16}, dev);
  check_experts(w1, w2, w1_scale, w2_scale, H, F, fp8, dev);

  const int R = check_ranks(kOp, peer_bases, peer_offsets, kForwardOffsets, rank, epoch, ring_slots, stall_rank,
                            stall_slot);
  if (R > 1) {
    const unsigned long long own = (unsigned long long)peer_bases[rank];
    TORCH_CHECK_VALUE(ptr(x) == own + peer_offsets[kOffX] && ptr(topk_idx) == own + peer_offsets[kOffIdx] &&
                          ptr(combine) == own + peer_offsets[kOffCombine],
                      kOp, ": at EP > 1, x, topk_idx and combine must be this rank's symmetric-region views");
    TORCH_CHECK_VALUE(!fp8 || (peer_offsets[kOffXq] >= 0 && peer_offsets[kOffXs] >= 0), kOp,
                      ": the FP8 forward quantises each token at its source: build the PeerBuffers with "
                      "fp8_sources=True");
  }
  if (saved_h.has_value()) {
    check_tensor(kOp, "saved_h", *saved_h, at::kBFloat16, 2, dev);
    TORCH_CHECK_VALUE(saved_h->size(1) == 2 * F && saved_h->size(0) >= 1 && saved_h->is_contiguous(), kOp,
                      ": saved_h must be contiguous [rows >= 1, ", 2 * F, "] (rows: the owner capacity), got ",
                      describe(*saved_h));
  }
  TORCH_CHECK_VALUE(keep_x.has_value() == keep_act.has_value(), kOp, ": keep_x and keep_act go together");
  int64_t keep_rows = 0;
  if (keep_x.has_value()) {
    TORCH_CHECK_VALUE(!fp8, kOp, ": the kept rows are bf16; the FP8 kernel keeps none (its backward pulls x again)");
    check_tensor(kOp, "keep_x", *keep_x, at::kBFloat16, 2, dev);
    keep_rows = keep_x->size(0);
    check_shape(kOp, "keep_x", *keep_x, at::kBFloat16, {keep_rows, H}, dev);
    check_shape(kOp, "keep_act", *keep_act, at::kBFloat16, {keep_rows, F}, dev);
    check_contiguous(kOp, "keep_x", *keep_x);
    check_contiguous(kOp, "keep_act", *keep_act);
  }
  check_timeline(kOp, timeline, timeline_count, dev);

  const c10::cuda::CUDAGuard guard(dev);
  load_kernels_once(dev.index());
  check_sm_split(kOp, dev.index(), comm_sms, ctas);
  at::Tensor out = at::empty({T, H}, x.options());
  at::Tensor tpe = at::empty({L}, x.options().dtype(at::kInt));

  const std::vector<long long> Ts((size_t)R, (long long)T);  // equal on every rank (checked in the kernel)
  mok_host::MokLaunchArgs a{};
  fill_rank_launch(a, R, L, H, F, K, dev, Ts, rank, epoch, comm_sms, ring_slots, minibatch, ctas, timeout_ms,
                   stall_rank, stall_slot, glu, glu_clamp, glu_offset, timeline, timeline_count);
  std::vector<unsigned long long> xs_, idx_, comb_, sig_, xq_, xsc_;
  if (R > 1) {
    xs_ = peer_ptrs(peer_bases, peer_offsets[kOffX]);
    idx_ = peer_ptrs(peer_bases, peer_offsets[kOffIdx]);
    comb_ = peer_ptrs(peer_bases, peer_offsets[kOffCombine]);
    sig_ = peer_ptrs(peer_bases, peer_offsets[kOffSignal]);
    if (fp8) {
      xq_ = peer_ptrs(peer_bases, peer_offsets[kOffXq]);
      xsc_ = peer_ptrs(peer_bases, peer_offsets[kOffXs]);
    }
  } else {
    xs_ = {ptr(x)};
    idx_ = {ptr(topk_idx)};
    comb_ = {ptr(combine)};
  }
  const std::vector<unsigned long long> w_ = own_only(R, (int)rank, ptr(topk_weight)),
                                        out_ = own_only(R, (int)rank, ptr(out)),
                                        tpe_ = own_only(R, (int)rank, ptr(tpe)),
                                        saved_ = own_only(R, (int)rank, ptr(saved_h));
  a.x = xs_.data();
  a.idx = idx_.data();
  a.w = w_.data();
  a.out = out_.data();
  a.combine = comb_.data();
  a.tpe = tpe_.data();
  a.signal = R > 1 ? sig_.data() : nullptr;
  const std::vector<unsigned long long> w1p = ptrs(w1), w2p = ptrs(w2), w1sp = ptrs(w1_scale), w2sp = ptrs(w2_scale);
  const std::vector<long long> w1ld = row_strides(w1), w2ld = row_strides(w2);
  a.w1 = w1p.data();
  a.w1_ld = w1ld.data();
  a.w2 = w2p.data();
  a.w2_ld = w2ld.data();
  a.fp8 = fp8 ? 1 : 0;
  a.w1s = fp8 ? w1sp.data() : nullptr;
  a.w2s = fp8 ? w2sp.data() : nullptr;
  a.xq = fp8 && R > 1 ? xq_.data() : nullptr;
  a.xs = fp8 && R > 1 ? xsc_.data() : nullptr;
  if (saved_h.has_value()) {
    a.saved_h = saved_.data();
    a.saved_h_rows = saved_h->size(0);
  }
  if (keep_x.has_value()) {
    a.keep_x = ptr(*keep_x);
    a.keep_act = ptr(*keep_act);
    a.keep_rows = keep_rows;
  }
  a.raster = (int)raster;
  a.debug = (int)debug;

  launch_with_workspace(kOp, a, &mok_host::forward_workspace_bytes, &mok_host::forward_launch, err, dev);
  return {out, tpe};
}

}  // namespace

TORCH_LIBRARY_IMPL(mok, CUDA, m) { m.impl("forward", &forward); }

}  // namespace mok_api
