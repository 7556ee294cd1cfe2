// CUTLASS strided dgrad (Ampere, mma.sync) instantiated as a transposed-convolution peer for bench/kernels/zoo.py.
//
// conv_transpose2d(x, w) is the data gradient of a forward convolution whose output gradient is x. In CUTLASS's
// terms (Conv2dProblemSize, NHWC activations, KRSC filter):
//   A  = dy = x            [N, P, Q, K]   (K = C_in; x channels_last)
//   B  = filter = w        [K, R, S, C]   (C = C_out; w.permute(0, 2, 3, 1), i.e. w channels_last)
//   D  = dx = y            [N, H, W, C]   (H, W = the transposed convolution's output size; y channels_last)
// with the forward convolution's padding, stride and dilation, mode kCrossCorrelation (no filter flip).
// bench/kernels/cutlass/peer.py computes the problem (its order: N, H, W, C, K, R, S, P, Q, pad_h, pad_w, stride_h,
// stride_w, dilation_h, dilation_w) and checks it; these files only instantiate kernels and launch them.
//
// Every kernel is DefaultConv2dDgrad with StrideSupport::kStrided (ImplicitGemmConvolutionStridedDgrad: one
// implicit GEMM per filter phase, so no MMA is spent on the zeros a stride-s transposed convolution would
// insert) and StridedDgradIdentityThreadblockSwizzle. Bias goes through the epilogue: C = bias with all NHWC
// strides 0 (a per-channel vector broadcast over N, H, W), beta = 1; without bias beta = 0 and C is not read.
//
// One translation unit per element type (dgrad_bf16.cu, dgrad_fp16.cu, dgrad_tf32.cu) so that the build compiles
// them in parallel; dgrad.cu holds the registry and the entry points that binding.cpp exposes.

#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"

namespace deconv_cutlass {

using CanImplementFn = cutlass::Status (*)(cutlass::conv::Conv2dProblemSize const&);
// Bytes of device workspace a launch needs (0 for these kernels: split-k is 1).
using WorkspaceFn = size_t (*)(cutlass::conv::Conv2dProblemSize const&);
// Runs one problem on `stream` (workspace: WorkspaceFn's bytes); returns "" or the reason it did not run.
using RunFn = std::string (*)(cutlass::conv::Conv2dProblemSize const&, void const* x, void const* w,
                              void const* bias, void* y, void* workspace, cudaStream_t stream);

struct Entry {
  char const* name;
  char const* dtype;  // "bf16", "fp16" or "tf32"
  int alignment;      // elements per access of every operand: channels must be multiples of it
  CanImplementFn can_implement;
  WorkspaceFn workspace_bytes;
  RunFn run;
};

std::vector<Entry> const& entries_bf16();
std::vector<Entry> const& entries_fp16();
std::vector<Entry> const& entries_tf32();

}  // namespace deconv_cutlass

#ifdef DECONV_CUTLASS_KERNELS

#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/threadblock/threadblock_swizzle.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/layout/tensor.h"

namespace deconv_cutlass {

using cutlass::conv::IteratorAlgorithm;
using cutlass::gemm::GemmShape;
using Layout = cutlass::layout::TensorNHWC;

using Inst16 = GemmShape<16, 8, 16>;  // bf16 / fp16 mma.sync
using Inst8 = GemmShape<16, 8, 8>;    // tf32 mma.sync (float operands rounded to tf32 in the warp-level MMA)
constexpr auto kOpt = IteratorAlgorithm::kOptimized;
constexpr auto kAna = IteratorAlgorithm::kAnalytic;

// One CUTLASS dgrad kernel: element type (in, out and epilogue source), fp32 accumulation and epilogue math.
template <typename Element, typename InstructionShape, typename ThreadblockShape, typename WarpShape, int Stages,
          IteratorAlgorithm Algorithm, int Alignment>
struct Dgrad {
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, Alignment, float, float>;
  using Kernel = typename cutlass::conv::kernel::DefaultConv2dDgrad<
      Element, Layout, Element, Layout, Element, Layout, float, cutlass::arch::OpClassTensorOp,
      cutlass::arch::Sm80, ThreadblockShape, WarpShape, InstructionShape, EpilogueOp,
      cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<1>, Stages,
      cutlass::arch::OpMultiplyAdd, Algorithm, cutlass::conv::StrideSupport::kStrided, Alignment,
      Alignment>::Kernel;
  using Op = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
  using Arguments = typename Op::Arguments;

  static Arguments arguments(cutlass::conv::Conv2dProblemSize const& p, void const* x, void const* w,
                             void const* bias, void* y) {
    Layout layout_a = Layout::packed({p.N, p.P, p.Q, p.K});
    Layout layout_b = Layout::packed({p.K, p.R, p.S, p.C});
    Layout layout_d = Layout::packed({p.N, p.H, p.W, p.C});
    Layout layout_c = bias ? Layout(Layout::Stride(0)) : layout_d;
    auto* ptr_a = static_cast<Element*>(const_cast<void*>(x));
    auto* ptr_b = static_cast<Element*>(const_cast<void*>(w));
    auto* ptr_c = static_cast<Element*>(const_cast<void*>(bias ? bias : y));
    auto* ptr_d = static_cast<Element*>(y);
    typename EpilogueOp::Params epilogue(1.0f, bias ? 1.0f : 0.0f);
    return Arguments(p, {ptr_a, layout_a}, {ptr_b, layout_b}, {ptr_c, layout_c}, {ptr_d, layout_d}, epilogue,
                     cutlass::conv::SplitKMode::kSerial);
  }

  static cutlass::Status can_implement(cutlass::conv::Conv2dProblemSize const& p) {
    return Op::can_implement(arguments(p, nullptr, nullptr, nullptr, nullptr));
  }

  static size_t workspace_bytes(cutlass::conv::Conv2dProblemSize const& p) {
    return Op::get_workspace_size(arguments(p, nullptr, nullptr, nullptr, nullptr));
  }

  static std::string run(cutlass::conv::Conv2dProblemSize const& p, void const* x, void const* w, void const* bias,
                         void* y, void* workspace, cudaStream_t stream) {
    Arguments args = arguments(p, x, w, bias, y);
    cutlass::Status status = Op::can_implement(args);
    if (status != cutlass::Status::kSuccess) {
      return std::string("can_implement: ") + cutlassGetStatusString(status);
    }
    if (Op::get_workspace_size(args) > 0 && workspace == nullptr) {
      return "no workspace given";
    }
    Op op;
    status = op.initialize(args, workspace, stream);
    if (status != cutlass::Status::kSuccess) {
      return std::string("initialize: ") + cutlassGetStatusString(status);
    }
    status = op.run(stream);
    if (status != cutlass::Status::kSuccess) {
      return std::string("run: ") + cutlassGetStatusString(status) + " (" +
             cudaGetErrorString(cudaGetLastError()) + ")";
    }
    return std::string();
  }
};

// The 16-bit configurations, for one element type. Alignment 8 = 128-bit accesses (C_in and C_out multiples
// of 8); other channel counts run these on zero-padded channels (peer.py's "pad:" configurations). There is no
// 16-bit alignment-1 kernel: the two-stage analytic one (cp.async cannot copy 2 bytes, so the only mainloop for
// it) gave norm-wise relative errors of 0.38-0.99 on every shape of peer.check() on an H200.
template <typename E>
using H128x128 = Dgrad<E, Inst16, GemmShape<128, 128, 32>, GemmShape<64, 64, 32>, 3, kOpt, 8>;
template <typename E>
using H128x64 = Dgrad<E, Inst16, GemmShape<128, 64, 32>, GemmShape<64, 32, 32>, 4, kOpt, 8>;
template <typename E>
using H64x64 = Dgrad<E, Inst16, GemmShape<64, 64, 32>, GemmShape<32, 32, 32>, 5, kOpt, 8>;

// tf32: float tensors, alignment 4 = 128-bit accesses (channels multiples of 4), alignment 1 for the rest. The
// alignment-1 kernel is multistage (4-byte cp.async): the two-stage mainloop has no float-to-tf32 operand
// conversion, so CUTLASS does not build it for float operands.
using T128x128 = Dgrad<float, Inst8, GemmShape<128, 128, 16>, GemmShape<64, 64, 16>, 4, kOpt, 4>;
using T128x64 = Dgrad<float, Inst8, GemmShape<128, 64, 16>, GemmShape<64, 32, 16>, 4, kOpt, 4>;
using T64x64 = Dgrad<float, Inst8, GemmShape<64, 64, 16>, GemmShape<32, 32, 16>, 5, kOpt, 4>;
using T64x64A1 = Dgrad<float, Inst8, GemmShape<64, 64, 16>, GemmShape<32, 32, 16>, 3, kAna, 1>;

}  // namespace deconv_cutlass

#define DECONV_CUTLASS_ENTRY(NAME, DTYPE, ALIGN, ...)                                                 \
  ::deconv_cutlass::Entry {                                                                          \
    NAME, DTYPE, ALIGN, &__VA_ARGS__::can_implement, &__VA_ARGS__::workspace_bytes, &__VA_ARGS__::run \
  }

#endif  // DECONV_CUTLASS_KERNELS
