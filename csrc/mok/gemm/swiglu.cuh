// SwiGLU of the expert FFN and its backward, with Megatron's optional GLU variant: for the fc1 output
// h = [g | u], clamp c (activation_func_clamp_value; +inf: none) and offset o (glu_linear_offset),
//
//   act = silu(min(g, c)) * (clamp(u, -c, c) + o)
//   d act / d g = (clamp(u, -c, c) + o) * silu'(min(g, c)) * [g <= c]
//   d act / d u = silu(min(g, c)) * [-c <= u <= c]
//
// (megatron_mok/activation.py is the definition; the clamp's gradient passes at its bounds, as torch.clamp's
// does). The plain SwiGLU (Params::glu == 0) never reaches these helpers, so its code and bits are those of
// silu(g) * u: the variant lives in kernel instances of its own (forward kFeatGlu, backward kGlu).
#pragma once

#include "common.cuh"

namespace mok {

// x rounded to bf16 (round to nearest even) and back: where the clamp's gradient mask is decided (the saved h
// and Megatron's fc1 output are bf16; the recompute path rounds its fp32 accumulators the same way).
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// min / max that return NaN when an operand is NaN (PTX min.NaN / max.NaN, sm_80+: one FMNMX each, where a
// compare-and-select takes two): the clamp keeps a NaN a NaN, as torch.clamp does.
__device__ __forceinline__ float min_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// g, u -> the clamped gate and the clamped, offset up value: four instructions (the FP8 fc1 epilogue runs 64 of
// these per thread and tile, on its critical path).
__device__ __forceinline__ void glu_inputs(const Params& P, float& g, float& u) {
  const float c = P.glu_clamp;
  g = min_nan(g, c);
  u = max_nan(min_nan(u, c), -c) + P.glu_offset;
}

// The SwiGLU backward's two factors at (g, u) of the variant: c1 = d act / d g, c2 = d act / d u, and act;
// sigmoid is the caller's (the recompute and saved-h epilogues use the same one).
template <class Sigmoid>
__device__ __forceinline__ void glu_terms(const Params& P, float g, float u, Sigmoid sigmoid, float& c1, float& c2,
                                          float& act) {
  const float c = P.glu_clamp;
  const bool pass_g = g <= c, pass_u = u >= -c && u <= c;
  glu_inputs(P, g, u);
  const float sig = sigmoid(g);
  const float silu = g * sig;
  c1 = pass_g ? u * (sig * (1.0f + g * (1.0f - sig))) : 0.0f;
  c2 = pass_u ? silu : 0.0f;
  act = silu * u;
}

}  // namespace mok
