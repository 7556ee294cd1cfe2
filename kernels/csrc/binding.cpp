// Torch binding for the ConvTranspose2d kernels: tensor checks, dtype dispatch and the current CUDA stream.
// Python (kernels/functional.py) validates arguments first with friendlier messages, and every caller goes through
// it: these checks are the last line of defence. Their messages format numbers with std::to_string and devices
// and dtypes with torch's own str()/toString(), never by streaming them: with the GPU machine's torch 2.11 build,
// a TORCH_CHECK message that streamed an integer (c10::str -> std::ostream << int64_t, compiled here) ended the
// interpreter with SIGSEGV instead of raising, while strings streamed fine (bench/NOTES.md v9).
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include "conv_transpose2d.h"

namespace {

// Numbers for check messages, formatted without std::ostream (see the top of this file).
template <typename Int>
std::string num(Int v) {
  return std::to_string(v);
}

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
      TORCH_CHECK(false, "conv_transpose2d supports float32, float16, bfloat16 and float64 tensors, got ",
                  std::string(c10::toString(t)), ".");
  }
}

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t op, int64_t d) {
  return (in - 1) * s - 2 * p + d * (k - 1) + op + 1;
}

void check_pair(const std::vector<int64_t>& v, const char* name) {
  TORCH_CHECK(v.size() == 2, "conv_transpose2d expects ", name, " as 2 values (height, width), got ", num(v.size()),
              ".");
}

// The sizes of one problem, after every argument check.
struct Problem {
  int64_t N, C_in, H_in, W_in, C_out, H_out, W_out, kH, kW;
};

// "[N, C_out, H_out, W_out]" of a problem's output.
std::string shape_text(const Problem& pr) {
  return "[" + num(pr.N) + ", " + num(pr.C_out) + ", " + num(pr.H_out) + ", " + num(pr.W_out) + "]";
}

// Checks the arguments against each other (not the devices); throws with a message naming the first problem.
Problem check_problem(const torch::Tensor& x,       // x: [N, C_in, H_in, W_in]
                      const torch::Tensor& weight,  // weight: [C_in, C_out/groups, kH, kW]
                      const c10::optional<torch::Tensor>& bias, const std::vector<int64_t>& stride,
                      const std::vector<int64_t>& padding, const std::vector<int64_t>& output_padding,
                      const std::vector<int64_t>& dilation, int64_t groups, const std::string& precision) {
  check_pair(stride, "stride");
  check_pair(padding, "padding");
  check_pair(output_padding, "output_padding");
  check_pair(dilation, "dilation");
  TORCH_CHECK(x.dim() == 4, "conv_transpose2d: input must be 4-D [N, C_in, H, W], got ", num(x.dim()), "-D.");
  TORCH_CHECK(weight.dim() == 4, "conv_transpose2d: weight must be 4-D [C_in, C_out/groups, kH, kW], got ",
              num(weight.dim()), "-D.");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "conv_transpose2d: weight dtype ",
              std::string(c10::toString(weight.scalar_type())), " differs from input dtype ",
              std::string(c10::toString(x.scalar_type())), ".");
  to_dtype(x.scalar_type());
  TORCH_CHECK(groups > 0, "conv_transpose2d: groups must be positive, got ", num(groups), ".");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(stride[i] > 0, "conv_transpose2d: stride must be positive.");
    TORCH_CHECK(dilation[i] > 0, "conv_transpose2d: dilation must be positive.");
    TORCH_CHECK(padding[i] >= 0, "conv_transpose2d: padding must be non-negative.");
    TORCH_CHECK(output_padding[i] >= 0 && output_padding[i] < std::max(stride[i], dilation[i]),
                "conv_transpose2d: output_padding must be smaller than either stride or dilation.");
  }
  Problem pr{};
  pr.N = x.size(0);
  pr.C_in = x.size(1);
  pr.H_in = x.size(2);
  pr.W_in = x.size(3);
  pr.kH = weight.size(2);
  pr.kW = weight.size(3);
  TORCH_CHECK(pr.kH > 0 && pr.kW > 0, "conv_transpose2d: kernel size must be positive.");
  TORCH_CHECK(weight.size(0) == pr.C_in, "conv_transpose2d: input has ", num(pr.C_in),
              " channels but weight expects ", num(weight.size(0)), ".");
  TORCH_CHECK(pr.C_in > 0 && pr.C_in % groups == 0, "conv_transpose2d: input channels (", num(pr.C_in),
              ") must be a positive multiple of groups (", num(groups), ").");
  TORCH_CHECK(pr.H_in > 0 && pr.W_in > 0, "conv_transpose2d: input height and width must be positive.");
  pr.C_out = weight.size(1) * groups;
  TORCH_CHECK(pr.C_out > 0, "conv_transpose2d: weight has no output channels.");
  pr.H_out = out_size(pr.H_in, pr.kH, stride[0], padding[0], output_padding[0], dilation[0]);
  pr.W_out = out_size(pr.W_in, pr.kW, stride[1], padding[1], output_padding[1], dilation[1]);
  TORCH_CHECK(pr.H_out > 0 && pr.W_out > 0, "conv_transpose2d: output size (", num(pr.H_out), " x ",
              num(pr.W_out), ") is too small.");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == pr.C_out, "conv_transpose2d: bias must be [", num(pr.C_out),
                "].");
    TORCH_CHECK(bias->device() == weight.device(), "conv_transpose2d: bias is on ", bias->device().str(),
                " but weight is on ", weight.device().str(), ".");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "conv_transpose2d: bias dtype differs from input.");
  }
  TORCH_CHECK(precision == "fp32" || precision == "tf32",
              "conv_transpose2d: precision must be 'fp32' or 'tf32', got '", precision, "'.");
  return pr;
}

// A kernel choice asked for by the caller (kernels/tuning.py, tests): -1 everywhere lets the dispatcher choose.
// `staged` is for the gemm kernel with an NCHW output: 1 writes it channels-last into scratch and changes the layout
// after (whole-sector stores, twice the output's traffic); 0 or -1 store straight into NCHW (a warp's stores cover
// a few channels, each a run of positions). Straight is the default: it was faster on 42 of 55 layers and precisions
// measured (up to 1.48x), staged on 12 (up to 2.3x: Mask R-CNN's head, KernelBench 81; bench/NOTES.md v16);
// measured choice times both.
// `round` is for the gemm kernel's TF32 products: 1 has x rounded to TF32 before the kernel (an NCHW x by the layout
// change it needs, a channels-last one by a pass of its own), so that the kernel skips rounding each landed A stage
// (in its multipliers' registers; at 256 columns in shared memory); 0 leaves the rounding to the kernel. The default
// (-1) rounds an NCHW x on its way in, which costs nothing, and leaves a channels-last x to the kernel; measured
// choice times the pass too (bench/NOTES.md v22, v33).
struct Forced {
  int64_t path = -1, config = -1, split = -1, staged = -1, round = -1;
};

Forced check_forced(int64_t force_path, int64_t force_config, int64_t force_split, int64_t force_staged,
                    int64_t force_round) {
  TORCH_CHECK(force_path >= -1 && force_path <= 9,
              "conv_transpose2d: force_path must be -1 (choose), 0 (SIMT), 1 (tensor cores), 2 (narrow), 3 "
              "(sparse), 4 (gemm), 5 (tiled narrow), 6 (shuffle), 7 (fold), 8 (taps) or 9 (fused taps), got ",
              num(force_path), ".");
  TORCH_CHECK(force_config >= -1 && force_config < deconv::kNumTensorCoreConfigs,
              "conv_transpose2d: force_config must be -1 (choose) or 0 to ",
              num(deconv::kNumTensorCoreConfigs - 1), ", got ", num(force_config), ".");
  TORCH_CHECK(force_split == -1 || (force_split >= 1 && force_split <= 16),
              "conv_transpose2d: force_split must be -1 (choose) or 1 to 16, got ", num(force_split), ".");
  TORCH_CHECK(force_staged >= -1 && force_staged <= 1,
              "conv_transpose2d: force_staged must be -1 (choose), 0 or 1, got ", num(force_staged), ".");
  TORCH_CHECK(force_round >= -1 && force_round <= 2,
              "conv_transpose2d: force_round must be -1 (choose), 0, 1 or 2, got ", num(force_round), ".");
  return Forced{force_path, force_config, force_split, force_staged, force_round};
}

// Packed copies of one weight tensor for the tensor-core and gemm kernels, one per packed layout
// (conv_transpose2d_packing), made on first use and kept: for weights that do not change while it lives (a served
// layer's, or the prepared weights below, which are re-made when the weight changes). A call that passes it skips
// the packing kernel it would otherwise run every time. It holds no reference to the weight tensor, only what
// identifies it (its memory, sizes, strides and dtype). Thread-safe; a new packing is waited for once, so that any
// stream may read it afterwards (so never made during a CUDA graph capture).
class WeightPacks {
 public:
  explicit WeightPacks(const torch::Tensor& weight)
      : data_(weight.data_ptr()),
        sizes_(weight.sizes().vec()),
        strides_(weight.strides().vec()),
        options_(weight.options()) {
    TORCH_CHECK(weight.is_cuda() && weight.dim() == 4 &&
                    (weight.is_contiguous() || weight.is_contiguous(at::MemoryFormat::ChannelsLast)),
                "WeightPacks: weight must be a 4-D CUDA tensor, contiguous or channels-last.");
  }

  // The packed weights for the kernel planned for `p` (p.w must be this weight's memory), packing them on `stream`
  // the first time; nullptr when that kernel reads the weights as they are.
  const void* get(const deconv::ConvTranspose2dParams& p, const deconv::KernelPlan& plan, cudaStream_t stream) {
    TORCH_CHECK(p.w == data_, "WeightPacks: the call's weight is not the tensor these packs hold.");
    const deconv::WeightPacking layout = deconv::conv_transpose2d_packing(p, plan);
    if (layout.bytes == 0) return nullptr;
    const std::array<int64_t, 6> key{layout.kind,   layout.groups, layout.ciw_pad,
                                     layout.co_pad, layout.kmajor, layout.layout};
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = packs_.find(key);
    if (it == packs_.end()) it = packs_.emplace(key, Pack{pack(p, plan, stream), {}}).first;
    Pack& pk = it->second;
    if (std::find(pk.readers.begin(), pk.readers.end(), stream) == pk.readers.end()) {
      // Read on this stream from now on: the allocator must not hand its memory out again, once the packs are
      // dropped, before the work queued here has read it.
      c10::cuda::CUDACachingAllocator::recordStream(pk.t.storage().data_ptr(),
                                                    c10::cuda::getStreamFromExternal(stream, options_.device().index()));
      pk.readers.push_back(stream);
    }
    return pk.t.data_ptr();
  }

  // Whether these packs were made for `weight` as it is laid out now.
  bool holds(const torch::Tensor& weight) const {
    return weight.data_ptr() == data_ && weight.sizes() == at::IntArrayRef(sizes_) &&
           weight.strides() == at::IntArrayRef(strides_) && weight.scalar_type() == options_.dtype().toScalarType() &&
           weight.device() == options_.device();
  }

  int64_t size() {
    const std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(packs_.size());
  }

 private:
  struct Pack {
    torch::Tensor t;
    std::vector<cudaStream_t> readers;  // streams the packed copy was handed to
  };

  // A new packed copy, made on a stream of its own after `stream`'s work so far (which may be writing the weight),
  // and waited for. Its memory is allocated by another thread: the calling thread's allocations may be going to a
  // CUDA graph's memory pool (torch.compile's CUDA graphs warm a model up that way, and refuse allocations that
  // outlive the warm-up), and these packs outlive the call.
  torch::Tensor pack(const deconv::ConvTranspose2dParams& p, const deconv::KernelPlan& plan, cudaStream_t stream) {
    const c10::DeviceIndex device = options_.device().index();
    const c10::cuda::CUDAStream own = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
    at::cuda::CUDAEvent written;
    written.record(c10::cuda::getStreamFromExternal(stream, device));
    written.block(own);
    const auto bytes = static_cast<int64_t>(deconv::conv_transpose2d_packing(p, plan).bytes);
    const at::TensorOptions options = options_.dtype(at::kByte);
    torch::Tensor t = std::async(std::launch::async, [&] {
                        const c10::cuda::CUDAStreamGuard on_own(own);
                        return torch::empty({bytes}, options);
                      }).get();
    cudaError_t err = deconv::conv_transpose2d_pack(p, plan, t.data_ptr(), own.stream());
    if (err == cudaSuccess) err = cudaStreamSynchronize(own.stream());
    TORCH_CHECK(err == cudaSuccess, "WeightPacks: packing the weights failed: ", cudaGetErrorString(err));
    return t;
  }

  const void* const data_;
  const std::vector<int64_t> sizes_, strides_;
  const at::TensorOptions options_;
  std::mutex mu_;
  std::map<std::array<int64_t, 6>, Pack> packs_;
};

void check_packs(const WeightPacks* packs, const torch::Tensor& weight) {
  if (packs == nullptr) return;
  TORCH_CHECK(packs->holds(weight), "conv_transpose2d: packs were made for another weight tensor.");
}

// Whether the current stream of x's device is capturing a CUDA graph: no stream synchronisation then (a new packing
// waits for its stream), and no packed copy made outside the graph, which a later replay would read as it was.
bool capturing(const torch::Tensor& x) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;  // cannot tell: take the path that is safe in a capture
  }
  return status != cudaStreamCaptureStatusNone;
}

// Weights prepared once per weight version: each CUDA weight tensor's packed copies (WeightPacks), made on the first
// call that runs it and kept while the tensor lives and does not change. A change is seen through what PyTorch
// tracks: the tensor's version counter (every in-place operation on it or its views: optimizer steps, copy_,
// load_state_dict), its memory and its strides (.data assignment, .to(), module._apply). Writes PyTorch cannot see
// (through .data, DLPack or raw pointers) need forget() (kernels.refresh_weights). Entries hold the tensor weakly
// (its TensorImpl stays allocated, so its address names no other tensor while the entry lives); entries of tensors
// that are gone are dropped as the registry grows. Inference tensors track no version: they are never prepared.
class PreparedWeights {
 public:
  // The packs for `weight` as it is now, made anew when it changed; nullptr where preparing is not safe.
  std::shared_ptr<WeightPacks> get(const torch::Tensor& weight) {
    if (!weight.is_cuda() || weight.is_inference() || weight.dim() != 4 ||
        !(weight.is_contiguous() || weight.is_contiguous(at::MemoryFormat::ChannelsLast)))
      return nullptr;
    c10::TensorImpl* impl = weight.unsafeGetTensorImpl();
    const uint32_t version = impl->version_counter().current_version();
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(impl);
    if (it != entries_.end() && !it->second.owner.expired() && it->second.version == version &&
        it->second.packs->holds(weight))
      return it->second.packs;
    Entry e{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), version,
            std::make_shared<WeightPacks>(weight)};
    if (it != entries_.end()) {
      it->second = std::move(e);
    } else {
      if (entries_.size() >= prune_at_) prune();
      it = entries_.emplace(impl, std::move(e)).first;
    }
    return it->second.packs;
  }

  // Drops the packs of `weight`, or of every tensor when it is undefined. Returns how many were dropped.
  int64_t forget(const torch::Tensor& weight) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!weight.defined()) {
      const int64_t n = static_cast<int64_t>(entries_.size());
      entries_.clear();
      return n;
    }
    return static_cast<int64_t>(entries_.erase(weight.unsafeGetTensorImpl()));
  }

  int64_t size() {
    const std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(entries_.size());
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> owner;
    uint32_t version;
    std::shared_ptr<WeightPacks> packs;
  };
  void prune() {
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->second.owner.expired() ? entries_.erase(it) : std::next(it);
    prune_at_ = 2 * entries_.size() + 64;
  }
  std::mutex mu_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t prune_at_ = 64;
};

PreparedWeights& prepared_weights() {
  static PreparedWeights* registry = new PreparedWeights();  // never destroyed: no teardown order at exit
  return *registry;
}

// Whether x is laid out channels-last (and not also NCHW-contiguous): PyTorch then returns a channels-last output.
bool channels_last(const torch::Tensor& x) {
  return x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// Changes a dense 4-D tensor's layout (NCHW <-> channels-last) from src into dst (same sizes, the other layout) with
// the tiled layout kernel, on `stream`; round_tf32 (fp32 only) rounds the values to TF32 on the way.
void convert(const torch::Tensor& src, const torch::Tensor& dst, bool to_channels_last, cudaStream_t stream,
             bool round_tf32 = false) {
  const cudaError_t err = deconv::convert_layout(src.data_ptr(), dst.data_ptr(), src.size(0), src.size(1),
                                                 src.size(2) * src.size(3), static_cast<int>(src.element_size()),
                                                 to_channels_last, round_tf32, stream);
  TORCH_CHECK(err == cudaSuccess, "conv_transpose2d: layout change failed: ", cudaGetErrorString(err));
}

// t (4-D, any strides) as a dense tensor in one layout: itself when it is already, the layout kernel's copy when it
// is dense in the other layout, else PyTorch's copy.
torch::Tensor in_layout(const torch::Tensor& t, bool to_channels_last, cudaStream_t stream) {
  const auto want = to_channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const auto other = to_channels_last ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast;
  if (t.is_contiguous(want)) return t;
  if (!t.is_contiguous(other)) return t.contiguous(want);
  torch::Tensor d = torch::empty(t.sizes(), t.options().memory_format(want));
  convert(t, d, to_channels_last, stream);
  return d;
}

// How a checked problem runs, decided from what the call's tensors look like (sizes, strides, dtype, where x and the
// weight start modulo 256 bytes: every alignment the kernel choice asks about) and its arguments, before any memory
// is touched: made once per problem and kept by the call cache below, so that a repeated call only allocates and
// launches. x may have any layout: the gemm kernel reads it channels-last, the others NCHW, each converted if needed.
struct CallPlan {
  Problem pr{};
  deconv::ConvTranspose2dParams p{};  // every field but the pointers (x, w, bias, y, workspace, packed_weights: null)
  deconv::KernelPlan plan{};
  int64_t pitch = 0;       // > 0: x goes to the gemm kernel as channels-last rows padded to this many channels
  bool x_as_is = false;    // the kernels read x in place (else a copy in their layout)
  bool round_x = false;    // the copy of x rounds fp32 to TF32 (an NCHW x's layout change, or a pass of its own)
  bool w_as_is = false;    // the kernels read the weight in place (else an NCHW copy)
  bool y_cl = false;       // y is returned channels-last (x is, and no `out` was given)
  bool staged = false;     // the kernel writes y in the other layout into scratch, converted after
  bool torch_cl = false;   // PyTorch's layout rule makes y channels-last (x or the weight suggests it)
};

// x [N, C, H, W] (any layout) as a channels-last [N, H, W, pitch] tensor whose channels past C are zeros, on the
// current stream.
torch::Tensor padded_rows(const torch::Tensor& x, int64_t pitch) {
  torch::Tensor d = torch::zeros({x.size(0), x.size(2), x.size(3), pitch}, x.options());
  d.narrow(3, 0, x.size(1)).copy_(x.permute({0, 2, 3, 1}));
  return d;
}

CallPlan plan_call(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                   bool has_out, const Problem& pr, const std::vector<int64_t>& stride,
                   const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
                   const std::string& precision, const Forced& forced) {
  CallPlan c;
  c.pr = pr;
  deconv::ConvTranspose2dParams& p = c.p;
  p.N = pr.N;
  p.C_in = pr.C_in;
  p.H_in = pr.H_in;
  p.W_in = pr.W_in;
  p.C_out = pr.C_out;
  p.H_out = pr.H_out;
  p.W_out = pr.W_out;
  p.kH = pr.kH;
  p.kW = pr.kW;
  p.stride_h = stride[0];
  p.stride_w = stride[1];
  p.pad_h = padding[0];
  p.pad_w = padding[1];
  p.dil_h = dilation[0];
  p.dil_w = dilation[1];
  p.groups = groups;
  p.dtype = to_dtype(x.scalar_type());
  p.precision = precision == "tf32" ? deconv::Precision::kTF32 : deconv::Precision::kExactFp32;
  p.force_path = static_cast<int>(forced.path);
  p.force_config = static_cast<int>(forced.config);
  p.force_split = static_cast<int>(forced.split);
  const bool x_cl = channels_last(x);
  const bool w_cl = channels_last(weight);
  c.torch_cl = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
               weight.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  // Families that read x as it is, so that nothing changes layout: the fold kernel (either layout; few channels, a
  // stride of 8 or more on the columns), the fused taps kernel (either layout; few output channels) and the tiled
  // narrow kernel's staged form (configuration 2, either layout; up to 4 output channels a group), which write y in
  // x's layout (NCHW into `out`) and read the weights in either layout unpacked, and the shuffle kernel (an NCHW x;
  // 16-bit layers whose kernel is their stride), which writes an NCHW y and packs the weights from either layout.
  if (x_cl || x.is_contiguous()) {
    deconv::ConvTranspose2dParams q = p;
    q.x_channels_last = x_cl;
    q.y_channels_last = x_cl && !has_out;
    q.w_channels_last = w_cl;
    q.x = x.data_ptr();
    q.w = weight.data_ptr();
    const deconv::KernelPlan plan = deconv::conv_transpose2d_plan(q);
    if (plan.path == deconv::KernelPath::kFold || plan.path == deconv::KernelPath::kTapsFused ||
        plan.path == deconv::KernelPath::kShuffle ||
        (plan.path == deconv::KernelPath::kNarrowTiled && plan.config == 2)) {
      p = q;
      p.x = p.w = nullptr;
      c.plan = plan;
      c.x_as_is = true;
      c.y_cl = q.y_channels_last;
      c.w_as_is = w_cl || weight.is_contiguous();  // else an NCHW copy (w_channels_last is false then)
      return c;
    }
  }
  // The kernel choice sees the input as the gemm kernel would read it: x itself when channels-last, else a new
  // (aligned) copy; it reads only the pointers' alignment.
  p.x_channels_last = true;
  p.x = x_cl ? x.data_ptr() : nullptr;
  const deconv::KernelPath cl_path = deconv::conv_transpose2d_plan(p).path;
  // The taps path runs the gemm kernel on x as the gemm path does, and writes y in either layout itself.
  const bool taps = cl_path == deconv::KernelPath::kTaps;
  bool gemm = cl_path == deconv::KernelPath::kGemm || taps;
  // With one group, input channels that do not fill whole 16-byte vectors (a DCGAN generator's 100 latent channels
  // in 16 bits) are padded for the gemm path where it would then run: a zero-padded channels-last copy of x, as an
  // NCHW x gets a channels-last one.
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  if (!gemm && groups == 1 && pr.C_in % vec != 0) {
    deconv::ConvTranspose2dParams q = p;
    q.x = nullptr;
    q.x_pitch = (pr.C_in + vec - 1) / vec * vec;
    if (deconv::conv_transpose2d_plan(q).path == deconv::KernelPath::kGemm) {
      gemm = true;
      c.pitch = q.x_pitch;
    }
  }
  // The caller gets y in x's layout (NCHW into `out`). The gemm kernel and the taps path write either layout; the
  // others write NCHW, staged in scratch and converted for a channels-last y (not for one output channel: both
  // layouts are then the same memory). The gemm kernel may stage an NCHW y channels-last too (never the taps path).
  c.y_cl = x_cl && !has_out;
  c.staged = taps ? false : gemm ? !c.y_cl && forced.staged == 1 : c.y_cl && pr.C_out > 1;
  p.x_channels_last = gemm;
  p.y_channels_last = gemm && (c.y_cl || c.staged);
  // The gemm kernel takes channels-last weights (reading 16-bit ones as they are, packing the others from that
  // layout); every other family reads NCHW weights, converted when they are not.
  p.w_channels_last = gemm && w_cl;
  c.w_as_is = p.w_channels_last || weight.is_contiguous();
  // An fp32 x bound for the gemm kernel's TF32 products may come rounded to TF32 (Forced::round): an NCHW one by the
  // layout change it needs, a channels-last one by a pass of its own. The kernel then skips rounding every A stage
  // (in registers or shared memory). Forced::round 2 has the kernel take x's fp32 values as they are, and the tensor
  // cores read their TF32 part (the low mantissa bits dropped: rounding toward zero; measured less accurate than
  // cuDNN's TF32, bench/NOTES.md: for experiments only). A channels-last x bound for the taps path is never copied
  // for rounding: taps_preferred tells an NCHW x by the null x it is planned with, and the final plan below must
  // stay the taps path.
  const bool tf32_gemm =
      gemm && c.pitch == 0 && p.dtype == deconv::DType::kFloat32 && p.precision == deconv::Precision::kTF32;
  const bool moves = !x.is_contiguous(at::MemoryFormat::ChannelsLast);  // x needs a layout change
  c.round_x = tf32_gemm && (moves ? x.is_contiguous() && (forced.round == -1 || forced.round == 1)
                                  : forced.round == 1 && !taps && x.numel() > 0);
  c.x_as_is = !c.round_x && c.pitch == 0 && x.is_contiguous(gemm ? at::MemoryFormat::ChannelsLast
                                                                  : at::MemoryFormat::Contiguous);
  p.x = c.x_as_is ? x.data_ptr() : nullptr;
  p.w = c.w_as_is ? weight.data_ptr() : nullptr;
  p.x_tf32_rounded = c.round_x || (tf32_gemm && forced.round == 2);
  p.x_pitch = c.pitch;
  c.plan = deconv::conv_transpose2d_plan(p);  // the final plan, with x's and the weight's alignment
  p.x = p.w = nullptr;
  return c;
}

// Runs a planned problem on x's CUDA device, on its current stream, into `out` when given (a contiguous NCHW tensor)
// or a new tensor: channels-last when x is and the gemm kernel runs (otherwise NCHW; callers that want PyTorch's
// layout apply CallPlan::torch_cl). Returns (y, kernel path).
std::tuple<torch::Tensor, int64_t> run_call(const CallPlan& c, const torch::Tensor& x, const torch::Tensor& weight,
                                            const c10::optional<torch::Tensor>& bias,
                                            const c10::optional<torch::Tensor>& out, WeightPacks* packs) {
  deconv::ConvTranspose2dParams p = c.p;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    p.bias = bc.data_ptr();
  }
  const torch::Tensor wc = c.w_as_is ? weight : in_layout(weight, false, stream);
  p.w = wc.data_ptr();
  torch::Tensor xk;
  if (c.round_x) {
    xk = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::ChannelsLast));
    if (!x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
      convert(x, xk, true, stream, true);
    } else {
      const cudaError_t err = deconv::round_to_tf32(x.data_ptr(), xk.data_ptr(), x.numel(), stream);
      TORCH_CHECK(err == cudaSuccess, "conv_transpose2d: rounding the input to TF32 failed: ",
                  cudaGetErrorString(err));
    }
  } else if (c.pitch > 0) {
    xk = padded_rows(x, c.pitch);
  } else {
    xk = c.x_as_is ? x : in_layout(x, p.x_channels_last, stream);
  }
  p.x = xk.data_ptr();
  const auto layout = [&](bool cl) {
    return x.options().memory_format(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  };
  const torch::Tensor y =
      out.has_value() ? *out : torch::empty({c.pr.N, c.pr.C_out, c.pr.H_out, c.pr.W_out}, layout(c.y_cl));
  if (c.pr.N == 0) return {y, 0};
  const torch::Tensor yk = c.staged ? torch::empty(y.sizes(), layout(p.y_channels_last)) : y;
  p.y = yk.data_ptr();
  if (packs != nullptr && packs->holds(wc)) p.packed_weights = packs->get(p, c.plan, stream);
  // Scratch (packed weights, split-K partials) from PyTorch's caching allocator, on the current stream: freed when
  // this returns, reusable by the allocator only after the kernels queued on this stream have run.
  const size_t ws_bytes = deconv::conv_transpose2d_workspace_bytes(p, c.plan);
  torch::Tensor workspace;
  if (ws_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  const cudaError_t err = deconv::conv_transpose2d_forward(p, c.plan, stream);
  TORCH_CHECK(err == cudaSuccess, "conv_transpose2d kernel launch failed: ", cudaGetErrorString(err));
  if (c.staged) convert(yk, y, c.y_cl, stream);
  return {y, static_cast<int64_t>(c.plan.path)};
}

// plan_call, then run_call.
std::tuple<torch::Tensor, int64_t> launch(const torch::Tensor& x, const torch::Tensor& weight,
                                          const c10::optional<torch::Tensor>& bias,
                                          const c10::optional<torch::Tensor>& out, const Problem& pr,
                                          const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                                          const std::vector<int64_t>& dilation, int64_t groups,
                                          const std::string& precision, const Forced& forced, WeightPacks* packs) {
  const CallPlan c =
      plan_call(x, weight, bias, out.has_value(), pr, stride, padding, dilation, groups, precision, forced);
  return run_call(c, x, weight, bias, out, packs);
}

// The call cache: the CallPlan of every problem a library call ran (forward with remember), so that a repeat of it
// (fast_forward) goes from Python to the launch in one call, skipping the argument checks, the layout decisions and
// the kernel choice. A problem is what the plan depends on: x's and the weight's sizes, strides, dtype, device and
// start address modulo 256 bytes, the bias's size, stride and alignment, the arguments and the multiply precision.
// The kernel choice is the caller's at remember time: kernels/tuning.py clears the cache when measured choice is
// turned on or off or forgets its choices. Bounded: past kMaxEntries problems it starts again empty.
struct CallKey {
  std::array<int64_t, 36> v{};
  bool operator==(const CallKey& o) const { return v == o.v; }
};

struct CallKeyHash {
  size_t operator()(const CallKey& k) const {
    uint64_t h = 1469598103934665603ULL;  // FNV-1a over the 64-bit words
    for (const int64_t e : k.v) {
      h ^= static_cast<uint64_t>(e);
      h *= 1099511628211ULL;
    }
    return static_cast<size_t>(h);
  }
};

// The precision code of a key: 1 for TF32 products of float32 tensors, 0 otherwise.
int64_t precision_code(at::ScalarType dtype, bool tf32) { return dtype == at::kFloat && tf32 ? 1 : 0; }

CallKey call_key(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor* b, const int64_t* stride,
                 const int64_t* padding, const int64_t* output_padding, const int64_t* dilation, int64_t groups,
                 int64_t precision) {
  CallKey k;
  size_t i = 0;
  const auto put = [&](int64_t e) { k.v[i++] = e; };
  const auto tensor = [&](const torch::Tensor& t) {
    for (int64_t d = 0; d < 4; ++d) put(t.size(d));
    for (int64_t d = 0; d < 4; ++d) put(t.stride(d));
    put(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 256));
  };
  tensor(x);
  tensor(w);
  put(static_cast<int64_t>(x.scalar_type()));
  put(x.device().index());
  if (b != nullptr) {
    put(1);
    put(b->dim() == 1 ? b->size(0) : -1);
    put(b->dim() == 1 ? b->stride(0) : -1);
    put(static_cast<int64_t>(reinterpret_cast<uintptr_t>(b->data_ptr()) % 256));
  } else {
    for (int j = 0; j < 4; ++j) put(0);
  }
  for (int j = 0; j < 2; ++j) put(stride[j]);
  for (int j = 0; j < 2; ++j) put(padding[j]);
  for (int j = 0; j < 2; ++j) put(output_padding[j]);
  for (int j = 0; j < 2; ++j) put(dilation[j]);
  put(groups);
  put(precision);
  return k;
}

class CallCache {
 public:
  static constexpr size_t kMaxEntries = 4096;

  bool find(const CallKey& k, CallPlan* plan) {
    const std::lock_guard<std::mutex> lock(mu_);
    const auto it = plans_.find(k);
    if (it == plans_.end()) return false;
    *plan = it->second;
    return true;
  }

  void store(const CallKey& k, const CallPlan& plan) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (plans_.size() >= kMaxEntries) plans_.clear();
    plans_[k] = plan;
  }

  int64_t clear() {
    const std::lock_guard<std::mutex> lock(mu_);
    const int64_t n = static_cast<int64_t>(plans_.size());
    plans_.clear();
    return n;
  }

  int64_t size() {
    const std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(plans_.size());
  }

 private:
  std::mutex mu_;
  std::unordered_map<CallKey, CallPlan, CallKeyHash> plans_;
};

CallCache& call_cache() {
  static CallCache* cache = new CallCache();  // never destroyed: no teardown order at exit
  return *cache;
}

// The packs a library call uses: the caller's, else (asked for with `prepare`, and never while the stream captures
// a CUDA graph, whose replays must read the weights as they are then) the weight's prepared ones.
std::shared_ptr<WeightPacks> call_packs(const torch::Tensor& x, const torch::Tensor& weight, bool prepare) {
  if (!prepare || capturing(x)) return nullptr;
  return prepared_weights().get(weight);
}

// Returns (y, path): path is the KernelPath that ran (0 SIMT, 1 tensor cores, 2 narrow, 3 sparse, 4 gemm, 5 tiled
// narrow, 6 shuffle, 7 fold, 8 taps, 9 fused taps). `prepare`: without `packs`, use the weight's prepared packs
// (PreparedWeights). `torch_layout`: y in PyTorch's layout (channels-last when x or the weight suggests it) rather
// than x's. `remember`: keep the call's plan in the call cache, for fast_forward (a library call without `out`, whose
// choice follows kernels.tuning).
std::tuple<torch::Tensor, int64_t> forward(const torch::Tensor& x,       // x: [N, C_in, H_in, W_in]
                                           const torch::Tensor& weight,  // weight: [C_in, C_out/groups, kH, kW]
                                           const c10::optional<torch::Tensor>& bias,  // bias: [C_out] or None
                                           std::vector<int64_t> stride, std::vector<int64_t> padding,
                                           std::vector<int64_t> output_padding, std::vector<int64_t> dilation,
                                           int64_t groups, const std::string& precision,
                                           const c10::optional<torch::Tensor>& out,  // out: [N, C_out, H_out, W_out]
                                           int64_t force_path, int64_t force_config, int64_t force_split,
                                           int64_t force_staged, int64_t force_round, WeightPacks* packs,
                                           bool prepare, bool torch_layout, bool remember) {
  TORCH_CHECK(x.is_cuda(), "conv_transpose2d: input must be a CUDA tensor.");
  TORCH_CHECK(weight.device() == x.device(), "conv_transpose2d: weight is on ", weight.device().str(),
              " but input is on ", x.device().str(), ".");
  const Problem pr = check_problem(x, weight, bias, stride, padding, output_padding, dilation, groups, precision);
  const Forced forced = check_forced(force_path, force_config, force_split, force_staged, force_round);
  check_packs(packs, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  if (out.has_value()) {
    TORCH_CHECK(out->device() == x.device() && out->scalar_type() == x.scalar_type() && out->is_contiguous() &&
                    out->sizes() == at::IntArrayRef({pr.N, pr.C_out, pr.H_out, pr.W_out}),
                "conv_transpose2d: out must be a contiguous ", shape_text(pr),
                " tensor of the input's dtype and device.");
  }
  const CallPlan c =
      plan_call(x, weight, bias, out.has_value(), pr, stride, padding, dilation, groups, precision, forced);
  const std::shared_ptr<WeightPacks> prepared = packs == nullptr ? call_packs(x, weight, prepare) : nullptr;
  auto [y, path] = run_call(c, x, weight, bias, out, packs != nullptr ? packs : prepared.get());
  if (remember && !out.has_value() && pr.N > 0) {
    const torch::Tensor* b = bias.has_value() ? &*bias : nullptr;
    call_cache().store(call_key(x, weight, b, stride.data(), padding.data(), output_padding.data(), dilation.data(),
                                groups, precision_code(x.scalar_type(), precision == "tf32")),
                       c);
  }
  if (torch_layout && c.torch_cl && !out.has_value()) y = y.contiguous(at::MemoryFormat::ChannelsLast);
  return {y, path};
}

// torch.nn.Parameter, whose instances count as plain tensors for fast_forward (set when the module loads).
PyTypeObject* parameter_type = nullptr;

// A tensor object fast_forward takes: a torch.Tensor or torch.nn.Parameter, not a subclass (fake, functional or
// other tensors with Python behaviour), over a plain TensorImpl (not a functorch wrapper), without the lazy
// negation or conjugation bits.
bool plain_tensor(PyObject* obj) {
  if (!(THPVariable_CheckExact(obj) || (parameter_type != nullptr && Py_TYPE(obj) == parameter_type))) return false;
  const torch::Tensor& t = THPVariable_Unpack(obj);
  return typeid(*t.unsafeGetTensorImpl()) == typeid(c10::TensorImpl) && !t.is_neg() && !t.is_conj();
}

// An int, or a tuple of two ints (exactly those types, as a module passes them), as a (height, width) pair.
bool read_pair(PyObject* obj, int64_t* pair) {
  if (PyLong_CheckExact(obj)) {
    const long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    pair[0] = pair[1] = v;
    return true;
  }
  if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return false;
  for (Py_ssize_t i = 0; i < 2; ++i) {
    PyObject* item = PyTuple_GET_ITEM(obj, i);
    if (!PyLong_CheckExact(item)) return false;
    const long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    pair[i] = v;
  }
  return true;
}

// A repeat of a library call (kernels.conv_transpose2d's arguments, as given): runs it from its cached plan and
// returns y in PyTorch's layout, or returns None when the call is not one the cache can take -- not remembered yet,
// on the CPU, unbatched or empty, needing autograd or autocast, under a dispatch mode, with tensor subclasses or
// arguments of other types than int and tuple -- so that the caller takes its full path, which checks everything.
py::object fast_forward(py::handle x_obj, py::handle w_obj, py::handle b_obj, py::handle stride_obj,
                        py::handle padding_obj, py::handle output_padding_obj, py::handle groups_obj,
                        py::handle dilation_obj, py::handle precision_obj) {
  const bool has_bias = !b_obj.is_none();
  if (!plain_tensor(x_obj.ptr()) || !plain_tensor(w_obj.ptr()) || (has_bias && !plain_tensor(b_obj.ptr())))
    return py::none();
  const torch::Tensor& x = THPVariable_Unpack(x_obj.ptr());
  const torch::Tensor& w = THPVariable_Unpack(w_obj.ptr());
  const torch::Tensor* b = has_bias ? &THPVariable_Unpack(b_obj.ptr()) : nullptr;
  if (!x.is_cuda() || x.dim() != 4 || w.dim() != 4 || x.size(0) == 0 || w.device() != x.device() ||
      w.scalar_type() != x.scalar_type() || (b != nullptr && (b->device() != x.device() ||
                                                               b->scalar_type() != x.scalar_type())))
    return py::none();
  if (at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || (b != nullptr && b->requires_grad())))
    return py::none();
  if (at::autocast::is_autocast_enabled(at::kCUDA) || c10::impl::TorchDispatchModeTLS::stack_len() > 0)
    return py::none();
  int64_t stride[2], padding[2], output_padding[2], dilation[2];
  if (!read_pair(stride_obj.ptr(), stride) || !read_pair(padding_obj.ptr(), padding) ||
      !read_pair(output_padding_obj.ptr(), output_padding) || !read_pair(dilation_obj.ptr(), dilation) ||
      !PyLong_CheckExact(groups_obj.ptr()))
    return py::none();
  const long long groups = PyLong_AsLongLong(groups_obj.ptr());
  if (groups == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return py::none();
  }
  bool tf32 = false;
  if (precision_obj.is_none()) {
    tf32 = at::globalContext().allowTF32CuDNN();
  } else if (PyUnicode_CheckExact(precision_obj.ptr())) {
    const std::string text = py::cast<std::string>(precision_obj);
    if (text != "tf32" && text != "fp32") return py::none();
    tf32 = text == "tf32";
  } else {
    return py::none();
  }
  CallPlan c;
  if (!call_cache().find(call_key(x, w, b, stride, padding, output_padding, dilation, groups,
                                  precision_code(x.scalar_type(), tf32)),
                         &c))
    return py::none();
  const c10::cuda::CUDAGuard guard(x.device());
  const std::shared_ptr<WeightPacks> packs = call_packs(x, w, /*prepare=*/true);
  const c10::optional<torch::Tensor> bias = b != nullptr ? c10::optional<torch::Tensor>(*b) : c10::nullopt;
  torch::Tensor y = std::get<0>(run_call(c, x, w, bias, c10::nullopt, packs.get()));
  if (c.torch_cl) y = y.contiguous(at::MemoryFormat::ChannelsLast);
  return py::cast(y);
}

// The registered operator deconv::conv_transpose2d (its schema, fake and Python kernels are in kernels/op.py) gets two
// C++ kernels for CUDA tensors, registered when this library loads (end of this file): the autograd step and the
// call itself. A compiled model's or an exported program's call of a problem it has run before then never enters
// Python, as a call of PyTorch's own convolution does not.
using OpSignature = torch::Tensor(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                                  c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, int64_t, c10::IntArrayRef,
                                  c10::optional<c10::string_view>, bool);

const c10::TypedOperatorHandle<OpSignature>& op_handle() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("deconv::conv_transpose2d", "").typed<OpSignature>();
  return handle;
}

// The operator's CUDA kernel. A problem in the call cache (remembered by an earlier call of the operator or of
// kernels.conv_transpose2d) runs from its plan. Any other call -- the first of its problem, one the cache cannot
// take, a malformed one -- goes to Python's kernel (kernels.op.conv_transpose2d_op), which checks it, makes the kernel
// choice (measured, with kernels.tuning on) and remembers the problem.
torch::Tensor op_cuda(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef output_padding,
                      int64_t groups, c10::IntArrayRef dilation, c10::optional<c10::string_view> precision,
                      bool prepare) {
  const torch::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
  bool tf32 = false;
  bool known = true;
  if (!precision.has_value()) {
    tf32 = at::globalContext().allowTF32CuDNN();
  } else if (*precision == "tf32") {
    tf32 = true;
  } else if (*precision != "fp32") {
    known = false;
  }
  const bool pairs = stride.size() == 2 && padding.size() == 2 && output_padding.size() == 2 && dilation.size() == 2;
  const bool takes = known && pairs && x.dim() == 4 && w.dim() == 4 && x.size(0) > 0 && w.device() == x.device() &&
                     w.scalar_type() == x.scalar_type() &&
                     (b == nullptr || (b->device() == x.device() && b->scalar_type() == x.scalar_type()));
  CallPlan c;
  if (takes && call_cache().find(call_key(x, w, b, stride.data(), padding.data(), output_padding.data(),
                                          dilation.data(), groups, precision_code(x.scalar_type(), tf32)),
                                 &c)) {
    const c10::cuda::CUDAGuard guard(x.device());
    const std::shared_ptr<WeightPacks> packs = call_packs(x, w, prepare);
    const c10::optional<torch::Tensor> bias_in = b != nullptr ? c10::optional<torch::Tensor>(*b) : c10::nullopt;
    torch::Tensor y = std::get<0>(run_call(c, x, w, bias_in, c10::nullopt, packs.get()));
    if (c.torch_cl) y = y.contiguous(at::MemoryFormat::ChannelsLast);
    return y;
  }
  const py::gil_scoped_acquire gil;
  static py::object* python_kernel = nullptr;  // never destroyed: no teardown order at exit
  if (python_kernel == nullptr) {
    python_kernel = new py::object(py::module_::import("kernels.op").attr("conv_transpose2d_op"));
  }
  const py::object text = precision.has_value() ? py::object(py::str(std::string(*precision))) : py::object(py::none());
  const py::object bias_obj = b != nullptr ? py::cast(*b) : py::object(py::none());
  return (*python_kernel)(x, w, bias_obj, stride.vec(), padding.vec(), output_padding.vec(), groups, dilation.vec(),
                          text, prepare)
      .cast<torch::Tensor>();
}

// Autograd of the operator on CUDA tensors: the gradients come from PyTorch's own convolution_backward (cuDNN), as
// with the Python autograd kernel kernels/op.py registers for other devices.
struct ConvTranspose2dFunction : public torch::autograd::Function<ConvTranspose2dFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& bias, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef output_padding, int64_t groups,
                               c10::IntArrayRef dilation, c10::optional<c10::string_view> precision, bool prepare) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["output_padding"] = output_padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    const at::AutoDispatchBelowADInplaceOrView below;
    return op_handle().call(x, w, bias, stride, padding, output_padding, groups, dilation, precision, prepare);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    const std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    const std::vector<int64_t> output_padding = ctx->saved_data["output_padding"].toIntVector();
    const std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    const std::vector<int64_t> bias_sizes{w.size(1) * groups};
    auto [gx, gw, gb] = at::convolution_backward(
        grads[0], x, w, has_bias ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(c10::nullopt),
        stride, padding, dilation, /*transposed=*/true, output_padding, groups, mask);
    return {gx, gw, gb, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

// The operator's autograd kernel for CUDA tensors: a call that needs no gradients goes straight to the CUDA kernel.
torch::Tensor op_autograd_cuda(const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& bias, c10::IntArrayRef stride,
                               c10::IntArrayRef padding, c10::IntArrayRef output_padding, int64_t groups,
                               c10::IntArrayRef dilation, c10::optional<c10::string_view> precision, bool prepare) {
  const bool needs = at::GradMode::is_enabled() &&
                     (x.requires_grad() || w.requires_grad() || (bias.has_value() && bias->defined() &&
                                                                 bias->requires_grad()));
  if (!needs) {
    const at::AutoDispatchBelowADInplaceOrView below;
    return op_handle().call(x, w, bias, stride, padding, output_padding, groups, dilation, precision, prepare);
  }
  return ConvTranspose2dFunction::apply(x, w, bias, stride, padding, output_padding, groups, dilation, precision,
                                        prepare);
}

// Host x_host -> weight's device -> kernels -> host y_host on the current stream, then waits for the stream. Called
// with the GIL released and weight's device current; returns the kernel path.
int64_t run_host_to_host(const torch::Tensor& x_host, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias, const torch::Tensor& y_host, const Problem& pr,
                         const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                         const std::vector<int64_t>& dilation, int64_t groups, const std::string& precision,
                         const Forced& forced, WeightPacks* packs) {
  const torch::Tensor x = x_host.to(weight.device(), /*non_blocking=*/true);
  const auto [y, path] = launch(x, weight, bias, c10::nullopt, pr, stride, padding, dilation, groups, precision,
                                forced, packs);
  y_host.copy_(y, /*non_blocking=*/true);
  at::cuda::getCurrentCUDAStream(weight.device().index()).synchronize();
  return path;
}

// One batch staged through host memory, for a serving worker thread: upload x_host, run the kernels, download into
// y_host and wait for the current stream, with the Python GIL released once for all of it. Called from Python op by
// op, each of those steps would release and re-take the GIL, and each re-take waits for whichever thread holds it:
// in a server, an event loop that holds it most of the time. Every check runs before the GIL is released; an error
// while it is released (out of memory, a failed launch) propagates once the GIL is held again.
int64_t forward_staged(const torch::Tensor& x_host,  // x_host: [N, C_in, H_in, W_in] on the CPU (pinned: asynchronous)
                       const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                       std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> output_padding,
                       std::vector<int64_t> dilation, int64_t groups, const std::string& precision,
                       const torch::Tensor& y_host,  // y_host: [N, C_out, H_out, W_out] on the CPU, contiguous
                       int64_t force_path, int64_t force_config, int64_t force_split, int64_t force_staged,
                       int64_t force_round, WeightPacks* packs) {
  const Forced forced = check_forced(force_path, force_config, force_split, force_staged, force_round);
  check_packs(packs, weight);
  TORCH_CHECK(x_host.device().is_cpu() && y_host.device().is_cpu(),
              "conv_transpose2d_staged: input and output must be CPU tensors.");
  TORCH_CHECK(weight.is_cuda(), "conv_transpose2d_staged: weight must be a CUDA tensor.");
  const Problem pr =
      check_problem(x_host, weight, bias, stride, padding, output_padding, dilation, groups, precision);
  TORCH_CHECK(y_host.scalar_type() == x_host.scalar_type() && y_host.is_contiguous() &&
                  y_host.sizes() == at::IntArrayRef({pr.N, pr.C_out, pr.H_out, pr.W_out}),
              "conv_transpose2d_staged: out must be a contiguous ", shape_text(pr),
              " CPU tensor of the input's dtype.");
  const py::gil_scoped_release no_gil;
  const c10::cuda::CUDAGuard guard(weight.device());
  return run_host_to_host(x_host, weight, bias, y_host, pr, stride, padding, dilation, groups, precision, forced,
                          packs);
}

// Buffers obtained from Python objects, released (with the GIL held) when this goes out of scope.
class HeldBuffers {
 public:
  explicit HeldBuffers(size_t n) { views_.reserve(n); }
  HeldBuffers(const HeldBuffers&) = delete;
  HeldBuffers& operator=(const HeldBuffers&) = delete;
  ~HeldBuffers() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  // The object's memory as one C-contiguous block (`writable`: memory to write into); throws the Python error when
  // it has none.
  const Py_buffer& get(PyObject* obj, bool writable = false) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0)
      throw py::error_already_set();
    views_.push_back(view);
    return views_.back();
  }

 private:
  std::vector<Py_buffer> views_;
};

// A piece of a batch's input or output in memory, in order.
struct Part {
  const void* data;
  size_t bytes;
};

// A host copy: `bytes` from `src` to `dst`.
struct Piece {
  char* dst;
  const char* src;
  size_t bytes;
};

// Makes the host copies: in pieces of at most 1 MiB across torch's intra-op threads when they add up to a megabyte
// or more (one thread's copies set a megabyte batch's pace, and a tiny batch's outputs come to 1.5 MB:
// bench/NOTES.md), else on this thread.
void copy_pieces(const std::vector<Piece>& copies) {
  constexpr size_t kPiece = size_t(1) << 20;
  std::vector<Piece> pieces;
  pieces.reserve(copies.size());
  size_t total = 0;
  for (const Piece& c : copies) {
    for (size_t off = 0; off < c.bytes; off += kPiece)
      pieces.push_back({c.dst + off, c.src + off, std::min(kPiece, c.bytes - off)});
    total += c.bytes;
  }
  const int64_t n = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, n, total >= kPiece ? 1 : std::max<int64_t>(n, 1), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
  });
}

// Copies the parts one after the other into dst (copy_pieces).
void gather_parts(const std::vector<Part>& parts, char* dst) {
  std::vector<Piece> copies;
  copies.reserve(parts.size());
  size_t at = 0;
  for (const Part& part : parts) {
    copies.push_back({dst + at, static_cast<const char*>(part.data), part.bytes});
    at += part.bytes;
  }
  copy_pieces(copies);
}

// A host batch's input as a meta tensor of x_shape, after the checks of the weights and packs it goes with (`name`:
// the caller, for the messages).
torch::Tensor host_batch_input(const char* name, const std::vector<int64_t>& x_shape, const torch::Tensor& weight,
                               const WeightPacks* packs) {
  TORCH_CHECK(weight.is_cuda(), name, ": weight must be a CUDA tensor.");
  check_packs(packs, weight);
  TORCH_CHECK(x_shape.size() == 4 && x_shape[0] > 0, name, ": shape must be [N, C_in, H, W].");
  return at::empty(x_shape, weight.options().device(at::kMeta));
}

// The memory of a batch's host parts (CPU tensors or buffers, checked by Python first), in order; `buffers` and
// `tensors` keep them referenced. Throws unless they hold exactly `nbytes`.
std::vector<Part> host_parts(const char* name, const py::list& parts, const torch::Tensor& weight, size_t nbytes,
                             HeldBuffers& buffers, std::vector<torch::Tensor>& tensors) {
  std::vector<Part> host;
  size_t total = 0;
  for (const py::handle obj : parts) {
    if (THPVariable_Check(obj.ptr())) {
      const torch::Tensor& t = THPVariable_Unpack(obj.ptr());
      TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == weight.scalar_type(),
                  name, ": tensor parts must be contiguous CPU tensors of the weight's dtype.");
      tensors.push_back(t);
      host.push_back({t.data_ptr(), t.nbytes()});
    } else {
      const Py_buffer& view = buffers.get(obj.ptr());
      host.push_back({view.buf, static_cast<size_t>(view.len)});
    }
    total += host.back().bytes;
  }
  TORCH_CHECK(total == nbytes, name, ": the parts hold ", num(total), " bytes, the input ", num(nbytes), ".");
  return host;
}

// forward_staged for a batch whose samples sit in several host buffers (each request's, where it arrived): with
// the GIL held only to find the parts' memory, the parts are copied into pinned staging memory, uploaded, run,
// downloaded into a new pinned tensor that is returned, and the current stream is waited for. A serving thread
// then takes the GIL back once per batch. Python (service/engine/ops.py, conv_transpose2d_gathered) checks the
// parts' types, dtypes and sizes first.
torch::Tensor forward_gathered(const py::list& parts,  // CPU tensors or buffers: [N, C_in, H_in, W_in] in order
                               const std::vector<int64_t>& x_shape, const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& bias, std::vector<int64_t> stride,
                               std::vector<int64_t> padding, std::vector<int64_t> output_padding,
                               std::vector<int64_t> dilation, int64_t groups, const std::string& precision,
                               int64_t force_path, int64_t force_config, int64_t force_split,
                               int64_t force_staged, int64_t force_round, WeightPacks* packs) {
  const Forced forced = check_forced(force_path, force_config, force_split, force_staged, force_round);
  const torch::Tensor x_meta = host_batch_input("conv_transpose2d_gathered", x_shape, weight, packs);
  const Problem pr =
      check_problem(x_meta, weight, bias, stride, padding, output_padding, dilation, groups, precision);
  std::vector<torch::Tensor> tensors;  // tensor parts, referenced until the copies are done
  HeldBuffers buffers(parts.size());
  const std::vector<Part> host =
      host_parts("conv_transpose2d_gathered", parts, weight, x_meta.nbytes(), buffers, tensors);
  torch::Tensor y_host;
  {
    const py::gil_scoped_release no_gil;
    const c10::cuda::CUDAGuard guard(weight.device());
    const auto pinned = weight.options().device(at::kCPU).pinned_memory(true);
    const torch::Tensor x_host = at::empty(x_shape, pinned);
    gather_parts(host, static_cast<char*>(x_host.data_ptr()));
    y_host = at::empty({pr.N, pr.C_out, pr.H_out, pr.W_out}, pinned);
    run_host_to_host(x_host, weight, bias, y_host, pr, stride, padding, dilation, groups, precision, forced,
                     packs);
  }
  return y_host;
}

// (address, bytes) pairs of memory the GPU reaches (unified addressing) as parts; throws unless their bytes add up
// to those of the batch's `tensor` ("input" or "output").
std::vector<Part> placed_parts(const std::vector<std::pair<int64_t, int64_t>>& pairs, size_t nbytes,
                               const char* tensor) {
  std::vector<Part> parts;
  parts.reserve(pairs.size());
  size_t total = 0;
  for (const auto& [address, bytes] : pairs) {
    TORCH_CHECK(address != 0 && bytes > 0, "conv_transpose2d_placed: a place needs an address and bytes.");
    parts.push_back({reinterpret_cast<const void*>(address), static_cast<size_t>(bytes)});
    total += static_cast<size_t>(bytes);
  }
  TORCH_CHECK(total == nbytes, "conv_transpose2d_placed: the ", tensor, " places hold ", num(total), " bytes, the ",
              tensor, " ", num(nbytes), ".");
  return parts;
}

// Host places smaller than this are staged: copied on the host into (or out of) one page-locked buffer, which one
// copy a run of consecutive staged places moves to (or from) the GPU, instead of one copy each. A copy costs the
// driver ~3 us whatever its size, more than the host copy of a small place (a tiny request's 16 KiB: ~2 us); larger
// places go by the copy engines straight from and into their memory (page-locked: DMA at PCIe speed, with no host
// copy; pageable: the driver's own staging).
constexpr size_t kStageBelow = size_t(256) << 10;

// Whether a place is memory of GPU `device` aligned for the kernels' vector accesses, which they then read or write
// in place.
bool in_place(const Part& place, int device) {
  constexpr uintptr_t kAlign = 16;
  if (reinterpret_cast<uintptr_t>(place.data) % kAlign != 0) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, place.data) != cudaSuccess) {
    cudaGetLastError();  // not an address the driver knows: host memory, copied as such
    return false;
  }
  return attr.type == cudaMemoryTypeDevice && attr.device == device;
}

// How a batch's tensor on the GPU (contiguous) and its places exchange their bytes, in order: the staged places
// through `stage`, a page-locked buffer holding them one after the other, the others each by a copy of its own.
struct Exchange {
  std::vector<bool> staged;
  torch::Tensor stage;  // page-locked; empty when no place is staged
  char* stage_at = nullptr;
};

// `host`: the places are host memory (the caller knows), and those below kStageBelow are staged. Otherwise each is
// copied by the driver wherever it is: asking the driver where each place is (cudaPointerGetAttributes) costs ~2 us
// a place on an H100, as much as the copy it would save.
Exchange plan_exchange(const std::vector<Part>& places, bool host) {
  Exchange ex;
  ex.staged.reserve(places.size());
  size_t staged = 0;
  for (const Part& place : places) {
    ex.staged.push_back(host && place.bytes < kStageBelow);
    if (ex.staged.back()) staged += place.bytes;
  }
  if (staged > 0) {
    ex.stage = at::empty({static_cast<int64_t>(staged)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    ex.stage_at = static_cast<char*>(ex.stage.data_ptr());
  }
  return ex;
}

// The device copies between `tensor` (the batch's on the GPU) and its places, on `stream`: one a run of consecutive
// staged places (to or from the stage), one for each other place. `upload`: places -> tensor, else tensor -> places.
void queue_copies(const std::vector<Part>& places, const Exchange& ex, char* tensor, bool upload,
                  cudaStream_t stream) {
  size_t at = 0, staged_at = 0;
  size_t run_at = 0, run_stage = 0, run_bytes = 0;  // the run of staged places being gathered
  const auto flush = [&] {
    if (run_bytes == 0) return;
    char* on_gpu = tensor + run_at;
    char* on_host = ex.stage_at + run_stage;
    C10_CUDA_CHECK(upload ? cudaMemcpyAsync(on_gpu, on_host, run_bytes, cudaMemcpyHostToDevice, stream)
                          : cudaMemcpyAsync(on_host, on_gpu, run_bytes, cudaMemcpyDeviceToHost, stream));
    run_bytes = 0;
  };
  for (size_t i = 0; i < places.size(); ++i) {
    const Part& place = places[i];
    if (ex.staged[i]) {
      if (run_bytes == 0) {
        run_at = at;
        run_stage = staged_at;
      }
      run_bytes += place.bytes;
      staged_at += place.bytes;
    } else {
      flush();
      void* mine = const_cast<void*>(place.data);
      C10_CUDA_CHECK(upload ? cudaMemcpyAsync(tensor + at, mine, place.bytes, cudaMemcpyDefault, stream)
                            : cudaMemcpyAsync(mine, tensor + at, place.bytes, cudaMemcpyDefault, stream));
    }
    at += place.bytes;
  }
  flush();
}

// The host copies between the staged places and the stage: `upload`, places -> stage, else stage -> places.
std::vector<Piece> stage_copies(const std::vector<Part>& places, const Exchange& ex, bool upload) {
  std::vector<Piece> copies;
  size_t staged_at = 0;
  for (size_t i = 0; i < places.size(); ++i) {
    if (!ex.staged[i]) continue;
    char* mine = static_cast<char*>(const_cast<void*>(places[i].data));
    char* stage = ex.stage_at + staged_at;
    copies.push_back(upload ? Piece{stage, mine, places[i].bytes} : Piece{mine, stage, places[i].bytes});
    staged_at += places[i].bytes;
  }
  return copies;
}

// Waits for a stream when an exception passes, before the page-locked stages that copies queued on it use go back
// to PyTorch's host allocator, which could otherwise lend them to another thread while a copy still runs. Declare
// it after the stages, so that it runs before they go.
class WaitOnUnwind {
 public:
  explicit WaitOnUnwind(cudaStream_t stream) : stream_(stream), exceptions_(std::uncaught_exceptions()) {}
  WaitOnUnwind(const WaitOnUnwind&) = delete;
  WaitOnUnwind& operator=(const WaitOnUnwind&) = delete;
  ~WaitOnUnwind() {
    if (std::uncaught_exceptions() > exceptions_ && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
  }

 private:
  cudaStream_t stream_;
  int exceptions_;
};

// A batch read from the places `in` and written into the places `out`, each in order, wherever the GPU reaches them:
// device memory of the weight's GPU (such as a client's CUDA shared memory mapped here), page-locked host memory
// (host_register), or other host memory. The input is gathered on the weight's GPU, or read in place when it is one
// place in that GPU's memory; the output is spread over the places (each request's rows into its own), or written
// in place when it is one place in that GPU's memory. `host`: every place is host memory, and the small ones are
// staged (kStageBelow), so that a batch of tiny requests moves in one upload and one download. Called with the GIL
// released, on the current stream, up to this call's own work: an event recorded behind it is waited for, not the
// whole stream, so that callers on other threads may queue their batches on the same stream meanwhile (each waits
// for its own); then the staged outputs are copied into their places. The caller keeps the memory alive and
// unchanged until this returns. Returns the kernel path.
int64_t run_placed(const std::vector<Part>& in, const std::vector<Part>& out, bool host,
                   const std::vector<int64_t>& x_shape, const std::vector<int64_t>& y_shape, const torch::Tensor& weight,
                   const c10::optional<torch::Tensor>& bias, const Problem& pr, const std::vector<int64_t>& stride,
                   const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups,
                   const std::string& precision, const Forced& forced, WeightPacks* packs) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const int device = weight.device().index();
  const at::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream(device);
  const cudaStream_t stream = current.stream();
  const Exchange in_ex = plan_exchange(in, host);
  const Exchange out_ex = plan_exchange(out, host);
  const WaitOnUnwind wait_on_unwind(stream);
  torch::Tensor x;
  if (!host && in.size() == 1 && in_place(in[0], device)) {
    x = at::from_blob(const_cast<void*>(in[0].data), x_shape, weight.options());
  } else {
    x = at::empty(x_shape, weight.options());
    copy_pieces(stage_copies(in, in_ex, /*upload=*/true));
    queue_copies(in, in_ex, static_cast<char*>(x.data_ptr()), /*upload=*/true, stream);
  }
  c10::optional<torch::Tensor> y_out;
  if (!host && out.size() == 1 && in_place(out[0], device))
    y_out = at::from_blob(const_cast<void*>(out[0].data), y_shape, weight.options());
  const auto [y_any, path] =
      launch(x, weight, bias, y_out, pr, stride, padding, dilation, groups, precision, forced, packs);
  if (!y_out.has_value()) {
    const torch::Tensor y = y_any.contiguous();
    queue_copies(out, out_ex, static_cast<char*>(y.data_ptr()), /*upload=*/false, stream);
  }
  at::cuda::CUDAEvent done;  // this batch's end on the stream, which later batches may share
  done.record(current);
  done.synchronize();
  copy_pieces(stage_copies(out, out_ex, /*upload=*/false));
  return path;
}

// The bytes of a batch's output of `itemsize`-byte elements, after check_problem.
size_t output_bytes(const Problem& pr, int64_t itemsize) {
  return static_cast<size_t>(pr.N * pr.C_out * pr.H_out * pr.W_out * itemsize);
}

// A batch read from and written into places given as (address, bytes) pairs, wherever they are (run_placed): each
// copied by itself.
int64_t forward_placed(const std::vector<std::pair<int64_t, int64_t>>& parts,  // [N, C_in, H_in, W_in] in order
                       const std::vector<std::pair<int64_t, int64_t>>& outs,   // [N, C_out, H_out, W_out] in order
                       const std::vector<int64_t>& x_shape, const torch::Tensor& weight,
                       const c10::optional<torch::Tensor>& bias, std::vector<int64_t> stride,
                       std::vector<int64_t> padding, std::vector<int64_t> output_padding,
                       std::vector<int64_t> dilation, int64_t groups, const std::string& precision,
                       int64_t force_path, int64_t force_config, int64_t force_split, int64_t force_staged,
                       int64_t force_round, WeightPacks* packs) {
  const Forced forced = check_forced(force_path, force_config, force_split, force_staged, force_round);
  const torch::Tensor x_meta = host_batch_input("conv_transpose2d_placed", x_shape, weight, packs);
  const Problem pr =
      check_problem(x_meta, weight, bias, stride, padding, output_padding, dilation, groups, precision);
  const std::vector<int64_t> y_shape{pr.N, pr.C_out, pr.H_out, pr.W_out};
  const std::vector<Part> in = placed_parts(parts, x_meta.nbytes(), "input");
  const std::vector<Part> out = placed_parts(outs, output_bytes(pr, x_meta.element_size()), "output");
  const py::gil_scoped_release no_gil;
  return run_placed(in, out, /*host=*/false, x_shape, y_shape, weight, bias, pr, stride, padding, dilation, groups,
                    precision, forced, packs);
}

// A batch read from host parts (CPU tensors or buffers) and written into writable host buffers, in order
// (run_placed; a serving batch's requests in their slots): with the GIL held only to find their memory.
int64_t forward_direct(const py::list& parts, const py::list& outs, const std::vector<int64_t>& x_shape,
                       const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                       std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> output_padding,
                       std::vector<int64_t> dilation, int64_t groups, const std::string& precision,
                       int64_t force_path, int64_t force_config, int64_t force_split, int64_t force_staged,
                       int64_t force_round, WeightPacks* packs) {
  const Forced forced = check_forced(force_path, force_config, force_split, force_staged, force_round);
  const torch::Tensor x_meta = host_batch_input("conv_transpose2d_direct", x_shape, weight, packs);
  const Problem pr =
      check_problem(x_meta, weight, bias, stride, padding, output_padding, dilation, groups, precision);
  const std::vector<int64_t> y_shape{pr.N, pr.C_out, pr.H_out, pr.W_out};
  std::vector<torch::Tensor> tensors;  // tensor parts, referenced until the copies are done
  HeldBuffers buffers(parts.size() + outs.size());
  std::vector<Part> in = host_parts("conv_transpose2d_direct", parts, weight, x_meta.nbytes(), buffers, tensors);
  std::vector<Part> out;
  out.reserve(outs.size());
  size_t total = 0;
  for (const py::handle obj : outs) {
    const Py_buffer& view = buffers.get(obj.ptr(), /*writable=*/true);
    out.push_back({view.buf, static_cast<size_t>(view.len)});
    total += out.back().bytes;
  }
  const size_t y_bytes = output_bytes(pr, x_meta.element_size());
  TORCH_CHECK(total == y_bytes, "conv_transpose2d_direct: the output places hold ", num(total), " bytes, the output ",
              num(y_bytes), ".");
  // Empty parts and places have nothing to copy (and no address the driver need know).
  const auto empty = [](const Part& p) { return p.bytes == 0; };
  in.erase(std::remove_if(in.begin(), in.end(), empty), in.end());
  out.erase(std::remove_if(out.begin(), out.end(), empty), out.end());
  const py::gil_scoped_release no_gil;
  return run_placed(in, out, /*host=*/true, x_shape, y_shape, weight, bias, pr, stride, padding, dilation, groups,
                    precision, forced, packs);
}

// Page-locks a host buffer's memory for every GPU (cudaHostRegisterPortable), so that copies to and from it are
// direct DMA (forward_placed). Returns its address, for host_unregister; the caller keeps the memory mapped until
// then. Throws when the driver refuses (the memory stays pageable and usable).
int64_t host_register(const py::object& buffer) {
  Py_buffer view;
  if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) throw py::error_already_set();
  void* const ptr = view.buf;
  const size_t bytes = static_cast<size_t>(view.len);
  PyBuffer_Release(&view);
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();  // the error is this call's, not a later launch's
    TORCH_CHECK(false, "host_register: cudaHostRegister of ", num(bytes), " bytes failed: ",
                std::string(cudaGetErrorString(err)), ".");
  }
  return reinterpret_cast<int64_t>(ptr);
}

// Undoes host_register; false when the driver refused (at interpreter exit its context may be gone already).
bool host_unregister(int64_t address) {
  const cudaError_t err = cudaHostUnregister(reinterpret_cast<void*>(address));
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deconv CUDA kernels: ConvTranspose2d forward.";
  parameter_type = reinterpret_cast<PyTypeObject*>(py::module_::import("torch.nn").attr("Parameter").ptr());
  m.def("forward", &forward,
        "ConvTranspose2d forward. Returns (y, path); path 0 = SIMT kernel, 1 = tensor-core kernel, 2 = narrow kernel, "
        "3 = sparse kernel, 4 = gemm kernel, 5 = tiled narrow kernel, 6 = shuffle kernel, 7 = fold kernel, 8 = taps "
        "path, 9 = fused taps kernel. "
        "force_path: -1 chooses, 0-9 ask for that kernel; 1-9 fall back to the choice of -1 when not eligible. "
        "force_split: -1 chooses, 1-8 the halo kernel's split-K factor (sm_90 and newer), 1-16 the gemm kernel's. "
        "force_staged: -1 chooses, 1 has the gemm kernel write an NCHW output channels-last into scratch and "
        "convert it, 0 write it straight. "
        "force_round: -1 chooses, 1 has an fp32 x rounded to TF32 before the gemm kernel's TF32 products (by its "
        "layout change, or a pass of its own for a channels-last x), 0 has the kernel round each stage.",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"),
        py::arg("out") = py::none(), py::arg("force_path") = -1, py::arg("force_config") = -1,
        py::arg("force_split") = -1, py::arg("force_staged") = -1, py::arg("force_round") = -1,
        py::arg("packs") = nullptr, py::arg("prepare") = false, py::arg("torch_layout") = false,
        py::arg("remember") = false);
  m.def("fast_forward", &fast_forward,
        "A repeat of a remembered library call (forward with remember): y in PyTorch's layout, or None when the call "
        "cannot be taken this way (then make the full call).",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("output_padding"), py::arg("groups"), py::arg("dilation"), py::arg("precision"));
  m.def("clear_call_cache", [] { return call_cache().clear(); },
        "Forget every remembered call (kernels.tuning does when the kernel choice changes); returns how many.");
  m.def("call_cache_size", [] { return call_cache().size(); }, "Problems in the call cache.");
  m.def("forget_prepared", [](const c10::optional<torch::Tensor>& weight) {
          return prepared_weights().forget(weight.has_value() ? *weight : torch::Tensor());
        },
        "Drop the prepared (packed) copies of a weight tensor, or of every tensor with None; returns how many.",
        py::arg("weight") = py::none());
  m.def("prepared_count", [] { return prepared_weights().size(); }, "Weight tensors with prepared packs.");
  m.def("forward_staged", &forward_staged,
        "ConvTranspose2d forward from host memory to host memory on the current stream, waiting for the result, "
        "with the GIL released throughout. Returns the kernel path as forward does.",
        py::arg("x_host"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"), py::arg("y_host"),
        py::arg("force_path") = -1, py::arg("force_config") = -1, py::arg("force_split") = -1,
        py::arg("force_staged") = -1, py::arg("force_round") = -1, py::arg("packs") = nullptr);
  m.def("forward_gathered", &forward_gathered,
        "ConvTranspose2d forward of an input given as host parts (CPU tensors or buffers, concatenated) into a new "
        "pinned host tensor, on the current stream, waiting for the result, with the GIL released once.",
        py::arg("parts"), py::arg("x_shape"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
        py::arg("padding"), py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"),
        py::arg("force_path") = -1, py::arg("force_config") = -1, py::arg("force_split") = -1,
        py::arg("force_staged") = -1, py::arg("force_round") = -1, py::arg("packs") = nullptr);
  m.def("forward_placed", &forward_placed,
        "ConvTranspose2d forward of an input read from places ((address, bytes) pairs, in order) into places, "
        "wherever the GPU reaches them (its own memory, page-locked or other host memory), on the current stream, "
        "waiting for its own work on it (not for work queued later by other threads), with the GIL released once. "
        "Returns the kernel path as forward does.",
        py::arg("parts"), py::arg("outs"), py::arg("x_shape"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
        py::arg("padding"), py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"),
        py::arg("force_path") = -1, py::arg("force_config") = -1, py::arg("force_split") = -1,
        py::arg("force_staged") = -1, py::arg("force_round") = -1, py::arg("packs") = nullptr);
  m.def("forward_direct", &forward_direct,
        "ConvTranspose2d forward of an input given as host parts (CPU tensors or buffers, in order) into writable "
        "host buffers (in order), as forward_placed, with the GIL held only to find their memory; parts and buffers "
        "below stage_below_bytes go through one page-locked buffer each way. Returns the kernel path as forward does.",
        py::arg("parts"), py::arg("outs"), py::arg("x_shape"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
        py::arg("padding"), py::arg("output_padding"), py::arg("dilation"), py::arg("groups"), py::arg("precision"),
        py::arg("force_path") = -1, py::arg("force_config") = -1, py::arg("force_split") = -1,
        py::arg("force_staged") = -1, py::arg("force_round") = -1, py::arg("packs") = nullptr);
  m.def("host_register", &host_register,
        "Page-lock a writable buffer's memory for every GPU (cudaHostRegister); returns its address.",
        py::arg("buffer"));
  m.def("host_unregister", &host_unregister, "Undo host_register at this address; False when the driver refused.",
        py::arg("address"));
  py::class_<WeightPacks>(m, "WeightPacks",
                          "Packed copies of one CUDA weight tensor for the tensor-core kernels, one per layout, made "
                          "on first use and kept (for weights that do not change while it lives).")
      .def(py::init<const torch::Tensor&>(), py::arg("weight"))
      .def("__len__", &WeightPacks::size);
  // Tile configurations the force_config argument takes: [0, num_gather_configs) the gather kernel's, the rest up
  // to num_tensor_core_configs the halo kernel's (the only ones force_split applies to).
  m.attr("num_gather_configs") = deconv::kNumGatherConfigs;
  m.attr("num_tensor_core_configs") = deconv::kNumTensorCoreConfigs;
  // Tile configurations of the gemm kernel (force_path 4): [0, num_gemm_configs).
  m.attr("num_gemm_configs") = deconv::kNumGemmConfigs;
  // Configurations of the tiled narrow kernel (force_path 5): [0, num_narrow_tiled_configs); 0 and 1 are columns a
  // thread - 1, 2 the staged form (at most 4 output channels a group).
  m.attr("num_narrow_tiled_configs") = deconv::kNumNarrowTiledConfigs;
  // Host places below this many bytes are staged by forward_direct (one copy a run of them).
  m.attr("stage_below_bytes") = kStageBelow;
}

TORCH_LIBRARY_IMPL(deconv, CUDA, m) { m.impl("conv_transpose2d", &op_cuda); }

TORCH_LIBRARY_IMPL(deconv, AutogradCUDA, m) { m.impl("conv_transpose2d", &op_autograd_cuda); }
