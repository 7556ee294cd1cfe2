// ConvTranspose2d forward for sparse-tap layers: the "sparse" kernel, a memory-bound path.
//
// When the stride is large against the dilated kernel (stride 5, 3x3 kernel, dilation 2: 16 of the 25 stride
// phases have no tap at all, the other 9 one) an output element costs a few dozen multiply-adds at most, and the
// time is the output's bytes. The phase GEMMs of the other kernels then spend it badly: each phase writes every
// output row in its own pass, pixels `stride` apart, so a warp's stores touch many sectors a few bytes each.
// Here a block owns kSparseThreads consecutive output pixels of one row (every phase), one image and one group:
//   - the input rows read by the output row's valid vertical taps are staged in shared memory once (the columns
//     that the block's pixels reach, zero outside the input), as fp32;
//   - per chunk of kCoc output channels, the weights of those vertical taps and every kernel column are staged,
//     [tap row][kernel column][input channel][kCoc] (rows padded by 4 words, so that the few kernel columns a
//     warp's pixels use sit in different banks), and read with 16-byte loads;
//   - a thread owns one pixel: its horizontal taps come from the per-residue phase table, every valid (row tap,
//     column tap) adds in-channels x kCoc exact FFMAs into kCoc accumulators, bias fused, and each output channel
//     is stored by the block's threads as one contiguous run of the row (coalesced NCHW stores).
// FFMA with fp32 accumulation in every mode (bf16/fp16 converted on staging). A TF32 request on an ungrouped layer
// stages both operands rounded to TF32 (nearest), giving the numbers of cuDNN's TF32 kernels, which PyTorch runs for
// such layers under its default flags; grouped layers stay exact, as cuDNN computes them (bench/NOTES.md v16).
// Pixels and rows without a valid tap get the bias (or zeros), like every kernel here.
// Eligible (sparse_eligible) for fp32/fp16/bf16 when the staged rows and one chunk's weights fit in 48 KiB,
// strides are at most 32, a row has at most kSparseMaxTapsH vertical taps and sizes fit 32-bit positions. Chosen
// by default (conv_transpose2d.cu) when the average output element costs at most kSparseMaxMacs multiply-adds.
//
// Every name here carries "sparse": kernels/build.py compiles all .cu files as one translation unit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "mma.cuh"
#include "phase.cuh"

namespace deconv {
namespace {

constexpr int kSparseThreads = 256;  // output pixels of one row a block
constexpr size_t kSparseMaxSmem = 48 * 1024;
constexpr int kSparseMaxStride = 32;
constexpr int kSparseMaxTapsH = 8;
constexpr int64_t kSparseMaxExtent = int64_t(1) << 28;  // sizes, paddings and kernel extents, per axis
constexpr int64_t kSparseMaxMacs = 48;  // default choice: average multiply-adds an output element

struct SparseGeom {
  AxisPhase32 h[kSparseMaxStride];  // by residue r_h < stride_h (phase.cuh)
  AxisPhase32 w[kSparseMaxStride];  // by residue r_w < stride_w
  int cin, cout;                    // channels per group
  int taps_h;                       // most vertical taps of a row: staged input rows and weight rows
  int xwp;                          // staged input columns per (tap row, channel), a multiple of 4
  int pitch;                        // floats per (tap row, kernel column) of staged weights: cin * kCoc + 4
  bool round_tf32;                  // stage operands rounded to TF32
};

// An operand as staged: rounded to TF32 (to nearest, ties away from zero: what the tensor-core kernels do) or as is.
__device__ __forceinline__ float sparse_operand(float v, bool round_tf32) {
  return round_tf32 ? __uint_as_float(tc::to_tf32(v)) : v;
}

// Output channels a chunk: 32, or 16 when a group has at most 16.
int sparse_coc(const ConvTranspose2dParams& p) { return p.C_out / p.groups > 16 ? 32 : 16; }

// Input columns the pixels of one block reach, rounded up to a multiple of 4.
int64_t sparse_xwp(const ConvTranspose2dParams& p) {
  const int64_t span = (kSparseThreads - 1 + (p.kW - 1) * p.dil_w) / p.stride_w + 2;
  return (span + 3) / 4 * 4;
}

// Dynamic shared memory: staged input rows plus one chunk's weights; ~0 when the counts are out of range.
size_t sparse_smem_bytes(const ConvTranspose2dParams& p) {
  const int64_t cin = p.C_in / p.groups;
  const int64_t taps_h = max_phase_taps(p.stride_h, p.dil_h, p.kH);
  const int64_t limit = static_cast<int64_t>(kSparseMaxSmem) / 4;  // floats
  if (taps_h > kSparseMaxTapsH || cin > limit || p.kW > limit) return ~size_t(0);
  const int64_t x_floats = taps_h * cin * sparse_xwp(p);
  const int64_t w_floats = taps_h * p.kW * (cin * sparse_coc(p) + 4);
  if (x_floats + w_floats > limit) return ~size_t(0);
  return static_cast<size_t>(4 * (x_floats + w_floats));
}

bool sparse_index_ok(const ConvTranspose2dParams& p) {
  if (p.stride_h > kSparseMaxStride || p.stride_w > kSparseMaxStride) return false;
  for (const int64_t v : {p.H_in, p.W_in, p.H_out, p.W_out, p.pad_h, p.pad_w, p.dil_h, p.dil_w, p.kH, p.kW}) {
    if (v >= kSparseMaxExtent) return false;
  }
  if (p.dil_h * (p.kH - 1) >= kSparseMaxExtent || p.dil_w * (p.kW - 1) >= kSparseMaxExtent) return false;
  // Image x group numbers and channel counts stay 32-bit; memory offsets are 64-bit.
  return p.N < (int64_t(1) << 30) / p.groups && p.C_in < (int64_t(1) << 30) && p.C_out < (int64_t(1) << 30);
}

__device__ __forceinline__ int sparse_floor_div(int a, int b) {  // b > 0
  const int q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

template <typename T, int kCoc>
__global__ void __launch_bounds__(kSparseThreads)
    conv_transpose2d_sparse_kernel(const ConvTranspose2dParams p, const SparseGeom g) {
  static_assert(kCoc % 4 == 0, "16-byte weight loads");
  extern __shared__ __align__(16) float sparse_smem[];
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int cin = g.cin, cout = g.cout, xwp = g.xwp, pitch = g.pitch;
  const int groups = static_cast<int>(p.groups);
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
  const int h_out = static_cast<int>(p.H_out), w_out = static_cast<int>(p.W_out);
  const int k_h = static_cast<int>(p.kH), k_w = static_cast<int>(p.kW);
  const int stride_h = static_cast<int>(p.stride_h), stride_w = static_cast<int>(p.stride_w);
  const int pad_h = static_cast<int>(p.pad_h), pad_w = static_cast<int>(p.pad_w);
  float* xs = sparse_smem;                      // [tap row][cin][xwp]
  float* ws = sparse_smem + g.taps_h * cin * xwp;  // [tap row][k_w][pitch]

  // This thread's pixel and its horizontal phase: the same for every row and image of the block.
  const int ow0 = blockIdx.x * kSparseThreads;
  const int ow = ow0 + static_cast<int>(threadIdx.x);
  const bool in_row = ow < w_out;
  const AxisPhase32& aw = g.w[(ow + pad_w) % stride_w];
  const int qw = (ow - aw.o0) / stride_w;  // exact: ow has o0's residue and ow >= o0
  // First input column any pixel of the block reads (kernel column k_w - 1 of pixel ow0).
  const int iw_lo = sparse_floor_div(ow0 + pad_w - (k_w - 1) * static_cast<int>(p.dil_w), stride_w);

  const int num_z = static_cast<int>(p.N) * groups;
  for (int z = blockIdx.z; z < num_z; z += gridDim.z) {
    const int n = z / groups;
    const int grp = z - n * groups;
    const T* x_grp = x + (static_cast<int64_t>(n) * p.C_in + static_cast<int64_t>(grp) * cin) * p.H_in * p.W_in;
    for (int oh = blockIdx.y; oh < h_out; oh += gridDim.y) {
      // The row's vertical taps th read input row hi = qh + base - th * dstep; the valid ones are a contiguous
      // range [th_lo, th_hi] (hi falls as th grows). Block-uniform.
      const AxisPhase32& ah = g.h[(oh + pad_h) % stride_h];
      const int qh = (oh - ah.o0) / stride_h;
      const int top = qh + ah.base;
      const int th_lo = top >= h_in ? (top - h_in + ah.dstep) / ah.dstep : 0;  // first th with hi < h_in
      const int th_hi = min(ah.taps - 1, top >= 0 ? top / ah.dstep : -1);      // last th with hi >= 0
      const int rows = max(0, th_hi - th_lo + 1);

      __syncthreads();  // every thread is done with the previous row's staged input and weights
      for (int i = threadIdx.x; i < rows * cin * xwp; i += kSparseThreads) {
        const int col = i % xwp;
        const int rest = i / xwp;
        const int ci = rest % cin;
        const int tv = rest / cin;
        const int hi = top - (th_lo + tv) * ah.dstep;
        const int iw = iw_lo + col;
        xs[i] = (iw >= 0 && iw < w_in)
                    ? sparse_operand(to_acc(x_grp[(static_cast<int64_t>(ci) * h_in + hi) * w_in + iw]), g.round_tf32)
                    : 0.0f;
      }

      for (int c0 = 0; c0 < cout; c0 += kCoc) {
        if (c0 > 0) __syncthreads();  // every thread is done with the previous chunk's weights
        // Global weights are [C_in][C_out / groups][kH][kW]: the kernel column runs fastest in both orders.
        for (int i = threadIdx.x; i < rows * k_w * cin * kCoc; i += kSparseThreads) {
          const int a = i % k_w;
          int rest = i / k_w;
          const int j = rest % kCoc;
          rest /= kCoc;
          const int ci = rest % cin;
          const int tv = rest / cin;
          const int a_h = ah.a0 + (th_lo + tv) * ah.step;
          float v = 0.0f;
          if (c0 + j < cout) {
            v = sparse_operand(
                to_acc(w[((static_cast<int64_t>(grp) * cin + ci) * cout + c0 + j) * (k_h * k_w) + a_h * k_w + a]),
                g.round_tf32);
          }
          ws[(tv * k_w + a) * pitch + ci * kCoc + j] = v;
        }
        __syncthreads();

        float acc[kCoc];
#pragma unroll
        for (int j = 0; j < kCoc; ++j) acc[j] = 0.0f;
        if (in_row) {
          for (int tv = 0; tv < rows; ++tv) {
            const float* x_rows = xs + tv * cin * xwp;
            const float* w_rows = ws + tv * k_w * pitch;
            for (int tw = 0; tw < aw.taps; ++tw) {
              const int wi = qw + aw.base - tw * aw.dstep;
              if (wi < 0 || wi >= w_in) continue;
              const float* xp = x_rows + (wi - iw_lo);
              const float* wp = w_rows + (aw.a0 + tw * aw.step) * pitch;
#pragma unroll 2
              for (int ci = 0; ci < cin; ++ci) {
                const float xv = xp[ci * xwp];
                const float4* wv = reinterpret_cast<const float4*>(wp + ci * kCoc);
#pragma unroll
                for (int q = 0; q < kCoc / 4; ++q) {
                  const float4 v = wv[q];
                  acc[4 * q + 0] = fmaf(xv, v.x, acc[4 * q + 0]);
                  acc[4 * q + 1] = fmaf(xv, v.y, acc[4 * q + 1]);
                  acc[4 * q + 2] = fmaf(xv, v.z, acc[4 * q + 2]);
                  acc[4 * q + 3] = fmaf(xv, v.w, acc[4 * q + 3]);
                }
              }
            }
          }
          // Each output channel's pixels ow0 .. ow0 + 255 of this row: one contiguous run across the block.
          T* y_px = y + ((static_cast<int64_t>(n) * p.C_out + static_cast<int64_t>(grp) * cout + c0) * h_out + oh) *
                            w_out + ow;
#pragma unroll
          for (int j = 0; j < kCoc; ++j) {
            if (c0 + j >= cout) break;
            const float b = bias != nullptr ? to_acc(bias[grp * cout + c0 + j]) : 0.0f;
            y_px[static_cast<int64_t>(j) * h_out * w_out] = store_cast<T, float>(acc[j] + b);
          }
        }
      }
    }
  }
}

template <typename T, int kCoc>
cudaError_t sparse_launch(const ConvTranspose2dParams& p, const SparseGeom& g, cudaStream_t stream) {
  const size_t smem = sparse_smem_bytes(p);
  const int64_t z = p.N * p.groups;
  // The kernel loops over rows and (image, group)s past the grid's limits: clamping costs parallelism only.
  const dim3 grid(static_cast<unsigned>((p.W_out + kSparseThreads - 1) / kSparseThreads),
                  static_cast<unsigned>(p.H_out < 65535 ? p.H_out : 65535),
                  static_cast<unsigned>(z < 65535 ? z : 65535));
  conv_transpose2d_sparse_kernel<T, kCoc><<<grid, kSparseThreads, smem, stream>>>(p, g);
  return cudaGetLastError();
}

template <typename T>
cudaError_t sparse_launch_dtype(const ConvTranspose2dParams& p, const SparseGeom& g, cudaStream_t stream) {
  return sparse_coc(p) == 32 ? sparse_launch<T, 32>(p, g, stream) : sparse_launch<T, 16>(p, g, stream);
}

}  // namespace

bool sparse_eligible(const ConvTranspose2dParams& p) {
  return p.dtype != DType::kFloat64 && p.C_out / p.groups >= 1 && sparse_index_ok(p) &&
         sparse_smem_bytes(p) <= kSparseMaxSmem;
}

bool sparse_preferred(const ConvTranspose2dParams& p) {
  if (!sparse_eligible(p)) return false;
  // Average valid taps an output pixel: (sum over residues of each axis' taps) / stride, per axis.
  int64_t taps_h = 0, taps_w = 0;
  for (int64_t r = 0; r < p.stride_h; ++r) taps_h += make_axis_phase(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH).taps;
  for (int64_t r = 0; r < p.stride_w; ++r) taps_w += make_axis_phase(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW).taps;
  const int64_t cin = p.C_in / p.groups;
  // cin * taps_h * taps_w / (stride_h * stride_w) <= kSparseMaxMacs, in integers (all factors < 2^31 here).
  return cin * taps_h * taps_w <= kSparseMaxMacs * p.stride_h * p.stride_w;
}

cudaError_t launch_sparse(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!sparse_eligible(p)) return cudaErrorInvalidValue;
  SparseGeom g{};
  for (int64_t r = 0; r < p.stride_h; ++r) g.h[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) g.w[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  g.cin = static_cast<int>(p.C_in / p.groups);
  g.cout = static_cast<int>(p.C_out / p.groups);
  g.taps_h = static_cast<int>(max_phase_taps(p.stride_h, p.dil_h, p.kH));
  g.xwp = static_cast<int>(sparse_xwp(p));
  g.pitch = g.cin * sparse_coc(p) + 4;
  g.round_tf32 = p.dtype == DType::kFloat32 && p.precision == Precision::kTF32 && p.groups == 1;
  switch (p.dtype) {
    case DType::kFloat32:
      return sparse_launch_dtype<float>(p, g, stream);
    case DType::kFloat16:
      return sparse_launch_dtype<__half>(p, g, stream);
    case DType::kBFloat16:
      return sparse_launch_dtype<__nv_bfloat16>(p, g, stream);
    case DType::kFloat64:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv
