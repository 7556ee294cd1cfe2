// The fp16 configurations of bench/kernels/cutlass/dgrad.cuh (names: dtype, threadblock tile, warp tile, stages,
// iterator algorithm, alignment).

#define DECONV_CUTLASS_KERNELS
#include "dgrad.cuh"

namespace deconv_cutlass {

std::vector<Entry> const& entries_fp16() {
  static std::vector<Entry> const entries{
      DECONV_CUTLASS_ENTRY("fp16_128x128x32_w64x64_s3_opt_a8", "fp16", 8, H128x128<cutlass::half_t>),
      DECONV_CUTLASS_ENTRY("fp16_128x64x32_w64x32_s4_opt_a8", "fp16", 8, H128x64<cutlass::half_t>),
      DECONV_CUTLASS_ENTRY("fp16_64x64x32_w32x32_s5_opt_a8", "fp16", 8, H64x64<cutlass::half_t>),
  };
  return entries;
}

}  // namespace deconv_cutlass
