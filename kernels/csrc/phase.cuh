// Stride-phase arithmetic shared by every kernel (see conv_transpose2d.cu for the decomposition).
#pragma once

#include <cstdint>

namespace deconv {

// ---------------------------------------------------------------------------------------------------------
// Phase arithmetic, one axis.
//
// Output positions o of residue r: o = o0 + q * stride, q in [0, count).
// Valid taps: a = a0 + t * step, t in [0, taps); then i = q + base - t * dstep reads input position i.
struct AxisPhase {
  int64_t o0;     // first output position of this phase
  int64_t count;  // output positions in this phase
  int64_t base;   // input position read by q = 0, t = 0
  int64_t a0;     // first valid tap (meaningless when taps == 0)
  int64_t step;   // tap step: stride / gcd(stride, dilation)
  int64_t dstep;  // input step per tap: dilation / gcd(stride, dilation)
  int64_t taps;   // number of valid taps
};

__host__ __device__ inline int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

__host__ __device__ inline AxisPhase make_axis_phase(int64_t r, int64_t out_size, int64_t stride, int64_t pad,
                                                     int64_t dil, int64_t k) {
  AxisPhase ax;
  // (o + pad) % stride == r  <=>  o == (r - pad) mod stride; compute a non-negative residue explicitly,
  // since C's % keeps the sign of the dividend.
  const int64_t o0 = ((r - pad) % stride + stride) % stride;
  ax.o0 = o0;
  ax.count = o0 < out_size ? (out_size - o0 + stride - 1) / stride : 0;
  const int64_t g = gcd64(stride, dil);
  ax.step = stride / g;
  ax.dstep = dil / g;
  ax.a0 = 0;
  ax.taps = 0;
  ax.base = 0;
  // a * dil == r (mod stride) has a solution in [0, step) iff it has one at all; it repeats every `step`.
  const int64_t lim = k < ax.step ? k : ax.step;
  for (int64_t a = 0; a < lim; ++a) {
    if ((a * dil) % stride == r) {
      ax.a0 = a;
      ax.taps = (k - 1 - a) / ax.step + 1;
      // o0 + pad - a0 * dil is an exact multiple of stride (both sides are == r mod stride), so the
      // division is exact even when negative.
      ax.base = (o0 + pad - a * dil) / stride;
      break;
    }
  }
  return ax;
}

// Most valid taps of any phase on one axis: residue 0 always has tap a0 = 0 and so the most taps,
// (k - 1) / step + 1 with step = stride / gcd(stride, dilation).
__host__ __device__ inline int64_t max_phase_taps(int64_t stride, int64_t dil, int64_t k) {
  return (k - 1) / (stride / gcd64(stride, dil)) + 1;
}

// AxisPhase in 32 bits, for kernels that take a per-residue table of them as a kernel parameter (narrow, sparse):
// the kernel then needs no 64-bit division, whose calls cost registers and spills. The caller has checked that
// every size fits.
struct AxisPhase32 {
  int o0, count, base, a0, step, dstep, taps;  // AxisPhase's fields
};

inline AxisPhase32 make_axis_phase32(int64_t r, int64_t out_size, int64_t stride, int64_t pad, int64_t dil,
                                     int64_t k) {
  const AxisPhase a = make_axis_phase(r, out_size, stride, pad, dil, k);
  return {static_cast<int>(a.o0),   static_cast<int>(a.count), static_cast<int>(a.base), static_cast<int>(a.a0),
          static_cast<int>(a.step), static_cast<int>(a.dstep), static_cast<int>(a.taps)};
}

}  // namespace deconv
