// Argument checks of the PyTorch operators (apis/*.cpp): one clear ValueError per bad argument, naming the
// operator, the tensor, what was expected and what came; and the conversion of a launcher's refusal into a
// RuntimeError. Host code only.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "host/launch_args.h"
#include "mok_limits.h"

#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace mok_api {

inline std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " " << t.sizes() << " on " << t.device();
  return s.str();
}

inline std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream s;
  s << shape;
  return s.str();
}

// t is a tensor of `dtype` on `device` with `ndim` dimensions.
inline void check_tensor(const char* op, const std::string& name, const at::Tensor& t, at::ScalarType dtype,
                         int64_t ndim, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is missing");
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == ndim && t.device() == device, op, ": ", name, " must be a ",
                    ndim, "-D ", dtype, " tensor on ", device, ", got ", describe(t));
}

// ... and of exactly `shape`.
inline void check_shape(const char* op, const std::string& name, const at::Tensor& t, at::ScalarType dtype,
                        at::IntArrayRef shape, const at::Device& device) {
  check_tensor(op, name, t, dtype, (int64_t)shape.size(), device);
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must be ", dtype, " ", shape_str(shape), ", got ", describe(t));
}

inline void check_contiguous(const char* op, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

// A 2-D operand read by TMA in place: unit inner stride, a row stride of a multiple of 16 bytes, 16-byte aligned.
inline void check_tma_rows(const char* op, const std::string& name, const at::Tensor& t) {
  const int64_t row_bytes = t.stride(0) * (int64_t)t.element_size();
  TORCH_CHECK_VALUE(t.stride(1) == 1 && row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op,
                    ": ", name, " needs unit inner stride, a row stride of a multiple of 16 bytes and a 16-byte aligned "
                    "start, got strides ", t.strides());
}

inline unsigned long long ptr(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); }

inline unsigned long long ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? ptr(*t) : 0ull; }

// Device pointers and row strides (elements) of a list of matrices, e.g. one rank's experts.
inline std::vector<unsigned long long> ptrs(at::TensorList ts) {
  std::vector<unsigned long long> v;
  v.reserve(ts.size());
  for (const at::Tensor& t : ts) v.push_back(ptr(t));
  return v;
}

inline std::vector<long long> row_strides(at::TensorList ts) {
  std::vector<long long> v;
  v.reserve(ts.size());
  for (const at::Tensor& t : ts) v.push_back(t.stride(0));
  return v;
}

// The problem a rank's megakernel launch computes, read from its operands: T tokens of hidden H (x), top-K
// (topk_idx), L experts (w1, w2) of ffn F (w2[0] is [hidden, ffn]). Each operand's full check follows in the operator.
struct Problem {
  at::Device dev;
  int64_t T, H, K, L, F;
};

inline Problem read_problem(const char* op, const at::Tensor& x, const at::Tensor& topk_idx, at::TensorList w1,
                            at::TensorList w2) {
  TORCH_CHECK_VALUE(x.defined() && x.is_cuda() && x.dim() == 2, op, ": x must be a 2-D CUDA tensor [tokens, hidden], got ",
                    x.defined() ? describe(x) : "nothing");
  TORCH_CHECK_VALUE(topk_idx.dim() == 2, op, ": topk_idx must be [tokens, top-k], got ", describe(topk_idx));
  const int64_t L = (int64_t)w1.size();
  TORCH_CHECK_VALUE(L >= 1 && (int64_t)w2.size() == L, op, ": w1 and w2 must hold this rank's experts, got ",
                    w1.size(), " and ", w2.size());
  TORCH_CHECK_VALUE(w2[0].dim() == 2, op, ": w2[0] must be [hidden, ffn], got ", describe(w2[0]));
  return {x.device(), x.size(0), x.size(1), topk_idx.size(1), L, w2[0].size(1)};
}

// Device pointers of every rank's region: peer_bases[r] + offset.
inline std::vector<unsigned long long> peer_ptrs(at::IntArrayRef bases, int64_t offset) {
  std::vector<unsigned long long> v(bases.size());
  for (size_t r = 0; r < bases.size(); ++r) v[r] = (unsigned long long)(bases[r] + offset);
  return v;
}

// Only rank `rank`'s entry set (owner-side buffers of a per-rank launch).
inline std::vector<unsigned long long> own_only(int world, int rank, unsigned long long p) {
  std::vector<unsigned long long> v((size_t)world, 0ull);
  v[(size_t)rank] = p;
  return v;
}

// A launcher's refusal (rc != 0) as one RuntimeError naming the operator.
inline void check_launch(int rc, const char* op, const char* errbuf) {
  TORCH_CHECK(rc == 0, op, ": ", errbuf[0] ? errbuf : "launch failed");
}

constexpr int kErrLen = 1024;

// The launch's SMs (ctas, or every SM of the device for 0) leave at least one compute SM beside comm_sms.
inline void check_sm_split(const char* op, int device, int64_t comm_sms, int64_t ctas) {
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess, op,
              ": cannot query the SM count of device ", device);
  const int64_t cpr = ctas > 0 ? ctas : sms;
  TORCH_CHECK_VALUE(comm_sms < cpr, op, ": comm_sms=", comm_sms, " leaves no compute SM: the launch runs on ", cpr,
                    " SMs");
}

// The ranks of a per-rank launch: 1 without peer bases (EP 1), else one per base, with `rank` among them, the
// region offsets the operator reads, a call number, and a debug stall inside the ranks and ring slots.
inline int check_ranks(const char* op, at::IntArrayRef peer_bases, at::IntArrayRef peer_offsets, int n_offsets,
                       int64_t rank, int64_t epoch, int64_t ring_slots, int64_t stall_rank, int64_t stall_slot) {
  const int R = peer_bases.empty() ? 1 : (int)peer_bases.size();
  TORCH_CHECK_VALUE(R <= MOK_MAX_RANKS, op, ": at most ", MOK_MAX_RANKS, " ranks, got ", R);
  TORCH_CHECK_VALUE(rank >= 0 && rank < R, op, ": rank ", rank, " out of [0, ", R, ")");
  if (R > 1) {
    TORCH_CHECK_VALUE((int)peer_offsets.size() == n_offsets, op, ": peer_offsets must hold ", n_offsets,
                      " region offsets, got ", peer_offsets.size());
    TORCH_CHECK_VALUE(epoch >= 1, op, ": epoch must be >= 1 at EP > 1 (the call number), got ", epoch);
  }
  TORCH_CHECK_VALUE(stall_rank >= -1 && stall_rank < R && stall_slot >= -1 && stall_slot < ring_slots, op,
                    ": debug stall (", stall_rank, ", ", stall_slot, ") out of range");
  return R;
}

// An optional in-kernel timeline: events int64 [grid, cap, 3] with per-CTA counts int32 [grid], or neither.
inline void check_timeline(const char* op, const std::optional<at::Tensor>& timeline,
                           const std::optional<at::Tensor>& timeline_count, const at::Device& dev) {
  TORCH_CHECK_VALUE(timeline.has_value() == timeline_count.has_value(), op,
                    ": timeline and timeline_count go together");
  if (timeline.has_value()) {
    check_tensor(op, "timeline", *timeline, at::kLong, 3, dev);
    check_shape(op, "timeline_count", *timeline_count, at::kInt, {timeline->size(0)}, dev);
  }
}

// The fields every rank's launch carries (host/launch_args.h: MokRankLaunch), from the operator's arguments. `T`
// is the caller's per-rank token counts (kept alive by the caller for the launch).
inline void fill_rank_launch(mok_host::MokRankLaunch& a, int R, int64_t L, int64_t H, int64_t F, int64_t K,
                             const at::Device& dev, const std::vector<long long>& T, int64_t rank, int64_t epoch,
                             int64_t comm_sms, int64_t ring_slots, int64_t minibatch, int64_t ctas, double timeout_ms,
                             int64_t stall_rank, int64_t stall_slot, int64_t glu, double glu_clamp, double glu_offset,
                             const std::optional<at::Tensor>& timeline,
                             const std::optional<at::Tensor>& timeline_count) {
  a.R = R;
  a.L = (int)L;
  a.H = (int)H;
  a.F = (int)F;
  a.K = (int)K;
  a.comm_sms = (int)comm_sms;
  a.ring_slots = (int)ring_slots;
  a.minibatch = (int)minibatch;
  a.ctas_per_rank = (int)ctas;
  a.stall_rank = (int)stall_rank;
  a.stall_slot = (int)stall_slot;
  a.device = dev.index();
  a.timeout_ms = timeout_ms;
  a.T = T.data();
  a.rank = (int)rank;
  a.epoch = (unsigned)epoch;
  if (timeline.has_value()) {
    a.timeline = ptr(*timeline);
    a.timeline_count = ptr(*timeline_count);
    a.timeline_cap = (int)timeline->size(1);
  }
  a.glu = (int)glu;
  a.glu_clamp = (float)glu_clamp;
  a.glu_offset = (float)glu_offset;
}

// Size the launch's workspace (its launcher's *_workspace_bytes), take it from the caching allocator for this call
// (stream-ordered reuse; a captured launch gets its own graph-pool block), 256-byte aligned, and launch on the
// current stream. A refusal of either is one error naming the operator.
template <class Args>
void launch_with_workspace(const char* op, Args& a, long long (*workspace_bytes)(const Args*, char*, int),
                           int (*launch)(const Args*, cudaStream_t, char*, int), const at::Tensor& err,
                           const at::Device& dev) {
  char eb[kErrLen] = {0};
  const long long nbytes = workspace_bytes(&a, eb, kErrLen);
  TORCH_CHECK_VALUE(nbytes >= 0, op, ": invalid launch: ", eb);
  at::Tensor ws = at::empty({nbytes + 256}, err.options().dtype(at::kByte));
  a.workspace = (ptr(ws) + 255) / 256 * 256;
  a.workspace_bytes = (unsigned long long)nbytes;
  a.err = ptr(err);
  check_launch(launch(&a, c10::cuda::getCurrentCUDAStream(dev.index()).stream(), eb, kErrLen), op, eb);
}

// Every MoK kernel loaded on `device` before the first launch there (once per device; host/launch_args.h says why).
inline void load_kernels_once(int device) {
  static std::mutex mu;
  static bool loaded[256] = {false};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 256 || loaded[device]) return;
  char eb[kErrLen] = {0};
  TORCH_CHECK(mok_host::load_forward_kernels(device, eb, kErrLen) == 0 &&
                  mok_host::load_backward_kernels(device, eb, kErrLen) == 0,
              "loading the MoK kernels failed: ", eb);
  loaded[device] = true;
}

}  // namespace mok_api
