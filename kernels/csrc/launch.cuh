// Host-side launch helpers shared by the kernel files.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

namespace deconv {

// Lets kKernel use the device's largest dynamic shared memory, once per device: the opt-in is a driver call, worth
// a few microseconds of host time on every launch otherwise, and a launch then asks for what it needs.
template <auto kKernel>
cudaError_t opt_in_shared_memory() {
  static std::atomic<uint64_t> done{0};  // bit d: device d opted in
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  int max_bytes = 0;
  err = cudaDeviceGetAttribute(&max_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_bytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

}  // namespace deconv
