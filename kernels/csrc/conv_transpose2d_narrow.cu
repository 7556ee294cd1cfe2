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

#include <cstdint>
#include <initializer_list>

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

}  // namespace

bool narrow_eligible(const ConvTranspose2dParams& p) {
  const int64_t cout_g = p.C_out / p.groups;
  return cout_g >= 1 && cout_g <= 8 && narrow_index_ok(p) && narrow_smem_bytes(p) <= kNarrowMaxSmem;
}

cudaError_t launch_narrow(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!narrow_eligible(p)) return cudaErrorInvalidValue;
  NarrowGeom g{};
  for (int64_t r = 0; r < p.stride_h; ++r) g.h[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) g.w[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  g.cin = static_cast<int>(p.C_in / p.groups);
  g.cout = static_cast<int>(p.C_out / p.groups);
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
