// The taps path in one kernel, for layers with few output channels: RGB and one-channel output layers of GAN
// generators, U-Nets and super-resolution networks, two-class heads. As in the two-kernel taps path
// (conv_transpose2d_taps.cu), every (output channel, tap) is a column of one GEMM with K = C_in,
//   Z[(n, iy, ix), (co, ky, kx)] = sum over ci of x[n, ci, iy, ix] w[ci, co, ky, kx],
// and each output element is the sum of the Z values of the taps that reach it. Here a block does both for a tile
// of input positions, with Z in shared memory instead of global memory (docs/architecture.md, "Kernels"):
//   1. A tile is TH x TW input positions (TH TW = 128; TW of 8, 16 or 32, whichever needs the fewest tiles) of one
//      image: the positions whose outputs it completes plus the halo of the taps that reach those outputs from the
//      neighbouring positions, ceil(k / s) - 1 rows and columns. Its GEMM (M = 128 positions, N = a chunk of whole
//      output channels' kH kW columns, at most 96; K = C_in in stages of 32 channels, two buffers) runs on mma.sync
//      m16n8k8 TF32 from shared memory: 8 warps, 4 along M (2 m16 tiles each) and 2 along N. x (zero outside the
//      image) and the weights come in by cp.async in fp32 (16-byte copies of a channels-last x), through registers
//      in 16 bits. fp32 products are TF32-rounded in registers (cuDNN's allow_tf32), or split into 3xTF32 (exact
//      fp32, a fresh partial sum a stage, mma.cuh); 16-bit values are TF32 values, so their products are exact.
//      Sums in fp32.
//   2. The accumulators go into shared memory as Z [column][position], over the stages' buffers.
//   3. Every output element whose taps all lie in the tile, (TH - halo) s_h x (TW - halo) s_w of them a channel,
//      adds its taps' Z values and the bias in fp32 and is stored, in y's layout.
// x, w and y are read and written in either layout as they are: one kernel a call, no packing, no workspace. Each
// x value is read (TH TW) / ((TH - halo) (TW - halo)) times (1.2-1.5x), once a chunk, and nothing but y is written.
// A block's stages are few (C_in / 32) and each waits on its loads, so the kernel is latency-bound on large
// layers: it is not the rule's choice, only measured choice's candidate (bench/NOTES.md v39).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace deconv {
namespace {

constexpr int kTfThreads = 256;                   // 8 warps
constexpr int kTfWarpsM = 4;                      // warps along the tile's positions
constexpr int kTfWarpsN = 2;                      // warps along its columns
constexpr int kTfTilesM = 2;                      // m16 tiles a warp
constexpr int kTfM = kTfWarpsM * kTfTilesM * 16;  // 128 positions a tile
constexpr int kTfMaxCols = 96;                    // columns a chunk: 2 warps x 6 n8 tiles
constexpr int kTfKC = 32;                         // input channels a stage: 4 k8 steps
constexpr int kTfPitchK = kTfKC + 4;              // a channels-last x's stage [position][channel]: 36 = 4 mod 32
constexpr int kTfPitchM = kTfM + 8;               // an NCHW x's stage [channel][position]: 136 = 8 mod 32 words
constexpr int kTfPitchZ = kTfM + 4;               // Z [column][position] (stage_accumulators: 4 mod 32)

// The kernel's shape for kNT n8 tiles a warp: 3 (at most 48 columns: an RGB layer's 3 x 16 taps) or 6 (96).
template <int kNT>
struct TfShape {
  static constexpr int kCols = kTfWarpsN * kNT * 8;
  static constexpr int kStageA = kTfM * kTfPitchK;  // words: the larger of the two forms (4608 against 4352)
  static constexpr int kPitchN = kCols + 8;  // 56 = 24 and 104 = 8 mod 32: conflict-free B fragment loads
  static constexpr int kStage = kStageA + kTfKC * kPitchN;
  static constexpr size_t kSmemBytes = 2 * kStage * sizeof(float);  // two stages; Z over them at a unit's end
  static_assert(kCols * kTfPitchZ <= 2 * kStage, "Z fits over the two stages");
};

struct TapsFusedArgs {
  const void* x;
  const void* w;
  const void* bias;
  void* y;
  int64_t xs_n, ys_n;     // element strides of x's and y's images
  int xs_c, xs_h, xs_w;   // inside an image (taps_fused_eligible: its offsets fit 32 bits)
  int ys_c, ys_h, ys_w;
  int c_in, h_in, w_in, c_out, h_out, w_out, kh, kw, s_h, s_w, pad_h, pad_w;
  int khw;
  int halo_h, halo_w;  // ceil(k / s) - 1: the most taps an output reaches back past its own position q
  int tw_shift;        // TW = 1 << tw_shift, TH = kTfM >> tw_shift
  int qh, qw;          // positions q whose outputs a tile completes: TH - halo_h by TW - halo_w
  int q0_h, q0_w;      // the first position q of any output: floor(pad / s)
  int tiles_h, tiles_w;
  int cpc;             // output channels a chunk (the last chunk may have fewer)
  int chunks;
  int64_t units;       // chunks x images x tiles
  bool x_cl, w_cl, y_cl;
  bool x_vec;          // a channels-last fp32 x in 16-byte copies (C_in a multiple of 4, x 16-byte aligned)
  FastDiv by_khw, by_ow, by_oh, by_cpc, by_cpc_last, by_sh, by_sw;
};

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool ok) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 4 : 0));
}

// A unit of work: one chunk of output channels over one tile of one image.
struct TfUnit {
  int64_t n;
  int qa_h, qa_w;  // the first position q whose outputs the tile completes
  int ch0, ncp;    // the chunk's first output channel and its channel count
};

__device__ __forceinline__ TfUnit tf_unit(const TapsFusedArgs& a, int64_t u) {
  TfUnit t;
  const int chunk = static_cast<int>(u % a.chunks);
  int64_t rest = u / a.chunks;
  const int bc = static_cast<int>(rest % a.tiles_w);
  rest /= a.tiles_w;
  const int br = static_cast<int>(rest % a.tiles_h);
  t.n = rest / a.tiles_h;
  t.qa_h = a.q0_h + br * a.qh;
  t.qa_w = a.q0_w + bc * a.qw;
  t.ch0 = chunk * a.cpc;
  t.ncp = min(a.cpc, a.c_out - t.ch0);
  return t;
}

// Two blocks an SM, but one for exact fp32 with 6 n8 tiles a warp: its partial sums double the 48 accumulators a
// thread holds (187 registers), and held to 128 ptxas spills 256 bytes a thread.
template <typename T, tc::MmaKind K, int kNT>
__global__ void __launch_bounds__(kTfThreads, K == tc::MmaKind::k3xTF32 && kNT == 6 ? 1 : 2)
    conv_transpose2d_taps_fused_kernel(const TapsFusedArgs a) {
  using S = TfShape<kNT>;
  constexpr bool kExact = K == tc::MmaKind::k3xTF32;
  constexpr bool kRound = K == tc::MmaKind::kTF32 && sizeof(T) == 4;  // fp32 values rounded to TF32
  constexpr int kCols = S::kCols, kPitchN = S::kPitchN;
  extern __shared__ __align__(16) float tf_smem[];
  float* const zs = tf_smem;  // Z over both stages once a unit's products are done

  const T* __restrict__ x = static_cast<const T*>(a.x);
  const T* __restrict__ w = static_cast<const T*>(a.w);
  const T* __restrict__ bias = static_cast<const T*>(a.bias);
  T* __restrict__ y = static_cast<T*>(a.y);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % kTfWarpsM, wn = warp / kTfWarpsM;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int tw_mask = (1 << a.tw_shift) - 1;
  // A stage's x: word (k, m) at k a_ks + m a_ms.
  const int a_ks = a.x_cl ? 1 : kTfPitchM, a_ms = a.x_cl ? kTfPitchK : 1;
  const int stages = (a.c_in + kTfKC - 1) / kTfKC;
  const int oh = a.qh * a.s_h, ow = a.qw * a.s_w;  // a tile's outputs a channel: oh x ow
  const int m_base = wm * kTfTilesM * 16, n_base = wn * kNT * 8;

  for (int64_t u = blockIdx.x; u < a.units; u += gridDim.x) {
    const TfUnit un = tf_unit(a, u);
    const T* x_img = x + un.n * a.xs_n;
    const int iy0 = un.qa_h - a.halo_h, ix0 = un.qa_w - a.halo_w;
    const int ncols = un.ncp * a.khw;

    // Stage s: channels [32 s, 32 s + 32) of x over the tile (zeros outside the image and past C_in) and of the
    // chunk's weight columns (zeros past C_in and past its columns).
    const auto load = [&](int s, float* buf) {
      const int c0 = s * kTfKC;
      if (a.x_vec) {  // four channels a copy
        for (int e = tid; e < kTfKC / 4 * kTfM; e += kTfThreads) {
          const int k = (e % (kTfKC / 4)) * 4, m = e / (kTfKC / 4);
          const int iy = iy0 + (m >> a.tw_shift), ix = ix0 + (m & tw_mask), ci = c0 + k;
          const bool ok = ci < a.c_in && iy >= 0 && iy < a.h_in && ix >= 0 && ix < a.w_in;
          cp_async16(buf + m * kTfPitchK + k, ok ? x_img + ci + iy * a.xs_h + ix * a.xs_w : x, ok ? 16 : 0);
        }
      } else {
        for (int e = tid; e < kTfKC * kTfM; e += kTfThreads) {
          const int k = a.x_cl ? e % kTfKC : e / kTfM;
          const int m = a.x_cl ? e / kTfKC : e % kTfM;
          const int iy = iy0 + (m >> a.tw_shift), ix = ix0 + (m & tw_mask), ci = c0 + k;
          const bool ok = ci < a.c_in && iy >= 0 && iy < a.h_in && ix >= 0 && ix < a.w_in;
          const T* src = ok ? x_img + ci * a.xs_c + iy * a.xs_h + ix * a.xs_w : x;
          float* dst = buf + k * a_ks + m * a_ms;
          if constexpr (sizeof(T) == 4) {
            cp_async4(dst, reinterpret_cast<const float*>(src), ok);
          } else {
            *dst = ok ? to_acc(__ldg(src)) : 0.f;
          }
        }
      }
      float* bs = buf + S::kStageA;
      for (int e = tid; e < kTfKC * kCols; e += kTfThreads) {
        const int k = e / kCols, col = e - k * kCols, ci = c0 + k;
        const bool ok = ci < a.c_in && col < ncols;
        int64_t off = 0;
        if (a.w_cl) {  // [C_in][kH][kW][C_out]; the chunk's columns are (channel, tap)
          const int co = fdiv(col, a.by_khw);
          off = (static_cast<int64_t>(ci) * a.khw + (col - co * a.khw)) * a.c_out + un.ch0 + co;
        } else {       // [C_in][C_out][kH][kW]: the chunk's columns are contiguous
          off = (static_cast<int64_t>(ci) * a.c_out + un.ch0) * a.khw + col;
        }
        const T* src = ok ? w + off : w;
        float* dst = bs + k * kPitchN + col;
        if constexpr (sizeof(T) == 4) {
          cp_async4(dst, reinterpret_cast<const float*>(src), ok);
        } else {
          *dst = ok ? to_acc(__ldg(src)) : 0.f;
        }
      }
    };

    // A stage's k8 steps into `sums`, an n8 tile's B fragment at a time (exact fp32: the residual products first,
    // as mma.cuh's mma_warp_tile adds them, with fewer fragments live at once).
    const auto stage_products = [&](const float* buf, float (&sums)[kTfTilesM][kNT][4]) {
      const float* as = buf;
      const float* bs = buf + S::kStageA;
#pragma unroll
      for (int ks = 0; ks < kTfKC / 8; ++ks) {
        uint32_t af[kTfTilesM][4], alo[kTfTilesM][4];
#pragma unroll
        for (int i = 0; i < kTfTilesM; ++i) {
          const int m = m_base + i * 16 + g8, k = ks * 8 + t4;
          const float v[4] = {as[k * a_ks + m * a_ms], as[k * a_ks + (m + 8) * a_ms], as[(k + 4) * a_ks + m * a_ms],
                              as[(k + 4) * a_ks + (m + 8) * a_ms]};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            af[i][e] = kRound || kExact ? tc::to_tf32(v[e]) : __float_as_uint(v[e]);
            if constexpr (kExact) alo[i][e] = tc::tf32_residual(v[e], af[i][e]);
          }
        }
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const float* b = bs + (ks * 8 + t4) * kPitchN + n_base + j * 8 + g8;
          const float bv[2] = {b[0], b[4 * kPitchN]};
          uint32_t bf[2], blo[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            bf[e] = kRound || kExact ? tc::to_tf32(bv[e]) : __float_as_uint(bv[e]);
            if constexpr (kExact) blo[e] = tc::tf32_residual(bv[e], bf[e]);
          }
#pragma unroll
          for (int i = 0; i < kTfTilesM; ++i) {
            if constexpr (kExact) {
              tc::mma<tc::MmaKind::kTF32>(sums[i][j], alo[i], bf);
              tc::mma<tc::MmaKind::kTF32>(sums[i][j], af[i], blo);
            }
            tc::mma<tc::MmaKind::kTF32>(sums[i][j], af[i], bf);
          }
        }
      }
    };

    float acc[kTfTilesM][kNT][4];
    tc::zero_tile(acc);
    load(0, tf_smem);
    cp_async_commit();
    for (int s = 0; s < stages; ++s) {
      if (s + 1 < stages) load(s + 1, tf_smem + ((s + 1) & 1) * S::kStage);
      cp_async_commit();
      cp_async_wait<1>();  // stage s has landed (s + 1 may be in flight)
      __syncthreads();
      const float* buf = tf_smem + (s & 1) * S::kStage;
      if constexpr (kExact) {
        float part[kTfTilesM][kNT][4];
        tc::zero_tile(part);
        stage_products(buf, part);
        tc::add_tile(acc, part);  // a fresh partial sum a stage (mma.cuh)
      } else {
        stage_products(buf, acc);
      }
      __syncthreads();  // the buffer is free for stage s + 2, or for Z
    }
    tc::stage_accumulators(zs, kTfPitchZ, acc, m_base, n_base, g8, t4);
    __syncthreads();

    // Every output of the chunk's channels whose taps lie in the tile: output (oy, ox) with oy + pad_h = t_h has
    // q_h = t_h / s_h and taps ky = t_h mod s_h + i s_h (i = 0, 1, ...) reading position q_h - i, tile row
    // (q_h - qa_h) + halo_h - i; likewise along the columns.
    const int count = un.ncp * oh * ow;
    const FastDiv& by_cpc = un.ncp == a.cpc ? a.by_cpc : a.by_cpc_last;
    for (int e = tid; e < count; e += kTfThreads) {
      int co, ly, lx;
      if (a.y_cl) {  // channels fastest: a channels-last y's contiguous run
        const int pix = fdiv(e, by_cpc);
        co = e - pix * un.ncp;
        ly = fdiv(pix, a.by_ow);
        lx = pix - ly * ow;
      } else {       // columns fastest: an NCHW y's rows
        const int r = fdiv(e, a.by_ow);
        lx = e - r * ow;
        co = fdiv(r, a.by_oh);
        ly = r - co * oh;
      }
      const int oy = un.qa_h * a.s_h + ly - a.pad_h, ox = un.qa_w * a.s_w + lx - a.pad_w;
      if (oy < 0 || oy >= a.h_out || ox < 0 || ox >= a.w_out) continue;
      const int ry = fdiv(ly, a.by_sh), rx = fdiv(lx, a.by_sw);
      const int ky0 = ly - ry * a.s_h, kx0 = lx - rx * a.s_w;
      const float* zc = zs + co * a.khw * kTfPitchZ;
      float sum = bias != nullptr ? to_acc(bias[un.ch0 + co]) : 0.f;
      for (int ky = ky0, r = ry + a.halo_h; ky < a.kh; ky += a.s_h, --r) {
        const float* zr = zc + ky * a.kw * kTfPitchZ + (r << a.tw_shift);
        for (int kx = kx0, c = rx + a.halo_w; kx < a.kw; kx += a.s_w, --c) sum += zr[kx * kTfPitchZ + c];
      }
      y[un.n * a.ys_n + ((un.ch0 + co) * a.ys_c + oy * a.ys_h + ox * a.ys_w)] = from_acc<T>(sum);
    }
    __syncthreads();  // Z is read before the next unit's stages land over it
  }
}

// Input positions q (output t = o + pad, q = t / s) of an axis: the first and the count.
void axis_positions(int64_t out, int64_t pad, int64_t s, int& first, int64_t& count) {
  first = static_cast<int>(pad / s);
  count = (out - 1 + pad) / s - first + 1;
}

// The tile's width TW = 2^shift (8, 16 or 32 positions; TH = 128 / TW) that needs the fewest tiles, the widest of
// those (longer runs of an NCHW x a channel); -1 when none has a completed position.
int tile_shift(int64_t rows, int64_t cols, int halo_h, int halo_w) {
  int best = -1;
  int64_t best_tiles = 0;
  for (int shift = 3; shift <= 5; ++shift) {
    const int tw = 1 << shift, th = kTfM / tw;
    if (th <= halo_h || tw <= halo_w) continue;
    const int64_t tiles = tc::div_up(rows, th - halo_h) * tc::div_up(cols, tw - halo_w);
    if (best < 0 || tiles <= best_tiles) best = shift, best_tiles = tiles;
  }
  return best;
}

// The kernel's arguments for `p`; units 0 when it cannot run it.
TapsFusedArgs taps_fused_args(const ConvTranspose2dParams& p) {
  TapsFusedArgs a{};
  a.khw = static_cast<int>(p.kH * p.kW);
  if (a.khw > kTfMaxCols) return a;
  a.halo_h = static_cast<int>(tc::div_up(p.kH, p.stride_h) - 1);
  a.halo_w = static_cast<int>(tc::div_up(p.kW, p.stride_w) - 1);
  int64_t rows = 0, cols = 0;
  axis_positions(p.H_out, p.pad_h, p.stride_h, a.q0_h, rows);
  axis_positions(p.W_out, p.pad_w, p.stride_w, a.q0_w, cols);
  a.tw_shift = tile_shift(rows, cols, a.halo_h, a.halo_w);
  if (a.tw_shift < 0) return a;
  a.qh = (kTfM >> a.tw_shift) - a.halo_h;
  a.qw = (1 << a.tw_shift) - a.halo_w;
  a.tiles_h = static_cast<int>(tc::div_up(rows, a.qh));
  a.tiles_w = static_cast<int>(tc::div_up(cols, a.qw));
  // Whole output channels a chunk, as evenly as the chunks allow.
  const int64_t per_chunk = std::min<int64_t>(p.C_out, kTfMaxCols / a.khw);
  a.chunks = static_cast<int>(tc::div_up(p.C_out, per_chunk));
  a.cpc = static_cast<int>(tc::div_up(p.C_out, a.chunks));
  a.units = int64_t(a.chunks) * p.N * a.tiles_h * a.tiles_w;
  return a;
}

int taps_fused_tiles_n(const TapsFusedArgs& a) { return a.cpc * a.khw <= TfShape<3>::kCols ? 3 : 6; }

template <typename T, tc::MmaKind K, int kNT>
cudaError_t taps_fused_launch_as(const TapsFusedArgs& a, cudaStream_t stream) {
  const cudaError_t err = opt_in_shared_memory<conv_transpose2d_taps_fused_kernel<T, K, kNT>>();
  if (err != cudaSuccess) return err;
  const int64_t cap = int64_t(1) << 30;  // the kernel loops over units past the grid
  conv_transpose2d_taps_fused_kernel<T, K, kNT>
      <<<static_cast<unsigned>(a.units < cap ? a.units : cap), kTfThreads, TfShape<kNT>::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, tc::MmaKind K>
cudaError_t taps_fused_launch_kind(const TapsFusedArgs& a, cudaStream_t stream) {
  return taps_fused_tiles_n(a) == 3 ? taps_fused_launch_as<T, K, 3>(a, stream)
                                     : taps_fused_launch_as<T, K, 6>(a, stream);
}

}  // namespace

bool taps_fused_eligible(const ConvTranspose2dParams& p) {
  if (p.dtype == DType::kFloat64 || p.groups != 1 || p.x_pitch > 0) return false;
  if (p.dil_h != 1 || p.dil_w != 1) return false;
  if (p.N < 1 || p.C_in < 1 || p.C_out < 1) return false;
  // Offsets inside an image and every count fit a 32-bit int (an image's offset is formed in 64 bits).
  const int64_t lim = int64_t(1) << 30;
  if (p.C_in * p.H_in * p.W_in >= lim || p.C_out * p.H_out * p.W_out >= lim || p.C_in * p.C_out * p.kH * p.kW >= lim ||
      p.H_out + p.pad_h >= lim || p.W_out + p.pad_w >= lim)
    return false;
  const TapsFusedArgs a = taps_fused_args(p);
  return a.units > 0 && a.units < (int64_t(1) << 40) && TfShape<6>::kSmemBytes <= max_dynamic_smem();
}

// Preferred for small layers of at most 8 output channels (below the tiled narrow kernel's 2^17 output pixels, where
// the per-pixel narrow kernel would run) with one group and at least 32 input channels: there the per-pixel kernel
// loads an input value for every (pixel, tap, channel), while this kernel's GEMM takes the channels as K on tensor
// cores (fsrcnn-x3 on one 64 x 64 frame: 15.9 against 71.2 us in exact fp32, cuDNN 18.3; bench/NOTES.md v42).
bool taps_fused_preferred(const ConvTranspose2dParams& p) {
  return p.C_out <= 8 && p.C_in >= 32 && p.groups == 1 && !narrow_tiled_preferred(p) && taps_fused_eligible(p);
}

cudaError_t launch_taps_fused(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!taps_fused_eligible(p)) return cudaErrorInvalidValue;
  TapsFusedArgs a = taps_fused_args(p);
  a.x = p.x;
  a.w = p.w;
  a.bias = p.bias;
  a.y = p.y;
  const int hw_in = static_cast<int>(p.H_in * p.W_in), hw_out = static_cast<int>(p.H_out * p.W_out);
  const int c_in = static_cast<int>(p.C_in), c_out = static_cast<int>(p.C_out);
  const int w_in = static_cast<int>(p.W_in), w_out = static_cast<int>(p.W_out);
  a.xs_n = p.C_in * hw_in, a.ys_n = p.C_out * hw_out;
  if (p.x_channels_last) {
    a.xs_c = 1, a.xs_h = w_in * c_in, a.xs_w = c_in;
  } else {
    a.xs_c = hw_in, a.xs_h = w_in, a.xs_w = 1;
  }
  if (p.y_channels_last) {
    a.ys_c = 1, a.ys_h = w_out * c_out, a.ys_w = c_out;
  } else {
    a.ys_c = hw_out, a.ys_h = w_out, a.ys_w = 1;
  }
  a.c_in = static_cast<int>(p.C_in), a.h_in = static_cast<int>(p.H_in), a.w_in = static_cast<int>(p.W_in);
  a.c_out = static_cast<int>(p.C_out), a.h_out = static_cast<int>(p.H_out), a.w_out = static_cast<int>(p.W_out);
  a.kh = static_cast<int>(p.kH), a.kw = static_cast<int>(p.kW);
  a.s_h = static_cast<int>(p.stride_h), a.s_w = static_cast<int>(p.stride_w);
  a.pad_h = static_cast<int>(p.pad_h), a.pad_w = static_cast<int>(p.pad_w);
  a.x_cl = p.x_channels_last, a.w_cl = p.w_channels_last, a.y_cl = p.y_channels_last;
  a.x_vec = p.dtype == DType::kFloat32 && a.x_cl && p.C_in % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const int last = a.c_out - (a.chunks - 1) * a.cpc;
  a.by_khw = make_fast_div(static_cast<uint32_t>(a.khw));
  a.by_ow = make_fast_div(static_cast<uint32_t>(a.qw * a.s_w));
  a.by_oh = make_fast_div(static_cast<uint32_t>(a.qh * a.s_h));
  a.by_cpc = make_fast_div(static_cast<uint32_t>(a.cpc));
  a.by_cpc_last = make_fast_div(static_cast<uint32_t>(last));
  a.by_sh = make_fast_div(static_cast<uint32_t>(a.s_h));
  a.by_sw = make_fast_div(static_cast<uint32_t>(a.s_w));
  switch (p.dtype) {
    case DType::kFloat32:
      return p.precision == Precision::kExactFp32 ? taps_fused_launch_kind<float, tc::MmaKind::k3xTF32>(a, stream)
                                                  : taps_fused_launch_kind<float, tc::MmaKind::kTF32>(a, stream);
    case DType::kFloat16:
      return taps_fused_launch_kind<__half, tc::MmaKind::kTF32>(a, stream);
    case DType::kBFloat16:
      return taps_fused_launch_kind<__nv_bfloat16, tc::MmaKind::kTF32>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
