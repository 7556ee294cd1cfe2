// Element conversions shared by every kernel: storage type <-> accumulator (fp32, or fp64 for double).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace deconv {

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

// Accumulator -> storage type, rounding to nearest even.
template <typename T>
__device__ __forceinline__ T from_acc(float v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Accumulator type per storage type: fp32, or fp64 for double.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// Accumulator -> storage type: double stays double, everything else rounds from fp32.
template <typename T, typename Acc>
__device__ __forceinline__ T store_cast(Acc v) {
  if constexpr (sizeof(Acc) == 8) {
    return static_cast<T>(v);
  } else {
    return from_acc<T>(v);
  }
}

}  // namespace deconv
