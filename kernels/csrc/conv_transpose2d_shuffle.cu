// Layers whose kernel is their stride (kH = stride_h, kW = stride_w, dilation 1, no output padding, one group):
// U-Net's 2 x 2 up-convolutions, YOLO's mask prototypes, SAM's mask decoder, ViT patch decoders. Every output pixel
// then takes exactly one tap of one input pixel, so the layer is one GEMM followed by a pixel shuffle:
//   Y[(co, a, b), (n, i, j)] = sum over ci of w[ci, co, a, b] x[n, ci, i, j],
//   y[n, co, i kH + a - pad_h, j kW + b - pad_w] = Y[(co, a, b), (n, i, j)] + bias[co]
// (docs/architecture.md, "Kernels"). Here the GEMM's M rows are the (co, a, b) rows of the packed weights
// ([co][a][b][ci_pad], K-major: gemm_pack's co-major rows) and its N columns one image's H_in W_in positions, read
// from a 16-bit NCHW x as it is: a box of 64 positions x 64 input channels is wgmma's transposed (N-major) B, as the
// gemm kernel reads channels-last weights (by TMA where an image's rows of positions are whole 16-byte vectors;
// else, 8-byte vectors, by the loader's 128 threads with cp.async: Mask R-CNN's 14 x 14 RoIs). So an NCHW call runs
// this one kernel: no layout change of x (the gemm
// kernel reads x channels-last), every tap from the same B tile (the gemm kernel reads x once a stride phase), and
// the output written NCHW through shared memory: a tile's 128 rows hold 128 / (kH kW) output channels with all of
// their taps, so that each output row's kW-interleaved run of columns is written whole, 8 bytes a thread.
//
// A block of 384 threads computes 128 x 128 tiles, persistent over them (output-row tiles fastest, so that the
// blocks in flight share one tile of x and the weights stay in L2): warpgroup 0's first thread issues a stage's
// bulk tensor copies (TMA: 128 weight rows x 64 channels, one or two boxes of x; or the loader's threads copy x's
// part into the same swizzled layout, publishing each stage one behind its copies), warpgroups 1 and 2 each multiply
// 64 of the rows, stage them (with the bias, rounded to 16 bits) in shared memory and store them, while the loader
// runs up to kStages stages ahead into the next tile. Hopper (sm_90a) only; layers it does not take run on the
// gemm kernel after a layout change.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "gemm.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_ss.cuh"

namespace deconv {
namespace {

constexpr int kShuffleThreads = 384;   // a loader warpgroup and two multiplier warpgroups
constexpr int kShuffleBM = 128;        // (co, a, b) rows a tile
constexpr int kShuffleBN = 128;        // positions of one image a tile
constexpr int kShuffleStages = 5;
constexpr int kShuffleCh = kGemmRowBytes / 2;  // input channels a stage (16-bit)
constexpr int kShuffleAStage = kShuffleBM * kGemmRowBytes;  // 16 KiB of weight rows
constexpr int kShuffleBChunk = 64 * kGemmRowBytes;          // 64 channels x 64 positions, 8 KiB
constexpr int kShuffleStage = kShuffleAStage + 2 * kShuffleBChunk;
constexpr int kShufflePitch = kShuffleBN + 8;  // elements a staged output row: 272 bytes, conflict-free pair writes
constexpr size_t kShuffleOutBytes = 2 * 64 * kShufflePitch * 2;
constexpr size_t kShuffleSmem = static_cast<size_t>(kShuffleStages) * kShuffleStage + kShuffleOutBytes +
                                2 * kShuffleStages * sizeof(uint64_t) + 1024;

// Input channels padded to whole stages: the packed weights' row length (gemm_pack's ci_pad for 16-bit weights).
int64_t shuffle_ci_pad(const ConvTranspose2dParams& p) { return tc::div_up(p.C_in, kShuffleCh) * kShuffleCh; }

struct ShuffleArgs {
  const void* x;     // [N, C_in, H_in, W_in], contiguous (read here only without TMA)
  const void* bias;  // [C_out] or nullptr
  void* y;           // [N, C_out, H_out, W_out], contiguous
  int c_in, c_out, h_out, w_out, kh, pad_h, pad_w, w_in;
  int hw, m_total, taps, kw_shift;  // kW = 1 << kw_shift (it divides 64)
  int kiters, total;
  FastDiv m_tiles, p_tiles, w_in_div;
};

// An 8-byte cp.async into shared memory, zero-filled where src_bytes is 0 (nothing is read then).
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Barrier among one multiplier warpgroup's 128 threads (named barriers 1 and 2; the loader never uses them).
__device__ __forceinline__ void warpgroup_sync(int mw) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(mw + 1) : "memory");
}

// Tile t: its image, first position and first row.
__device__ __forceinline__ void shuffle_decode(const ShuffleArgs& g, int t, int& n, int& p0, int& m0) {
  const int r = fdiv(t, g.m_tiles);
  m0 = (t - r * static_cast<int>(g.m_tiles.d)) * kShuffleBM;
  n = fdiv(r, g.p_tiles);
  p0 = (r - n * static_cast<int>(g.p_tiles.d)) * kShuffleBN;
}

// Four staged values of one row group (output channel co, kernel row a) as four outputs: one 8-byte store where they
// are four neighbours of one output row at an 8-byte aligned place, else one store each (image edges, cropping).
template <typename T>
__device__ __forceinline__ void shuffle_store4(const ShuffleArgs& g, const T* rows, int n, int p0, int co, int a,
                                               int rem) {
  const int kw = 1 << g.kw_shift;
  int64_t at[4];
  T v[4];
  bool ok[4];
  bool whole = true;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int pl = (rem + e) >> g.kw_shift, b = (rem + e) & (kw - 1);
    const int pos = p0 + pl;
    const int i = fdiv(pos, g.w_in_div);
    const int oh = i * g.kh + a - g.pad_h, ow = (pos - i * g.w_in) * kw + b - g.pad_w;
    ok[e] = pos < g.hw && oh >= 0 && oh < g.h_out && ow >= 0 && ow < g.w_out;
    at[e] = ((static_cast<int64_t>(n) * g.c_out + co) * g.h_out + oh) * g.w_out + ow;
    v[e] = rows[b * kShufflePitch + pl];
    whole = whole && ok[e] && at[e] == at[0] + e;
  }
  T* y = static_cast<T*>(g.y);
  if (whole && ((reinterpret_cast<uintptr_t>(y + at[0])) & 7) == 0) {
    uint2 pack;
    pack.x = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&v[0])) |
             static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&v[1])) << 16;
    pack.y = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&v[2])) |
             static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&v[3])) << 16;
    *reinterpret_cast<uint2*>(y + at[0]) = pack;
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (ok[e]) y[at[e]] = v[e];
}

// The loader's copies of a stage's x part without TMA: 64 channels x 128 positions of one image as 8-byte vectors
// (4 positions), thread `pt` of 128 taking vector u = pt % 32 of channel rows pt / 32 + 4 i, a warp one row's 256
// contiguous bytes; each lands where the TMA box would put it (chunk u / 16, row of 128 bytes, its 16-byte unit
// XOR the row's low 3 bits: the 128-byte swizzle). Zero-filled past C_in (the packed weights are zero there, but
// a stale value could be Inf or NaN) and past the image's positions.
template <typename T>
__device__ __forceinline__ void shuffle_copy_x(const ShuffleArgs& g, uint32_t dst, int n, int p0, int c0, int pt) {
  const int u = pt & 31;
  const int pos = p0 + 4 * u;
  const uint32_t col = static_cast<uint32_t>((u >> 4) * kShuffleBChunk + (u & 1) * 8);
  const int unit = (u & 15) >> 1;
  const T* x = static_cast<const T*>(g.x);
#pragma unroll 4
  for (int i = 0; i < kShuffleCh / 4; ++i) {
    const int ci = (pt >> 5) + 4 * i, c = c0 + ci;
    const bool ok = c < g.c_in && pos < g.hw;
    const T* src = ok ? x + (static_cast<int64_t>(n) * g.c_in + c) * g.hw + pos : x;
    cp_async8(dst + col + ci * kGemmRowBytes + ((unit ^ (ci & 7)) << 4), src, ok ? 8 : 0);
  }
}

// kTmaB: x's part of a stage comes by TMA (an image's positions in whole 16-byte vectors), else by the loader's
// threads (shuffle_copy_x).
template <typename T, tc::MmaKind K, bool kTmaB>
__global__ void __launch_bounds__(kShuffleThreads, 1)
    conv_transpose2d_shuffle_kernel(const __grid_constant__ ShuffleArgs g, const __grid_constant__ CUtensorMap map_w,
                                    const __grid_constant__ CUtensorMap map_x) {
  constexpr int kKSteps = kGemmRowBytes / 32;  // k16 steps a stage
  static_assert(kShuffleThreads == kWsThreads, "the register budgets of wgmma_ss.cuh");
  constexpr int kProdRegs = kWsLoaderRegs;
  constexpr int kConsRegs = kWsMultiplierRegs;

  extern __shared__ uint8_t shuffle_smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(shuffle_smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = shuffle_smem_raw + (base - raw);
  T* const staged = reinterpret_cast<T*>(smem + kShuffleStages * kShuffleStage);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kShuffleStages * kShuffleStage + kShuffleOutBytes);
  uint64_t* empty = full + kShuffleStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kShuffleStages; ++s) {
      wg::mbar_init(&full[s], kTmaB ? 1 : 129);  // the issuing thread's expect_tx (and the copying threads)
      wg::mbar_init(&empty[s], 256);  // every multiplier thread, once done with the stage
    }
#if DECONV_WGMMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }
  __syncthreads();

  const int wgi = threadIdx.x >> 7;
  uint32_t it = 0;  // stages loaded (loader) or consumed (multipliers) so far
  if (wgi == 0) {
    wg::setmaxnreg_dec<kProdRegs>();
    if constexpr (kTmaB) {
      if (threadIdx.x != 0) return;
      for (int t = blockIdx.x; t < g.total; t += gridDim.x) {
        int n, p0, m0;
        shuffle_decode(g, t, n, p0, m0);
        // The second box only where the tile has positions past its first 64 (its columns are never stored).
        const bool two = g.hw - p0 > 64;
        const uint32_t bytes = kShuffleAStage + (two ? 2 : 1) * kShuffleBChunk;
        for (int k = 0; k < g.kiters; ++k, ++it) {
          const int s = static_cast<int>(it % kShuffleStages);
          wg::mbar_wait(&empty[s], ((it / kShuffleStages) & 1) ^ 1);
          wg::mbar_arrive_expect_tx(&full[s], bytes);
          const uint32_t st = base + s * kShuffleStage;
          tma_load_3d(st, &map_w, k * kShuffleCh, m0, 0, &full[s]);
          tma_load_3d(st + kShuffleAStage, &map_x, p0, k * kShuffleCh, n, &full[s]);
          if (two) tma_load_3d(st + kShuffleAStage + kShuffleBChunk, &map_x, p0 + 64, k * kShuffleCh, n, &full[s]);
        }
      }
    } else {
      // Every loader thread copies a part of x; thread 0 also brings the weight rows by TMA. A stage is published
      // once its copies have landed, made visible to the tensor cores (the async proxy), which is checked one stage
      // later, so that two stages of copies are in flight a thread.
      const int pt = threadIdx.x;
      int pending = -1;  // the stage copied last, not yet published
      for (int t = blockIdx.x; t < g.total; t += gridDim.x) {
        int n, p0, m0;
        shuffle_decode(g, t, n, p0, m0);
        for (int k = 0; k < g.kiters; ++k, ++it) {
          const int s = static_cast<int>(it % kShuffleStages);
          wg::mbar_wait(&empty[s], ((it / kShuffleStages) & 1) ^ 1);
          const uint32_t st = base + s * kShuffleStage;
          if (pt == 0) {
            wg::mbar_arrive_expect_tx(&full[s], kShuffleAStage);
            tma_load_3d(st, &map_w, k * kShuffleCh, m0, 0, &full[s]);
          }
          shuffle_copy_x<T>(g, st + kShuffleAStage, n, p0, k * kShuffleCh, pt);
          cp_async_commit();
          if (pending >= 0) {
            cp_async_wait<1>();
            fence_async_smem();
            wg::mbar_arrive(&full[pending]);
          }
          pending = s;
        }
      }
      if (pending >= 0) {
        cp_async_wait<0>();
        fence_async_smem();
        wg::mbar_arrive(&full[pending]);
      }
    }
    return;
  }

  wg::setmaxnreg_inc<kConsRegs>();
  const int mw = wgi - 1;  // rows mw 64 .. mw 64 + 63 of each tile
  const int lt = threadIdx.x & 127, lane = threadIdx.x & 31, wq = lt >> 5;
  T* const out = staged + mw * 64 * kShufflePitch;
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  const int kw = 1 << g.kw_shift;
  for (int t = blockIdx.x; t < g.total; t += gridDim.x) {
    int n, p0, m0;
    shuffle_decode(g, t, n, p0, m0);
    float acc[kShuffleBN / 2];
#pragma unroll
    for (int i = 0; i < kShuffleBN / 2; ++i) acc[i] = 0.f;
    int prev = -1;  // the stage whose wgmma may still run
    for (int k = 0; k < g.kiters; ++k, ++it) {
      const int s = static_cast<int>(it % kShuffleStages);
      wg::mbar_wait(&full[s], (it / kShuffleStages) & 1);
      const uint32_t a_addr = base + s * kShuffleStage + mw * 64 * kGemmRowBytes;
      const uint32_t b_addr = base + s * kShuffleStage + kShuffleAStage;
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk)  // k16 steps: 32 bytes along A's rows, 16 rows of 128 bytes down B
        wgmma_ss<kShuffleBN, K, true>(acc, sw128_desc(a_addr + 32 * kk), sw128_desc_nmajor(b_addr + 2048 * kk));
      wg::commit();
      wg::wait<1>();  // the previous stage's wgmma are done: its buffer goes back to the loader
      if (prev >= 0) wg::mbar_arrive(&empty[prev]);
      prev = s;
    }
    wg::wait<0>();
    if (prev >= 0) wg::mbar_arrive(&empty[prev]);
    wg::pin<kShuffleBN / 2>(acc);

    // Stage the warpgroup's 64 rows with their bias, as 16-bit pairs: accumulator 4j + e holds row
    // (warp's 16) + lane / 4 (+ 8 for e >= 2), column 8j + 2 (lane % 4) (+ 1 for odd e). The previous tile's
    // stores must have read the rows first.
    warpgroup_sync(mw);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wq * 16 + (lane >> 2) + 8 * half;
      const int m = m0 + mw * 64 + r;
      const float bv = bias != nullptr && m < g.m_total ? to_acc(bias[m / g.taps]) : 0.f;
      uint32_t* row = reinterpret_cast<uint32_t*>(out + r * kShufflePitch + 2 * (lane & 3));
#pragma unroll
      for (int j = 0; j < kShuffleBN / 8; ++j)
        row[4 * j] = pack_pair(static_cast<T*>(nullptr), acc[4 * j + 2 * half] + bv, acc[4 * j + 2 * half + 1] + bv);
    }
    warpgroup_sync(mw);
    // Store: the 64 rows are 64 / kW row groups (co, a) of kW rows (b); a group's values in output order are
    // (position, b), b fastest: kW-interleaved runs of an output row. Four a thread, 512 a pass.
    const int group_elems = kw * kShuffleBN;
    for (int e = 4 * lt; e < 64 * kShuffleBN; e += 4 * 128) {
      const int grp = e / group_elems;
      const int m = m0 + mw * 64 + grp * kw;  // row (co, a, 0); C_out kH kW is a multiple of kW
      if (m >= g.m_total) break;              // later groups are past it too
      const int co = m / g.taps;
      const int a = (m - co * g.taps) >> g.kw_shift;
      shuffle_store4<T>(g, out + grp * kw * kShufflePitch, n, p0, co, a, e - grp * group_elems);
    }
  }
}

ShuffleArgs shuffle_args(const ConvTranspose2dParams& p) {
  ShuffleArgs g{};
  g.x = p.x;
  g.c_in = static_cast<int>(p.C_in);
  g.bias = p.bias;
  g.y = p.y;
  g.c_out = static_cast<int>(p.C_out);
  g.h_out = static_cast<int>(p.H_out);
  g.w_out = static_cast<int>(p.W_out);
  g.kh = static_cast<int>(p.kH);
  g.pad_h = static_cast<int>(p.pad_h);
  g.pad_w = static_cast<int>(p.pad_w);
  g.w_in = static_cast<int>(p.W_in);
  g.hw = static_cast<int>(p.H_in * p.W_in);
  g.taps = static_cast<int>(p.kH * p.kW);
  g.m_total = static_cast<int>(p.C_out * p.kH * p.kW);
  g.kw_shift = 0;
  while ((int64_t(1) << g.kw_shift) < p.kW) ++g.kw_shift;
  g.kiters = static_cast<int>(shuffle_ci_pad(p) / kShuffleCh);
  const int64_t m_tiles = tc::div_up(p.C_out * p.kH * p.kW, kShuffleBM);
  const int64_t p_tiles = tc::div_up(p.H_in * p.W_in, kShuffleBN);
  g.total = static_cast<int>(m_tiles * p_tiles * p.N);
  g.m_tiles = make_fast_div(static_cast<uint32_t>(m_tiles));
  g.p_tiles = make_fast_div(static_cast<uint32_t>(p_tiles));
  g.w_in_div = make_fast_div(static_cast<uint32_t>(p.W_in));
  return g;
}

// Tensor maps of the packed weights ([C_out kH kW][ci_pad], boxes of 64 channels x 128 rows) and, with_x, of x
// ([N][C_in][H_in W_in], boxes of 64 positions x 64 channels of one image), 128-byte swizzle, zero-filled outside.
bool shuffle_maps(const ConvTranspose2dParams& p, const void* wp, bool with_x, CUtensorMap* mw, CUtensorMap* mx) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const CUtensorMapDataType dt =
      p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint32_t ones[3] = {1, 1, 1};
  const cuuint64_t ci_pad = static_cast<cuuint64_t>(shuffle_ci_pad(p));
  const cuuint64_t rows = static_cast<cuuint64_t>(p.C_out * p.kH * p.kW);
  const cuuint64_t wdim[3] = {ci_pad, rows, 1};
  const cuuint64_t wstride[2] = {ci_pad * 2, rows * ci_pad * 2};
  const cuuint32_t wbox[3] = {kShuffleCh, kShuffleBM, 1};
  if (encode(mw, dt, 3, const_cast<void*>(wp), wdim, wstride, wbox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  if (!with_x) return true;
  const cuuint64_t hw = static_cast<cuuint64_t>(p.H_in * p.W_in);
  const cuuint64_t xdim[3] = {hw, static_cast<cuuint64_t>(p.C_in), static_cast<cuuint64_t>(p.N)};
  const cuuint64_t xstride[2] = {hw * 2, static_cast<cuuint64_t>(p.C_in) * hw * 2};
  const cuuint32_t xbox[3] = {64, kShuffleCh, 1};
  return encode(mx, dt, 3, const_cast<void*>(p.x), xdim, xstride, xbox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether TMA can read x: an image's positions in whole 16-byte vectors, x 16-byte aligned.
bool shuffle_tma_x(const ConvTranspose2dParams& p) {
  return (p.H_in * p.W_in) % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
}

template <typename T, tc::MmaKind K, bool kTmaB>
cudaError_t shuffle_launch_as(const ConvTranspose2dParams& p, const void* wp, cudaStream_t stream) {
  const cudaError_t err = opt_in_shared_memory<conv_transpose2d_shuffle_kernel<T, K, kTmaB>>();
  if (err != cudaSuccess) return err;
  CUtensorMap mw{}, mx{};  // mx stays unused (zeros) without TMA for x
  if (!shuffle_maps(p, wp, kTmaB, &mw, &mx)) return cudaErrorInvalidValue;
  const ShuffleArgs g = shuffle_args(p);
  const int sms = sm_count() > 0 ? sm_count() : 1;
  conv_transpose2d_shuffle_kernel<T, K, kTmaB>
      <<<g.total < sms ? g.total : sms, kShuffleThreads, kShuffleSmem, stream>>>(g, mw, mx);
  return cudaGetLastError();
}

}  // namespace

bool shuffle_eligible(const ConvTranspose2dParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (!gemm_default_ready()) return false;  // wgmma: an sm_90 device and sm_90a code
  if (p.groups != 1 || p.kH != p.stride_h || p.kW != p.stride_w) return false;
  if ((p.kH > 1 && p.dil_h != 1) || (p.kW > 1 && p.dil_w != 1)) return false;
  // No output padding: every output pixel is one tap of one input pixel (padding only crops).
  if (p.H_out != p.H_in * p.kH - 2 * p.pad_h || p.W_out != p.W_in * p.kW - 2 * p.pad_w) return false;
  if (p.kW > 64 || 64 % p.kW != 0) return false;  // a warpgroup's 64 rows hold whole row groups
  // NCHW x and y; x's image rows of positions in whole 8-byte vectors at an 8-byte aligned address (whole 16-byte
  // vectors at a 16-byte aligned one for TMA).
  if (p.x_channels_last || p.y_channels_last || p.x_pitch > 0) return false;
  if ((p.H_in * p.W_in) % 4 != 0 || reinterpret_cast<uintptr_t>(p.x) % 8 != 0) return false;
  const int64_t lim = int64_t(1) << 30;
  const int64_t tiles =
      tc::div_up(p.C_out * p.kH * p.kW, kShuffleBM) * tc::div_up(p.H_in * p.W_in, kShuffleBN) * p.N;
  return p.C_out * p.kH * p.kW * shuffle_ci_pad(p) < lim && p.H_in * p.W_in < lim && p.N * p.C_in < lim &&
         p.C_out * p.H_out * p.W_out < lim && tiles < lim;
}

bool shuffle_preferred(const ConvTranspose2dParams& p) { return p.C_out * p.kH * p.kW >= 64; }

WeightPacking shuffle_packing(const ConvTranspose2dParams& p) {
  WeightPacking w{};
  const int64_t ci_pad = shuffle_ci_pad(p);
  w.bytes = static_cast<size_t>(p.C_out * p.kH * p.kW * ci_pad * 2);
  w.kind = static_cast<int64_t>(p.dtype == DType::kBFloat16 ? tc::MmaKind::kBF16 : tc::MmaKind::kFP16);
  w.groups = 1;
  w.ciw_pad = ci_pad;
  w.co_pad = p.C_out;
  w.kmajor = true;
  w.layout = 2;
  return w;
}

size_t shuffle_workspace_bytes(const ConvTranspose2dParams& p) {
  return p.packed_weights == nullptr ? (shuffle_packing(p).bytes + 255) / 256 * 256 : 0;
}

cudaError_t shuffle_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream) {
  return gemm_pack(p, dst, stream, true);
}

cudaError_t launch_shuffle(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!shuffle_eligible(p)) return cudaErrorInvalidValue;
  const void* wp = p.packed_weights;
  if (wp == nullptr) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    const cudaError_t err = shuffle_pack(p, p.workspace, stream);
    if (err != cudaSuccess) return err;
    wp = p.workspace;
  }
  const bool tma = shuffle_tma_x(p);
  if (p.dtype == DType::kBFloat16)
    return tma ? shuffle_launch_as<__nv_bfloat16, tc::MmaKind::kBF16, true>(p, wp, stream)
               : shuffle_launch_as<__nv_bfloat16, tc::MmaKind::kBF16, false>(p, wp, stream);
  return tma ? shuffle_launch_as<__half, tc::MmaKind::kFP16, true>(p, wp, stream)
             : shuffle_launch_as<__half, tc::MmaKind::kFP16, false>(p, wp, stream);
}

}  // namespace deconv
