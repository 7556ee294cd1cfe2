// The registry of bench/kernels/cutlass/dgrad_{bf16,fp16,tf32}.cu and the entry points binding.cpp exposes: the list of
// configurations, CUTLASS's can_implement for a problem, and a launch on the current torch stream. The mapping
// from conv_transpose2d to CUTLASS's dgrad problem is in dgrad.cuh's header comment and bench/kernels/cutlass/peer.py.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "dgrad.cuh"

namespace deconv_cutlass {
namespace {

std::vector<Entry> const& all_entries() {
  static std::vector<Entry> const all = [] {
    std::vector<Entry> v;
    for (auto const* part : {&entries_bf16(), &entries_fp16(), &entries_tf32()}) {
      v.insert(v.end(), part->begin(), part->end());
    }
    return v;
  }();
  return all;
}

Entry const& find(std::string const& name) {
  for (Entry const& e : all_entries()) {
    if (name == e.name) {
      return e;
    }
  }
  TORCH_CHECK(false, "deconv_cutlass: no configuration named '", name, "'");
}

cutlass::conv::Conv2dProblemSize problem_size(std::vector<int64_t> const& v) {
  TORCH_CHECK(v.size() == 15, "deconv_cutlass: a problem is 15 integers (N, H, W, C, K, R, S, P, Q, pad_h, pad_w, ",
              "stride_h, stride_w, dilation_h, dilation_w), got ", v.size());
  for (int64_t e : v) {
    TORCH_CHECK(e >= 0 && e <= INT32_MAX, "deconv_cutlass: problem value ", e, " out of int32 range");
  }
  auto i = [&](size_t k) { return static_cast<int>(v[k]); };
  return cutlass::conv::Conv2dProblemSize(i(0), i(1), i(2), i(3), i(4), i(5), i(6), i(7), i(8), i(9), i(10), i(11),
                                          i(12), i(13), i(14), cutlass::conv::Mode::kCrossCorrelation,
                                          /*split_k_slices=*/1, /*groups=*/1);
}

at::ScalarType scalar_type(std::string const& dtype) {
  return dtype == "bf16" ? at::kBFloat16 : dtype == "fp16" ? at::kHalf : at::kFloat;
}

}  // namespace
}  // namespace deconv_cutlass

// (name, dtype, alignment) of every compiled configuration.
std::vector<std::tuple<std::string, std::string, int64_t>> dgrad_configs() {
  std::vector<std::tuple<std::string, std::string, int64_t>> out;
  for (auto const& e : deconv_cutlass::all_entries()) {
    out.emplace_back(e.name, e.dtype, e.alignment);
  }
  return out;
}

// "" when configuration `name` can run `problem`, else CUTLASS's reason (its Status string).
std::string dgrad_can_implement(std::string const& name, std::vector<int64_t> const& problem) {
  auto const& e = deconv_cutlass::find(name);
  cutlass::Status status = e.can_implement(deconv_cutlass::problem_size(problem));
  return status == cutlass::Status::kSuccess ? std::string() : std::string(cutlassGetStatusString(status));
}

// y[N, C, H, W] (channels_last memory) = dgrad(x[N, K, P, Q] channels_last, w_krsc[K, R, S, C] contiguous)
// (+ bias[C]), on the current stream. Returns "" or the reason it did not run.
std::string dgrad_run(std::string const& name, std::vector<int64_t> const& problem, at::Tensor const& x,
                      at::Tensor const& w_krsc, c10::optional<at::Tensor> const& bias, at::Tensor& y) {
  auto const& e = deconv_cutlass::find(name);
  auto p = deconv_cutlass::problem_size(problem);
  at::ScalarType want = deconv_cutlass::scalar_type(e.dtype);
  TORCH_CHECK(x.is_cuda() && w_krsc.is_cuda() && y.is_cuda(), "deconv_cutlass: tensors must be on a CUDA device");
  TORCH_CHECK(w_krsc.device() == x.device() && y.device() == x.device(),
              "deconv_cutlass: x, w_krsc and y must be on one device");
  TORCH_CHECK(x.scalar_type() == want && w_krsc.scalar_type() == want && y.scalar_type() == want,
              "deconv_cutlass: ", e.name, " takes ", at::toString(want), " tensors");
  TORCH_CHECK(x.dim() == 4 && x.size(0) == p.N && x.size(1) == p.K && x.size(2) == p.P && x.size(3) == p.Q,
              "deconv_cutlass: x is not [N, K, P, Q] of the problem");
  TORCH_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast), "deconv_cutlass: x must be channels_last");
  TORCH_CHECK(w_krsc.dim() == 4 && w_krsc.size(0) == p.K && w_krsc.size(1) == p.R && w_krsc.size(2) == p.S &&
                  w_krsc.size(3) == p.C && w_krsc.is_contiguous(),
              "deconv_cutlass: w_krsc is not a contiguous [K, R, S, C] of the problem");
  TORCH_CHECK(y.dim() == 4 && y.size(0) == p.N && y.size(1) == p.C && y.size(2) == p.H && y.size(3) == p.W &&
                  y.is_contiguous(at::MemoryFormat::ChannelsLast),
              "deconv_cutlass: y is not a channels_last [N, C, H, W] of the problem");
  void const* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_cuda() && bias->device() == x.device() && bias->scalar_type() == want &&
                    bias->dim() == 1 && bias->size(0) == p.C && bias->is_contiguous(),
                "deconv_cutlass: bias must be a contiguous [C] tensor of the same dtype and device");
    bias_ptr = bias->data_ptr();
  }
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  size_t workspace_bytes = e.workspace_bytes(p);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, x.options().dtype(at::kByte));
  }
  return e.run(p, x.data_ptr(), w_krsc.data_ptr(), bias_ptr, y.data_ptr(),
               workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
}
