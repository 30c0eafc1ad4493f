// The launch arguments of every MoK kernel and the host launchers that take them: the one definition both sides
// of the library boundary use (the launchers in host/forward.cu and host/backward.cu, the PyTorch operators in
// apis/). Host code only; no CUDA device code and no torch here.
//
// Every launcher validates its arguments and returns 0, or 1 with the reason in errbuf (a null errbuf is allowed).
// The *_workspace_bytes functions return the device workspace a launch needs, or -1 when the arguments are
// invalid (the reason in errbuf).
#pragma once
#include <cuda_runtime_api.h>

namespace mok_host {

// What every rank's launch of a megakernel (forward or backward) carries: the problem, the partition of the SMs,
// the ring, the peers, the workspace, the optional timeline and the SwiGLU variant. Filled by one helper on the
// operator side (apis/checks.h: fill_rank_launch) and validated by one function on the launcher side
// (host/host_launch.h: rank_launch_ok).
struct MokRankLaunch {
  int R, L, H, F, K;                // ranks, local experts, hidden, ffn, top-k
  int comm_sms, ring_slots, minibatch;
  int ctas_per_rank;                // 0 = auto: every SM of the device
  int stall_rank, stall_slot;       // debug stall of one (rank, slot) (-1: none)
  int device;
  double timeout_ms;
  const long long* T;               // host [R] tokens per rank
  int rank;                         // this launch runs rank `rank` of R (R = 1 needs no peer memory)
  unsigned long long workspace;
  unsigned long long workspace_bytes;
  unsigned long long err;           // device int32[16], the error record (common.cuh: err[0..7])
  // R > 1 only (peers meet on signal pads):
  unsigned epoch;                   // call number >= 1, the same on every rank (shared by forward and backward)
  const unsigned long long* signal; // host [R] device ptrs of every rank's signal pad (uint32[4*72], common.cuh: SignalKind)
  // Optional timeline (timeline.cuh): events [grid][timeline_cap] and per-CTA counts [grid]; 0 = off.
  unsigned long long timeline;
  unsigned long long timeline_count;
  int timeline_cap;
  // The SwiGLU variant (swiglu.cuh; Megatron's activation_func_clamp_value / glu_linear_offset): glu = 1 with
  // glu_clamp > 0 (+inf: none) and a finite glu_offset; 0 = the plain SwiGLU (the lean kernel instance).
  int glu;
  float glu_clamp;
  float glu_offset;
};

// One rank's launch of the forward megakernel.
struct MokLaunchArgs : MokRankLaunch {
  const unsigned long long* x;      // host [R] device ptrs
  const unsigned long long* idx;    // host [R]
  const unsigned long long* w;      // host [R]
  const unsigned long long* out;    // host [R]
  const unsigned long long* combine;// host [R]
  const unsigned long long* tpe;    // host [R]
  const unsigned long long* w1;     // host [R*L] expert (q*L+e) fc1 weight [2F, H]
  const long long* w1_ld;           // host [R*L] row stride (elements)
  const unsigned long long* w2;     // host [R*L] fc2 weight [H, F]
  const long long* w2_ld;           // host [R*L]
  // Optional: host [R] device ptrs (0 = none) of the owners' fc1-output buffers [saved_h_rows, 2F] bf16
  // (layout order) that the backward reads instead of recomputing fc1; only this launch's ranks' are used.
  const unsigned long long* saved_h;
  long long saved_h_rows;
  // FP8 kernel (kernel.dtype fp8) when fp8 = 1: w1 / w2 then point at e4m3 weights (w1_ld / w2_ld in
  // elements = bytes) and w1s / w2s at their fp32 128 x 128 block scales, host [R*L] device ptrs of
  // [2F/128, H/128] and [H/128, F/128] (contiguous). Needs H and F multiples of 128.
  int fp8;
  const unsigned long long* w1s;
  const unsigned long long* w2s;
  // Optional (bf16 only): keep the expert input and SwiGLU output rows for the backward. keep_x
  // [parts][keep_rows][H] and keep_act [parts][keep_rows][F] bf16 (parts = the launch's ranks,
  // contiguous) replace the ring: minibatch i sits at its own layout rows [mb_begin(i), mb_begin(i+1))
  // of its owner's part, so the backward reads them instead of pulling x again and recomputing act (the rows
  // Megatron's grouped GEMM keeps too). keep_rows: a multiple of the minibatch, the owner capacity.
  unsigned long long keep_x;
  unsigned long long keep_act;
  long long keep_rows;
  // FP8 at R > 1 only: host [R] device
  // ptrs of every rank's source-quantised copy of its tokens in its symmetric region, e4m3 [T, H] and fp32
  // [T, H / 128] scales (this rank's written by this launch, peers' pulled). At R = 1 the copy lives in the
  // workspace and these are ignored.
  const unsigned long long* xq;
  const unsigned long long* xs;
  // Tuning (config key kernel.tile_raster; changes no result bit): raster: ticket order of a GEMM stage, 0
  // row-block major, 1 n-tile major, G in [2, 64] bands of G row blocks, -1 the measured default (bf16 16: each
  // wave's expert weights stay in L2, 2.6-5.4 % faster on the H200; fp8 0: bands were 1.8-2.7 % slower, its
  // weights are half the bytes).
  int raster;
  // Timing ablations of the -DMOK_ABLATION build (common.cuh: MOK_DBG bits; results wrong); 0 otherwise.
  int debug;
};

// One rank's launch of the backward megakernel (the mirror of the forward launch).
struct MokBwdArgs : MokRankLaunch {
  long long cap;                      // rows of each rank's layout-order buffers
  const unsigned long long* x;        // host [R] device ptrs
  const unsigned long long* idx;
  const unsigned long long* w;
  const unsigned long long* grad_out;
  const unsigned long long* combine;
  const unsigned long long* grad_buf;
  const unsigned long long* grad_x;
  const unsigned long long* grad_w;
  const unsigned long long* tpe;
  const unsigned long long* xl;
  const unsigned long long* gyl;
  const unsigned long long* dh;
  const unsigned long long* act;
  const unsigned long long* w1;       // host [R*L] [2F, H] row stride w1_ld
  const long long* w1_ld;
  const unsigned long long* w2;       // host [R*L] [H, F] row stride w2_ld (read MN-major, as stored)
  const long long* w2_ld;
  const unsigned long long* w2t;      // host [R*L] [F, H] contiguous W2^T: recompute path only (else 0)
  // Optional host [R] (0 = recompute): forward's fc1 output [cap, 2F] bf16 in layout order (kept by the
  // forward kernel with saved_h); stage 1 then reads h instead of recomputing x @ W1^T.
  const unsigned long long* saved_h;
  // x / idx / w / grad_out / grad_buf / signal are every rank's symmetric-memory pointers, the owner-side
  // arrays (xl, gyl, dh, act, saved_h, grad_x, grad_w, combine, tpe) only need this rank's entry, and
  // w1 / w1_ld / w2 / w2_ld / w2t hold this rank's L experts.
  // FP8 dgrad (kernel.dtype fp8; needs saved_h, H and F multiples of 128): fp8 = 1 and, per expert of this
  // launch (host [np*L], like w1 / w2), W2^T e4m3 [F, H] + scales [F/128, H/128] and W1^T e4m3 [H, 2F] +
  // scales [H/128, 2F/128], all contiguous; per rank (host [R], owner side as xl), gy and dH e4m3
  // [cap, H] / [cap, 2F] with 1 x 128 block scales [cap, H/128] / [cap, 2F/128]. 0 = bf16 dgrad.
  int fp8;
  const unsigned long long* w2t8;
  const unsigned long long* w2ts;
  const unsigned long long* w1t8;
  const unsigned long long* w1ts;
  const unsigned long long* gyl8;
  const unsigned long long* gys;
  const unsigned long long* dh8;
  const unsigned long long* dhs;
  // 1: skip the router-weight gradient and the grad_x sum; the wgrad launch that follows on the same
  // stream does them (MokWgradArgs.home_parts) with its idle producer warps. 0: done here.
  int defer_home;
  // 1: xl already holds the layout-order expert input rows (the forward kernel kept them, keep_x):
  // the comm SMs pull only grad_out. act_kept (needs saved_h): act holds the forward's SwiGLU output
  // rows (keep_act), not recomputed from h.
  int x_kept;
  int act_kept;
};

// One launch of the wgrad kernel over the layout-order buffers a backward launch leaves.
struct MokWgradArgs {
  int np, L, H, F;
  int rank0;                          // rank of partition 0 (error reports)
  int device;
  int accumulate;                     // 1: add into the outputs (main_grad), 0: overwrite them
  double timeout_ms;
  long long cap;                      // rows of each layout-order buffer
  const unsigned long long* tpe;      // host [np] device int32[L] (the dgrad launch's tokens per expert)
  const unsigned long long* xl;       // host [np] [cap, H] bf16
  const unsigned long long* gyl;      // host [np] [cap, H] bf16
  const unsigned long long* dh;       // host [np] [cap, 2F] bf16
  const unsigned long long* act;      // host [np] [cap, F] bf16
  const unsigned long long* gw1;      // host [np*L] fp32 [2F, H], row stride gw1_ld
  const long long* gw1_ld;
  const unsigned long long* gw2;      // host [np*L] fp32 [H, F], row stride gw2_ld
  const long long* gw2_ld;
  unsigned long long workspace;
  unsigned long long workspace_bytes;
  unsigned long long err;             // device int32[16]: the dgrad launch's record (not cleared here)
  // Home-side reductions of the preceding dgrad launch (made with defer_home = 1), 0 = none: per home
  // rank (host [home_parts]) T, grad_out [T, H], combine [T, K, H], grad_buf [T, K, H], idx [T, K] int32,
  // grad_w [T, K] fp32 and grad_x [T, H] outputs.
  int K;
  int home_parts;
  const long long* h_T;
  const unsigned long long* h_grad_out;
  const unsigned long long* h_combine;
  const unsigned long long* h_grad_buf;
  const unsigned long long* h_idx;
  const unsigned long long* h_grad_w;
  const unsigned long long* h_grad_x;
};

// The FP8 block-scaled grouped GEMM unit (gemm/fp8_gemm.cuh).
struct MokFp8GemmArgs {
  int L, N, K, device;
  long long rows;                     // rows of xq / xs / out
  const long long* counts;            // host [L] rows per expert, segments back to back from row 0
  unsigned long long xq;              // device e4m3 [rows, K]
  unsigned long long xs;              // device fp32 [rows, K / 128]
  const unsigned long long* wq;       // host [L] device e4m3 [N, K]
  const unsigned long long* ws;       // host [L] device fp32 [N / 128, K / 128]
  unsigned long long out;             // device bf16 [rows, N]
  unsigned long long workspace;
  unsigned long long workspace_bytes;
  unsigned long long err;             // device int32[16]
  double timeout_ms;
};

// The FP8 K-grouped weight-gradient GEMM unit (gemm/fp8_wgrad_gemm.cuh): out_e (+)= a_e b_e^T over expert e's tokens.
struct MokFp8WgradArgs {
  int L, M, N, device;
  long long ktot;                     // token columns of a / b (a multiple of 128)
  unsigned long long counts;          // device int32 [L] tokens per expert (the token-major layout pads each to 128)
  unsigned long long a;               // device e4m3 [M, ktot]
  unsigned long long sa;              // device fp32 [ktot / 128, M]
  unsigned long long b;               // device e4m3 [N, ktot]
  unsigned long long sb;              // device fp32 [ktot / 128, N]
  const unsigned long long* out;      // host [L] device fp32 [M, N]
  int accumulate;                     // 1: out += a_e b_e^T, 0: out = a_e b_e^T
  unsigned long long workspace;
  unsigned long long workspace_bytes;
  unsigned long long err;             // device int32[16]
  double timeout_ms;
};

// Every kernel of the forward / backward library loaded on `device` (lazy loading at a first launch can deadlock
// launches that wait for each other: host/persistent_launch.h, load_kernels). Called once per device before any launch.
int load_forward_kernels(int device, char* errbuf, int errlen);
int load_backward_kernels(int device, char* errbuf, int errlen);

long long forward_workspace_bytes(const MokLaunchArgs* a, char* errbuf, int errlen);
int forward_launch(const MokLaunchArgs* a, cudaStream_t stream, char* errbuf, int errlen);
long long backward_workspace_bytes(const MokBwdArgs* a, char* errbuf, int errlen);
int backward_launch(const MokBwdArgs* a, cudaStream_t stream, char* errbuf, int errlen);
long long wgrad_workspace_bytes(const MokWgradArgs* a, char* errbuf, int errlen);
int wgrad_launch(const MokWgradArgs* a, cudaStream_t stream, char* errbuf, int errlen);
long long fp8_gemm_workspace_bytes(const MokFp8GemmArgs* a, char* errbuf, int errlen);
int fp8_gemm_launch(const MokFp8GemmArgs* a, cudaStream_t stream, char* errbuf, int errlen);
long long fp8_wgrad_workspace_bytes(const MokFp8WgradArgs* a, char* errbuf, int errlen);
int fp8_wgrad_launch(const MokFp8WgradArgs* a, cudaStream_t stream, char* errbuf, int errlen);
// Token columns of the FP8 wgrad operands of nrows layout-order rows of L experts, each padded to 128 tokens.
inline long long token_major_capacity(long long nrows, int L) { return (nrows + 127LL * L + 127) / 128 * 128; }
// bf16 layout-order rows [nrows, F] (row stride ld; counts: device int32 [L] rows per expert) -> e4m3 q [F, kcap]
// and fp32 scales s [kcap / 128, F], one per 128 tokens of a column, experts padded to 128 tokens; counts that do not
// fit the rows are reported in the error record err (int32[16])
int fp8_quantize_tokens(const void* rows, long long ld, long long nrows, int F, int L, const int* counts, void* q,
                        float* s, long long kcap, int* err, int device, cudaStream_t stream, char* errbuf, int errlen);
// bf16 [N, K] (row stride ld) -> e4m3 q [N, K] and fp32 128 x 128 block scales s [N/128, K/128]
int fp8_quantize_weight(const void* w, long long ld, int N, int K, void* q, float* s, int device, cudaStream_t stream,
                        char* errbuf, int errlen);
// bf16 rows [M, H] (row stride ld) -> e4m3 q [M, H] and UE8M0 1 x 32 scales sf in layout sf_layout (0 row-major,
// 1 the sm_100 tcgen05 layout) of sf_bytes bytes
int mxfp8_quantize_rows(const void* x, long long ld, int M, int H, void* q, void* sf, long long sf_bytes, int sf_layout,
                        int device, cudaStream_t stream, char* errbuf, int errlen);
// bool routing map [T, E] and probs [T, E] (fp32, or bf16 with probs_bf16), both contiguous -> top-k expert ids
// idx [T, K] int32 and their probabilities w [T, K] of probs' dtype (routing/topk_from_map.cuh)
int topk_from_map(const void* map, const void* probs, int probs_bf16, long long T, int E, int K, int* idx, void* w,
                  int device, cudaStream_t stream, char* errbuf, int errlen);

}  // namespace mok_host
