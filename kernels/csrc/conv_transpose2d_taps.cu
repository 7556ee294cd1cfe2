// Layers with few output channels and many input channels in fp32: RGB output layers of GAN generators and U-Nets,
// one-channel super-resolution outputs, keypoint heads. Their phase GEMMs have C_out columns (3 of a 64-column
// tile at work), and the narrow kernels' FFMA products reach a fraction of the tensor cores' rate. Here every tap
// is a column instead (docs/architecture.md, "Kernels"):
//   Z[(n, iy, ix), (co, ky, kx)] = sum over ci of x[n, ci, iy, ix] w[ci, co, ky, kx],
// one GEMM of M = N H_in W_in positions, N = C_out kH kW columns and K = C_in, which is the gemm kernel's 1x1
// problem on the same x and weights (w's memory, [C_in][C_out kH kW], is that problem's weight matrix as it is), Z
// channels-last in the workspace; then the taps' sum (col2im): every output element adds the Z values of the taps
// that reach it,
//   y[n, co, oy, ox] = bias[co] + sum over ky = (oy + pad_h) mod s_h + t s_h, kx likewise, of
//                      Z[(n, (oy + pad_h - ky) / s_h, (ox + pad_w - kx) / s_w), (co, ky, kx)],
// each Z value read once, in fp32 (exact fp32: 3xTF32 products in the gemm kernel, fp32 sums). Two kernels a call;
// Z costs kH kW / (s_h s_w) times y's bytes and C_out kH kW / C_in times x's, so the path suits few output channels.
// fp32 only: a 16-bit Z would round every tap's sum before the taps are added.

#include <cstdint>

#include "conv_transpose2d.h"
#include "halo.cuh"
#include "mma.cuh"

namespace deconv {
namespace {

constexpr int kTapsThreads = 128;  // output columns a block
constexpr int64_t kTapsMaxColumns = 4096;  // C_out kH kW at most: Z at most 4096 / C_in times x's bytes

struct TapsArgs {
  const float* z;    // [N][H_in][W_in][cols]
  const float* bias;
  float* y;
  int64_t rows;      // N H_out output rows
  int chunks;        // blocks of kTapsThreads columns a row
  int64_t ys_n, ys_c, ys_h, ys_w;
  int c_out, h_out, w_out, h_in, w_in, kh, kw, s_h, s_w, pad_h, pad_w;
  int cols, cout_g, khw;
  int col_step;      // columns from one output channel of a group to the next: 1 (channels-last weights) or kH kW
  int tap_step;      // columns from one tap to the next: cout_g (channels-last weights) or 1
};

// A thread sums one output pixel's taps for every output channel, consecutive threads on consecutive columns of one
// output row (no division a pixel: a block's row and column chunk come from its index once).
__global__ void __launch_bounds__(kTapsThreads) conv_transpose2d_taps_sum_kernel(const TapsArgs a) {
  const int64_t units = a.rows * a.chunks;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t row = u / a.chunks;
    const int ox = static_cast<int>(u - row * a.chunks) * kTapsThreads + threadIdx.x;
    if (ox >= a.w_out) continue;
    const int64_t n = row / a.h_out;
    const int oy = static_cast<int>(row - n * a.h_out);
    const float* zn = a.z + n * a.h_in * a.w_in * a.cols;
    float* yp = a.y + n * a.ys_n + oy * a.ys_h + ox * a.ys_w;
    const int ty = oy + a.pad_h, tx = ox + a.pad_w;
    const int ky0 = ty % a.s_h, kx0 = tx % a.s_w;
    for (int g = 0, co = 0; co < a.c_out; ++g) {
      for (int c = 0; c < a.cout_g; ++c, ++co) {
        const float* zc = zn + g * a.cout_g * a.khw + c * a.col_step;  // group g's channel c
        float sum = 0.f;
        for (int ky = ky0; ky < a.kh; ky += a.s_h) {
          const int iy = (ty - ky) / a.s_h;
          if (iy >= a.h_in) continue;
          if (iy < 0) break;  // larger ky only lower iy
          for (int kx = kx0; kx < a.kw; kx += a.s_w) {
            const int ix = (tx - kx) / a.s_w;
            if (ix >= a.w_in) continue;
            if (ix < 0) break;
            sum += __ldg(zc + (static_cast<int64_t>(iy) * a.w_in + ix) * a.cols + (ky * a.kw + kx) * a.tap_step);
          }
        }
        if (a.bias != nullptr) sum += __ldg(a.bias + co);
        yp[co * a.ys_c] = sum;
      }
    }
  }
}

// Z's bytes, rounded up to whole 256-byte lines.
size_t taps_z_bytes(const ConvTranspose2dParams& p) {
  return (static_cast<size_t>(p.N * p.H_in * p.W_in * p.C_out * p.kH * p.kW) * sizeof(float) + 255) / 256 * 256;
}

}  // namespace

ConvTranspose2dParams taps_view(const ConvTranspose2dParams& p) {
  ConvTranspose2dParams q = p;
  q.bias = nullptr;
  q.y = nullptr;
  q.C_out = p.C_out * p.kH * p.kW;
  q.H_out = p.H_in;
  q.W_out = p.W_in;
  q.kH = q.kW = 1;
  q.stride_h = q.stride_w = 1;
  q.pad_h = q.pad_w = 0;
  q.dil_h = q.dil_w = 1;
  q.y_channels_last = true;
  q.w_channels_last = true;  // a 1x1 kernel's weights are the same memory in either layout
  return q;
}

bool taps_eligible(const ConvTranspose2dParams& p) {
  if (p.dtype != DType::kFloat32 || p.dil_h != 1 || p.dil_w != 1 || p.x_pitch > 0) return false;
  if (p.N < 1 || p.C_in < 1 || p.C_out < 1) return false;
  const int64_t cols = p.C_out * p.kH * p.kW;
  if (cols > kTapsMaxColumns) return false;
  const int64_t lim = int64_t(1) << 31;
  if (p.N * p.H_in * p.W_in * cols >= lim || p.N * p.C_out * p.H_out * p.W_out >= lim) return false;
  return gemm_eligible(taps_view(p));
}

// Preferred where eligible for at most 32 output channels a group, at least 32 input channels a group (the gemm
// kernel's K), Z at most twice x's bytes (C_out kH kW <= 2 C_in) and at least 2^14 input positions (128-row tiles
// for the SMs): RGB, one-channel and keypoint output layers, whose phase GEMMs leave most of a tile's columns idle
// and whose narrow kernels run FFMA (bench/NOTES.md v38, `probes fold`). An NCHW x (planned with a null x: the
// binding makes a channels-last copy) pays for its layout change first; the tiled narrow kernel reads it as it is
// and stays the choice where it is preferred. In exact fp32 its staged form (configuration 2) reads a channels-last x
// as it is too, and stays the choice where it is the tiled kernel's (fsrcnn-x3: bench/NOTES.md v41).
bool taps_preferred(const ConvTranspose2dParams& p) {
  const int64_t cin_g = p.C_in / p.groups, cout_g = p.C_out / p.groups;
  if (cout_g > 32 || cin_g < 32 || p.C_out * p.kH * p.kW > 2 * p.C_in || p.N * p.H_in * p.W_in < (int64_t(1) << 14))
    return false;
  if (narrow_tiled_eligible(p) && narrow_tiled_preferred(p) &&
      (p.x == nullptr || (p.precision == Precision::kExactFp32 && narrow_tiled_config(p) == 2)))
    return false;
  return taps_eligible(p);
}

int taps_config(const ConvTranspose2dParams& p) { return gemm_config(taps_view(p)); }

WeightPacking taps_packing(const ConvTranspose2dParams& p, int config) { return gemm_packing(taps_view(p), config); }

size_t taps_workspace_bytes(const ConvTranspose2dParams& p, int config) {
  return (gemm_workspace_bytes(taps_view(p), config) + 255) / 256 * 256 + taps_z_bytes(p);
}

cudaError_t taps_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream) {
  return gemm_pack(taps_view(p), dst, stream);
}

cudaError_t launch_taps(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  if (!taps_eligible(p) || p.workspace == nullptr) return cudaErrorInvalidValue;
  ConvTranspose2dParams q = taps_view(p);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  float* z = reinterpret_cast<float*>(ws + (gemm_workspace_bytes(q, config) + 255) / 256 * 256);
  q.y = z;
  cudaError_t err = launch_gemm(q, config, stream);
  if (err != cudaSuccess) return err;
  TapsArgs a{};
  a.z = z;
  a.bias = static_cast<const float*>(p.bias);
  a.y = static_cast<float*>(p.y);
  a.rows = p.N * p.H_out;
  a.chunks = static_cast<int>(tc::div_up(p.W_out, kTapsThreads));
  if (p.y_channels_last) {
    a.ys_c = 1, a.ys_w = p.C_out, a.ys_h = p.W_out * p.C_out, a.ys_n = p.H_out * p.W_out * p.C_out;
  } else {
    a.ys_w = 1, a.ys_h = p.W_out, a.ys_c = p.H_out * p.W_out, a.ys_n = p.C_out * p.H_out * p.W_out;
  }
  a.c_out = static_cast<int>(p.C_out), a.h_out = static_cast<int>(p.H_out), a.w_out = static_cast<int>(p.W_out);
  a.h_in = static_cast<int>(p.H_in), a.w_in = static_cast<int>(p.W_in);
  a.kh = static_cast<int>(p.kH), a.kw = static_cast<int>(p.kW);
  a.s_h = static_cast<int>(p.stride_h), a.s_w = static_cast<int>(p.stride_w);
  a.pad_h = static_cast<int>(p.pad_h), a.pad_w = static_cast<int>(p.pad_w);
  a.cols = static_cast<int>(q.C_out);
  a.cout_g = static_cast<int>(p.C_out / p.groups);
  a.khw = static_cast<int>(p.kH * p.kW);
  a.col_step = p.w_channels_last ? 1 : a.khw;
  a.tap_step = p.w_channels_last ? a.cout_g : 1;
  const int sms = sm_count() > 0 ? sm_count() : 1;
  const int64_t units = a.rows * a.chunks, cap = int64_t(sms) * 16;
  conv_transpose2d_taps_sum_kernel<<<static_cast<unsigned>(units < cap ? units : cap), kTapsThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace deconv
