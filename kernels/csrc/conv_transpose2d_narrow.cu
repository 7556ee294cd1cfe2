// ConvTranspose2d forward for few output channels per group (C_out / groups <= 8): the "narrow" kernel.
//
// The stride-phase GEMM of conv_transpose2d.cu has N = C_out / groups; with N = 3 (an RGB output layer) a
// 64-channel tile wastes 61/64 of its work. Here a thread owns kTP consecutive pixels of one phase row and every
// output channel of the group, all in registers (acc[kTP][kCoutMax], kCoutMax = 4 or 8, unused lanes zero):
//   - the (phase, group)'s weights, packed [tap][ci][kCoutMax] in the accumulator type (zero-padded lanes), are
//     staged once per block into shared memory; every thread reads the same weights at the same time
//     (broadcast, no bank conflicts) with 16-byte loads;
//   - taps outer (the input row / column bounds checked once per tap), input channels inner: one x load per
//     pixel and channel feeds kCoutMax FMAs; neighbouring threads read neighbouring input columns (coalesced);
//   - bias fused into the epilogue, NCHW stores.
// Exact FFMA in every mode (fp32 accumulation, fp64 for float64), so TF32 requests get exact fp32 results.
// A phase with no valid tap on an axis writes the bias (or zeros), like the SIMT kernel.
// Eligible (narrow_eligible) when C_out / groups <= 8, the largest phase's packed weights fit in 48 KiB, both
// strides are at most 32 (the per-residue phase table is a kernel parameter) and sizes fit 32-bit positions.
//
// Every name here carries "narrow": kernels/build.py compiles all .cu files as one translation unit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "phase.cuh"

namespace deconv {
namespace {

constexpr size_t kNarrowMaxSmem = 48 * 1024;  // static limit: no opt-in attribute needed on any sm_80+ GPU
constexpr int kNarrowMaxThreads = 256;
constexpr int kNarrowUnroll = 4;  // input channels a step of the inner loop: several loads in flight a thread

// The kCoutMax weights of one (tap, channel) from shared memory, 16 bytes per load.
template <int kCoutMax>
__device__ __forceinline__ void narrow_load_weights(const float* s, float (&w)[kCoutMax]) {
  static_assert(kCoutMax % 4 == 0, "float4 loads");
#pragma unroll
  for (int i = 0; i < kCoutMax / 4; ++i) {
    const float4 v = reinterpret_cast<const float4*>(s)[i];
    w[4 * i + 0] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
}
template <int kCoutMax>
__device__ __forceinline__ void narrow_load_weights(const double* s, double (&w)[kCoutMax]) {
  static_assert(kCoutMax % 2 == 0, "double2 loads");
#pragma unroll
  for (int i = 0; i < kCoutMax / 2; ++i) {
    const double2 v = reinterpret_cast<const double2*>(s)[i];
    w[2 * i + 0] = v.x;
    w[2 * i + 1] = v.y;
  }
}

// Per-axis phase geometry as 32-bit values (AxisPhase32, phase.cuh), made on the host and passed as a kernel
// parameter.
constexpr int kNarrowMaxStride = 32;
constexpr int64_t kNarrowMaxExtent = int64_t(1) << 28;  // sizes, paddings and kernel extents, per axis

struct NarrowGeom {
  AxisPhase32 h[kNarrowMaxStride];  // by residue r_h < stride_h
  AxisPhase32 w[kNarrowMaxStride];  // by residue r_w < stride_w
  int cin, cout;                    // channels per group
  int rows, cols;                   // the largest phase's rows and columns: ceil(H_out / stride_h), ceil(W_out / ...)
};

// Shared memory for the weights of the largest (phase, group), or ~0 when more than kNarrowMaxSmem.
size_t narrow_smem_bytes(const ConvTranspose2dParams& p) {
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t cin_g = p.C_in / p.groups;
  const int64_t lanes = cout_g <= 4 ? 4 : 8;
  const int64_t acc_bytes = p.dtype == DType::kFloat64 ? 8 : 4;
  const int64_t per_k = lanes * acc_bytes;  // bytes per (tap, input channel)
  const int64_t max_k = static_cast<int64_t>(kNarrowMaxSmem) / per_k;
  const int64_t taps = max_phase_taps(p.stride_h, p.dil_h, p.kH) * max_phase_taps(p.stride_w, p.dil_w, p.kW);
  // Compared one factor at a time first, so that huge channel or tap counts cannot overflow the product.
  if (cin_g > max_k || taps > max_k || cin_g * taps > max_k) return ~size_t(0);
  return static_cast<size_t>(cin_g * taps * per_k);
}

// Units of the largest phase in one image: ceil(H_out / stride_h) rows x ceil(ceil(W_out / stride_w) / tp).
int64_t narrow_units_per_image(const ConvTranspose2dParams& p, int tp) {
  const int64_t rows = (p.H_out + p.stride_h - 1) / p.stride_h;
  const int64_t cols = (p.W_out + p.stride_w - 1) / p.stride_w;
  return rows * ((cols + tp - 1) / tp);
}

// Everything the kernel keeps in 32 bits must fit, with room: unit numbers plus a block (< 2^31), input and output
// positions (|hi|, |wi| < 2^30), (phase, group) numbers. Checked one factor at a time, so nothing overflows.
bool narrow_index_ok(const ConvTranspose2dParams& p) {
  if (p.stride_h > kNarrowMaxStride || p.stride_w > kNarrowMaxStride) return false;
  for (const int64_t v : {p.H_in, p.W_in, p.H_out, p.W_out, p.pad_h, p.pad_w, p.dil_h, p.dil_w, p.kH, p.kW}) {
    if (v >= kNarrowMaxExtent) return false;
  }
  if (p.dil_h * (p.kH - 1) >= kNarrowMaxExtent || p.dil_w * (p.kW - 1) >= kNarrowMaxExtent) return false;
  if (p.groups > (int64_t(1) << 30) / (p.stride_h * p.stride_w)) return false;
  const int64_t max_units = (int64_t(1) << 31) - (int64_t(1) << 16);
  const int64_t per_image = narrow_units_per_image(p, 1);  // < 2^56 with the sizes above
  return per_image <= max_units && p.N <= max_units / per_image;
}

// One block covers blockDim.x "units" of one (phase, group); a unit is kTP consecutive pixels of one phase row
// (qw = c * kTP + j, j < kTP, those past the row end skipped). Units are numbered (n, qh, c), c fastest.
// Positions, counts and unit numbers are 32-bit (narrow_index_ok bounds them); memory offsets are 64-bit.
template <typename T, int kCoutMax, int kTP>
__global__ void __launch_bounds__(kNarrowMaxThreads)
    conv_transpose2d_narrow_kernel(const ConvTranspose2dParams p, const NarrowGeom g) {
  using Acc = typename AccType<T>::type;
  extern __shared__ __align__(16) unsigned char narrow_smem[];
  Acc* ws = reinterpret_cast<Acc*>(narrow_smem);  // ws: [taps_h * taps_w][cin][kCoutMax]

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int nthreads = blockDim.x;
  const int cin = g.cin;    // < 48 KiB / 16 bytes by eligibility
  const int cout = g.cout;  // <= kCoutMax
  const int groups = static_cast<int>(p.groups);
  const int stride_w = static_cast<int>(p.stride_w);
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
  const int64_t hw_in = p.H_in * p.W_in;
  const int num_z = static_cast<int>(p.stride_h * p.stride_w * p.groups);

  for (int z = blockIdx.z; z < num_z; z += gridDim.z) {
    const int grp = z % groups;
    const int phase = z / groups;
    const AxisPhase32& ah = g.h[phase / stride_w];
    const AxisPhase32& aw = g.w[phase % stride_w];
    const int count_h = ah.count, count_w = aw.count;
    const int cw = (count_w + kTP - 1) / kTP;  // units per phase row
    const int units = static_cast<int>(p.N) * count_h * cw;
    // Block-uniform: a block with no unit in this (phase, group) skips it, barriers included.
    if (static_cast<int64_t>(blockIdx.x) * nthreads >= units) continue;

    const int taps_h = ah.taps, taps_w = aw.taps;
    const int w_elems = taps_h * taps_w * cin * kCoutMax;  // 0 for a phase without taps: bias only

    __syncthreads();  // every thread is done with the previous (phase, group)'s weights
    for (int i = threadIdx.x; i < w_elems; i += nthreads) {
      const int co = i % kCoutMax;
      const int rest = i / kCoutMax;
      const int ci = rest % cin;
      const int tap = rest / cin;
      const int th = tap / taps_w;
      const int tw = tap - th * taps_w;
      Acc v = Acc(0);
      if (co < cout) {
        const int a = ah.a0 + th * ah.step;
        const int b = aw.a0 + tw * aw.step;
        v = to_acc(w[((static_cast<int64_t>(grp) * cin + ci) * cout + co) * (p.kH * p.kW) + a * p.kW + b]);
      }
      ws[i] = v;
    }
    __syncthreads();

    for (int ut = blockIdx.x; static_cast<int64_t>(ut) * nthreads < units; ut += gridDim.x) {
      const int u = ut * nthreads + threadIdx.x;  // < units + nthreads < 2^31 by eligibility
      if (u >= units) continue;  // no barrier below: idle threads may leave the tile
      const int row = u / cw;
      const int qw0 = (u - row * cw) * kTP;
      const int n = row / count_h;
      const int qh = row - n * count_h;
      const T* x_img = x + (static_cast<int64_t>(n) * p.C_in + static_cast<int64_t>(grp) * cin) * hw_in;
      // Pixel (qh, qw) and tap (th, tw) read x[hi, wi] with hi = qh + base_h - th * dstep_h (phase.cuh).
      const int hbase = qh + ah.base;
      const int wbase = qw0 + aw.base;

      Acc acc[kTP][kCoutMax];
#pragma unroll
      for (int j = 0; j < kTP; ++j)
#pragma unroll
        for (int co = 0; co < kCoutMax; ++co) acc[j][co] = Acc(0);

      for (int th = 0; th < taps_h; ++th) {
        const int hi = hbase - th * ah.dstep;
        if (hi < 0 || hi >= h_in) continue;
        const T* x_row = x_img + static_cast<int64_t>(hi) * w_in;
        for (int tw = 0; tw < taps_w; ++tw) {
          const int wi0 = wbase - tw * aw.dstep;
          bool ok[kTP];
          bool any = false;
#pragma unroll
          for (int j = 0; j < kTP; ++j) {
            const int wi = wi0 + j;  // pixel qw0 + j reads column wi0 + j
            ok[j] = qw0 + j < count_w && wi >= 0 && wi < w_in;
            any = any || ok[j];
          }
          if (!any) continue;
          const T* px = x_row + wi0;  // dereferenced only at the columns j with ok[j]
          const Acc* wt = ws + (th * taps_w + tw) * cin * kCoutMax;
#pragma unroll kNarrowUnroll
          for (int ci = 0; ci < cin; ++ci) {
            Acc xv[kTP];
#pragma unroll
            for (int j = 0; j < kTP; ++j) xv[j] = ok[j] ? to_acc(__ldg(px + j)) : Acc(0);
            px += hw_in;
            Acc wv[kCoutMax];
            narrow_load_weights<kCoutMax>(wt + ci * kCoutMax, wv);
#pragma unroll
            for (int j = 0; j < kTP; ++j)
#pragma unroll
              for (int co = 0; co < kCoutMax; ++co) acc[j][co] = fma(xv[j], wv[co], acc[j][co]);
          }
        }
      }

      // Epilogue: bias, convert, NCHW stores at (ho, wo) = (o0_h + qh * stride_h, o0_w + qw * stride_w).
      const int64_t ho = ah.o0 + static_cast<int64_t>(qh) * p.stride_h;
      const int64_t wo0 = aw.o0 + static_cast<int64_t>(qw0) * p.stride_w;
      T* y_pix = y + ((static_cast<int64_t>(n) * p.C_out + static_cast<int64_t>(grp) * cout) * p.H_out + ho) * p.W_out +
                 wo0;
#pragma unroll
      for (int co = 0; co < kCoutMax; ++co) {
        if (co >= cout) continue;
        const Acc b = bias != nullptr ? to_acc(bias[grp * cout + co]) : Acc(0);
#pragma unroll
        for (int j = 0; j < kTP; ++j) {
          if (qw0 + j >= count_w) continue;
          y_pix[co * (p.H_out * p.W_out) + j * stride_w] = store_cast<T, Acc>(acc[j][co] + b);
        }
      }
    }
  }
}

template <typename T, int kCoutMax, int kTP>
cudaError_t narrow_launch_shape(const ConvTranspose2dParams& p, const NarrowGeom& g, int threads, size_t smem,
                                cudaStream_t stream) {
  const int64_t tiles = (p.N * narrow_units_per_image(p, kTP) + threads - 1) / threads;
  const int64_t z = p.stride_h * p.stride_w * p.groups;
  // The kernel loops over tiles and (phase, group)s past the grid's limits: clamping costs parallelism only.
  const dim3 grid(static_cast<unsigned>(tiles < 0x7fffffff ? tiles : 0x7fffffff), 1u,
                  static_cast<unsigned>(z < 65535 ? z : 65535));
  conv_transpose2d_narrow_kernel<T, kCoutMax, kTP><<<grid, threads, smem, stream>>>(p, g);
  return cudaGetLastError();
}

template <typename T>
cudaError_t narrow_launch_dtype(const ConvTranspose2dParams& p, const NarrowGeom& g, cudaStream_t stream) {
  const size_t smem = narrow_smem_bytes(p);
  // Output pixels times groups = work items of one output-channel group. Two pixels a thread only when there are
  // plenty (more independent loads a thread, half the shared-memory weight reads a FMA); 256-thread blocks only
  // when there are enough blocks to fill the GPU.
  const int64_t pixels = p.N * p.H_out * p.W_out * p.groups;
  const bool two = pixels >= (int64_t(1) << 20);
  const int threads = (two ? pixels / 2 : pixels) >= (int64_t(1) << 16) ? 256 : 128;
  if (g.cout > 4) {
    return two ? narrow_launch_shape<T, 8, 2>(p, g, threads, smem, stream)
               : narrow_launch_shape<T, 8, 1>(p, g, threads, smem, stream);
  }
  return two ? narrow_launch_shape<T, 4, 2>(p, g, threads, smem, stream)
             : narrow_launch_shape<T, 4, 1>(p, g, threads, smem, stream);
}

// ---------------------------------------------------------------------------------------------------------
// The tiled narrow kernel: register tiles for layers with few output channels and many input channels (an RGB or
// one-channel output layer after 56-512 channels: pix2pix, DCGAN, FSRCNN; depthwise up-sampling), and, by
// measured choice, for up to 32 output channels a group.
//
// The per-pixel kernel above loads one x value per (pixel, tap, channel) and uses it for at most kCoutMax FMAs
// (one useful for a one-channel output): its loads, not its FMAs, set its speed. Here a thread owns
// tiled_rows(kCo, kJ) rows x kJ columns of one phase (kJ = 1 or 2, the configuration; columns blockDim.x apart, so
// that a warp's loads are consecutive columns) and kCo output channels (the group's 1-4, else 8, 16, 24 or 32 with
// zero-weight lanes). Per input channel it loads, for each of its columns and horizontal taps, the rows + kT - 1
// input rows its pixels read, and uses each value for every vertical tap that reads it: kT x kCo FMAs a load
// instead of kCo. The taps are a template parameter kT (2 or 3, the most taps of any phase on either axis) so that
// accumulators, weights and offsets stay in registers; a warp with a lane whose pixels read past the input's
// edges, or of a phase with fewer taps, runs the copy of the loop with predicated loads. Needs the per-tap input
// step to be 1 on both axes (dilation dividing stride: every dilation-1 layer). Blocks are numbered phase-fastest,
// so that the phases of one input tile read it from L2 together.
//
// The block's (phase, group) weights sit in shared memory as [ci][th][tw][kCo], each channel's padded to a
// multiple of 4 floats, read into registers with 16-byte broadcasts: all of a channel's at once up to 8 output
// channels, one tap's at a time beyond. fp32 accumulation, exact FFMA.

constexpr int kTiledThreads = 128;
constexpr int kTiledMaxTaps = 3;
constexpr int kTiledMaxCout = 32;  // output channels a group
// Fewest output pixels (times groups) for which the tiled kernel is the default: a thread owns 4 or 8 pixels, so
// below this (512-1024 warps) there are too few warps to hide the loads' latency; the per-pixel kernel keeps those.
constexpr int64_t kTiledMinPixels = int64_t(1) << 17;

// Phase rows a thread: 4 for up to 4 output channels, 2 for 8; for 16-32 channels 2 with one column, 1 with two.
__host__ __device__ constexpr int tiled_rows(int co, int cols) { return co > 8 ? 3 - cols : co == 8 ? 2 : 4; }
// Floats of shared memory per input channel: kT * kT * kCo weights, padded to 16-byte vectors.
__host__ __device__ constexpr int tiled_w_stride(int taps, int co) { return (taps * taps * co + 3) / 4 * 4; }

int tiled_taps(const ConvTranspose2dParams& p) {
  const int64_t t = std::max(max_phase_taps(p.stride_h, p.dil_h, p.kH), max_phase_taps(p.stride_w, p.dil_w, p.kW));
  return t <= 2 ? 2 : static_cast<int>(t);
}

// Output channels a thread computes: the group's own up to 4, else 8, 16, 24 or 32 (padded lanes have zero weights).
int tiled_cout(const ConvTranspose2dParams& p) {
  const int64_t c = p.C_out / p.groups;
  return c <= 4 ? static_cast<int>(c) : c <= 8 ? 8 : static_cast<int>((c + 7) / 8 * 8);
}

size_t tiled_smem_bytes(const ConvTranspose2dParams& p) {
  const int64_t per_ci = int64_t(tiled_w_stride(tiled_taps(p), tiled_cout(p))) * 4;
  const int64_t cin_g = p.C_in / p.groups;
  if (cin_g > static_cast<int64_t>(kNarrowMaxSmem) / per_ci) return ~size_t(0);
  return static_cast<size_t>(cin_g * per_ci);
}

// Threads along a phase row: 32, 16 or 8, the fewest whose `cols` columns each cover the widest phase row.
int tiled_block_x(const ConvTranspose2dParams& p, int cols) {
  const int64_t row = (p.W_out + p.stride_w - 1) / p.stride_w;
  return row > 16 * cols ? 32 : row > 8 * cols ? 16 : 8;
}

// x[p] converted to fp32, or 0 without reading when !ok: a predicated load, so that a warp whose lanes differ in
// which loads they need runs one stream of instructions, not a branch per load.
__device__ __forceinline__ float masked_ldg(const float* p, bool ok) {
  float v;
  asm(
      "{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b32 %0, 0;\n @q ld.global.nc.f32 %0, [%1];\n}"
      : "=f"(v)
      : "l"(p), "r"(static_cast<unsigned>(ok)));
  return v;
}
__device__ __forceinline__ unsigned short masked_ldg16(const void* p, bool ok) {
  unsigned short v;
  asm(
      "{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b16 %0, 0;\n @q ld.global.nc.b16 %0, [%1];\n}"
      : "=h"(v)
      : "l"(p), "r"(static_cast<unsigned>(ok)));
  return v;
}
__device__ __forceinline__ float masked_ldg(const __half* p, bool ok) {
  return __half2float(__ushort_as_half(masked_ldg16(p, ok)));
}
__device__ __forceinline__ float masked_ldg(const __nv_bfloat16* p, bool ok) {
  return __bfloat162float(__ushort_as_bfloat16(masked_ldg16(p, ok)));
}

// Four blocks an SM (128 registers a thread; ptxas spills at most 12 bytes), two for 8 channels and 3 taps (whose
// 64 accumulators and 72 weights need more) and for more than 8 channels.
template <typename T, int kCo, int kT, int kJ>
__global__ void __launch_bounds__(kTiledThreads, kCo > 8 || (kCo == 8 && kT >= 3) ? 2 : 4)
    conv_transpose2d_narrow_tiled_kernel(const ConvTranspose2dParams p, const NarrowGeom g) {
  constexpr int kR = tiled_rows(kCo, kJ);
  constexpr int kWin = kR + kT - 1;  // input rows a thread's pixels read, per channel, column and horizontal tap
  constexpr int kWs = tiled_w_stride(kT, kCo);
  extern __shared__ __align__(16) unsigned char narrow_smem[];
  float* ws = reinterpret_cast<float*>(narrow_smem);  // [cin][kWs: th, tw, co]

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int bx = blockDim.x;
  const int tid = threadIdx.y * bx + threadIdx.x;
  const int nthreads = bx * blockDim.y;
  const int tile_w = bx * kJ, tile_h = blockDim.y * kR;
  const int cin = g.cin, cout = g.cout;
  const int groups = static_cast<int>(p.groups);
  const int stride_w = static_cast<int>(p.stride_w);
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t hw_out = p.H_out * p.W_out;
  const int num_z = static_cast<int>(p.stride_h * p.stride_w * p.groups);

  // Blocks are numbered (n, tile row, tile column, phase, group), phase and group fastest: the blocks that read one
  // input tile run together and share it in L2. Tiles are those of the largest phase; a smaller phase skips its
  // missing last row or column of tiles.
  const int tiles_w = (g.cols + tile_w - 1) / tile_w;
  const int tiles_h = (g.rows + tile_h - 1) / tile_h;
  const int64_t units = p.N * static_cast<int64_t>(tiles_h) * tiles_w * num_z;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int z = static_cast<int>(u % num_z);
    const int64_t tile = u / num_z;
    const int tc = static_cast<int>(tile % tiles_w);
    const int64_t rest = tile / tiles_w;
    const int tr = static_cast<int>(rest % tiles_h);
    const int64_t n = rest / tiles_h;
    const int grp = z % groups;
    const int phase = z / groups;
    const AxisPhase32& ah = g.h[phase / stride_w];
    const AxisPhase32& aw = g.w[phase % stride_w];
    const int count_h = ah.count, count_w = aw.count;
    if (tr * tile_h >= count_h || tc * tile_w >= count_w) continue;  // block-uniform, barriers included
    const int taps_h = ah.taps, taps_w = aw.taps;

    __syncthreads();  // every thread is done with the previous unit's weights
    for (int i = tid; i < cin * kWs; i += nthreads) {
      const int k = i % kWs;
      const int ci = i / kWs;
      const int co = k % kCo;
      const int tw = (k / kCo) % kT;
      const int th = k / (kCo * kT);  // >= kT in the padding
      float v = 0.f;
      if (th < taps_h && tw < taps_w && co < cout) {
        const int a = ah.a0 + th * ah.step;
        const int b = aw.a0 + tw * aw.step;
        v = to_acc(w[((static_cast<int64_t>(grp) * cin + ci) * cout + co) * (p.kH * p.kW) + a * p.kW + b]);
      }
      ws[i] = v;
    }
    __syncthreads();

    const int qh0 = tr * tile_h + threadIdx.y * kR;
    const int qwb = tc * tile_w + threadIdx.x;  // this thread's columns: qwb + j * bx
    if (qh0 >= count_h || qwb >= count_w) continue;  // no barrier below: idle threads may leave the tile

    // Pixel (qh, qw) and tap (th, tw) read x[qh + base_h - th][qw + base_w - tw] (per-tap step 1), so window
    // row r of rows h0 .. h0 + kWin - 1 serves pixel row i = r + th - (kT - 1) through tap th. Positions inside
    // a channel plane fit 32 bits (narrow_tiled_eligible: H_in * W_in <= 2^30).
    const int h0 = qh0 + ah.base - (kT - 1);
    int off[kWin][kJ];  // plane position of window row r, column j, tap tw = 0 (tap tw reads off - tw)
    uint32_t rows_ok = 0, cols_ok = 0;  // bit r: window row inside x; bit j * kT + tw: that column inside x
#pragma unroll
    for (int r = 0; r < kWin; ++r) rows_ok |= (h0 + r >= 0 && h0 + r < h_in) ? 1u << r : 0u;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int wc = qwb + j * bx + aw.base;
#pragma unroll
      for (int r = 0; r < kWin; ++r) off[r][j] = (h0 + r) * w_in + wc;
#pragma unroll
      for (int tw = 0; tw < kT; ++tw) {
        const bool ok = qwb + j * bx < count_w && tw < taps_w && wc - tw >= 0 && wc - tw < w_in;
        cols_ok |= ok ? 1u << (j * kT + tw) : 0u;
      }
    }
    // Every lane of the warp reads inside x: the copy without masks (warp-uniform, so no lane runs both copies).
    const bool full = __all_sync(__activemask(), taps_h == kT && rows_ok == (1u << kWin) - 1 &&
                                                     cols_ok == (1u << (kT * kJ)) - 1);

    float acc[kR][kJ][kCo];
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int j = 0; j < kJ; ++j)
#pragma unroll
        for (int co = 0; co < kCo; ++co) acc[i][j][co] = 0.f;

    // One input channel. kFull: no masks (every tap of every pixel reads inside x). Otherwise masked loads read 0
    // and the FMAs of taps past the phase's vertical count are skipped: their weights are 0, but 0 * inf is not.
    const auto channel = [&](const T* xc, const float* wci, auto full_tag) {
      constexpr bool kFull = decltype(full_tag)::value;
      if constexpr (kCo > 8) {
        // More than 8 channels: the channel's window in registers, then one tap's kCo weights at a time.
        float xv[kWin][kJ][kT];
#pragma unroll
        for (int r = 0; r < kWin; ++r)
#pragma unroll
          for (int j = 0; j < kJ; ++j)
#pragma unroll
            for (int tw = 0; tw < kT; ++tw)
              xv[r][j][tw] = kFull ? to_acc(__ldg(xc + off[r][j] - tw))
                                   : masked_ldg(xc + off[r][j] - tw,
                                                (rows_ok >> r) & (cols_ok >> (j * kT + tw)) & 1u);
#pragma unroll
        for (int th = 0; th < kT; ++th) {
          if (!kFull && th >= taps_h) continue;
#pragma unroll
          for (int tw = 0; tw < kT; ++tw) {
            float wv[kCo];
#pragma unroll
            for (int v = 0; v < kCo; v += 4) {
              const float4 q = *reinterpret_cast<const float4*>(wci + (th * kT + tw) * kCo + v);
              wv[v] = q.x;
              wv[v + 1] = q.y;
              wv[v + 2] = q.z;
              wv[v + 3] = q.w;
            }
#pragma unroll
            for (int i = 0; i < kR; ++i)
#pragma unroll
              for (int j = 0; j < kJ; ++j)
#pragma unroll
                for (int co = 0; co < kCo; ++co)
                  acc[i][j][co] = fmaf(xv[i - th + kT - 1][j][tw], wv[co], acc[i][j][co]);
          }
        }
      } else {
        float wv[kWs];
#pragma unroll
        for (int v = 0; v < kWs; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(wci + v);
          wv[v] = q.x;
          wv[v + 1] = q.y;
          wv[v + 2] = q.z;
          wv[v + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < kWin; ++r) {
#pragma unroll
          for (int j = 0; j < kJ; ++j) {
            const T* px = xc + off[r][j];
#pragma unroll
            for (int tw = 0; tw < kT; ++tw) {
              const float xv = kFull ? to_acc(__ldg(px - tw))
                                     : masked_ldg(px - tw, (rows_ok >> r) & (cols_ok >> (j * kT + tw)) & 1u);
#pragma unroll
              for (int th = 0; th < kT; ++th) {
                const int i = r + th - (kT - 1);
                if (i < 0 || i >= kR) continue;
                if (!kFull && th >= taps_h) continue;
#pragma unroll
                for (int co = 0; co < kCo; ++co)
                  acc[i][j][co] = fmaf(xv, wv[(th * kT + tw) * kCo + co], acc[i][j][co]);
              }
            }
          }
        }
      }
    };
    const T* x_img = x + (n * p.C_in + static_cast<int64_t>(grp) * cin) * hw_in;
    if (full) {
      for (int ci = 0; ci < cin; ++ci)
        channel(x_img + ci * hw_in, ws + ci * kWs, std::integral_constant<bool, true>{});
    } else {
      for (int ci = 0; ci < cin; ++ci)
        channel(x_img + ci * hw_in, ws + ci * kWs, std::integral_constant<bool, false>{});
    }

    // Epilogue: bias, convert, NCHW stores at (ho, wo) = (o0_h + qh * stride_h, o0_w + qw * stride_w).
    T* y_img = y + (n * p.C_out + static_cast<int64_t>(grp) * cout) * hw_out;
#pragma unroll
    for (int co = 0; co < kCo; ++co) {
      if (co >= cout) continue;
      const float b = bias != nullptr ? to_acc(bias[grp * cout + co]) : 0.f;
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        if (qh0 + i >= count_h) continue;
        const int64_t ho = ah.o0 + static_cast<int64_t>(qh0 + i) * p.stride_h;
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int qw = qwb + j * bx;
          if (qw >= count_w) continue;
          y_img[co * hw_out + ho * p.W_out + aw.o0 + static_cast<int64_t>(qw) * p.stride_w] =
              from_acc<T>(acc[i][j][co] + b);
        }
      }
    }
  }
}

template <typename T, int kCo, int kT, int kJ>
cudaError_t tiled_launch_shape(const ConvTranspose2dParams& p, const NarrowGeom& g, cudaStream_t stream) {
  const int bx = tiled_block_x(p, kJ);
  const dim3 block(bx, kTiledThreads / bx);
  const int64_t tile_h = block.y * tiled_rows(kCo, kJ), tile_w = bx * kJ;
  const int64_t units =
      p.N * ((g.rows + tile_h - 1) / tile_h) * ((g.cols + tile_w - 1) / tile_w) * p.stride_h * p.stride_w * p.groups;
  // The kernel loops over units past the grid's limit: clamping costs parallelism only.
  const dim3 grid(static_cast<unsigned>(units < 0x7fffffff ? units : 0x7fffffff));
  conv_transpose2d_narrow_tiled_kernel<T, kCo, kT, kJ><<<grid, block, tiled_smem_bytes(p), stream>>>(p, g);
  return cudaGetLastError();
}

template <typename T, int kT, int kJ>
cudaError_t tiled_launch_taps(const ConvTranspose2dParams& p, const NarrowGeom& g, cudaStream_t stream) {
  switch (tiled_cout(p)) {
    case 1:
      return tiled_launch_shape<T, 1, kT, kJ>(p, g, stream);
    case 2:
      return tiled_launch_shape<T, 2, kT, kJ>(p, g, stream);
    case 3:
      return tiled_launch_shape<T, 3, kT, kJ>(p, g, stream);
    case 4:
      return tiled_launch_shape<T, 4, kT, kJ>(p, g, stream);
    case 8:
      return tiled_launch_shape<T, 8, kT, kJ>(p, g, stream);
    case 16:
      return tiled_launch_shape<T, 16, kT, kJ>(p, g, stream);
    case 24:
      return tiled_launch_shape<T, 24, kT, kJ>(p, g, stream);
    default:
      return tiled_launch_shape<T, 32, kT, kJ>(p, g, stream);
  }
}

NarrowGeom make_narrow_geom(const ConvTranspose2dParams& p);

// ---------------------------------------------------------------------------------------------------------
// The staged form (configuration 2), for up to 4 output channels a group and 4 to 9 phases. The forms above read x
// from global memory for every window row, column and horizontal tap: with one output channel (fsrcnn-x3, 56 -> 1,
// k9 s3) a load feeds kT FMAs, and the loads, not the FMAs, set the speed (68-71 us against an FMA floor of 9 us).
// Here a block takes a region of 16 x 32 positions q of every phase (of one image and group): warp w computes phase
// w's positions, each thread 4 x 4 of them. Every phase of a region reads nearly the same input window (phase
// bases differ by a position or so), so the block stages one window for all of them in shared memory as fp32,
// up to kNsCC input channels a stage, with the stage's weights of every phase beside it. A stage's values are fetched
// into registers while the block multiplies the stage before (two buffers, one barrier a stage), which serves fp32
// and 16-bit inputs alike. Per channel a thread reads its window of 4 + kT - 1 rows with two or three 16-byte loads
// a row and uses each value for up to kT x kT taps and kCo output channels: 144 FMAs for 12-18 vector loads with one
// output channel and 3 x 3 taps. Staged column 0 is a multiple of 4, so with W_in % 4 == 0 and x aligned a staged
// row is whole vectors of x; a phase's window then starts kD = 0-3 columns into a vector, a template parameter of
// the channel loop (a warp-uniform switch), so that the window's values sit in registers.
// Unlike the forms above, it reads x and the weights in either layout and writes y in either (p's *_channels_last),
// so that a channels-last caller needs no layout change: only the fetch of a stage and the epilogue's stores differ.
// A channels-last x is fetched as the stage's channels of one or more positions a vector (a 16- or 8-byte load of 4
// channels of a position where they are whole, aligned vectors), and put into the same staged [channel][row][column]
// window.
// With one output channel a group (kCo 1: a thread's accumulators and window take 114 registers, so that one block
// of 9 warps fills an SM's registers; fsrcnn-x3's 128 regions then leave each scheduler 2.2 warps, 0.5 of them
// eligible: bench/NOTES.md v41), two warps take each phase: each multiplies alternate channels of every stage over the
// same positions, with half the fetches and registers, and the second adds its sums into the first's through shared
// memory at the end of the region (a fixed order: the result does not depend on timing).

constexpr int kNsPix = 4;        // positions a thread along each axis
constexpr int kNsTileW = 32;     // a region's positions along a row: 8 threads of 4
constexpr int kNsTileH = 16;     // and along a column: 4 threads of 4
constexpr int kNsCC = 4;         // most input channels a stage (StagedGeom::cc)
constexpr int kNsMaxVecs = 4;    // most x vectors a thread fetches a stage (with one warp a phase; half with two)
constexpr int kNsMaxWts = 3;     // most weights a thread fetches a stage (with one warp a phase; 2 with two)
constexpr int kNsMaxCout = 4;
constexpr int kNsMinPhases = 4;  // fewer warps than that would fetch more than kNsMaxVecs vectors each
// 288 threads at most with one warp a phase: up to 224 registers a thread (with 512, capped at 128, the kernels
// spilled up to 1 KB); 576 with two (one output channel: at most 112 registers).
constexpr int kNsMaxPhases = 9;

// Output channels the staged kernel computes for a group's 1-4: 1, 3 (for 2 or 3; a lane of zero weights, its
// outputs not stored) or 4.
int staged_cout(const ConvTranspose2dParams& p) {
  const int64_t c = p.C_out / p.groups;
  return c <= 1 ? 1 : c <= 3 ? 3 : 4;
}

// The staged window's shape, the same for every region (made on the host).
struct StagedGeom {
  int phases;          // stride_h x stride_w: `halves` warps each
  int halves;          // warps a phase: 2 with one output channel a group (their sums added at the end), else 1
  int cc;              // input channels a stage: 4, 2 or 1, the most whose values the threads fetch
  int base_h, base_w;  // the least phase base on each axis
  int rows, pitch;     // staged rows; floats a staged row (a multiple of 4)
  int x_floats;        // floats of one stage's window: cc x rows x pitch
  int w_floats;        // floats of one stage's weights: cc x phases x tiled_w_stride
  int tiles_h, tiles_w;
};

StagedGeom make_staged_geom(const ConvTranspose2dParams& p, const NarrowGeom& g) {
  StagedGeom s{};
  const int taps = tiled_taps(p);
  s.phases = static_cast<int>(p.stride_h * p.stride_w);
  s.halves = staged_cout(p) == 1 ? 2 : 1;
  // The bases of the phases with taps (a phase without taps on an axis reads nothing; its warp writes the bias).
  const auto bases = [](const AxisPhase32* a, int64_t stride, int& least, int& most) {
    least = INT32_MAX;
    most = INT32_MIN;
    for (int r = 0; r < stride; ++r) {
      if (a[r].taps == 0) continue;
      least = std::min(least, a[r].base);
      most = std::max(most, a[r].base);
    }
    if (least > most) least = most = 0;
  };
  int max_h = 0, max_w = 0;
  bases(g.h, p.stride_h, s.base_h, max_h);
  bases(g.w, p.stride_w, s.base_w, max_w);
  s.rows = kNsTileH + taps - 1 + (max_h - s.base_h);
  // A phase's window starts e = base_w - least base + (the region's first window column mod 4) columns in, at most
  // 3 + the bases' spread; a thread reads from column 4 (tx + e / 4) two or three vectors (three when e % 4 == 3).
  const int e_max = 3 + (max_w - s.base_w);
  s.pitch = 4 * (kNsTileW / 4 - 1 + e_max / 4 + 3);
  // Fetched values sit in registers through a stage's products: at most kNsMaxVecs vectors and kNsMaxWts weights a
  // warp's thread (16-19 registers; with two warps a phase, each thread fetches half as many); fewer phases
  // (threads) stage fewer channels.
  const int threads = 32 * s.phases;
  const int per_channel_w = s.phases * tiled_w_stride(taps, staged_cout(p));
  s.cc = kNsCC;
  while (s.cc > 1 && (s.cc * s.rows * s.pitch / 4 > kNsMaxVecs * threads || s.cc * per_channel_w > kNsMaxWts * threads))
    s.cc /= 2;
  s.x_floats = s.cc * s.rows * s.pitch;
  s.w_floats = s.cc * per_channel_w;
  s.tiles_h = (g.rows + kNsTileH - 1) / kNsTileH;
  s.tiles_w = (g.cols + kNsTileW - 1) / kNsTileW;
  return s;
}

// Two stages' buffers; with two warps a phase, at least the second warps' sums at the region's end (16 a thread).
size_t staged_smem_bytes(const StagedGeom& s) {
  const size_t sums = s.halves == 2 ? static_cast<size_t>(kNsPix * kNsPix) * 32 * s.phases : 0;
  return sizeof(float) * std::max(2 * static_cast<size_t>(s.x_floats + s.w_floats), sums);
}

// The element type is a kernel argument, not a template parameter: one kernel serves fp32, fp16 and bf16 tensors
// (values are fp32 from the stage on), which keeps the build's time down. Element i of `base`, as fp32.
enum : int { kNsF32 = 0, kNsF16 = 1, kNsBF16 = 2 };
__device__ __forceinline__ float staged_load(const void* base, int64_t i, int dt) {
  if (dt == kNsF32) return __ldg(static_cast<const float*>(base) + i);
  if (dt == kNsF16) return to_acc(__ldg(static_cast<const __half*>(base) + i));
  return to_acc(__ldg(static_cast<const __nv_bfloat16*>(base) + i));
}
__device__ __forceinline__ void staged_store(void* base, int64_t i, float v, int dt) {
  if (dt == kNsF32) {
    static_cast<float*>(base)[i] = v;
  } else if (dt == kNsF16) {
    static_cast<__half*>(base)[i] = from_acc<__half>(v);
  } else {
    static_cast<__nv_bfloat16*>(base)[i] = from_acc<__nv_bfloat16>(v);
  }
}

// Four 16-bit values (fp16 or bf16, dt) as fp32.
__device__ __forceinline__ float4 unpack4(uint2 v, int dt) {
  if (dt == kNsF16) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// x values wi .. wi + 3 of the row at element `row` of `x` as fp32: one 16- or 8-byte load where rows are whole
// vectors (`vec`), else element by element; zeros outside the row.
__device__ __forceinline__ float4 staged_fetch4(const void* x, int64_t row, int wi, int w_in, bool vec, int dt) {
  if (vec) {
    if (dt == kNsF32) return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(x) + row + wi));
    return unpack4(__ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(x) + row + wi)), dt);
  }
  float f[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) f[k] = wi + k >= 0 && wi + k < w_in ? staged_load(x, row + wi + k, dt) : 0.f;
  return make_float4(f[0], f[1], f[2], f[3]);
}

// A channels-last x's stage: its values run [row][column][channel] over the cc channels, so vector v holds 4 / cc
// consecutive columns of one staged row, cc channels each. x_grp: the image's group's first channel at position 0
// plus the stage's first channel (c0); left: the group's channels from c0 on. Zeros outside x and past the group's
// channels.
__device__ __forceinline__ float4 staged_fetch_cl(const void* x, int64_t x_grp, int v, int left, const StagedGeom& sg,
                                                  int x_r0, int x_c0, int h_in, int w_in, int64_t c_in, bool vec,
                                                  int dt) {
  const int e = 4 * v;  // the vector's first value: channel e % cc of staged position e / cc
  const int pos = e / sg.cc;
  const int r = pos / sg.pitch, col = pos % sg.pitch;
  const int hi = x_r0 + r;
  if (hi < 0 || hi >= h_in) return make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t row = x_grp + static_cast<int64_t>(hi) * w_in * c_in;
  if (sg.cc == 4 && vec && left >= 4) {  // 4 channels of one position, one load
    const int wi = x_c0 + col;
    if (wi < 0 || wi >= w_in) return make_float4(0.f, 0.f, 0.f, 0.f);
    const int64_t i = row + wi * c_in;
    if (dt == kNsF32) return __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(x) + i));
    return unpack4(__ldg(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(x) + i)), dt);
  }
  float f[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int c = (e + k) % sg.cc;
    const int wi = x_c0 + col + (e + k) / sg.cc - pos;
    f[k] = c < left && wi >= 0 && wi < w_in ? staged_load(x, row + wi * c_in + c, dt) : 0.f;
  }
  return make_float4(f[0], f[1], f[2], f[3]);
}

// Puts a channels-last vector (staged_fetch_cl) into the staged [channel][row][column] window: 4 columns of one
// channel (cc 1, the NCHW form's vector), 2 columns of 2 channels, or 4 channels of one column.
__device__ __forceinline__ void staged_put_cl(float* dst, int v, float4 q, const StagedGeom& sg) {
  const int plane = sg.rows * sg.pitch;
  if (sg.cc == 1) {
    *reinterpret_cast<float4*>(dst + 4 * v) = q;
  } else if (sg.cc == 2) {
    *reinterpret_cast<float2*>(dst + 2 * v) = make_float2(q.x, q.z);
    *reinterpret_cast<float2*>(dst + plane + 2 * v) = make_float2(q.y, q.w);
  } else {
    dst[v] = q.x;
    dst[plane + v] = q.y;
    dst[2 * plane + v] = q.z;
    dst[3 * plane + v] = q.w;
  }
}

// vec: a vector of a stage is 4 aligned, consecutive values of x: for an NCHW x W_in % 4 == 0 (staged rows are
// whole vectors of x), for a channels-last one C_in / groups % 4 == 0 with 4 channels a stage; x aligned to 4
// values in both. dt: the element type.
template <int kCo, int kT, int kHalves>
__global__ void __launch_bounds__(kNsMaxPhases * 32 * kHalves)
    conv_transpose2d_narrow_staged_kernel(const ConvTranspose2dParams p, const NarrowGeom g, const StagedGeom sg,
                                          int vec, int dt) {
  constexpr int kWs = tiled_w_stride(kT, kCo);
  constexpr int kWin = kNsPix + kT - 1;  // window rows a thread reads a channel
  constexpr int kFetchVecs = kNsMaxVecs / kHalves;                // x vectors a thread fetches a stage, at most
  constexpr int kFetchWts = (kNsMaxWts + kHalves - 1) / kHalves;  // and weights
  extern __shared__ __align__(16) unsigned char narrow_smem[];
  float* const smem = reinterpret_cast<float*>(narrow_smem);  // two stages of [x window][weights]

  const int threads = blockDim.x;  // 32 x phases x kHalves
  const int tid = threadIdx.x;
  const int half = (tid >> 5) / sg.phases;  // the second warps of the phases take the odd channels
  const int ph = (tid >> 5) - half * sg.phases, lane = tid & 31;
  const int tx = lane & 7, ty = lane >> 3;
  const int cin = g.cin, cout = g.cout;
  const int groups = static_cast<int>(p.groups);
  const int stride_w = static_cast<int>(p.stride_w);
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t hw_out = p.H_out * p.W_out;
  const bool x_cl = p.x_channels_last, w_cl = p.w_channels_last, y_cl = p.y_channels_last;
  const int stages = (cin + sg.cc - 1) / sg.cc;
  const int vecs_row = sg.pitch / 4;
  const int x_vecs = sg.cc * sg.rows * vecs_row;  // <= kFetchVecs x threads (staged_fits)
  const int w_elems = sg.w_floats;               // <= kFetchWts x threads
  const int stage = sg.x_floats + sg.w_floats;

  // This warp's phase.
  const AxisPhase32& ah = g.h[ph / stride_w];
  const AxisPhase32& aw = g.w[ph % stride_w];
  const int taps_h = ah.taps, taps_w = aw.taps;
  const bool any = taps_h > 0 && taps_w > 0;  // a phase without taps on an axis writes the bias alone
  const bool full = taps_h == kT && taps_w == kT;

  // Regions are numbered (n, tile row, tile column, group), group fastest.
  const int64_t units = p.N * static_cast<int64_t>(sg.tiles_h) * sg.tiles_w * groups;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int grp = static_cast<int>(u % groups);
    const int64_t tile = u / groups;
    const int tc = static_cast<int>(tile % sg.tiles_w);
    const int64_t rest = tile / sg.tiles_w;
    const int tr = static_cast<int>(rest % sg.tiles_h);
    const int64_t n = rest / sg.tiles_h;
    const int q_r0 = tr * kNsTileH, q_c0 = tc * kNsTileW;
    // Position (qh, qw) of a phase and tap (th, tw) read x[qh + base_h - th][qw + base_w - tw] (per-tap step 1).
    // Staged row 0 is input row x_r0; staged column 0 is input column x_c0, a multiple of 4 at or left of every
    // phase's first window column.
    const int x_r0 = q_r0 + sg.base_h - (kT - 1);
    const int x_c0 = (q_c0 + sg.base_w - (kT - 1)) & ~3;
    const int e = q_c0 + aw.base - (kT - 1) - x_c0;  // this phase's first window column, staged
    const int kd = e & 3;
    // The image's group, elements: its first channel's plane (NCHW), or its first channel at position 0.
    const int64_t x_img = x_cl ? n * hw_in * p.C_in + static_cast<int64_t>(grp) * cin
                               : (n * p.C_in + static_cast<int64_t>(grp) * cin) * hw_in;

    float4 xf[kFetchVecs];
    float wf[kFetchWts];
    // Stage s's window and weights into registers: zeros outside x, past the group's channels and at the taps a
    // phase lacks.
    const auto fetch = [&](int s) {
      const int c0 = s * sg.cc;
#pragma unroll
      for (int k = 0; k < kFetchVecs; ++k) {
        const int v = tid + k * threads;
        xf[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (v >= x_vecs) continue;
        if (x_cl) {
          xf[k] = staged_fetch_cl(p.x, x_img + c0, v, cin - c0, sg, x_r0, x_c0, h_in, w_in, p.C_in, vec != 0, dt);
        } else {
          const int cv = v % vecs_row;
          const int cr = v / vecs_row;
          const int r = cr % sg.rows, c = cr / sg.rows;
          const int hi = x_r0 + r, wi = x_c0 + 4 * cv;
          if (c0 + c < cin && hi >= 0 && hi < h_in && wi < w_in && wi + 3 >= 0)
            xf[k] = staged_fetch4(p.x, x_img + (c0 + c) * hw_in + static_cast<int64_t>(hi) * w_in, wi, w_in,
                                  vec != 0, dt);
        }
      }
#pragma unroll
      for (int k = 0; k < kFetchWts; ++k) {
        const int i = tid + k * threads;
        wf[k] = 0.f;
        if (i >= w_elems) continue;
        const int kk = i % kWs;
        const int cp = i / kWs;  // channel x phases + phase
        const int q = cp % sg.phases, ci = c0 + cp / sg.phases;
        const int co = kk % kCo;
        const int tw = (kk / kCo) % kT;
        const int th = kk / (kCo * kT);  // >= kT in the padding
        const AxisPhase32& bh = g.h[q / stride_w];
        const AxisPhase32& bw = g.w[q % stride_w];
        if (ci < cin && th < bh.taps && tw < bw.taps && co < cout) {
          const int a = bh.a0 + th * bh.step;
          const int b = bw.a0 + tw * bw.step;
          const int64_t wc = static_cast<int64_t>(grp) * cin + ci;  // the weight's input channel
          wf[k] = staged_load(p.w, w_cl ? ((wc * p.kH + a) * p.kW + b) * cout + co
                                        : (wc * cout + co) * (p.kH * p.kW) + a * p.kW + b,
                              dt);
        }
      }
    };
    const auto put = [&](float* dst) {
#pragma unroll
      for (int k = 0; k < kFetchVecs; ++k) {
        const int v = tid + k * threads;
        if (v >= x_vecs) continue;
        if (x_cl) {
          staged_put_cl(dst, v, xf[k], sg);
        } else {
          *reinterpret_cast<float4*>(dst + 4 * v) = xf[k];
        }
      }
#pragma unroll
      for (int k = 0; k < kFetchWts; ++k) {
        const int i = tid + k * threads;
        if (i < w_elems) dst[sg.x_floats + i] = wf[k];
      }
    };

    float acc[kNsPix][kNsPix][kCo];
#pragma unroll
    for (int i = 0; i < kNsPix; ++i)
#pragma unroll
      for (int j = 0; j < kNsPix; ++j)
#pragma unroll
        for (int co = 0; co < kCo; ++co) acc[i][j][co] = 0.f;

    // The channels of one stage (with two warps a phase, those of parity `par`), the window starting kD columns
    // into the thread's first vector. kFull: every tap of kT x kT is the phase's. Otherwise the taps past the phase's
    // counts are skipped: their weights are 0, but 0 * inf is not.
    const auto channels = [&](const float* xb, const float* wb, int nc, int par, auto kd_tag, auto full_tag) {
      constexpr int kD = decltype(kd_tag)::value;
      constexpr bool kFull = decltype(full_tag)::value;
      constexpr int kVecs = (kD + kT + 2) / 4 + 1;  // vectors covering columns kD .. kD + kNsPix + kT - 2
#pragma unroll
      for (int c = 0; c < kNsCC; ++c) {
        if (c >= nc) break;
        if (kHalves == 2 && (c & 1) != par) continue;
        const float* xc = xb + c * (sg.rows * sg.pitch);
        float wv[kWs];
#pragma unroll
        for (int v = 0; v < kWs; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(wb + c * sg.phases * kWs + v);
          wv[v] = q.x;
          wv[v + 1] = q.y;
          wv[v + 2] = q.z;
          wv[v + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < kWin; ++r) {
          float xr[4 * kVecs];
#pragma unroll
          for (int v = 0; v < kVecs; ++v) {
            const float4 q = *reinterpret_cast<const float4*>(xc + r * sg.pitch + 4 * v);
            xr[4 * v] = q.x;
            xr[4 * v + 1] = q.y;
            xr[4 * v + 2] = q.z;
            xr[4 * v + 3] = q.w;
          }
#pragma unroll
          for (int th = 0; th < kT; ++th) {
            const int i = r + th - (kT - 1);  // the thread's row that window row r serves through tap th
            if (i < 0 || i >= kNsPix) continue;
            if (!kFull && th >= taps_h) continue;
#pragma unroll
            for (int tw = 0; tw < kT; ++tw) {
              if (!kFull && tw >= taps_w) continue;
#pragma unroll
              for (int j = 0; j < kNsPix; ++j)
#pragma unroll
                for (int co = 0; co < kCo; ++co)
                  acc[i][j][co] = fmaf(xr[kD + j + kT - 1 - tw], wv[(th * kT + tw) * kCo + co], acc[i][j][co]);
            }
          }
        }
      }
    };
    const auto run = [&](const float* buf, int nc, int par, auto full_tag) {
      // The thread's window: staged row (base_h - least base) + 4 ty, the vector holding staged column e + 4 tx.
      const float* xb = buf + (ah.base - sg.base_h + kNsPix * ty) * sg.pitch + 4 * (e >> 2) + kNsPix * tx;
      const float* wb = buf + sg.x_floats + ph * kWs;
      switch (kd) {
        case 0:
          channels(xb, wb, nc, par, std::integral_constant<int, 0>{}, full_tag);
          break;
        case 1:
          channels(xb, wb, nc, par, std::integral_constant<int, 1>{}, full_tag);
          break;
        case 2:
          channels(xb, wb, nc, par, std::integral_constant<int, 2>{}, full_tag);
          break;
        default:
          channels(xb, wb, nc, par, std::integral_constant<int, 3>{}, full_tag);
          break;
      }
    };

    __syncthreads();  // every thread is done with the previous region's buffers
    fetch(0);
    put(smem);
    __syncthreads();
    for (int s = 0; s < stages; ++s) {
      if (s + 1 < stages) fetch(s + 1);  // in flight while this stage multiplies
      if (any) {
        const float* buf = smem + (s & 1) * stage;
        const int nc = min(sg.cc, cin - s * sg.cc);
        const int par = (half + s * sg.cc) & 1;  // this warp's channels s cc + c: those of its half's parity
        if (full) {
          run(buf, nc, par, std::integral_constant<bool, true>{});
        } else {
          run(buf, nc, par, std::integral_constant<bool, false>{});
        }
      }
      if (s + 1 < stages) put(smem + ((s + 1) & 1) * stage);  // that buffer's stage (s - 1) is done everywhere
      __syncthreads();
    }
    if (kHalves == 2) {  // the second warps' sums into the first's, through the idle stage buffers
      const int t = tid - half * 32 * sg.phases;  // the thread's place in its half
      const int n_t = 32 * sg.phases;
#pragma unroll
      for (int i = 0; i < kNsPix; ++i)
#pragma unroll
        for (int j = 0; j < kNsPix; ++j)
          if (half == 1) smem[(i * kNsPix + j) * n_t + t] = acc[i][j][0];
      __syncthreads();
      if (half == 1) continue;  // the next region's first barrier waits for the first warps' reads
#pragma unroll
      for (int i = 0; i < kNsPix; ++i)
#pragma unroll
        for (int j = 0; j < kNsPix; ++j) acc[i][j][0] += smem[(i * kNsPix + j) * n_t + t];
    }

    // Epilogue: bias, convert, stores at (ho, wo) = (o0_h + qh * stride_h, o0_w + qw * stride_w), NCHW or
    // channels-last.
    const int64_t y_img = y_cl ? n * hw_out * p.C_out + static_cast<int64_t>(grp) * cout
                               : (n * p.C_out + static_cast<int64_t>(grp) * cout) * hw_out;
#pragma unroll
    for (int co = 0; co < kCo; ++co) {
      if (co >= cout) continue;
      const float b = p.bias != nullptr ? staged_load(p.bias, grp * cout + co, dt) : 0.f;
#pragma unroll
      for (int i = 0; i < kNsPix; ++i) {
        const int qh = q_r0 + kNsPix * ty + i;
        if (qh >= ah.count) continue;
        const int64_t ho = ah.o0 + static_cast<int64_t>(qh) * p.stride_h;
#pragma unroll
        for (int j = 0; j < kNsPix; ++j) {
          const int qw = q_c0 + kNsPix * tx + j;
          if (qw >= aw.count) continue;
          const int64_t pos = ho * p.W_out + aw.o0 + static_cast<int64_t>(qw) * p.stride_w;
          staged_store(p.y, y_cl ? y_img + pos * p.C_out + co : y_img + co * hw_out + pos, acc[i][j][co] + b, dt);
        }
      }
    }
  }
}

template <int kCo, int kT>
cudaError_t staged_launch_shape(const ConvTranspose2dParams& p, const NarrowGeom& g, const StagedGeom& sg,
                                cudaStream_t stream) {
  constexpr int kHalves = kCo == 1 ? 2 : 1;  // sg.halves
  constexpr auto kKernel = conv_transpose2d_narrow_staged_kernel<kCo, kT, kHalves>;
  const cudaError_t err = opt_in_shared_memory<kKernel>();
  if (err != cudaSuccess) return err;
  const int64_t units = p.N * static_cast<int64_t>(sg.tiles_h) * sg.tiles_w * p.groups;
  const int dt = p.dtype == DType::kFloat32 ? kNsF32 : p.dtype == DType::kFloat16 ? kNsF16 : kNsBF16;
  const size_t bytes = dt == kNsF32 ? 4 : 2;
  // Whole, aligned vectors of 4 values: along a row (NCHW) or over 4 channels of a stage (channels-last, cc 4).
  const bool whole = p.x_channels_last ? sg.cc == 4 && (p.C_in / p.groups) % 4 == 0 : p.W_in % 4 == 0;
  const bool vec = whole && reinterpret_cast<uintptr_t>(p.x) % (4 * bytes) == 0;
  // The kernel loops over regions past the grid's limit: clamping costs parallelism only.
  const dim3 grid(static_cast<unsigned>(units < 0x7fffffff ? units : 0x7fffffff));
  kKernel<<<grid, 32 * sg.phases * kHalves, staged_smem_bytes(sg), stream>>>(p, g, sg, vec ? 1 : 0, dt);
  return cudaGetLastError();
}

// fp32, fp16 or bf16 (staged_fits).
cudaError_t launch_staged(const ConvTranspose2dParams& p, const NarrowGeom& g, cudaStream_t stream) {
  const StagedGeom sg = make_staged_geom(p, g);
  const bool three = tiled_taps(p) == 3;
  switch (staged_cout(p)) {
    case 1:
      return three ? staged_launch_shape<1, 3>(p, g, sg, stream) : staged_launch_shape<1, 2>(p, g, sg, stream);
    case 3:
      return three ? staged_launch_shape<3, 3>(p, g, sg, stream) : staged_launch_shape<3, 2>(p, g, sg, stream);
    default:
      return three ? staged_launch_shape<4, 3>(p, g, sg, stream) : staged_launch_shape<4, 2>(p, g, sg, stream);
  }
}

// Whether the staged form takes a problem the tiled form takes: at most 4 output channels a group, 4 to 9 phases
// (a warp each), a stage's values within what the block's threads fetch, both buffers within the device's shared
// memory.
bool staged_fits(const ConvTranspose2dParams& p) {
  const int64_t phases = p.stride_h * p.stride_w;
  if (p.dtype == DType::kFloat64 || p.C_out / p.groups > kNsMaxCout || phases < kNsMinPhases ||
      phases > kNsMaxPhases)
    return false;
  const StagedGeom sg = make_staged_geom(p, make_narrow_geom(p));
  const int threads = 32 * sg.phases;
  return sg.x_floats / 4 <= kNsMaxVecs * threads && sg.w_floats <= kNsMaxWts * threads &&
         staged_smem_bytes(sg) <= max_dynamic_smem();
}

template <typename T>
cudaError_t tiled_launch_dtype(const ConvTranspose2dParams& p, int config, const NarrowGeom& g,
                               cudaStream_t stream) {
  if (config == 0) {
    return tiled_taps(p) == 2 ? tiled_launch_taps<T, 2, 1>(p, g, stream) : tiled_launch_taps<T, 3, 1>(p, g, stream);
  }
  return tiled_taps(p) == 2 ? tiled_launch_taps<T, 2, 2>(p, g, stream) : tiled_launch_taps<T, 3, 2>(p, g, stream);
}

NarrowGeom make_narrow_geom(const ConvTranspose2dParams& p) {
  NarrowGeom g{};
  for (int64_t r = 0; r < p.stride_h; ++r) g.h[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) g.w[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  g.cin = static_cast<int>(p.C_in / p.groups);
  g.cout = static_cast<int>(p.C_out / p.groups);
  g.rows = static_cast<int>((p.H_out + p.stride_h - 1) / p.stride_h);
  g.cols = static_cast<int>((p.W_out + p.stride_w - 1) / p.stride_w);
  return g;
}

}  // namespace

bool narrow_eligible(const ConvTranspose2dParams& p) {
  const int64_t cout_g = p.C_out / p.groups;
  return cout_g >= 1 && cout_g <= 8 && narrow_index_ok(p) && narrow_smem_bytes(p) <= kNarrowMaxSmem;
}

cudaError_t launch_narrow(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!narrow_eligible(p)) return cudaErrorInvalidValue;
  const NarrowGeom g = make_narrow_geom(p);
  switch (p.dtype) {
    case DType::kFloat32:
      return narrow_launch_dtype<float>(p, g, stream);
    case DType::kFloat16:
      return narrow_launch_dtype<__half>(p, g, stream);
    case DType::kBFloat16:
      return narrow_launch_dtype<__nv_bfloat16>(p, g, stream);
    case DType::kFloat64:
      return narrow_launch_dtype<double>(p, g, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv

namespace deconv {

bool narrow_tiled_eligible(const ConvTranspose2dParams& p) {
  const int64_t cout_g = p.C_out / p.groups;
  if (p.dtype == DType::kFloat64 || cout_g < 1 || cout_g > kTiledMaxCout || !narrow_index_ok(p)) return false;
  // Per-tap input step 1 on both axes: dilation / gcd(stride, dilation) == 1.
  if (p.dil_h != gcd64(p.stride_h, p.dil_h) || p.dil_w != gcd64(p.stride_w, p.dil_w)) return false;
  if (max_phase_taps(p.stride_h, p.dil_h, p.kH) > kTiledMaxTaps) return false;
  if (max_phase_taps(p.stride_w, p.dil_w, p.kW) > kTiledMaxTaps) return false;
  if (p.H_in * p.W_in > (int64_t(1) << 30)) return false;  // plane positions in 32 bits (H_in, W_in < 2^28)
  return tiled_smem_bytes(p) <= kNarrowMaxSmem;
}

bool narrow_tiled_preferred(const ConvTranspose2dParams& p) {
  return p.C_out / p.groups <= 8 && p.N * p.H_out * p.W_out * p.groups >= kTiledMinPixels;
}

namespace {

// Where the staged form is the default: one output channel a group (two warps a phase), 9 phases of 3 taps (18 warps
// a block, one block an SM), at least 4 input channels a group, and regions that fill their waves of one block an SM
// to at least 85%; in 16 bits one wave at most. Measured (bench/NOTES.md v41, cold us against the better of
// configurations 0 and 1): fsrcnn-x3, 128 regions on 132 SMs, 52.6 against 68.1 in fp32 and 60.3 against 71.6 in
// BF16; 960 x 540 frames, 1020 regions in 7.7 waves, 362 against 373 in fp32 but 426 against 389 in BF16; slower
// with 150 regions (2 waves: 94.7 against 87.8), 8 regions (49.5 against 33.8), 4 phases (118 against 87) and 3
// output channels (one warp a phase, 168 registers: 127 against 116, 293 against 107 with 4 phases).
bool staged_preferred(const ConvTranspose2dParams& p) {
  if (p.C_out / p.groups != 1 || p.stride_h != 3 || p.stride_w != 3 || tiled_taps(p) != 3 || p.C_in / p.groups < 4 ||
      !staged_fits(p))
    return false;
  const StagedGeom sg = make_staged_geom(p, make_narrow_geom(p));
  const int64_t regions = p.N * static_cast<int64_t>(sg.tiles_h) * sg.tiles_w * p.groups;
  const int64_t sms = sm_count() > 0 ? sm_count() : 132;
  const int64_t waves = (regions + sms - 1) / sms;
  if (p.dtype != DType::kFloat32 && waves > 1) return false;
  return regions * 100 >= 85 * waves * sms;
}

}  // namespace

// The default: one column a thread for 3 taps a phase (the 6-row, 3-tap window of a column takes the registers a
// second column would: 95 against 127, so more warps an SM; fsrcnn-x3 0.070 against 0.094 ms), two otherwise
// (dcgan64-rgb, pix2pix-rgb and the depthwise dla layers 1.1-1.9x faster with two; bench/NOTES.md v21, `probes.py
// narrow`); but the staged form where staged_preferred says (slower than configuration 1 on every 2-tap layer
// measured, pix2pix-rgb 370 against 192 us: bench/NOTES.md v40-v41). Configuration 2 forced where the staged form
// does not fit runs the default.
int narrow_tiled_config(const ConvTranspose2dParams& p) {
  const int forced = p.force_config;
  if (forced >= 0 && forced < kNumNarrowTiledConfigs && (forced != 2 || staged_fits(p))) return forced;
  if (tiled_taps(p) < 3) return 1;
  return staged_preferred(p) ? 2 : 0;
}

cudaError_t launch_narrow_tiled(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  if (!narrow_tiled_eligible(p) || config < 0 || config >= kNumNarrowTiledConfigs) return cudaErrorInvalidValue;
  if (config == 2 && !staged_fits(p)) return cudaErrorInvalidValue;
  const NarrowGeom g = make_narrow_geom(p);
  if (config == 2) return launch_staged(p, g, stream);  // either layout of x, the weights and y
  if (p.x_channels_last || p.w_channels_last || p.y_channels_last) return cudaErrorInvalidValue;  // NCHW only
  switch (p.dtype) {
    case DType::kFloat32:
      return tiled_launch_dtype<float>(p, config, g, stream);
    case DType::kFloat16:
      return tiled_launch_dtype<__half>(p, config, g, stream);
    case DType::kBFloat16:
      return tiled_launch_dtype<__nv_bfloat16>(p, config, g, stream);
    case DType::kFloat64:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv
