// ConvTranspose2d forward as an implicit GEMM over stride phases.
//
// The output is split into stride_h x stride_w phases: the output rows ho with (ho + pad_h) % stride_h == r_h
// (and likewise columns). Inside one phase every output pixel sees the same set of kernel taps, and those taps
// form an arithmetic progression (a = a0, a0 + step, ...), so each phase is a dense GEMM with no multiply on an
// inserted zero:
//   M = N * rows_in_phase * cols_in_phase   (output pixels)
//   N = C_out / groups                      (output channels of one group)
//   K = C_in / groups * taps_h * taps_w     (input channels x valid taps)
// A[m, k] = x[n, ci, hi, wi] (zero outside the input), B[k, co] = w[ci, co, a, b].
// A phase with no valid tap on an axis writes the bias (or zeros).
//
// This file holds the portable SIMT kernel (every dtype, exact fp32 and fp64) and the launcher that picks one of
// five kernel families:
//   narrow      (conv_transpose2d_narrow.cu) for C_out / groups <= 8 when its weights fit in shared memory:
//               a thread holds every output channel of its pixels; every dtype, exact FFMA; in its tiled form
//               (fp32/fp16/bf16, up to 3 taps a phase per axis, large outputs) 4 x 2 pixels a thread, each
//               loaded input value used for every vertical tap that reads it;
//   sparse      (conv_transpose2d_sparse.cu) for layers whose output elements average at most 48 multiply-adds
//               (large strides, few input channels): a block writes runs of whole output rows; exact FFMA;
//   tensor core (conv_transpose2d_mma.cu: gather kernel; conv_transpose2d_halo.cu: halo tiles;
//               conv_transpose2d_wgmma.cu: warp-specialized halo tiles on sm_90 wgmma) for dense layers in
//               float32 / bfloat16 / float16;
//   gemm        (conv_transpose2d_gemm.cu, conv_transpose2d_gemm_sync.cu) for channel-heavy layers and 1 x 1
//               inputs: 128-pixel tiles across images over a channels-last input, wgmma with both operands in
//               shared memory on sm_90 (the default there), mma.sync on sm_80 and newer (measured choice);
//   SIMT        (below) for everything else (float64, too few input channels, weights too large for narrow).
// It needs nothing newer than sm_80; the wgmma tiles run where the build holds sm_90a code (kernels/build.py).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "phase.cuh"

namespace deconv {
namespace {

// ---------------------------------------------------------------------------------------------------------
// SIMT implicit GEMM. One block computes a BM (pixels) x BN (output channels) tile of one (phase, group);
// K is walked in BK slices staged through shared memory; each thread owns TM x TN accumulators, strided by
// the thread-grid size so that neighbouring threads write neighbouring output pixels.
template <typename T, int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
    conv_transpose2d_simt_kernel(const ConvTranspose2dParams p) {
  using Acc = typename AccType<T>::type;
  constexpr int kThreadsM = BM / TM;
  constexpr int kThreadsN = BN / TN;
  constexpr int kThreads = kThreadsM * kThreadsN;
  static_assert(kThreads % BM == 0 && kThreads % BN == 0, "loader mapping needs BM, BN | threads");
  static_assert((BK * BM) % kThreads == 0 && (BK * BN) % kThreads == 0, "tile must split evenly");
  constexpr int kRowsA = kThreads / BM;  // k rows of A loaded per pass
  constexpr int kRowsB = kThreads / BN;

  __shared__ Acc As[BK][BM];
  __shared__ Acc Bs[BK][BN];

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ w = static_cast<const T*>(p.w);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int tid = threadIdx.x;
  const int64_t cin_g = p.C_in / p.groups;
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t khw = p.kH * p.kW;
  const int64_t num_z = p.stride_h * p.stride_w * p.groups;

  for (int64_t z = blockIdx.z; z < num_z; z += gridDim.z) {
    const int64_t grp = z % p.groups;
    const int64_t phase = z / p.groups;
    const AxisPhase ah = make_axis_phase(phase / p.stride_w, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
    const AxisPhase aw = make_axis_phase(phase % p.stride_w, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
    const int64_t pix_per_img = ah.count * aw.count;
    const int64_t M = p.N * pix_per_img;
    const int64_t taps = ah.taps * aw.taps;
    const int64_t K = cin_g * taps;

    for (int64_t nt = blockIdx.y; nt * BN < cout_g; nt += gridDim.y) {
      for (int64_t mt = blockIdx.x; mt * BM < M; mt += gridDim.x) {
        // This thread's A-load row: one output pixel, decoded once per tile.
        const int lm = tid % BM;
        const int64_t m_load = mt * BM + lm;
        const bool m_ok = m_load < M;
        int64_t x_img = 0, hbase = 0, wbase = 0;
        if (m_ok) {
          const int64_t n = m_load / pix_per_img;
          const int64_t rem = m_load - n * pix_per_img;
          const int64_t qh = rem / aw.count;
          const int64_t qw = rem - qh * aw.count;
          x_img = (n * p.C_in + grp * cin_g) * hw_in;
          hbase = qh + ah.base;
          wbase = qw + aw.base;
        }
        // This thread's B-load column: one output channel.
        const int lc = tid % BN;
        const int64_t co_load = nt * BN + lc;
        const bool co_ok = co_load < cout_g;

        Acc acc[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

        for (int64_t k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
          for (int r = 0; r < BK; r += kRowsA) {
            const int kk = r + tid / BM;
            const int64_t k = k0 + kk;
            Acc v = Acc(0);
            if (m_ok && k < K) {
              // k -> (tap_h, tap_w, ci), ci fastest.
              const int64_t tap = k / cin_g;
              const int64_t ci = k - tap * cin_g;
              const int64_t th = tap / aw.taps;
              const int64_t tw = tap - th * aw.taps;
              const int64_t hi = hbase - th * ah.dstep;
              const int64_t wi = wbase - tw * aw.dstep;
              if (hi >= 0 && hi < p.H_in && wi >= 0 && wi < p.W_in) {
                v = to_acc(x[x_img + ci * hw_in + hi * p.W_in + wi]);
              }
            }
            As[kk][lm] = v;
          }
#pragma unroll
          for (int r = 0; r < BK; r += kRowsB) {
            const int kk = r + tid / BN;
            const int64_t k = k0 + kk;
            Acc v = Acc(0);
            if (co_ok && k < K) {
              const int64_t tap = k / cin_g;
              const int64_t ci = k - tap * cin_g;
              const int64_t th = tap / aw.taps;
              const int64_t tw = tap - th * aw.taps;
              const int64_t a = ah.a0 + th * ah.step;
              const int64_t b = aw.a0 + tw * aw.step;
              v = to_acc(w[((grp * cin_g + ci) * cout_g + co_load) * khw + a * p.kW + b]);
            }
            Bs[kk][lc] = v;
          }
          __syncthreads();
#pragma unroll
          for (int kk = 0; kk < BK; ++kk) {
            Acc av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) av[i] = As[kk][tid % kThreadsM + i * kThreadsM];
#pragma unroll
            for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tid / kThreadsM + j * kThreadsN];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
              for (int j = 0; j < TN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
          }
          __syncthreads();
        }

        // Epilogue: bias, convert, scatter this phase's pixels back to NCHW.
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const int64_t m = mt * BM + tid % kThreadsM + i * kThreadsM;
          if (m >= M) continue;
          const int64_t n = m / pix_per_img;
          const int64_t rem = m - n * pix_per_img;
          const int64_t qh = rem / aw.count;
          const int64_t qw = rem - qh * aw.count;
          const int64_t ho = ah.o0 + qh * p.stride_h;
          const int64_t wo = aw.o0 + qw * p.stride_w;
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            const int64_t co = nt * BN + tid / kThreadsM + j * kThreadsN;
            if (co >= cout_g) continue;
            const int64_t cog = grp * cout_g + co;
            Acc v = acc[i][j];
            if (bias != nullptr) v += to_acc(bias[cog]);
            y[((n * p.C_out + cog) * p.H_out + ho) * p.W_out + wo] = store_cast<T, Acc>(v);
          }
        }
      }
    }
  }
}

template <typename T>
cudaError_t launch_simt(const ConvTranspose2dParams& p, cudaStream_t stream) {
  constexpr int BM = 64, BN = 64, BK = 16, TM = 4, TN = 4;
  constexpr int kThreads = (BM / TM) * (BN / TN);
  // Largest phase: ceil(H_out / stride_h) x ceil(W_out / stride_w) pixels per image.
  const int64_t max_m = p.N * ((p.H_out + p.stride_h - 1) / p.stride_h) * ((p.W_out + p.stride_w - 1) / p.stride_w);
  const int64_t m_tiles = (max_m + BM - 1) / BM;
  const int64_t n_tiles = (p.C_out / p.groups + BN - 1) / BN;
  const int64_t z = p.stride_h * p.stride_w * p.groups;
  // The kernel loops over tiles past the grid's limits, so clamping only costs parallelism, never coverage.
  const dim3 grid(static_cast<unsigned>(m_tiles < 0x7fffffff ? m_tiles : 0x7fffffff),
                  static_cast<unsigned>(n_tiles < 65535 ? n_tiles : 65535),
                  static_cast<unsigned>(z < 65535 ? z : 65535));
  conv_transpose2d_simt_kernel<T, BM, BN, BK, TM, TN><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

namespace {

// Whether the gemm kernel is the default for an eligible problem: layers with many channels on both sides, where
// its 128-pixel tiles across images and whole 128-byte channel rows beat the halo tiles (bench/NOTES.md v15), and
// layers of one input pixel, which the gemm path runs as one plain GEMM per tap while the other kernels tile
// pixels (the DCGAN latent layer: 3.8x, v18).
bool gemm_preferred(const ConvTranspose2dParams& p) {
  const int64_t cout_g = p.C_out / p.groups;
  return (p.C_in / p.groups >= 128 && cout_g >= 64) || (p.H_in == 1 && p.W_in == 1 && cout_g >= 64);
}

// force_path 0 runs the SIMT kernel; 1-9 run the tensor-core, narrow, sparse, gemm, tiled narrow, shuffle and fold
// kernels, the taps path and the fused taps kernel when eligible, else what -1 chooses: the fold kernel when
// preferred (either layout as it is), then the shuffle kernel when eligible and preferred (it takes the NCHW tensors
// the others would convert), then the taps path when preferred, then the tiled narrow kernel when eligible and
// preferred, then the fused taps kernel when preferred (small layers of few output channels), then the narrow
// kernel when eligible, then the sparse kernel when preferred (none of these when force_config asks for the tensor
// cores), then the gemm kernel when eligible and preferred, then the tensor cores when eligible, then the SIMT
// kernel. Only force_path -1 or 6 runs the shuffle kernel, -1 or 7 the fold kernel, -1 or 8 the taps path and -1 or
// 9 the fused taps kernel (also measured choice's candidate). A forced family is timed as it runs on its own.
KernelPlan choose_kernel(const ConvTranspose2dParams& p) {
  if (p.force_path == 0) return {KernelPath::kSimt, -1};
  if (p.force_path == 4 && gemm_eligible(p)) return {KernelPath::kGemm, gemm_config(p)};
  if (p.force_path == 1) {
    const int config = tensor_core_config(p);
    if (config >= 0) return {KernelPath::kTensorCore, config};
  }
  if (p.force_path == 2 && narrow_eligible(p)) return {KernelPath::kNarrow, -1};
  if (p.force_path == 3 && sparse_eligible(p)) return {KernelPath::kSparse, -1};
  if (p.force_path == 5 && narrow_tiled_eligible(p)) return {KernelPath::kNarrowTiled, narrow_tiled_config(p)};
  if (p.force_path == 6 && shuffle_eligible(p)) return {KernelPath::kShuffle, -1};
  if (p.force_path == 7 && fold_eligible(p)) return {KernelPath::kFold, -1};
  if (p.force_path == 8 && taps_eligible(p)) return {KernelPath::kTaps, taps_config(p)};
  if (p.force_path == 9 && taps_fused_eligible(p)) return {KernelPath::kTapsFused, -1};
  if (p.force_path < 0 && p.force_config < 0 && fold_preferred(p)) return {KernelPath::kFold, -1};
  if (p.force_path < 0 && p.force_config < 0 && shuffle_eligible(p) && shuffle_preferred(p))
    return {KernelPath::kShuffle, -1};
  if (p.force_path < 0 && p.force_config < 0 && taps_preferred(p)) return {KernelPath::kTaps, taps_config(p)};
  if (p.force_config < 0 && narrow_tiled_eligible(p) && narrow_tiled_preferred(p))
    return {KernelPath::kNarrowTiled, narrow_tiled_config(p)};
  if (p.force_path < 0 && p.force_config < 0 && taps_fused_preferred(p)) return {KernelPath::kTapsFused, -1};
  if (p.force_config < 0 && narrow_eligible(p)) return {KernelPath::kNarrow, -1};
  if (p.force_config < 0 && sparse_preferred(p)) return {KernelPath::kSparse, -1};
  if (p.force_config < 0 && gemm_preferred(p) && gemm_default_ready() && gemm_eligible(p))
    return {KernelPath::kGemm, gemm_config(p)};
  const int config = tensor_core_config(p);
  if (config >= 0) return {KernelPath::kTensorCore, config};
  return {KernelPath::kSimt, -1};
}

}  // namespace

KernelPlan conv_transpose2d_plan(const ConvTranspose2dParams& p) { return choose_kernel(p); }

size_t conv_transpose2d_workspace_bytes(const ConvTranspose2dParams& p, const KernelPlan& c) {
  if (c.path == KernelPath::kGemm) return gemm_workspace_bytes(p, c.config);
  if (c.path == KernelPath::kTaps) return taps_workspace_bytes(p, c.config);
  if (c.path == KernelPath::kShuffle) return shuffle_workspace_bytes(p);
  return c.path == KernelPath::kTensorCore && p.packed_weights == nullptr ? tensor_core_workspace_bytes(p, c.config)
                                                                           : 0;
}

WeightPacking conv_transpose2d_packing(const ConvTranspose2dParams& p, const KernelPlan& c) {
  if (c.path == KernelPath::kGemm) return gemm_packing(p, c.config);
  if (c.path == KernelPath::kTaps) return taps_packing(p, c.config);
  if (c.path == KernelPath::kShuffle) return shuffle_packing(p);
  return c.path == KernelPath::kTensorCore ? tensor_core_packing(p, c.config) : WeightPacking{};
}

cudaError_t conv_transpose2d_pack(const ConvTranspose2dParams& p, const KernelPlan& c, void* dst,
                                  cudaStream_t stream) {
  if (c.path == KernelPath::kGemm) return gemm_pack(p, dst, stream);
  if (c.path == KernelPath::kTaps) return taps_pack(p, dst, stream);
  if (c.path == KernelPath::kShuffle) return shuffle_pack(p, dst, stream);
  return c.path == KernelPath::kTensorCore ? tensor_core_pack(p, c.config, dst, stream) : cudaSuccess;
}

cudaError_t conv_transpose2d_forward(const ConvTranspose2dParams& p, const KernelPlan& c, cudaStream_t stream) {
  if (c.path == KernelPath::kFold) return launch_fold(p, stream);  // either layout
  if (c.path == KernelPath::kTapsFused) return launch_taps_fused(p, stream);  // either layout
  if (c.path == KernelPath::kNarrowTiled && c.config == 2) return launch_narrow_tiled(p, 2, stream);  // either layout
  const bool reads_cl = c.path == KernelPath::kGemm || c.path == KernelPath::kTaps;
  if (reads_cl != p.x_channels_last || p.y_channels_last && !reads_cl)
    return cudaErrorInvalidValue;  // the binding lays x and y out for the path (conv_transpose2d_path)
  if (c.path == KernelPath::kGemm) return launch_gemm(p, c.config, stream);
  if (c.path == KernelPath::kTaps) return launch_taps(p, c.config, stream);
  if (c.path == KernelPath::kShuffle) return launch_shuffle(p, stream);
  if (c.path == KernelPath::kTensorCore) {
    if (p.workspace == nullptr && p.packed_weights == nullptr) return cudaErrorInvalidValue;
    return launch_tensor_core(p, c.config, stream);
  }
  if (c.path == KernelPath::kNarrow) return launch_narrow(p, stream);
  if (c.path == KernelPath::kNarrowTiled) return launch_narrow_tiled(p, c.config, stream);
  if (c.path == KernelPath::kSparse) return launch_sparse(p, stream);
  switch (p.dtype) {
    case DType::kFloat32:
      return launch_simt<float>(p, stream);
    case DType::kFloat16:
      return launch_simt<__half>(p, stream);
    case DType::kBFloat16:
      return launch_simt<__nv_bfloat16>(p, stream);
    case DType::kFloat64:
      return launch_simt<double>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace deconv
