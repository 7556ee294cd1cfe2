// Torch binding for the ConvTranspose2d kernels: tensor checks, dtype dispatch and the current CUDA stream.
// Python (kernels/functional.py) validates arguments first with friendlier messages; these checks are the last
// line of defence for anyone calling the extension directly.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "conv_transpose2d.h"

namespace {

deconv::DType to_dtype(const at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return deconv::DType::kFloat32;
    case at::kHalf:
      return deconv::DType::kFloat16;
    case at::kBFloat16:
      return deconv::DType::kBFloat16;
    case at::kDouble:
      return deconv::DType::kFloat64;
    default:
      TORCH_CHECK(false, "conv_transpose2d supports float32, float16, bfloat16 and float64 tensors, got ", t, ".");
  }
}

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t op, int64_t d) {
  return (in - 1) * s - 2 * p + d * (k - 1) + op + 1;
}

void check_pair(const std::vector<int64_t>& v, const char* name) {
  TORCH_CHECK(v.size() == 2, "conv_transpose2d expects ", name, " as 2 values (height, width), got ", v.size(), ".");
}

// Returns (y, path) where path is 0 for the SIMT kernel, 1 for the tensor-core kernels and 2 for the narrow kernel.
std::tuple<torch::Tensor, int64_t> forward(const torch::Tensor& x,       // x: [N, C_in, H_in, W_in]
                                           const torch::Tensor& weight,  // weight: [C_in, C_out/groups, kH, kW]
                                           const c10::optional<torch::Tensor>& bias,  // bias: [C_out] or None
                                           std::vector<int64_t> stride, std::vector<int64_t> padding,
                                           std::vector<int64_t> output_padding, std::vector<int64_t> dilation,
                                           int64_t groups, const std::string& precision,
                                           const c10::optional<torch::Tensor>& out,  // out: [N, C_out, H_out, W_out]
                                           int64_t force_path, int64_t force_config) {
  check_pair(stride, "stride");
  check_pair(padding, "padding");
  check_pair(output_padding, "output_padding");
  check_pair(dilation, "dilation");
  TORCH_CHECK(x.is_cuda(), "conv_transpose2d: input must be a CUDA tensor.");
  TORCH_CHECK(x.dim() == 4, "conv_transpose2d: input must be 4-D [N, C_in, H, W], got ", x.dim(), "-D.");
  TORCH_CHECK(weight.dim() == 4, "conv_transpose2d: weight must be 4-D [C_in, C_out/groups, kH, kW], got ",
              weight.dim(), "-D.");
  TORCH_CHECK(weight.device() == x.device(), "conv_transpose2d: weight is on ", weight.device(),
              " but input is on ", x.device(), ".");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "conv_transpose2d: weight dtype ", weight.scalar_type(),
              " differs from input dtype ", x.scalar_type(), ".");
  const deconv::DType dtype = to_dtype(x.scalar_type());
  TORCH_CHECK(groups > 0, "conv_transpose2d: groups must be positive, got ", groups, ".");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(stride[i] > 0, "conv_transpose2d: stride must be positive.");
    TORCH_CHECK(dilation[i] > 0, "conv_transpose2d: dilation must be positive.");
    TORCH_CHECK(padding[i] >= 0, "conv_transpose2d: padding must be non-negative.");
    TORCH_CHECK(output_padding[i] >= 0 && output_padding[i] < std::max(stride[i], dilation[i]),
                "conv_transpose2d: output_padding must be smaller than either stride or dilation.");
  }
  const int64_t N = x.size(0), C_in = x.size(1), H_in = x.size(2), W_in = x.size(3);
  const int64_t kH = weight.size(2), kW = weight.size(3);
  TORCH_CHECK(kH > 0 && kW > 0, "conv_transpose2d: kernel size must be positive.");
  TORCH_CHECK(weight.size(0) == C_in, "conv_transpose2d: input has ", C_in, " channels but weight expects ",
              weight.size(0), ".");
  TORCH_CHECK(C_in > 0 && C_in % groups == 0, "conv_transpose2d: input channels (", C_in,
              ") must be a positive multiple of groups (", groups, ").");
  TORCH_CHECK(H_in > 0 && W_in > 0, "conv_transpose2d: input height and width must be positive.");
  const int64_t C_out = weight.size(1) * groups;
  TORCH_CHECK(C_out > 0, "conv_transpose2d: weight has no output channels.");
  const int64_t H_out = out_size(H_in, kH, stride[0], padding[0], output_padding[0], dilation[0]);
  const int64_t W_out = out_size(W_in, kW, stride[1], padding[1], output_padding[1], dilation[1]);
  TORCH_CHECK(H_out > 0 && W_out > 0, "conv_transpose2d: output size (", H_out, " x ", W_out,
              ") is too small.");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C_out, "conv_transpose2d: bias must be [", C_out, "].");
    TORCH_CHECK(bias->device() == x.device(), "conv_transpose2d: bias is on ", bias->device(),
                " but input is on ", x.device(), ".");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "conv_transpose2d: bias dtype differs from input.");
  }
  TORCH_CHECK(precision == "fp32" || precision == "tf32",
              "conv_transpose2d: precision must be 'fp32' or 'tf32', got '", precision, "'.");

  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor wc = weight.contiguous();
  torch::Tensor bc;
  if (bias.has_value()) bc = bias->contiguous();
  torch::Tensor y;
  if (out.has_value()) {
    TORCH_CHECK(out->device() == x.device() && out->scalar_type() == x.scalar_type() && out->is_contiguous() &&
                    out->sizes() == at::IntArrayRef({N, C_out, H_out, W_out}),
                "conv_transpose2d: out must be a contiguous [", N, ", ", C_out, ", ", H_out, ", ", W_out,
                "] tensor of the input's dtype and device.");
    y = *out;
  } else {
    y = torch::empty({N, C_out, H_out, W_out}, x.options().memory_format(at::MemoryFormat::Contiguous));
  }
  if (N == 0) return {y, 0};

  deconv::ConvTranspose2dParams p{};
  p.x = xc.data_ptr();
  p.w = wc.data_ptr();
  p.bias = bias.has_value() ? bc.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.N = N;
  p.C_in = C_in;
  p.H_in = H_in;
  p.W_in = W_in;
  p.C_out = C_out;
  p.H_out = H_out;
  p.W_out = W_out;
  p.kH = kH;
  p.kW = kW;
  p.stride_h = stride[0];
  p.stride_w = stride[1];
  p.pad_h = padding[0];
  p.pad_w = padding[1];
  p.dil_h = dilation[0];
  p.dil_w = dilation[1];
  p.groups = groups;
  p.dtype = dtype;
  p.precision = precision == "tf32" ? deconv::Precision::kTF32 : deconv::Precision::kExactFp32;
  TORCH_CHECK(force_path >= -1 && force_path <= 2,
              "conv_transpose2d: force_path must be -1 (choose), 0 (SIMT), 1 (tensor cores) or 2 (narrow), got ",
              force_path, ".");
  TORCH_CHECK(force_config >= -1 && force_config < deconv::kNumTensorCoreConfigs,
              "conv_transpose2d: force_config out of range.");
  p.force_path = static_cast<int>(force_path);
  p.force_config = static_cast<int>(force_config);
  // Scratch (packed weights) from PyTorch's caching allocator, on the current stream: freed when this returns,
  // reusable by the allocator only after the kernels queued on this stream have run.
  const size_t ws_bytes = deconv::conv_transpose2d_workspace_bytes(p);
  torch::Tensor workspace;
  if (ws_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }

  deconv::KernelPath path = deconv::KernelPath::kSimt;
  const cudaError_t err =
      deconv::conv_transpose2d_forward(p, at::cuda::getCurrentCUDAStream(x.device().index()).stream(), &path);
  TORCH_CHECK(err == cudaSuccess, "conv_transpose2d kernel launch failed: ", cudaGetErrorString(err));
  return {y, static_cast<int64_t>(path)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deconv CUDA kernels: ConvTranspose2d forward.";
  m.def("forward", &forward,
        "ConvTranspose2d forward. Returns (y, path); path 0 = SIMT kernel, 1 = tensor-core kernel, 2 = narrow kernel. "
        "force_path: -1 chooses, 0/1/2 ask for that kernel; 1 and 2 fall back to the choice of -1 when not eligible.",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"),
        py::arg("out") = py::none(), py::arg("force_path") = -1, py::arg("force_config") = -1);
}
