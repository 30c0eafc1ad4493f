// Host-only probe (runs on a CPU): prints the byte offset CUTLASS's sm_100 block-scaled scale-factor layout
// (Sm1xxBlockScaledConfig<32>::tile_atom_to_shape_SFA, K-major) gives every (row, 32-element K block) of
// an M x K operand, one "row kblock offset" line each. tests/test_mxfp8.py compares it with
// megatron_mok.mxfp8.sm100_sf_offset, the formula the MXFP8 quantiser writes scales with.
//   nvcc -std=c++17 -I<cutlass include> sf_layout_probe.cu -o probe && ./probe M K
#include <cstdio>
#include <cstdlib>

#include <cute/tensor.hpp>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s M K\n", argv[0]);
    return 2;
  }
  const int M = std::atoi(argv[1]), K = std::atoi(argv[2]);
  using Config = cutlass::detail::Sm1xxBlockScaledConfig<32>;
  const auto layout = Config::tile_atom_to_shape_SFA(cute::make_shape(M, 1, K, 1));
  for (int m = 0; m < M; ++m)
    for (int kb = 0; kb < K / 32; ++kb) std::printf("%d %d %d\n", m, kb, (int)layout(m, kb * 32, 0));
  return 0;
}
