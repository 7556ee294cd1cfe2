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

// One column a thread for 3 taps a phase (the 6-row, 3-tap window of a column takes the registers a second column
// would: 95 against 127, so more warps an SM; fsrcnn-x3 0.070 against 0.094 ms), two otherwise (dcgan64-rgb,
// pix2pix-rgb and the depthwise dla layers 1.1-1.9x faster with two). bench/NOTES.md v21, `probes.py narrow`.
int narrow_tiled_config(const ConvTranspose2dParams& p) {
  if (p.force_config >= 0 && p.force_config < kNumNarrowTiledConfigs) return p.force_config;
  return tiled_taps(p) >= 3 ? 0 : 1;
}

cudaError_t launch_narrow_tiled(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  if (!narrow_tiled_eligible(p) || config < 0 || config >= kNumNarrowTiledConfigs) return cudaErrorInvalidValue;
  const NarrowGeom g = make_narrow_geom(p);
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
