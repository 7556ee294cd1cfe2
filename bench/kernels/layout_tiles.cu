// Tile geometry and vector width of the batched layout change (kernels/csrc/layout.cu's transpose_batched_vec),
// measured outside the extension: [rows][cols] -> [cols][rows] per image in tiles of TR source rows x TC source
// columns, moved as kVec-element vectors through shared memory, on Mask R-CNN's staged output (512 images of
// [784][256]) and on rows of 768 positions (128-byte rows), 16-bit and 32-bit elements. Each variant's output is
// checked against an element-wise transpose; times are CUDA events around single launches with the L2 flushed
// before each, best and mean of 20 (bench/NOTES.md v29).
//
//     nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/layout_tiles bench/kernels/layout_tiles.cu
//     /tmp/layout_tiles          # the tile and vector sweep of v29
//     /tmp/layout_tiles planes   # 64 or 128 positions a tile back to NCHW, by plane and tensor size (v37)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                         \
  do {                                                                      \
    const cudaError_t err_ = (call);                                        \
    if (err_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(err_));   \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

constexpr int kThreads = 256;

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using type = uint4;
};
template <>
struct VecOf<8> {
  using type = uint2;
};

// The kernel body of transpose_batched_vec with the tile's geometry as parameters: a thread loads kVec consecutive
// elements of a source row and stores kVec consecutive elements of a destination row gathered from a tile column.
template <typename T, int kVec, int TR, int TC>
__global__ void __launch_bounds__(kThreads)
    tiles(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int64_t cols) {
  using V = typename VecOf<kVec * static_cast<int>(sizeof(T))>::type;
  constexpr int kLoadLine = TC / kVec, kStoreLine = TR / kVec;
  constexpr int kLoads = TR * kLoadLine / kThreads, kStores = TC * kStoreLine / kThreads;
  constexpr int kPitch = TC + (sizeof(T) == 2 ? 2 : 1);
  __shared__ T tile[TR][kPitch];
  const int64_t image = blockIdx.z, c0 = static_cast<int64_t>(blockIdx.x) * TC;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * TR;
  const T* s = src + image * rows * cols + r0 * cols + c0;
  T* d = dst + image * rows * cols + c0 * rows + r0;
  const int nr = static_cast<int>(rows - r0 < TR ? rows - r0 : TR);
  const int nc = static_cast<int>(cols - c0 < TC ? cols - c0 : TC);
  V v[kLoads];
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int idx = threadIdx.x + k * kThreads, i = idx / kLoadLine, j = idx % kLoadLine * kVec;
    if (i < nr && j < nc) v[k] = *reinterpret_cast<const V*>(s + i * cols + j);
  }
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int idx = threadIdx.x + k * kThreads, i = idx / kLoadLine, j = idx % kLoadLine * kVec;
    if (i < nr && j < nc) {
      T e[kVec];
      memcpy(e, &v[k], sizeof(V));
#pragma unroll
      for (int q = 0; q < kVec; ++q) tile[i][j + q] = e[q];
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kStores; ++k) {
    const int idx = threadIdx.x + k * kThreads, j = idx / kStoreLine, i = idx % kStoreLine * kVec;
    if (i < nr && j < nc) {
      T e[kVec];
#pragma unroll
      for (int q = 0; q < kVec; ++q) e[q] = tile[i + q][j];
      V out;
      memcpy(&out, e, sizeof(V));
      *reinterpret_cast<V*>(d + j * rows + i) = out;
    }
  }
}

template <typename T>
__global__ void reference(const T* src, T* dst, int64_t rows, int64_t cols, int64_t images) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= images * rows * cols) return;
  const int64_t image = t / (rows * cols), r = t / cols % rows, c = t % cols;
  dst[image * rows * cols + c * rows + r] = src[t];
}

template <typename T, int kVec, int TR, int TC>
void measure(const char* name, int64_t images, int64_t rows, int64_t cols) {
  const size_t count = images * rows * cols, bytes = count * sizeof(T), flush_bytes = size_t{256} << 20;
  T *src, *dst, *expected;
  void* flush;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMalloc(&expected, bytes));
  CHECK(cudaMalloc(&flush, flush_bytes));
  std::vector<T> host(count), got(count), want(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<T>(i * 2654435761u >> 7);
  CHECK(cudaMemcpy(src, host.data(), bytes, cudaMemcpyHostToDevice));
  const dim3 grid((cols + TC - 1) / TC, (rows + TR - 1) / TR, images);
  reference<T><<<(count + 255) / 256, 256>>>(src, expected, rows, cols, images);
  CHECK(cudaMemset(dst, 0xff, bytes));
  tiles<T, kVec, TR, TC><<<grid, kThreads>>>(src, dst, rows, cols);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(want.data(), expected, bytes, cudaMemcpyDeviceToHost));
  const bool ok = std::memcmp(got.data(), want.data(), bytes) == 0;
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  constexpr int kReps = 20;
  float best = 1e9f, sum = 0.f;
  for (int r = 0; r < kReps; ++r) {
    CHECK(cudaMemsetAsync(flush, r, flush_bytes));
    CHECK(cudaEventRecord(start));
    tiles<T, kVec, TR, TC><<<grid, kThreads>>>(src, dst, rows, cols);
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    best = ms < best ? ms : best;
    sum += ms;
  }
  std::printf("%-24s images %4ld rows %5ld cols %4ld tile %3dx%-3d: best %7.1f us mean %7.1f us %5.2f TB/s %s\n",
              name, static_cast<long>(images), static_cast<long>(rows), static_cast<long>(cols), TR, TC, best * 1e3f,
              sum / kReps * 1e3f, 2.0 * bytes / (best * 1e-3) / 1e12, ok ? "ok" : "WRONG");
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  CHECK(cudaFree(expected));
  CHECK(cudaFree(flush));
}

// Back to NCHW (source rows = an image's positions, columns = its channels) with 64 or 128 positions a tile, over
// channel planes from 1.5 KB to 2 MB: whether the wide tiles' gain follows the plane's size or the tensor's.
template <typename T>
void planes(int64_t hw, int64_t c, int64_t images) {
  const char* name = sizeof(T) == 2 ? "16-bit, 8-byte vectors" : "32-bit, 16-byte vectors";
  measure<T, 16 / sizeof(T) / (sizeof(T) == 2 ? 2 : 1), 64, 64>(name, images, hw, c);
  measure<T, 16 / sizeof(T) / (sizeof(T) == 2 ? 2 : 1), 128, 64>(name, images, hw, c);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "planes") == 0) {
    // About 512 MiB of 16-bit values, 64 channels, planes of 1.5 KB to 2 MB.
    for (const int64_t hw : {784, 3072, 8192, 16384, 33800, 65536, 262144, 1052676})
      planes<uint16_t>(hw, 64, (int64_t{256} << 20) / (hw * 64) > 0 ? (int64_t{256} << 20) / (hw * 64) : 1);
    // One plane size (KernelBench 69's output, 67 KB), 66 to 528 MiB.
    for (const int64_t images : {8, 16, 32, 64}) planes<uint16_t>(33800, 128, images);
    // The layers' own outputs: Mask R-CNN's head, pose-up3, KernelBench 57 and 69, in 16 and 32 bits.
    planes<uint16_t>(784, 256, 512);
    planes<uint16_t>(3072, 256, 32);
    planes<uint16_t>(1052676, 64, 8);
    planes<uint32_t>(784, 256, 512);
    planes<uint32_t>(33800, 128, 64);
    planes<uint32_t>(1052676, 64, 8);
    for (const int64_t hw : {3072, 16384, 65536, 262144}) planes<uint32_t>(hw, 64, (int64_t{128} << 20) / (hw * 64));
    return 0;
  }
  for (const int64_t rows : {int64_t{784}, int64_t{768}}) {
    measure<uint16_t, 8, 64, 64>("16-bit, 16-byte vectors", 512, rows, 256);
    measure<uint16_t, 8, 128, 32>("16-bit, 16-byte vectors", 512, rows, 256);
    measure<uint16_t, 8, 256, 16>("16-bit, 16-byte vectors", 512, rows, 256);
    measure<uint16_t, 8, 128, 64>("16-bit, 16-byte vectors", 512, rows, 256);
    measure<uint16_t, 4, 64, 64>("16-bit, 8-byte vectors", 512, rows, 256);
    measure<uint32_t, 4, 64, 64>("32-bit, 16-byte vectors", 512, rows, 256);
    measure<uint32_t, 4, 128, 32>("32-bit, 16-byte vectors", 512, rows, 256);
    measure<uint32_t, 4, 32, 64>("32-bit, 16-byte vectors", 512, rows, 256);
  }
  return 0;
}
