// Memory-layout changes between NCHW and channels-last (NHWC) for the binding: an input laid out for another kernel
// family than the one that runs, and an output staged in the layout a kernel writes best (docs/architecture.md,
// "Kernels"). Both directions are a batched 2-D transpose: per image, [rows][cols] -> [cols][rows], with rows = C
// and cols = H * W for NCHW -> NHWC, and the other way round. Tiles of 32 x 32 elements go through shared memory
// so that reads and writes are both whole runs along memory; the element is moved as raw bits (2, 4 or 8 bytes).
#include <cstdint>

#include "conv_transpose2d.h"

namespace deconv {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;  // a block is 32 x 8 threads, each moving 4 elements of the tile

template <typename T>
__global__ void __launch_bounds__(kTile * kRowsPerPass)
    transpose_batched(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int64_t cols) {
  __shared__ T tile[kTile][kTile + 1];  // +1: the column reads of the write phase hit 32 different banks
  const int64_t image = blockIdx.z;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile, r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const T* s = src + image * rows * cols;
  T* d = dst + image * rows * cols;
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = s[r * cols + c];
  }
  __syncthreads();
#pragma unroll
  for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) d[c * rows + r] = tile[threadIdx.x][i];
  }
}

template <typename T>
cudaError_t launch_transpose(const void* src, void* dst, int64_t images, int64_t rows, int64_t cols,
                             cudaStream_t stream) {
  const int64_t col_tiles = (cols + kTile - 1) / kTile, row_tiles = (rows + kTile - 1) / kTile;
  if (col_tiles > INT32_MAX || row_tiles > 65535) return cudaErrorInvalidValue;
  const dim3 block(kTile, kRowsPerPass);
  const int64_t per_image = rows * cols;
  // At most 65535 images a launch (the grid's z); larger batches go in slices.
  for (int64_t first = 0; first < images; first += 65535) {
    const int64_t count = images - first < 65535 ? images - first : 65535;
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles), static_cast<unsigned>(count));
    transpose_batched<T><<<grid, block, 0, stream>>>(static_cast<const T*>(src) + first * per_image,
                                                     static_cast<T*>(dst) + first * per_image, rows, cols);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t convert_layout(const void* src, void* dst, int64_t N, int64_t C, int64_t HW, int elem_bytes,
                           bool to_channels_last, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || HW <= 0) return cudaSuccess;
  const int64_t rows = to_channels_last ? C : HW, cols = to_channels_last ? HW : C;
  switch (elem_bytes) {
    case 2:
      return launch_transpose<uint16_t>(src, dst, N, rows, cols, stream);
    case 4:
      return launch_transpose<uint32_t>(src, dst, N, rows, cols, stream);
    case 8:
      return launch_transpose<uint64_t>(src, dst, N, rows, cols, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv
