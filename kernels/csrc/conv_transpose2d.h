// Shared declarations between the CUDA kernels (conv_transpose2d.cu) and the torch binding (binding.cpp).
// Plain C++ and CUDA runtime only: no torch headers, so that the .cu files compile with nvcc alone.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace deconv {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// How float32 operands may be multiplied. bf16/fp16 always multiply natively and accumulate in fp32;
// float64 is always exact.
enum class Precision : int {
  kExactFp32 = 0,  // IEEE fp32 products and sums (FFMA)
  kTF32 = 1,       // tensor cores with operands rounded to TF32 (what cuDNN does with allow_tf32)
};

// One transposed convolution, already validated by the caller. All tensors contiguous NCHW.
// Gather form (docs/architecture.md): y[n, co, ho, wo] = bias[co] + sum over ci in co's group and taps (a, b) of
// x[n, ci, hi, wi] * w[ci, co % (C_out / groups), a, b], with hi = (ho + pad_h - a * dil_h) / stride_h
// when the division is exact and 0 <= hi < H_in (same for wi).
struct ConvTranspose2dParams {
  const void* x;     // x: [N, C_in, H_in, W_in]
  const void* w;     // w: [C_in, C_out / groups, kH, kW]
  const void* bias;  // bias: [C_out], or nullptr for none
  void* y;           // y: [N, C_out, H_out, W_out]
  int64_t N, C_in, H_in, W_in;
  int64_t C_out, H_out, W_out;
  int64_t kH, kW;
  int64_t stride_h, stride_w;
  int64_t pad_h, pad_w;
  int64_t dil_h, dil_w;
  int64_t groups;
  DType dtype;
  Precision precision;
  void* workspace;          // scratch of conv_transpose2d_workspace_bytes(p) bytes (packed weights), or nullptr
  // Weights already packed for the kernel this problem runs (conv_transpose2d_pack, same layout as
  // conv_transpose2d_packing says), or nullptr: the tensor-core kernels then pack them into the workspace first.
  const void* packed_weights;
  // Memory layouts: x is channels-last ([N, H_in, W_in, C_in] in memory) rather than NCHW, and so is y. Only the
  // gemm and taps paths (which need a channels-last x), the fold and fused taps kernels and the tiled narrow
  // kernel's staged form (configuration 2; these three take either layout as it is) read a channels-last x and
  // write a channels-last y; the binding converts for the rest.
  bool x_channels_last;
  bool y_channels_last;
  // w is channels-last ([C_in][kH][kW][C_out / groups] in memory). Only the gemm and taps paths (the gemm kernel
  // reads 16-bit ones as they are, gemm_reads_weights, and packs the others from that layout) and the families that
  // take either layout of x take such weights; the binding makes them NCHW-contiguous for the rest.
  bool w_channels_last;
  // Elements from one position of a channels-last x to the next, when larger than C_in (0: C_in): an x whose rows of
  // channels the binding padded to whole 16-byte vectors for the gemm path (one group only; the padding is zeros).
  int64_t x_pitch;
  // x's fp32 values are already TF32, rounded to nearest: the binding's layout change rounds an NCHW x on its way to
  // the gemm path's channels-last copy (convert_layout), and the gemm kernel then skips its own rounding of each
  // landed A stage. Rounding is idempotent: a kernel that rounds anyway gives the same numbers.
  bool x_tf32_rounded;
  // -1: choose; 0: SIMT; 1: tensor cores; 2: narrow; 3: sparse; 4: gemm; 5: tiled narrow; 6: shuffle; 7: fold;
  // 8: taps; 9: fused taps. A forced path that is not eligible for the problem falls back to the choice of -1.
  int force_path;
  // -1: choose; else a tile configuration index (tests and tuning): the tensor-core kernels', or with force_path 4
  // or 8 the gemm kernel's, or with force_path 5 the tiled narrow kernel's. With force_path -1 it asks for the tensor cores, which then run ahead of the narrow kernel.
  int force_config;
  // <= 0: choose; else the split-K factor: the halo kernel's (blocks of a cluster sharing a tile, at most 8; sm_90
  // and newer, elsewhere 1) or with force_path 4 or 8 the gemm kernel's (at most 16). Tests and tuning.
  int force_split;
};

// Which kernel family ran; reported back to Python for tests and benchmarks.
enum class KernelPath : int {
  kSimt = 0,
  kTensorCore = 1,
  kNarrow = 2,
  kSparse = 3,
  kGemm = 4,
  kNarrowTiled = 5,
  kShuffle = 6,
  kFold = 7,
  kTaps = 8,
  kTapsFused = 9
};

// The kernel that runs a problem: its family and tile configuration (-1 for families without one). Chosen from the
// sizes, the layouts and x's alignment, so made once x is in place (the binding lays x and y out for the family
// first: the gemm kernel reads a channels-last x; the others NCHW) and passed to the calls below.
struct KernelPlan {
  KernelPath path;
  int config;
};
KernelPlan conv_transpose2d_plan(const ConvTranspose2dParams& p);

// Bytes of scratch the forward pass needs for this problem (0 when the planned kernel needs none, or when
// p.packed_weights is given).
size_t conv_transpose2d_workspace_bytes(const ConvTranspose2dParams& p, const KernelPlan& plan);

// The packed copy of the weights that the kernel chosen for `p` reads: its size (0 when that kernel reads the
// weights as they are) and what its content depends on besides the weights themselves (two packings with equal
// fields are identical, so one can serve every problem of that layout).
struct WeightPacking {
  size_t bytes;
  int64_t kind;     // multiply kind: TF32, 3xTF32, BF16, FP16
  int64_t groups;
  int64_t ciw_pad;  // input-channel words per group, padded
  int64_t co_pad;   // output channels per group, padded to the tile width
  bool kmajor;      // K-major core matrices (the wgmma tiles)
  int64_t layout;   // 0: the tensor-core kernels' word layout; 1: the gemm kernel's [g][a][b][co][ci] elements;
                    // 2: the shuffle kernel's [co][a][b][ci] elements
};
WeightPacking conv_transpose2d_packing(const ConvTranspose2dParams& p, const KernelPlan& plan);
// Packs p.w for the planned kernel into `dst` (conv_transpose2d_packing(p, plan).bytes bytes) on `stream`.
cudaError_t conv_transpose2d_pack(const ConvTranspose2dParams& p, const KernelPlan& plan, void* dst,
                                  cudaStream_t stream);

// Launches the planned forward kernel on `stream`. Returns the launch's error code (cudaSuccess when queued).
cudaError_t conv_transpose2d_forward(const ConvTranspose2dParams& p, const KernelPlan& plan, cudaStream_t stream);

// Tensor-core path (conv_transpose2d_mma.cu). Configurations 0 .. kNumGatherConfigs - 1 are the gather kernel's
// tiles, the next kNumHaloConfigs the halo tiles (halo.cuh): mma.sync (conv_transpose2d_halo.cu) and, on sm_90,
// warp-specialized wgmma (conv_transpose2d_wgmma.cu).
constexpr int kNumGatherConfigs = 4;
constexpr int kNumHaloConfigs = 10;
constexpr int kNumTensorCoreConfigs = kNumGatherConfigs + kNumHaloConfigs;
int tensor_core_config(const ConvTranspose2dParams& p);  // chosen tile configuration, or -1 if not eligible
size_t tensor_core_workspace_bytes(const ConvTranspose2dParams& p, int config);
WeightPacking tensor_core_packing(const ConvTranspose2dParams& p, int config);
cudaError_t tensor_core_pack(const ConvTranspose2dParams& p, int config, void* dst, cudaStream_t stream);
cudaError_t launch_tensor_core(const ConvTranspose2dParams& p, int config, cudaStream_t stream);

// Halo kernel (conv_transpose2d_halo.cu); `config` counts from 0 within the halo configurations.
int halo_block_n(int config);                  // output channels per block
int halo_choose(const ConvTranspose2dParams& p);  // the halo configuration for this problem, or -1: gather kernel
// Whether a halo configuration runs a wgmma tile here, which reads its weights packed K-major (mma.cuh).
bool halo_kmajor(const ConvTranspose2dParams& p, int config);
cudaError_t launch_halo(const ConvTranspose2dParams& p, int config, const uint32_t* packed_weights,
                        int64_t ciw_pad, int64_t co_pad, cudaStream_t stream);

// Narrow kernel (conv_transpose2d_narrow.cu): few output channels per group (C_out / groups <= 8), every dtype,
// exact FFMA. Eligible when C_out / groups <= 8, the largest phase's weights fit in 48 KiB of shared memory,
// strides are at most 32 and sizes leave room for 32-bit positions (memory offsets stay 64-bit).
bool narrow_eligible(const ConvTranspose2dParams& p);
cudaError_t launch_narrow(const ConvTranspose2dParams& p, cudaStream_t stream);
// Its tiled form: a thread owns 1-4 rows x 1 or 2 columns (configuration 0 or 1) of a phase and reuses each loaded
// input value for every vertical tap that reads it; configuration 2 (at most 4 output channels a group) stages a
// region's input window in shared memory, gives a thread 4 x 4 positions and reads x and the weights and writes y in
// either layout (configurations 0 and 1: NCHW only). fp32/fp16/bf16; eligible for up to 32 output channels a group
// when the per-tap input step is 1 on both axes (dilation divides stride), no phase has more than 3 taps on an axis,
// its weights fit in 48 KiB and sizes leave room for 32-bit positions; preferred for at most 8 output channels a group
// from 2^17 output pixels (times groups) up.
constexpr int kNumNarrowTiledConfigs = 3;
bool narrow_tiled_eligible(const ConvTranspose2dParams& p);
bool narrow_tiled_preferred(const ConvTranspose2dParams& p);
int narrow_tiled_config(const ConvTranspose2dParams& p);  // force_config when it names one, else the default
cudaError_t launch_narrow_tiled(const ConvTranspose2dParams& p, int config, cudaStream_t stream);

// Sparse kernel (conv_transpose2d_sparse.cu): a block writes a run of one output row, every phase, for layers
// whose output elements cost few multiply-adds (large strides against the dilated kernel, few input channels);
// fp32/fp16/bf16, exact FFMA. Eligible when the staged input rows and one chunk's weights fit in 48 KiB, strides
// are at most 32 and a row has at most 8 vertical taps; preferred when an output element averages at most 48
// multiply-adds.
bool sparse_eligible(const ConvTranspose2dParams& p);
bool sparse_preferred(const ConvTranspose2dParams& p);
cudaError_t launch_sparse(const ConvTranspose2dParams& p, cudaStream_t stream);

// Gemm path (conv_transpose2d_gemm.cu, conv_transpose2d_gemm_sync.cu): channel-major implicit GEMM for
// TF32/BF16/FP16 and exact fp32 (3xTF32, wgmma configurations 0, 2, 5, 8 and 9 only), reading a channels-last x,
// writing y in either layout. Configurations 0-2 and 5-12 run wgmma (sm_90 devices, kernels built with sm_90a code;
// 9-12 in pairs of blocks that share their weights' stages), 3-4 mma.sync (sm_80 and newer). Eligible on sm_80 and newer (exact fp32: where wgmma runs) when a group's input
// channels fill whole 16-byte vectors (with one group, x_pitch may pad them) and strides are at most
// kGemmMaxStride.
constexpr int kNumGemmConfigs = 13;
constexpr int kGemmMaxStride = 16;
bool gemm_eligible(const ConvTranspose2dParams& p);
// Whether the gemm path is the default choice where it is eligible and preferred: where its wgmma configurations
// run (the mma.sync ones are picked by measured choice only).
bool gemm_default_ready();
// force_config when in range and it runs here (a wgmma configuration needs sm_90), else the configuration chosen.
int gemm_config(const ConvTranspose2dParams& p);
int gemm_split(const ConvTranspose2dParams& p, int config);
// Whether the gemm kernel reads p's weights as they are, with no packing: a wgmma configuration, 16-bit
// channels-last weights whose output-channel rows are whole 16-byte vectors at a 16-byte aligned address and whose
// groups have their input channels in whole stages (64).
bool gemm_reads_weights(const ConvTranspose2dParams& p, int config);
WeightPacking gemm_packing(const ConvTranspose2dParams& p, int config);
size_t gemm_workspace_bytes(const ConvTranspose2dParams& p, int config);
// Packs p.w as the gemm kernel reads it ([groups][kH][kW][cout_g][ci_pad]) or, co_major, as the shuffle kernel does
// ([groups][cout_g][kH][kW][ci_pad]); TF32-rounded for fp32.
cudaError_t gemm_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream, bool co_major = false);
cudaError_t launch_gemm(const ConvTranspose2dParams& p, int config, cudaStream_t stream);

// Shuffle kernel (conv_transpose2d_shuffle.cu): layers whose kernel is their stride (one group, dilation 1, no
// output padding), BF16/FP16, an NCHW x and y: one GEMM of the packed weights' (co, a, b) rows by x's positions read
// as they are, then the pixel shuffle in its epilogue; no layout change, one kernel a call. Eligible on sm_90 with
// sm_90a code when an image's H_in W_in positions fill whole 8-byte vectors, x is 8-byte aligned and kW divides 64
// (x read by TMA where they fill 16-byte vectors at a 16-byte aligned address); preferred where the layer has at
// least 64 (co, a, b) rows.
bool shuffle_eligible(const ConvTranspose2dParams& p);
bool shuffle_preferred(const ConvTranspose2dParams& p);
WeightPacking shuffle_packing(const ConvTranspose2dParams& p);  // [C_out][kH][kW][ci_pad], layout 2
size_t shuffle_workspace_bytes(const ConvTranspose2dParams& p);
cudaError_t shuffle_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream);
cudaError_t launch_shuffle(const ConvTranspose2dParams& p, cudaStream_t stream);

// Fold kernel (conv_transpose2d_fold.cu): layers with few channels (FCN's score up-samplers): a row phase's GEMM
// with the stride's column phases folded into its columns (N = C_out stride_w padded to whole n8 tiles, K = the
// taps a phase has times C_in) on mma.sync TF32, stores straight from the accumulators. Exact fp32 (3xTF32), fp32
// with TF32 products, bf16 and fp16 (products exact, fp32 sums); x, w and y in either layout as they are, no
// packing. Eligible on sm_80 and newer with one group, dilation 1, strides at most 64 and a row phase's weights for
// up to 176 columns (64 in exact fp32) and a tile's input patch in 110 KiB of shared memory; preferred where
// eligible with stride_w a multiple of 8 and at most 24 input channels, unless the tiled narrow kernel is preferred.
bool fold_eligible(const ConvTranspose2dParams& p);
bool fold_preferred(const ConvTranspose2dParams& p);
cudaError_t launch_fold(const ConvTranspose2dParams& p, cudaStream_t stream);

// Taps path (conv_transpose2d_taps.cu): fp32 layers with few output channels: the gemm kernel on the 1x1 problem
// whose columns are every (output channel, tap), Z channels-last in the workspace, then a kernel that sums each
// output element's taps of Z and the bias. Reads a channels-last x (as the gemm path does) and the weights in either
// layout as they are; writes y in either layout. Eligible with dilation 1, at most 4096 columns C_out kH kW, where
// the gemm kernel takes the 1x1 problem (packed weights: gemm_packing of taps_view); preferred for at most 32 output
// channels and at least 32 input channels a group, C_out kH kW <= 2 C_in and 2^14 input positions or more, unless
// x is NCHW (planned with a null x) and the tiled narrow kernel is preferred.
ConvTranspose2dParams taps_view(const ConvTranspose2dParams& p);  // the 1x1 problem the gemm kernel runs
bool taps_eligible(const ConvTranspose2dParams& p);
bool taps_preferred(const ConvTranspose2dParams& p);
int taps_config(const ConvTranspose2dParams& p);  // the gemm kernel's configuration for taps_view(p)
WeightPacking taps_packing(const ConvTranspose2dParams& p, int config);
size_t taps_workspace_bytes(const ConvTranspose2dParams& p, int config);
cudaError_t taps_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream);
cudaError_t launch_taps(const ConvTranspose2dParams& p, int config, cudaStream_t stream);

// Fused taps kernel (conv_transpose2d_taps_fused.cu): the taps path in one kernel, Z in shared memory. A block runs
// the GEMM of every (output channel, tap) column on a tile of 128 input positions (mma.sync TF32; exact fp32 as
// 3xTF32, bf16 and fp16 exact products; fp32 sums), then sums the taps of the outputs the tile completes. x, w and
// y in either layout as they are, no packing, no workspace. Eligible on sm_80 and newer with one group, dilation 1,
// at most 96 taps kH kW, and a tile that completes some output (ceil(k / s) - 1 < 16 rows or columns). The rule's
// choice for small layers of few output channels with many input channels (taps_fused_preferred); elsewhere forced,
// or measured choice's where it is fastest (bench/NOTES.md v39, v42).
bool taps_fused_eligible(const ConvTranspose2dParams& p);
bool taps_fused_preferred(const ConvTranspose2dParams& p);
cudaError_t launch_taps_fused(const ConvTranspose2dParams& p, cudaStream_t stream);

// Layout change (layout.cu): N images of C channels x HW positions, NCHW -> channels-last when to_channels_last,
// else channels-last -> NCHW; elements of 2, 4 or 8 bytes moved as bits, or with round_tf32 (4-byte elements
// only) fp32 values rounded to TF32 on the way (cvt.rna: to nearest, ties away from zero). src and dst must not
// overlap.
cudaError_t convert_layout(const void* src, void* dst, int64_t N, int64_t C, int64_t HW, int elem_bytes,
                           bool to_channels_last, bool round_tf32, cudaStream_t stream);
// dst = src's `count` fp32 values rounded to TF32 as convert_layout rounds them (layout.cu); for a channels-last x
// whose rounding the gemm kernel is spared. src and dst must not overlap.
cudaError_t round_to_tf32(const void* src, void* dst, int64_t count, cudaStream_t stream);

}  // namespace deconv
