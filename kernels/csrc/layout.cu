// Memory-layout changes between NCHW and channels-last (NHWC) for the binding: an input laid out for another kernel
// family than the one that runs, and an output staged in the layout a kernel writes best (docs/architecture.md,
// "Kernels"). Both directions are a batched 2-D transpose: per image, [rows][cols] -> [cols][rows], with rows = C
// and cols = H * W for NCHW -> NHWC, and the other way round. Tiles of 64 rows x kCols columns go through shared
// memory so that reads (along a row) and writes (along a column) are both runs along memory; the element is moved as
// raw bits (2, 4 or 8 bytes). Where both sides allow it (rows and columns multiples of a vector, both tensors aligned
// to it: most layers), transpose_batched_vec moves 64 x 64 tiles (back to NCHW, mostly 128 positions x 64 channels:
// wide_tiles) as 16-byte (fp32), 8- or 4-byte vectors: more bytes in flight a thread and fewer memory instructions
// than the element-wise tiles (bench/NOTES.md v28, v29, v37).
// kCols is 8 or 16 for images of that few positions (a DCGAN's 4 x 4), where 32-column tiles would leave most
// threads idle. Tensors of at most 8 channels (an RGB or one-channel output, its input) skip the tiles, which would
// be at most 8 of 64 rows full: a thread moves the channels of one position. kRound (fp32 bits) rounds each value to
// TF32 on the way: an input bound for the gemm kernel's TF32 products, which then need not round it in shared memory
// (ConvTranspose2dParams::x_tf32_rounded); round_to_tf32 does the same for an x that keeps its layout.
#include <cstdint>
#include <cstring>

#include "conv_transpose2d.h"
#include "mma.cuh"

namespace deconv {
namespace {

constexpr int kTileRows = 64;
constexpr int kThreads = 256;

// The element as it is stored: its bits, or with kRound (fp32 bits) rounded to TF32.
template <bool kRound, typename T>
__device__ __forceinline__ T moved(T v) {
  if constexpr (kRound) {
    static_assert(sizeof(T) == 4, "TF32 rounding takes fp32 bits");
    return tc::to_tf32(__uint_as_float(v));
  } else {
    return v;
  }
}

// This block's tile of a batched transpose (tiles of kTileR x kTileC; grid: column tiles, row tiles, images): its
// first element in the source and the destination, and how many of its rows and columns lie inside the image.
template <typename T, int kTileR, int kTileC>
struct Tile {
  const T* src;
  T* dst;
  int rows, cols;
  __device__ __forceinline__ Tile(const T* s, T* d, int64_t n_rows, int64_t n_cols) {
    const int64_t image = blockIdx.z;
    const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileC, r0 = static_cast<int64_t>(blockIdx.y) * kTileR;
    src = s + image * n_rows * n_cols + r0 * n_cols + c0;
    dst = d + image * n_rows * n_cols + c0 * n_rows + r0;
    rows = static_cast<int>(n_rows - r0 < kTileR ? n_rows - r0 : kTileR);
    cols = static_cast<int>(n_cols - c0 < kTileC ? n_cols - c0 : kTileC);
  }
};

template <typename T, int kCols, bool kRound>
__global__ void __launch_bounds__(kThreads)
    transpose_batched(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int64_t cols) {
  // Rows padded to an odd number of 32-bit words (2-byte and 4-byte elements): the column reads of the write phase
  // hit different banks.
  constexpr int kPitch = kCols + (sizeof(T) == 2 ? 2 : 1);
  constexpr int kPerThread = kTileRows * kCols / kThreads;
  __shared__ T tile[kTileRows][kPitch];
  const Tile<T, kTileRows, kCols> at(src, dst, rows, cols);
  const T* s = at.src;
  T* d = at.dst;
  const int nr = at.rows, nc = at.cols;
  T v[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {  // consecutive threads along a row of the source
    const int idx = threadIdx.x + k * kThreads, i = idx / kCols, j = idx % kCols;
    if (i < nr && j < nc) v[k] = s[i * cols + j];
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int idx = threadIdx.x + k * kThreads, i = idx / kCols, j = idx % kCols;
    tile[i][j] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {  // consecutive threads along a row of the destination
    const int idx = threadIdx.x + k * kThreads, j = idx / kTileRows, i = idx % kTileRows;
    if (i < nr && j < nc) d[j * rows + i] = moved<kRound>(tile[i][j]);
  }
}

// The unsigned type of a vector of kBytes.
template <int kBytes>
struct VecOf;
template <>
struct VecOf<4> {
  using type = uint32_t;
};
template <>
struct VecOf<8> {
  using type = uint2;
};
template <>
struct VecOf<16> {
  using type = uint4;
};

constexpr int kVecTile = 64;  // columns of transpose_batched_vec's tile, and its rows but for kWideRows

// Source rows a tile for a change back to NCHW (rows = positions): each destination plane gets runs of 128 positions,
// not 64. Measured on an H200 over planes of 784 to 1052676 positions (bench/kernels/layout_tiles.cu planes,
// bench/NOTES.md v37): fp32 values took 0.83-0.93x the time of 64-row tiles on every plane; 16-bit values took
// 0.79-0.97x where a plane's bytes are not a multiple of a 32-byte sector (so that a run's first and last sectors
// are shared with the neighbouring tiles' runs), and 1.11-1.24x where they are.
constexpr int kWideRows = 128;
template <typename T>
bool wide_tiles(int64_t hw, bool to_channels_last) {
  return !to_channels_last && (sizeof(T) == 4 || hw * static_cast<int64_t>(sizeof(T)) % 32 != 0);
}

// transpose_batched with kVec elements a memory access on both sides, on tiles of kRows source rows x 64 source
// columns. The caller guarantees rows % kVec == 0, cols % kVec == 0 and src, dst aligned to kVec * sizeof(T), so
// every vector lies whole inside or outside a tile. A thread loads kVec consecutive elements of a source row, and
// stores kVec consecutive elements of a destination row gathered from a column of the tile.
template <typename T, int kVec, bool kRound, int kRows>
__global__ void __launch_bounds__(kThreads)
    transpose_batched_vec(const T* __restrict__ src, T* __restrict__ dst, int64_t rows, int64_t cols) {
  using V = typename VecOf<kVec * static_cast<int>(sizeof(T))>::type;
  constexpr int kLoadLine = kVecTile / kVec;  // vectors along a tile's row (loads)
  constexpr int kStoreLine = kRows / kVec;    // vectors along a tile's column (stores)
  constexpr int kLoads = kRows * kLoadLine / kThreads, kStores = kVecTile * kStoreLine / kThreads;
  static_assert(kLoads >= 1 && kRows * kLoadLine % kThreads == 0, "whole vectors per thread");
  static_assert(kStores >= 1 && kVecTile * kStoreLine % kThreads == 0, "whole vectors per thread");
  // Rows padded by one 32-bit word: a warp's stores into a row, and its column reads, spread over the banks.
  constexpr int kPitch = kVecTile + (sizeof(T) == 2 ? 2 : 1);
  __shared__ T tile[kRows][kPitch];
  const Tile<T, kRows, kVecTile> at(src, dst, rows, cols);
  const T* s = at.src;
  T* d = at.dst;
  const int nr = at.rows, nc = at.cols;
  V v[kLoads];
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {  // consecutive threads along a row of the source
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
  for (int k = 0; k < kStores; ++k) {  // consecutive threads along a row of the destination
    const int idx = threadIdx.x + k * kThreads, j = idx / kStoreLine, i = idx % kStoreLine * kVec;
    if (i < nr && j < nc) {
      T e[kVec];
#pragma unroll
      for (int q = 0; q < kVec; ++q) e[q] = moved<kRound>(tile[i + q][j]);
      V out;
      memcpy(&out, e, sizeof(V));
      *reinterpret_cast<V*>(d + j * rows + i) = out;
    }
  }
}

constexpr int64_t kFewChannels = 8;

// NCHW <-> NHWC for c <= kFewChannels: thread p of an image moves position p's c elements. A warp reads (or writes)
// 32 consecutive positions of a channel plane and writes (or reads) 32 * c consecutive elements.
template <typename T, bool kRound>
__global__ void __launch_bounds__(kThreads)
    transpose_few_channels(const T* __restrict__ src, T* __restrict__ dst, int64_t hw, int c, bool to_channels_last) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (p >= hw) return;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * hw * c;
  const T* s = src + base;
  T* d = dst + base;
  if (to_channels_last) {
    for (int k = 0; k < c; ++k) d[p * c + k] = moved<kRound>(s[k * hw + p]);
  } else {
    for (int k = 0; k < c; ++k) d[k * hw + p] = moved<kRound>(s[p * c + k]);
  }
}

template <typename T, bool kRound>
cudaError_t launch_few_channels(const void* src, void* dst, int64_t images, int64_t c, int64_t hw,
                                bool to_channels_last, cudaStream_t stream) {
  const int64_t blocks = (hw + kThreads - 1) / kThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t per_image = c * hw;
  for (int64_t first = 0; first < images; first += 65535) {  // at most 65535 images a launch (the grid's y)
    const int64_t count = images - first < 65535 ? images - first : 65535;
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(count));
    transpose_few_channels<T, kRound><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(src) + first * per_image, static_cast<T*>(dst) + first * per_image, hw,
        static_cast<int>(c), to_channels_last);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// A batched transpose kernel (src, dst, rows, cols) over tiles of kTileR x kTileC: grid (column tiles, row tiles,
// images), at most 65535 images a launch (the grid's z); larger batches go in slices.
template <typename T, int kTileR, int kTileC>
cudaError_t launch_tiles(void (*kernel)(const T*, T*, int64_t, int64_t), const void* src, void* dst, int64_t images,
                         int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t col_tiles = (cols + kTileC - 1) / kTileC, row_tiles = (rows + kTileR - 1) / kTileR;
  if (col_tiles > INT32_MAX || row_tiles > 65535) return cudaErrorInvalidValue;
  const int64_t per_image = rows * cols;
  for (int64_t first = 0; first < images; first += 65535) {
    const int64_t count = images - first < 65535 ? images - first : 65535;
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles), static_cast<unsigned>(count));
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(src) + first * per_image,
                                          static_cast<T*>(dst) + first * per_image, rows, cols);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T, int kCols, bool kRound>
cudaError_t launch_transpose_cols(const void* src, void* dst, int64_t images, int64_t rows, int64_t cols,
                                  cudaStream_t stream) {
  return launch_tiles<T, kTileRows, kCols>(transpose_batched<T, kCols, kRound>, src, dst, images, rows, cols, stream);
}

template <typename T, int kVec, bool kRound>
cudaError_t launch_transpose_vec(const void* src, void* dst, int64_t images, int64_t rows, int64_t cols, bool wide,
                                 cudaStream_t stream) {
  if (wide)
    return launch_tiles<T, kWideRows, kVecTile>(transpose_batched_vec<T, kVec, kRound, kWideRows>, src, dst, images,
                                                rows, cols, stream);
  return launch_tiles<T, kVecTile, kVecTile>(transpose_batched_vec<T, kVec, kRound, kVecTile>, src, dst, images, rows,
                                             cols, stream);
}

// The widest vector (16 bytes for fp32, 8 for 16-bit values, then 8 and 4 bytes, at least two elements) that
// divides rows and cols and both addresses, in elements; 0 when none does, the image is too small for 64 x 64 tiles
// to pay (fewer than 32 rows or columns), or the elements are 8 bytes (fp64: not a speed target; its 64 x 64 tile
// would take 33 KB of shared memory). 16-bit values move as 8-byte vectors at most: with 16-byte ones the same tiles
// ran up to 1.9x slower (Mask R-CNN's 512 x [784][256] output, 214 against 113 us on an H200; bench/NOTES.md v29).
template <typename T>
int vector_elements(const void* src, const void* dst, int64_t rows, int64_t cols) {
  if (sizeof(T) > 4 || rows < 32 || cols < 32) return 0;
  const uintptr_t both = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  for (int bytes = sizeof(T) == 2 ? 8 : 16; bytes >= 4 && bytes >= static_cast<int>(sizeof(T)); bytes /= 2) {
    const int n = bytes / static_cast<int>(sizeof(T));
    if (n >= 2 && rows % n == 0 && cols % n == 0 && both % bytes == 0) return n;
  }
  return 0;
}

template <typename T, bool kRound>
cudaError_t launch_transpose(const void* src, void* dst, int64_t images, int64_t c, int64_t hw,
                             bool to_channels_last, cudaStream_t stream) {
  if (c == 1 && !kRound) {  // the same bits in both layouts
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(images * hw) * sizeof(T), cudaMemcpyDeviceToDevice, stream);
  }
  if (c <= kFewChannels) return launch_few_channels<T, kRound>(src, dst, images, c, hw, to_channels_last, stream);
  const int64_t rows = to_channels_last ? c : hw, cols = to_channels_last ? hw : c;
  const bool wide = wide_tiles<T>(hw, to_channels_last);
  switch (vector_elements<T>(src, dst, rows, cols)) {
    case 4:
      if constexpr (sizeof(T) <= 4)
        return launch_transpose_vec<T, 4, kRound>(src, dst, images, rows, cols, wide, stream);
      break;
    case 2:
      if constexpr (sizeof(T) <= 4)
        return launch_transpose_vec<T, 2, kRound>(src, dst, images, rows, cols, wide, stream);
      break;
  }
  if (cols <= 8) return launch_transpose_cols<T, 8, kRound>(src, dst, images, rows, cols, stream);
  if (cols <= 16) return launch_transpose_cols<T, 16, kRound>(src, dst, images, rows, cols, stream);
  return launch_transpose_cols<T, 32, kRound>(src, dst, images, rows, cols, stream);
}

// dst = src rounded to TF32, `count` fp32 values; 16-byte vectors where both addresses allow (a grid-stride loop).
__global__ void __launch_bounds__(kThreads)
    round_tf32_copy(const uint32_t* __restrict__ src, uint32_t* __restrict__ dst, int64_t count, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {
    const int64_t vecs = count / 4;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (int64_t v = i; v < vecs; v += stride) {
      const uint4 a = s4[v];
      d4[v] = {moved<true>(a.x), moved<true>(a.y), moved<true>(a.z), moved<true>(a.w)};
    }
    i += vecs * 4;  // the tail past the last whole vector
  }
  for (; i < count; i += stride) dst[i] = moved<true>(src[i]);
}

}  // namespace

cudaError_t round_to_tf32(const void* src, void* dst, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const bool vec = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int64_t work = vec ? (count + 3) / 4 : count;
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  // A few waves of blocks at most; each thread loops over the rest.
  const unsigned grid = static_cast<unsigned>(blocks < 8192 ? blocks : 8192);
  round_tf32_copy<<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst),
                                                 count, vec);
  return cudaGetLastError();
}

cudaError_t convert_layout(const void* src, void* dst, int64_t N, int64_t C, int64_t HW, int elem_bytes,
                           bool to_channels_last, bool round_tf32, cudaStream_t stream) {
  if (round_tf32 && elem_bytes != 4) return cudaErrorInvalidValue;
  if (N <= 0 || C <= 0 || HW <= 0) return cudaSuccess;
  switch (elem_bytes) {
    case 2:
      return launch_transpose<uint16_t, false>(src, dst, N, C, HW, to_channels_last, stream);
    case 4:
      return round_tf32 ? launch_transpose<uint32_t, true>(src, dst, N, C, HW, to_channels_last, stream)
                        : launch_transpose<uint32_t, false>(src, dst, N, C, HW, to_channels_last, stream);
    case 8:
      return launch_transpose<uint64_t, false>(src, dst, N, C, HW, to_channels_last, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv
