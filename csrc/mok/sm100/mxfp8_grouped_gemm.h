// Host API of the sm_100a MXFP8 grouped expert GEMM unit (sm100/mxfp8_grouped_gemm.cu): D_g = A_g B_g^T per expert.
// A[g] [M_g, K] e4m3 row-major; B[g] [N, K] e4m3 row-major (the expert weight); SFA[g] / SFB[g] their scales in the
// sm_100 layout; D[g] [M_g, ldd] bf16. K a multiple of 128, N of 16, M_g >= 0. Host code only.
#pragma once
#include <cuda_runtime_api.h>

namespace mok_host {

// Bytes of device workspace a launch needs, or -1 for shapes the unit cannot run (errbuf says why).
long long sm100_mxfp8_gemm_workspace_bytes(int G, const int* M, int N, int K, int device);
// 0 on success, else 1 with the reason in errbuf.
int sm100_mxfp8_grouped_gemm(int G, const int* M, int N, int K, const void* const* A, const void* const* B,
                             const void* const* SFA, const void* const* SFB, void* const* D, long long ldd,
                             void* workspace, unsigned long long workspace_bytes, int device, cudaStream_t stream,
                             char* errbuf, int errlen);

}  // namespace mok_host
