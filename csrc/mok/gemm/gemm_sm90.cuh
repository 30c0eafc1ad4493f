// Hopper GEMM building blocks for the compute role: TMA 2-D tile loads into SWIZZLE_128B smem,
// WGMMA m64n256k16 (bf16 x bf16 -> fp32; m64n256k32 e4m3 x e4m3 -> fp32; A K-major or MN-major, B K-major or MN-major in smem),
// mbarrier helpers.
// Uses CuTe/CUTLASS arch-level atoms only.
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include <utility>

namespace mok {

using Barrier = cutlass::arch::ClusterTransactionBarrier;  // static API on raw uint64_t smem words

// Shared-memory matrix descriptor for a K-major operand tile stored as rows of 128 B with the
// 128-byte swizzle (exactly what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a 64-element box).
// start address >> 4 in bits [0,14), leading byte offset (unused for swizzled K-major) [16,30),
// stride byte offset = 1024 B (8 rows) in [32,46), layout type 1 = SWIZZLE_128B in [62,64).
// Built from its two 32-bit words: the high word (stride byte offset, swizzle mode) is one constant; stages and
// K steps move only the start address in the low word, which stays below bit 14 for any address in the 228 KB
// of shared memory, so a K loop can add to the low word alone and leave the 64-bit arithmetic out.
constexpr uint32_t kSw128DescHi = (uint32_t)(1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t smem_desc_sw128_lo(const void* smem_ptr) {
  return (((uint32_t)__cvta_generic_to_shared(smem_ptr) & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) { return ((uint64_t)kSw128DescHi << 32) | lo; }
__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* smem_ptr) {
  return sw128_desc(smem_desc_sw128_lo(smem_ptr));
}

// Descriptor for an MN-major operand (rows of 64 MN-contiguous elements, one row per K index) stored as
// [64 MN x 64 K] TMA boxes with the 128-byte swizzle, box after box along MN (8 KB apart): CuTe's
// canonical MN-major SW128 layout ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-byte units, i.e. leading byte
// offset = 8192 B (next 64-element MN block), stride byte offset = 1024 B (next 8 K rows). One k16 step
// advances the start address by 16 rows = 2048 B. Lets the backward read W1 / W2 as stored (no W^T copy).
__device__ __forceinline__ uint64_t make_smem_desc_sw128_mn(const void* smem_ptr) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_ptr);
  uint64_t desc = 0;
  desc |= (uint64_t)((addr & 0x3FFFF) >> 4);
  desc |= (uint64_t)(8192 >> 4) << 16;
  desc |= (uint64_t)(1024 >> 4) << 32;
  desc |= (uint64_t)1 << 62;
  return desc;
}
constexpr uint64_t kMnDescK16Step = 2048 >> 4;  // descriptor start-address step per k16 (MN-major)

// One WGMMA of the CuTe atom `Atom` with its NAcc fp32 accumulator registers d[0..NAcc) passed one by
// one (the atom's fma takes them as separate references); accumulate = false writes d = A * B^T.
template <class Atom, size_t... I>
__device__ __forceinline__ void wgmma_atom_impl(uint64_t da, uint64_t db, float* d, bool accumulate,
                                                std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}
template <class Atom, int NAcc>
__device__ __forceinline__ void wgmma_atom(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom_impl<Atom>(da, db, d, accumulate, std::make_index_sequence<NAcc>{});
}

namespace gmma = cute::SM90::GMMA;
using Wgmma256 = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using Wgmma128 = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
using Wgmma256BMn = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;
using Wgmma256MnMn = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
// FP8 WGMMA takes K-major operands only; one k32 step is 32 B of each SW128 row, like a bf16 k16 step.
using Wgmma128F8 = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
using Wgmma256F8 = gmma::MMA_64x256x32_F32E4M3E4M3_SS_TN<>;

// d[128] += A(64x16, smem) * B(256x16, smem)^T   (or d = A*B^T when !accumulate)
__device__ __forceinline__ void wgmma_64x256x16(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma256, 128>(da, db, d, accumulate);
}
// as wgmma_64x256x16 with B MN-major (descriptor from make_smem_desc_sw128_mn)
__device__ __forceinline__ void wgmma_64x256x16_bmn(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma256BMn, 128>(da, db, d, accumulate);
}
// d[64] += A(64x16, smem) * B(128x16, smem)^T (the backward's 128-column dA tiles)
__device__ __forceinline__ void wgmma_64x128x16(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma128, 64>(da, db, d, accumulate);
}
// as wgmma_64x256x16 with A and B both MN-major (reductions over the rows of row-major buffers: wgrad)
__device__ __forceinline__ void wgmma_64x256x16_mnmn(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma256MnMn, 128>(da, db, d, accumulate);
}
// FP8 half tile: d[64] (+)= A(64 x 32 e4m3) * B(128 x 32 e4m3)^T, the layout of one 128-column half of
// the m64n256 accumulator (d = acc or acc + 64), so promotion can overlap the other half's MMAs.
__device__ __forceinline__ void wgmma_64x128x32_e4m3(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma128F8, 64>(da, db, d, accumulate);
}
// FP8 full tile: d[128] (+)= A(64 x 32 e4m3) * B(256 x 32 e4m3)^T; the same register layout as two
// 128-column halves (d[0..64) = columns 0-127), with A read once for all 256 columns.
__device__ __forceinline__ void wgmma_64x256x32_e4m3(uint64_t da, uint64_t db, float* d, bool accumulate) {
  wgmma_atom<Wgmma256F8, 128>(da, db, d, accumulate);
}

__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(d[i]);
}
__device__ __forceinline__ void fence_acc64(float* d) {
#pragma unroll
  for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(d[i]);
}


// TMA 2-D load: box at (c0 = inner/K coordinate, c1 = row coordinate) into smem, completing on bar.
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, uint64_t* bar, void* smem, int c0, int c1) {
  cute::SM90_TMA_LOAD_2D::copy(map, bar, 0x1000000000000000ull /*EVICT_NORMAL*/, smem, c0, c1);
}

// Fetch a tensor map's descriptor into the TMA unit's cache ahead of its first load: the expert weight
// maps change from tile to tile (3 per local expert: 96 with 32 experts), and a miss delays the tile's
// first stage by a descriptor round trip to global memory.
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// TMA 2-D store: smem box -> global at (c0 = inner coordinate, c1 = row coordinate), bulk-group based.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem, int c0, int c1) {
  cute::SM90_TMA_STORE_2D::copy(map, smem, c0, c1);
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// wait until every committed store has finished READING its smem (the buffer may be reused)
__device__ __forceinline__ void tma_store_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// wait until every committed store has completed its global writes
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// generic-proxy smem writes of this thread -> visible to the async proxy (a following TMA store)
__device__ __forceinline__ void fence_view_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// p[0..1] += v as one reduction performed by the L2 (red.global.add.v2.f32): unlike a read-add-write, the thread
// does not wait for the old values, so an epilogue adding a gradient tile into fp32 buffers (Megatron's main_grad)
// issues like one of stores. Each element gets one add, rounded to nearest as FADD rounds (subnormal inputs and sums
// flush to zero).
__device__ __forceinline__ void red_add_f32x2(float* p, float2 v) {
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1)
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
#else  // vector reductions need PTX ISA 8.1 (CUDA 12.1): two scalar ones, the same sums
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v.x) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(v.y) : "memory");
#endif
}

// Stage st of a consumer's stage ring is free for its producer again (Smem: the kernel's carve of its shared
// memory, with the ring's `empty` barriers).
template <class Smem>
__device__ __forceinline__ void release_stage(const Smem& sm, int st) {
  Barrier::arrive(&sm.empty[st]);
}
// A K loop's after_issue hook that does nothing.
struct NoHook {
  __device__ __forceinline__ void operator()(int) const {}
};

}  // namespace mok
