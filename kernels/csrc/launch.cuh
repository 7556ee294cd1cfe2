// Host-side launch helpers shared by the kernel files.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

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

// A launch of `grid` blocks in clusters of `size` consecutive blocks along x.
inline void cluster_config(cudaLaunchConfig_t& cfg, cudaLaunchAttribute (&attr)[1], dim3 grid, int threads,
                           size_t smem, int size, cudaStream_t stream) {
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = size;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
}

// How many clusters of `size` blocks of `kernel` with `smem` bytes each the current device runs at once: 0 where its
// code was built for no sm_90 or newer (cluster barriers, distributed shared memory) or none fits. Asked of the
// driver once per (kernel, device, shared memory, size).
template <typename Kernel>
int max_active_clusters(Kernel kernel, int threads, size_t smem, int size) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t, int>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, smem, size);
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int clusters = 0;
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.binaryVersion >= 90) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cluster_config(cfg, attr, dim3(size), threads, smem, size, nullptr);
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) clusters = 0;
  }
  cudaGetLastError();  // a refused query leaves no sticky error for the launch
  cache.emplace(key, clusters);
  return clusters;
}

}  // namespace deconv
