// Python bindings of bench/kernels/cutlass/dgrad.cu (loaded by bench/kernels/cutlass/peer.py as the extension deconv_cutlass_peer).

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

std::vector<std::tuple<std::string, std::string, int64_t>> dgrad_configs();
std::string dgrad_can_implement(std::string const& name, std::vector<int64_t> const& problem);
std::string dgrad_run(std::string const& name, std::vector<int64_t> const& problem, at::Tensor const& x,
                      at::Tensor const& w_krsc, c10::optional<at::Tensor> const& bias, at::Tensor& y);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUTLASS strided dgrad (Sm80 mma.sync) kernels as conv_transpose2d, NHWC";
  m.def("configs", &dgrad_configs, "(name, dtype, alignment) of every compiled configuration");
  m.def("can_implement", &dgrad_can_implement, "'' if the configuration runs the problem, else CUTLASS's reason",
        py::arg("name"), py::arg("problem"));
  m.def("run", &dgrad_run, "y = dgrad(x, w_krsc) (+ bias) on the current stream; '' or the reason it did not run",
        py::arg("name"), py::arg("problem"), py::arg("x"), py::arg("w_krsc"), py::arg("bias"), py::arg("y"));
}
