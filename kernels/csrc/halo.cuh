// Shared by the halo kernel (conv_transpose2d_halo.cu) and the warp-specialized wgmma kernel
// (conv_transpose2d_wgmma.cu): tile shapes, the patch geometry and its staging copy, fast division, the launch
// plan and the device facts they are chosen by.
#pragma once

#include <cstddef>
#include <cstdint>

#include "conv_transpose2d.h"
#include "phase.cuh"

namespace deconv {

// A tile: TH x TW pixels of one stride phase x BN output channels, warps_m x warps_n warps. mma.sync tiles give
// each warp a contiguous block of BM / warps_m pixels. `ws` tiles run the warp-specialized wgmma kernel (sm_90a,
// TF32/BF16/FP16): warps_m / 4 consumer warpgroups, each owning BM / (warps_m / 4) pixels as m64 blocks (warp q
// of a group: rows 16q .. 16q + 15 of each block), and one producer warpgroup. Where a ws tile cannot run
// (halo_effective) its `fallback` runs, the mma.sync tile of the same TH x TW x BN.
struct HaloShape {
  int th, tw, bn, warps_m, warps_n;
  bool ws;
  int fallback;
};
// Index = halo configuration (tensor-core configuration kNumGatherConfigs + index).
constexpr HaloShape kHaloShapes[kNumHaloConfigs] = {
    {8, 32, 64, 4, 2, false, 0},   // 0: 256 pixels x 64 channels, 8 warps (warp tile 64 x 32)
    {16, 32, 64, 8, 2, false, 1},  // 1: 512 pixels x 64 channels, 16 warps
    {8, 32, 128, 4, 4, false, 2},  // 2: 256 pixels x 128 channels, 16 warps
    {16, 32, 32, 8, 1, false, 3},  // 3: 512 pixels x 32 channels, 8 warps
    {16, 32, 16, 8, 1, false, 4},  // 4: 512 pixels x 16 channels, 8 warps (warp tile 64 x 16)
    {8, 32, 64, 8, 1, true, 0},    // 5: warp-specialized wgmma, 256 x 64, 2 consumer warpgroups
    {8, 32, 128, 8, 1, true, 2},   // 6: warp-specialized wgmma, 256 x 128, 2 consumer warpgroups
    {16, 32, 32, 8, 1, true, 3},   // 7: warp-specialized wgmma, 512 x 32, 2 consumer warpgroups
    {16, 32, 64, 16, 1, true, 1},  // 8: warp-specialized wgmma, 512 x 64, 4 consumer warpgroups
    {2, 32, 16, 2, 1, false, 9},   // 9: 64 pixels x 16 channels, 2 warps (warp tile 32 x 16): one-image layers
};
constexpr int kMaxStages = 3;    // halo kernel: 2 when three do not fit in shared memory
constexpr int kMaxWsStages = 4;  // warp-specialized kernel
constexpr int kWsMaxStride = 8;  // the warp-specialized kernel's phase tables hold strides up to this

// Division by a divisor fixed for the whole launch, for dividends in [0, 2^31): a multiply-high, an add and a
// shift instead of a ~25-instruction integer division (the stage copies decompose every index).
struct FastDiv {
  uint32_t d, mul, shr;
};

__host__ __device__ inline FastDiv make_fast_div(uint32_t d) {
  uint32_t shr = 0;
  while ((uint64_t(1) << shr) < d) ++shr;
  const uint64_t mul = ((uint64_t(1) << 32) * ((uint64_t(1) << shr) - d)) / d + 1;
  return {d, static_cast<uint32_t>(mul), shr};
}

__device__ __forceinline__ int fdiv(int n, const FastDiv& f) {
  return static_cast<int>((__umulhi(static_cast<uint32_t>(n), f.mul) + static_cast<uint32_t>(n)) >> f.shr);
}

// Largest halo a tile's patch holds: (taps - 1) * dstep rows and columns (up to 7 x 9 dense kernels).
constexpr int kHaloH = 6;
constexpr int kHaloW = 8;
constexpr int kMaxTaps = (kHaloH + 1) * (kHaloW + 1);

// Patch strides are compile-time constants, so that every fragment load of a tap is one base register plus an
// immediate offset. Rows hold TW + kHaloW columns plus up to one vector of misalignment.
__host__ __device__ constexpr int patch_row_stride(int tw, int elem_bytes) {
  return (tw + kHaloW + 16 / elem_bytes - 1 + 16 / elem_bytes - 1) / (16 / elem_bytes) * (16 / elem_bytes);
}
__host__ __device__ constexpr int patch_channel_stride(int th, int tw, int elem_bytes) {
  return (th + kHaloH) * patch_row_stride(tw, elem_bytes) +
         ((8 - (th + kHaloH) * patch_row_stride(tw, elem_bytes) % 32) + 32) % 32;  // == 8 mod 32
}

// Host-computed launch geometry (weights sized for the phase with the most taps).
struct HaloGeom {
  int nvec;         // 16-byte vectors copied per patch row (vectorized copy)
  int patch_words;  // 32-bit words of the patch in a stage
  int stage_words;  // patch + weights
  int vec;          // 1: 16-byte cp.async copies; 0: element copies through registers
  int stages;       // pipeline depth
  FastDiv nvec_div;  // by nvec
  int extra;        // word offset in shared memory after the stages: the halo kernel's tap table (kMaxTaps
                    // kernel-tap indices) or the warp-specialized kernel's barriers
  int64_t tiles_h, tiles_w;  // tiles per image of the largest phase
  int split;        // blocks of a cluster that share a tile, each over 1/split of the stages (1: no split)
};

struct HaloPlan {
  HaloGeom geo;
  size_t smem;  // dynamic shared memory a block; ~0 when the configuration does not fit the problem
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__host__ __device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Copies one stage's patch with 16-byte cp.async (zero-filled outside x and past the group's channels): KC
// channels x ph rows x nvec vectors, threads [0, nthreads) of the copy taking v = (channel quad * ph + row) * nvec
// + vector, four channels a v. Patch row 0, column 0 is x row hi0, column wa; `ch_left` channels remain from
// x_chunk on in this group.
template <typename T, int kKC, int kRS, int kCS>
__device__ __forceinline__ void copy_patch_vec(T* patch, const T* x_chunk, const T* x_any, int tid, int nthreads,
                                               int ph, int nvec, const FastDiv& pairs_div, const FastDiv& nvec_div,
                                               int hi0, int wa, int h_in, int w_in, int64_t hw_in, int ch_left) {
  constexpr int kVec = 16 / sizeof(T);
  const int npairs = ph * nvec;
  for (int v = tid; v < kKC / 4 * npairs; v += nthreads) {
    const int cq = fdiv(v, pairs_div);
    const int pair = v - cq * npairs;
    const int row = fdiv(pair, nvec_div);
    const int vc = pair - row * nvec;
    const int hi = hi0 + row, wi = wa + vc * kVec;
    const bool in = hi >= 0 && hi < h_in && wi >= 0 && wi < w_in;
    const T* src = x_chunk + int64_t(4 * cq) * hw_in + (hi * w_in + wi);
    T* dst = patch + 4 * cq * kCS + row * kRS + vc * kVec;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = in && 4 * cq + j < ch_left;
      cp_async16(dst + j * kCS, ok ? src + j * hw_in : x_any, ok ? 16 : 0);
    }
  }
}

// Host side (conv_transpose2d_halo.cu).
size_t max_dynamic_smem();  // opt-in shared memory per block of the current device
int sm_count();             // multiprocessors of the current device
HaloPlan halo_plan(const ConvTranspose2dParams& p, int config);

// The warp-specialized kernel for ws configuration `config` (conv_transpose2d_wgmma.cu), weights packed K-major.
cudaError_t launch_halo_ws(const ConvTranspose2dParams& p, int config, const HaloPlan& pl, const uint32_t* wt,
                           int64_t ciw_pad, int64_t co_pad, cudaStream_t stream);

}  // namespace deconv
