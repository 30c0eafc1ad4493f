// Argument checks of the PyTorch operators (apis/*.cpp): one clear ValueError per bad argument, naming the
// operator, the tensor, what was expected and what came; and the conversion of a launcher's refusal into a
// RuntimeError. Host code only.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "host/launch_args.h"

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
