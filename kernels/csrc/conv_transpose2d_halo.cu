// ConvTranspose2d forward on tensor cores with halo tiles: the stride-phase implicit GEMM of
// conv_transpose2d_mma.cu, restructured so that every input element is fetched from global memory once per
// block instead of once per tap.
//
// A block computes a TH x TW tile of one phase's output pixels (one image) for BN output channels of one group.
// For pixel (qh, qw) of a phase and tap (th, tw) the input read is x[hi, wi] with hi = qh + base_h - th * dstep_h
// (phase.cuh), so the whole tile, over all the phase's taps, reads one rectangle of x: rows
// [qh0 + base_h - (taps_h - 1) * dstep_h, qh0 + base_h + TH) and likewise for columns. Per stage of KC input
// channels (8 fp32 or 16 16-bit values = 8 K words) the block copies that rectangle (the "patch") and the packed
// weights of every tap into shared memory with 16-byte cp.async (zero-filled outside x), then runs every tap
// on it: a tap is a shifted window of the patch, so the A fragments of tap (th, tw) are the patch read at a
// constant offset. Stages form a 3-deep cp.async pipeline (2-deep when three do not fit in shared memory).
//
// Shared-memory layout of a stage: patch [KC][TH + kHaloH][RS] elements (compile-time strides; channel stride
// CS = 8 mod 32 elements, so the 4 channels and 8 pixels of an mma fragment load hit 32 distinct banks; rows
// start 16-byte aligned), then weights [tap][8 words][BN + 8] words (8 or 24 mod 32: conflict-free B fragments;
// packed as in conv_transpose2d_mma.cu, 16-bit channel pairs per word).
// The fp32 A fragments are read one word per element; the 16-bit ones pair two channels (two 16-bit loads and
// a byte permute per register).
//
// The epilogue stages accumulators through shared memory and writes each output row segment of the tile with
// neighbouring threads on neighbouring pixels (coalesced for stride_w == 1), bias fused.
//
// Split-K over a thread-block cluster (sm_90+): when the tiles alone would leave most SMs idle (one image, a few
// tiles a phase), `split` blocks of a cluster (grid x = tiles x split, cluster (split, 1, 1)) compute the same
// tile over disjoint ranges of input-channel stages. Each stages its partial sums in its own shared memory; after
// a cluster barrier, block r reduces channels [r, r + 1) x nc / split of the tile by reading every block's
// partial sums through distributed shared memory, always in rank order (deterministic), adds the bias and
// writes them; a second barrier keeps each block's shared memory alive until the others have read it. No
// workspace and no atomics.
//
// When rows of x are not 16-byte aligned (W_in not a multiple of 16 / sizeof(T)) the patch is copied element by
// element through registers instead (same tile, slower loads). Halos beyond kHaloH x kHaloW (taps - 1 times the
// dilation step) and stages that do not fit in shared memory are not eligible: tensor_core_config falls back to
// the gather kernel.
//
// This file also chooses among the halo configurations (halo.cuh): on sm_90, TF32/BF16/FP16 layers whose tiles
// fill the SMs run the same tiles warp-specialized on wgmma (conv_transpose2d_wgmma.cu), the rest these mma.sync
// tiles.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cooperative_groups.h>

#include <atomic>
#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "phase.cuh"

namespace deconv {
namespace {

// Barrier over the block's cluster (split-K); the host launches clusters only for sm_90 code.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// Block `rank`'s copy of a shared-memory address in this cluster.
__device__ __forceinline__ const float* cluster_shared(const float* ptr, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(const_cast<float*>(ptr), rank);
#else
  return ptr;
#endif
}

template <typename T, tc::MmaKind K, int TH, int TW, int BN, int WARPS_M, int WARPS_N>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32, 1)
    conv_transpose2d_halo_kernel(const ConvTranspose2dParams p, const uint32_t* __restrict__ wt, int64_t ciw_pad,
                                 int64_t co_pad, const HaloGeom geo) {
  using tc::MmaKind;
  constexpr int kThreads = WARPS_M * WARPS_N * 32;
  constexpr int BM = TH * TW;
  constexpr int kWarpM = BM / WARPS_M;
  constexpr int kWarpN = BN / WARPS_N;
  constexpr int kMT = kWarpM / 16;
  constexpr int kNT = kWarpN / 8;
  constexpr int kKC = sizeof(T) == 4 ? 8 : 16;  // input channels per stage (8 K words)
  constexpr int kVec = 16 / sizeof(T);          // elements per 16-byte copy
  constexpr int kWS = BN + 8;                   // weight row stride (words), == 8 mod 32
  constexpr int kCStride = BM + 4;
  constexpr int kBRowVecs = BN / 4;
  constexpr int kRS = patch_row_stride(TW, sizeof(T));          // patch row stride (elements)
  constexpr int kCS = patch_channel_stride(TH, TW, sizeof(T));  // patch channel stride (elements)
  static_assert(TW % 16 == 0 && kWarpM % 16 == 0 && kWarpN % 8 == 0, "warp tile");
  static_assert(kWS % 32 == 8 || kWS % 32 == 24, "weight rows must be 8 or 24 mod 32 words");

  extern __shared__ __align__(16) uint32_t smem[];
  float* Cs = reinterpret_cast<float*>(smem);  // [BN][kCStride], after the main loop

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % WARPS_M;
  const int wn = warp / WARPS_M;
  const int g8 = lane >> 2;
  const int t4 = lane & 3;

  const int64_t cin_g = p.C_in / p.groups;
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t hw_out = p.H_out * p.W_out;
  const int64_t num_z = p.stride_h * p.stride_w * p.groups;
  const int64_t tiles_img = geo.tiles_h * geo.tiles_w;
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
  // Split-K: this block's rank in its cluster (clusters are `split` consecutive blocks along x).
  const int split = geo.split;
  const int rank = static_cast<int>(blockIdx.x % split);
  static_assert(kWarpM % TW == 0 || TW % kWarpM == 0, "a warp's pixels start a tile row or stay in one");
  // This thread's first fragment pixel in the patch; m16 tile i adds pixel_offset(i).
  const int a_base = ((wm * kWarpM) / TW) * kRS + (wm * kWarpM) % TW + g8;
  auto pixel_offset = [&](int i) {
    const int m = (wm * kWarpM) % TW + i * 16;  // the tile's first pixel, counted from the warp's tile row
    return (m / TW) * kRS + m % TW - (wm * kWarpM) % TW;
  };

  // Work items (spatial tile, channel tile, phase and group), phase and group fastest: the stride phases of one
  // output region, then its channel tiles, run on neighbouring blocks at the same time, so that their shared input
  // patch is read from DRAM once and the output sectors that the phases each write a part of are completed in L2
  // (bench/NOTES.md v12). The phase's set-up below is redone per item: integer work and two barriers, small
  // against a tile's stages.
  const int64_t n_tiles = tc::div_up(cout_g, BN);
  const int64_t items = p.N * tiles_img * n_tiles * num_z;
  for (int64_t item = blockIdx.x / split; item < items; item += gridDim.x / split) {
    const int64_t z = item % num_z;
    const int64_t nt = (item / num_z) % n_tiles;
    const int64_t bx = item / num_z / n_tiles;
    const int64_t grp = z % p.groups;
    const int64_t phase = z / p.groups;
    const AxisPhase ah = make_axis_phase(phase / p.stride_w, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
    const AxisPhase aw = make_axis_phase(phase % p.stride_w, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
    if (ah.count == 0 || aw.count == 0) continue;
    const int taps_h = static_cast<int>(ah.taps), taps_w = static_cast<int>(aw.taps);
    const int taps = taps_h * taps_w;
    const int dstep_h = static_cast<int>(ah.dstep), dstep_w = static_cast<int>(aw.dstep);
    const int ph = TH + (taps_h > 0 ? taps_h - 1 : 0) * dstep_h;      // patch rows of this phase
    const int pw = TW + (taps_w > 0 ? taps_w - 1 : 0) * dstep_w;      // patch columns of this phase
    const int64_t tiles_h = tc::div_up(ah.count, TH), tiles_w = tc::div_up(aw.count, TW);
    const int nchunks = taps > 0 ? static_cast<int>(tc::div_up(cin_g, kKC)) : 0;
    // This block's stages: [c_lo, c_lo + nloc) of the nchunks (all of them without a split).
    const int c_lo = static_cast<int>(int64_t(rank) * nchunks / split);
    const int nloc = static_cast<int>(int64_t(rank + 1) * nchunks / split) - c_lo;
    const FastDiv pairs_div = make_fast_div(ph * geo.nvec);
    const int a0 = static_cast<int>(ah.a0), b0 = static_cast<int>(aw.a0);
    const int step_h = static_cast<int>(ah.step), step_w = static_cast<int>(aw.step);
    const int k_w = static_cast<int>(p.kW);
    // The phase's taps as kernel-tap indices a * kW + b, tap t = (th, tw) at t = th * taps_w + tw: the weight
    // copies of every stage look them up instead of decomposing t.
    int* tap_table = reinterpret_cast<int*>(smem + geo.extra);
    __syncthreads();  // the previous item is done with the table
    for (int t = tid; t < taps; t += kThreads) {
      const int th = t / taps_w;
      tap_table[t] = (a0 + th * step_h) * k_w + b0 + (t - th * taps_w) * step_w;
    }
    __syncthreads();

    const int64_t n0 = nt * BN;
    const uint32_t* wt_grp = wt + grp * p.kH * p.kW * ciw_pad * co_pad + n0;
    const int64_t img = bx / tiles_img;
    const int64_t rem = bx - img * tiles_img;
    const int64_t tile_h = rem / geo.tiles_w;
    const int64_t tile_w = rem - tile_h * geo.tiles_w;
    if (tile_h >= tiles_h || tile_w >= tiles_w) continue;  // a smaller phase: nothing here
    const int qh0 = static_cast<int>(tile_h * TH), qw0 = static_cast<int>(tile_w * TW);
    const int hi0 = qh0 + static_cast<int>(ah.base) - (taps_h > 0 ? taps_h - 1 : 0) * dstep_h;
    const int wi0 = qw0 + static_cast<int>(aw.base) - (taps_w > 0 ? taps_w - 1 : 0) * dstep_w;
    const int wa = geo.vec ? floor_div(wi0, kVec) * kVec : wi0;  // first column copied
    const int shift = wi0 - wa;
    const T* x_img = x + (img * p.C_in + grp * cin_g) * hw_in;

    auto load_stage = [&](int c, int buf) {
      uint32_t* st = smem + buf * geo.stage_words;
      T* patch = reinterpret_cast<T*>(st);
      const int ci0 = c * kKC;
      const T* x_chunk = x_img + int64_t(ci0) * hw_in;
      if (geo.vec) {
        copy_patch_vec<T, kKC, kRS, kCS>(patch, x_chunk, x, tid, kThreads, ph, geo.nvec, pairs_div, geo.nvec_div,
                                         hi0, wa, h_in, w_in, hw_in, static_cast<int>(cin_g - ci0));
      } else {
        const int per_ch = ph * pw;
        for (int e = tid; e < kKC * per_ch; e += kThreads) {
          const int ch = e / per_ch;
          const int r = e - ch * per_ch;
          const int row = r / pw;
          const int col = r - row * pw;
          const int hi = hi0 + row, wi = wa + col;
          const bool ok = ci0 + ch < cin_g && hi >= 0 && hi < h_in && wi >= 0 && wi < w_in;
          T v = ok ? x_chunk[int64_t(ch) * hw_in + (hi * w_in + wi)] : from_acc<T>(0.f);
          patch[ch * kCS + row * kRS + col] = v;
        }
      }
      // Weights: v = (t * 8 + k) * (BN / 4) + column vector; 8 * BN / 4 is a power of two.
      uint32_t* wsm = st + geo.patch_words;
      const uint32_t* w_chunk = wt_grp + int64_t(c) * 8 * co_pad;
      for (int v = tid; v < taps * 8 * kBRowVecs; v += kThreads) {
        const int t = v / (8 * kBRowVecs);
        const int r = v - t * (8 * kBRowVecs);
        const int k = r / kBRowVecs;
        const int col = (r - k * kBRowVecs) * 4;
        const int64_t tap = tap_table[t];
        cp_async16(wsm + (t * 8 + k) * kWS + col, w_chunk + (tap * ciw_pad + k) * co_pad + col, 16);
      }
    };

    // Exact fp32 runs each stage into `part` and adds it to `acc` (tc::add_tile says why).
    constexpr bool kPartial = K == MmaKind::k3xTF32;
    float acc[kMT][kNT][4];
    float part[kPartial ? kMT : 1][kPartial ? kNT : 1][4];
    tc::zero_tile(acc);

    // Fragments of tap t: B from the stage's weights, A from the patch at the tap's offset.
    auto load_frags = [&](const uint32_t* st, const uint32_t* wsm, int t, int off, uint32_t (&af)[kMT][4],
                          uint32_t (&bf)[kNT][2]) {
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        bf[j][0] = wsm[t * 8 * kWS + j * 8];
        bf[j][1] = wsm[t * 8 * kWS + 4 * kWS + j * 8];
      }
      if constexpr (sizeof(T) == 4) {
        const uint32_t* pa = st + t4 * kCS + a_base + off;
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
          const int o = pixel_offset(i);
          af[i][0] = pa[o];
          af[i][1] = pa[o + 8];
          af[i][2] = pa[4 * kCS + o];
          af[i][3] = pa[4 * kCS + o + 8];
        }
      } else {
        const uint16_t* pa = reinterpret_cast<const uint16_t*>(st) + 2 * t4 * kCS + a_base + off;
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
          const int o = pixel_offset(i);
          af[i][0] = __byte_perm(pa[o], pa[kCS + o], 0x5410);
          af[i][1] = __byte_perm(pa[o + 8], pa[kCS + o + 8], 0x5410);
          af[i][2] = __byte_perm(pa[8 * kCS + o], pa[9 * kCS + o], 0x5410);
          af[i][3] = __byte_perm(pa[8 * kCS + o + 8], pa[9 * kCS + o + 8], 0x5410);
        }
      }
    };
    auto mma_tap = [&](uint32_t (&af)[kMT][4], uint32_t (&bf)[kNT][2]) {
      if constexpr (K == MmaKind::kTF32) {  // x is staged as fp32; the packed weights are rounded already
#pragma unroll
        for (int i = 0; i < kMT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) af[i][e] = tc::to_tf32(__uint_as_float(af[i][e]));
      }
      if constexpr (kPartial) {
        tc::mma_warp_tile<K>(part, af, bf);
      } else {
        tc::mma_warp_tile<K>(acc, af, bf);
      }
    };

    const int stages = geo.stages;
    for (int s = 0; s < stages - 1; ++s) {
      if (s < nloc) load_stage(c_lo + s, s);
      cp_async_commit();
    }
    for (int c = 0; c < nloc; ++c) {
      if (stages == 3) {
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // stage c landed for everyone; stage c - 1's buffer is free
      {
        const int nxt = c + stages - 1;
        if (nxt < nloc) load_stage(c_lo + nxt, nxt % stages);
        cp_async_commit();
      }
      const uint32_t* st = smem + (c % stages) * geo.stage_words;
      const uint32_t* wsm = st + geo.patch_words + t4 * kWS + wn * kWarpN + g8;
      uint32_t af[kMT][4], bf[kNT][2];
      int tw = 0;
      int off = (taps_h - 1) * dstep_h * kRS + (taps_w - 1) * dstep_w + shift;  // tap 0's patch offset
      auto advance = [&]() {
        ++tw;
        off -= dstep_w;
        if (tw == taps_w) {
          tw = 0;
          off += taps_w * dstep_w - dstep_h * kRS;
        }
      };
      if constexpr (kPartial) tc::zero_tile(part);
      for (int t = 0; t < taps; ++t) {
        load_frags(st, wsm, t, off, af, bf);
        mma_tap(af, bf);
        advance();
      }
      if constexpr (kPartial) tc::add_tile(acc, part);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: Cs aliases them

    // Epilogue: accumulators -> shared [channel][pixel] -> bias, convert, NCHW row segments.
    tc::stage_accumulators(Cs, kCStride, acc, wm * kWarpM, wn * kWarpN, g8, t4);
    if (split > 1) {
      cluster_sync();  // every block's partial sums are staged
    } else {
      __syncthreads();
    }
    // A thread owns pixels (neighbouring threads: neighbouring pixels of a row) and walks channels, so the
    // pixel's address is computed once and a warp stores 32 neighbouring pixels per channel.
    constexpr int kPixThreads = BM < kThreads ? BM : kThreads;
    T* y_blk = y + (img * p.C_out + grp * cout_g + n0) * hw_out;
    const int nc_max = static_cast<int>(cout_g - n0 < BN ? cout_g - n0 : BN);
    // With a split, this block writes its share of the channels, summing every block's partial sums.
    const int nc_lo = rank * nc_max / split, nc_hi = (rank + 1) * nc_max / split;
    for (int m = tid % kPixThreads; m < BM; m += kPixThreads) {
      const int qh = qh0 + m / TW, qw = qw0 + m % TW;
      if (qh >= ah.count || qw >= aw.count) continue;
      T* y_pix = y_blk + (ah.o0 + int64_t(qh) * p.stride_h) * p.W_out + aw.o0 + int64_t(qw) * p.stride_w;
      for (int nc = nc_lo + tid / kPixThreads; nc < nc_hi; nc += kThreads / kPixThreads) {
        float v;
        if (split > 1) {
          v = 0.f;
          for (int q = 0; q < split; ++q) v += cluster_shared(Cs, q)[nc * kCStride + m];
        } else {
          v = Cs[nc * kCStride + m];
        }
        if (bias != nullptr) v += to_acc(bias[grp * cout_g + n0 + nc]);
        y_pix[nc * hw_out] = from_acc<T>(v);
      }
    }
    if (split > 1) {
      cluster_sync();  // the other blocks have read this block's Cs, which the next tile's stages overwrite
    } else {
      __syncthreads();  // Cs aliases the next tile's stages
    }
  }
}

int max_taps(int64_t stride, int64_t out_size, int64_t pad, int64_t dil, int64_t k) {
  int64_t best = 0;
  for (int64_t r = 0; r < stride; ++r) {
    const AxisPhase ax = make_axis_phase(r, out_size, stride, pad, dil, k);
    if (ax.taps > best) best = ax.taps;
  }
  return static_cast<int>(best);
}

// Attribute `A` of the current device, queried once per device (-1 when the query fails).
template <cudaDeviceAttr A>
int device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // value + 1; 0: not asked yet
  int dev = 0, value = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  if (dev < kMaxDevices && (value = cached[dev].load(std::memory_order_relaxed)) > 0) return value - 1;
  if (cudaDeviceGetAttribute(&value, A, dev) != cudaSuccess) return -1;
  if (dev < kMaxDevices) cached[dev].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace

size_t max_dynamic_smem() {
  const int bytes = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  return bytes > 0 ? static_cast<size_t>(bytes) : 0;
}

int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

namespace {

constexpr int kMaxSplit = 8;  // the portable cluster size

// Split-K factor for a launch of `blocks` tiles x channel blocks x phases (measured on an H200, bench/NOTES.md v9):
// - up to an eighth of the SMs busy: as many blocks a tile as fill the SMs, at most kMaxSplit, even beyond the
//   number of stages (a block without a stage still reduces its share of the channels);
// - up to half of them: as many as fill the SMs while every block keeps at least 4 stages (with fewer, the
//   extra prologue and the reduction cost more than the parallel stages gain);
// - more: no split. `force_split` (tests, tuning) > 0 asks for that many.
int halo_split(const ConvTranspose2dParams& p, int64_t blocks) {
  if (p.force_split > 0) return p.force_split < kMaxSplit ? p.force_split : kMaxSplit;
  const int64_t nchunks = tc::div_up(p.C_in / p.groups, p.dtype == DType::kFloat32 ? 8 : 16);
  const int64_t sms = sm_count();
  if (blocks <= 0 || 2 * blocks > sms) return 1;
  int64_t split = sms / blocks;
  if (split > kMaxSplit) split = kMaxSplit;
  if (8 * blocks > sms && split > nchunks / 4) split = nchunks / 4;
  return split >= 2 ? static_cast<int>(split) : 1;
}

// Whether the current device can run the warp-specialized wgmma kernel for this problem's precision: not exact
// fp32, an sm_90 device, and kernels built with sm_90a code (kernels/build.py defines DECONV_SM90A_SASS then; a
// compute capability 9.0 GPU runs that machine code rather than JIT-compiled PTX).
bool wgmma_device(const ConvTranspose2dParams& p) {
#if defined(DECONV_SM90A_SASS)
  return !(p.dtype == DType::kFloat32 && p.precision != Precision::kTF32) &&
         device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9 &&
         device_attribute<cudaDevAttrComputeCapabilityMinor>() == 0;
#else
  (void)p;
  return false;
#endif
}

// The halo configuration that runs for `config`: config itself, or the fallback of a warp-specialized tile that
// cannot run here (wgmma_device), lacks what it needs (16-byte aligned input rows, strides up to kWsMaxStride,
// tile indices in 31 bits) or would leave the SMs idle without the halo kernel's split.
int halo_effective(const ConvTranspose2dParams& p, int config) {
  const HaloShape& s = kHaloShapes[config];
  if (!s.ws) return config;
  const int64_t vec_elems = p.dtype == DType::kFloat32 ? 4 : 8;
  if (!wgmma_device(p) || p.W_in % vec_elems != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0 ||
      p.stride_h > kWsMaxStride || p.stride_w > kWsMaxStride)
    return s.fallback;
  const int64_t spatial = p.N * tc::div_up(tc::div_up(p.H_out, p.stride_h), s.th) *
                          tc::div_up(tc::div_up(p.W_out, p.stride_w), s.tw);
  const int64_t blocks = spatial * tc::div_up(p.C_out / p.groups, s.bn) * p.stride_h * p.stride_w * p.groups;
  if (blocks >= (int64_t(1) << 31) || halo_split(p, blocks) > 1) return s.fallback;
  return config;
}

}  // namespace

HaloPlan halo_plan(const ConvTranspose2dParams& p, int config) {
  const HaloShape s = kHaloShapes[config];
  const int elem = p.dtype == DType::kFloat32 ? 4 : 2;
  const int vec_elems = 16 / elem;
  const int64_t taps_h = max_taps(p.stride_h, p.H_out, p.pad_h, p.dil_h, p.kH);
  const int64_t taps_w = max_taps(p.stride_w, p.W_out, p.pad_w, p.dil_w, p.kW);
  const int64_t dstep_h = p.dil_h / gcd64(p.stride_h, p.dil_h), dstep_w = p.dil_w / gcd64(p.stride_w, p.dil_w);
  const int64_t halo_h = (taps_h > 0 ? taps_h - 1 : 0) * dstep_h;
  const int64_t halo_w = (taps_w > 0 ? taps_w - 1 : 0) * dstep_w;
  HaloPlan pl{};
  pl.smem = ~size_t(0);  // not eligible until shown otherwise
  if (halo_h > kHaloH || halo_w > kHaloW) return pl;
  HaloGeom& g = pl.geo;
  g.vec = p.W_in % vec_elems == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  g.nvec = static_cast<int>(tc::div_up(s.tw + halo_w + vec_elems - 1, vec_elems));
  g.nvec_div = make_fast_div(static_cast<uint32_t>(g.nvec));
  const int64_t cs = patch_channel_stride(s.th, s.tw, elem);
  g.patch_words = static_cast<int>(8 * cs);  // 8 fp32 channels or 16 16-bit channels
  const int64_t w_words = taps_h * taps_w * 8 * (s.ws ? s.bn : s.bn + 8);  // ws: K-major, no padding
  g.stage_words = static_cast<int>(g.patch_words + w_words);
  const int64_t epi = int64_t(s.bn) * (s.th * s.tw + 4) * 4;
  const size_t limit = max_dynamic_smem();
  // After the stages (and the halo kernel's accumulator staging, which aliases them): the halo kernel's tap
  // table, or the warp-specialized kernel's full and empty barriers.
  const int64_t extra_words = s.ws ? 4 * kMaxWsStages : kMaxTaps;
  g.stages = s.ws ? kMaxWsStages : kMaxStages;
  while (g.stages > 2 && (static_cast<size_t>(g.stages) * g.stage_words + extra_words) * 4 > limit) --g.stages;
  const int64_t pipe = int64_t(g.stages) * g.stage_words * 4;
  g.tiles_h = tc::div_up(tc::div_up(p.H_out, p.stride_h), s.th);
  g.tiles_w = tc::div_up(tc::div_up(p.W_out, p.stride_w), s.tw);
  g.split = 1;
  g.extra = static_cast<int>((s.ws || pipe > epi ? pipe : epi) / 4);  // the ws kernel stages no accumulators
  pl.smem = static_cast<size_t>(g.extra + extra_words) * 4;
  return pl;
}

namespace {

template <typename T, tc::MmaKind K, int TH, int TW, int BN, int WM, int WN>
cudaError_t launch_halo_shape(const ConvTranspose2dParams& p, const HaloPlan& pl, const uint32_t* wt, int64_t ciw_pad,
                         int64_t co_pad, cudaStream_t stream) {
  auto kernel = conv_transpose2d_halo_kernel<T, K, TH, TW, BN, WM, WN>;
  cudaError_t err = opt_in_shared_memory<conv_transpose2d_halo_kernel<T, K, TH, TW, BN, WM, WN>>();
  if (err != cudaSuccess) return err;
  // One block (a cluster of `split` with split-K) per work item: spatial tiles x channel tiles x phases x groups.
  const int64_t items = p.N * pl.geo.tiles_h * pl.geo.tiles_w * (co_pad / BN) * p.stride_h * p.stride_w * p.groups;
  HaloGeom geo = pl.geo;
  geo.split = halo_split(p, items);
  if (geo.split > 1 && max_active_clusters(kernel, WM * WN * 32, pl.smem, geo.split) == 0) geo.split = 1;
  const int64_t max_x = 0x7fffffff / geo.split;  // grid x stays a multiple of the split
  const dim3 grid(static_cast<unsigned>((items < max_x ? items : max_x) * geo.split));
  if (geo.split == 1) {
    kernel<<<grid, WM * WN * 32, pl.smem, stream>>>(p, wt, ciw_pad, co_pad, geo);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cluster_config(cfg, attr, grid, WM * WN * 32, pl.smem, geo.split, stream);
  return cudaLaunchKernelEx(&cfg, kernel, p, wt, ciw_pad, co_pad, geo);
}

template <typename T, tc::MmaKind K>
cudaError_t launch_halo_kind(const ConvTranspose2dParams& p, int config, const uint32_t* wt, int64_t ciw_pad,
                        int64_t co_pad, cudaStream_t stream) {
  config = halo_effective(p, config);
  const HaloPlan pl = halo_plan(p, config);
  if (pl.smem > max_dynamic_smem()) return cudaErrorInvalidConfiguration;
  if (kHaloShapes[config].ws) return launch_halo_ws(p, config, pl, wt, ciw_pad, co_pad, stream);
  switch (config) {
    case 0:
      return launch_halo_shape<T, K, 8, 32, 64, 4, 2>(p, pl, wt, ciw_pad, co_pad, stream);
    case 1:
      return launch_halo_shape<T, K, 16, 32, 64, 8, 2>(p, pl, wt, ciw_pad, co_pad, stream);
    case 2:
      return launch_halo_shape<T, K, 8, 32, 128, 4, 4>(p, pl, wt, ciw_pad, co_pad, stream);
    case 3:
      return launch_halo_shape<T, K, 16, 32, 32, 8, 1>(p, pl, wt, ciw_pad, co_pad, stream);
    case 4:
      return launch_halo_shape<T, K, 16, 32, 16, 8, 1>(p, pl, wt, ciw_pad, co_pad, stream);
    case 9:
      return launch_halo_shape<T, K, 2, 32, 16, 2, 1>(p, pl, wt, ciw_pad, co_pad, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int halo_block_n(int config) { return kHaloShapes[config].bn; }

bool halo_kmajor(const ConvTranspose2dParams& p, int config) { return kHaloShapes[halo_effective(p, config)].ws; }

int halo_choose(const ConvTranspose2dParams& p) {
  if (p.dtype == DType::kFloat64) return -1;
  if (p.H_in > (int64_t(1) << 30) || p.W_in > (int64_t(1) << 30) || p.H_out > (int64_t(1) << 30) ||
      p.W_out > (int64_t(1) << 30) || p.H_in * p.W_in >= (int64_t(1) << 31))
    return -1;
  // The halo kernel pays off when taps share a patch, stages hold enough channels and the 32-pixel tile rows are
  // mostly used.
  const int64_t taps = max_taps(p.stride_h, p.H_out, p.pad_h, p.dil_h, p.kH) *
                       max_taps(p.stride_w, p.W_out, p.pad_w, p.dil_w, p.kW);
  const int64_t cin_g = p.C_in / p.groups, cout_g = p.C_out / p.groups;
  if (taps < 2 || cin_g < 16 || tc::div_up(p.W_out, p.stride_w) < 24) return -1;
  // Measured on an H200 (bench/kernels/sweep.py, bench/NOTES.md v5): 16-warp tiles for C_out > 32 in every precision
  // but exact fp32, whose per-stage partial sums (tc::add_tile) spill at the 16-warp tiles' 128 registers.
  const bool exact = p.dtype == DType::kFloat32 && p.precision != Precision::kTF32;
  const int config = cout_g > 32 ? (exact ? 0 : cout_g > 64 ? 2 : 1) : cout_g > 16 ? 3 : 4;
  // On sm_90 the warp-specialized wgmma tiles of the same channel widths (bench/NOTES.md v11); for 33-64 channels
  // with many taps a stage (KernelBench 65: 3 x 7) the four-consumer 512 x 64 tile, which keeps more wgmma in
  // flight per stage (v11 sweep: 65 TF32 1.92 against 2.35 ms, bf16 1.17 against 1.34; 57's 9 taps: slower).
  const int ws = exact ? -1 : cout_g > 64 ? 6 : cout_g > 32 ? (taps >= 15 ? 8 : 5) : cout_g > 16 ? 7 : -1;
  if (ws >= 0 && halo_effective(p, ws) == ws && halo_plan(p, ws).smem <= max_dynamic_smem()) return ws;
  return halo_plan(p, config).smem <= max_dynamic_smem() ? config : -1;
}

cudaError_t launch_halo(const ConvTranspose2dParams& p, int config, const uint32_t* wt, int64_t ciw_pad,
                        int64_t co_pad, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32:
      return p.precision == Precision::kTF32
                 ? launch_halo_kind<float, tc::MmaKind::kTF32>(p, config, wt, ciw_pad, co_pad, stream)
                 : launch_halo_kind<float, tc::MmaKind::k3xTF32>(p, config, wt, ciw_pad, co_pad, stream);
    case DType::kFloat16:
      return launch_halo_kind<__half, tc::MmaKind::kFP16>(p, config, wt, ciw_pad, co_pad, stream);
    case DType::kBFloat16:
      return launch_halo_kind<__nv_bfloat16, tc::MmaKind::kBF16>(p, config, wt, ciw_pad, co_pad, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
