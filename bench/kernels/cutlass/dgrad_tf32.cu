// The tf32 configurations of bench/kernels/cutlass/dgrad.cuh (float tensors; names: dtype, threadblock tile, warp tile,
// stages, iterator algorithm, alignment).

#define DECONV_CUTLASS_KERNELS
#include "dgrad.cuh"

namespace deconv_cutlass {

std::vector<Entry> const& entries_tf32() {
  static std::vector<Entry> const entries{
      DECONV_CUTLASS_ENTRY("tf32_128x128x16_w64x64_s4_opt_a4", "tf32", 4, T128x128),
      DECONV_CUTLASS_ENTRY("tf32_128x64x16_w64x32_s4_opt_a4", "tf32", 4, T128x64),
      DECONV_CUTLASS_ENTRY("tf32_64x64x16_w32x32_s5_opt_a4", "tf32", 4, T64x64),
      DECONV_CUTLASS_ENTRY("tf32_64x64x16_w32x32_s3_ana_a1", "tf32", 1, T64x64A1),
  };
  return entries;
}

}  // namespace deconv_cutlass
