// Tensor-core building blocks shared by the gather (conv_transpose2d_mma.cu) and halo
// (conv_transpose2d_halo.cu) kernels: mma.sync wrappers, TF32 rounding and the weight packing kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "convert.cuh"

namespace deconv {
namespace tc {

enum class MmaKind : int { kTF32 = 0, k3xTF32 = 1, kBF16 = 2, kFP16 = 3 };

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ uint4 to_tf32(uint4 v) {
  return {to_tf32(__uint_as_float(v.x)), to_tf32(__uint_as_float(v.y)), to_tf32(__uint_as_float(v.z)),
          to_tf32(__uint_as_float(v.w))};
}

// 3xTF32: the TF32 rounding of what is left of v once its TF32 part h (to_tf32(v)) is taken: v = h + residual to
// about 2^-22 of v.
__device__ __forceinline__ uint32_t tf32_residual(float v, uint32_t h) { return to_tf32(v - __uint_as_float(h)); }

// Rounds `words` fp32 words at `p` (16-byte aligned, a multiple of 4) to TF32 in place, threads [0, nthreads) of
// the caller taking every nthreads-th 16-byte vector from `tid`: four vectors loaded before any is stored, so that
// four loads are in flight (the compiler cannot tell that v4[i] and v4[i + nthreads] differ, and would keep one).
__device__ __forceinline__ void round_tf32_inplace(void* p, int words, int tid, int nthreads) {
  uint4* v4 = reinterpret_cast<uint4*>(p);
  const int vecs = words / 4;
  int i = tid;
  for (; i + 3 * nthreads < vecs; i += 4 * nthreads) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = v4[i + u * nthreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) v4[i + u * nthreads] = to_tf32(v[u]);
  }
  for (; i < vecs; i += nthreads) v4[i] = to_tf32(v4[i]);
}

template <MmaKind K>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (K == MmaKind::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (K == MmaKind::kFP16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

template <typename T>
__device__ __forceinline__ uint16_t bits16(T v);
template <>
__device__ __forceinline__ uint16_t bits16<__half>(__half v) {
  return __half_as_ushort(v);
}
template <>
__device__ __forceinline__ uint16_t bits16<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v);
}

template <MmaKind K>
__device__ __forceinline__ uint32_t round_word(uint32_t w) {
  if constexpr (K == MmaKind::kTF32) {
    return to_tf32(__uint_as_float(w));
  } else {
    return w;
  }
}

// Packs w [C_in, C_out/g, kH, kW] into words [g][a][b][ciw_pad][co_pad] (see the file comment), zero-padded;
// `kmajor` (the wgmma tiles) packs [g][a][b][ciw_pad / 4][co_pad][4] instead: 4 channel words of an output
// channel together, the K-major core-matrix rows that wgmma reads.
template <typename T, MmaKind K>
__global__ void pack_weights_kernel(const T* __restrict__ w, uint32_t* __restrict__ wt, int64_t groups,
                                    int64_t cin_g, int64_t cout_g, int64_t kH, int64_t kW, int64_t ciw_pad,
                                    int64_t co_pad, bool kmajor) {
  const int64_t total = groups * kH * kW * ciw_pad * co_pad;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t co = i % co_pad;
    int64_t r = i / co_pad;
    const int64_t cw = r % ciw_pad;
    r /= ciw_pad;
    const int64_t b = r % kW;
    r /= kW;
    const int64_t a = r % kH;
    const int64_t g = r / kH;
    uint32_t word = 0;
    if (co < cout_g) {
      auto at = [&](int64_t ci) { return w[(((g * cin_g + ci) * cout_g + co) * kH + a) * kW + b]; };
      if constexpr (sizeof(T) == 4) {
        if (cw < cin_g) {
          const float v = to_acc(at(cw));
          word = K == MmaKind::kTF32 ? to_tf32(v) : __float_as_uint(v);
        }
      } else {
        const int64_t ci = 2 * cw;
        const uint32_t lo = ci < cin_g ? bits16<T>(at(ci)) : 0u;
        const uint32_t hi = ci + 1 < cin_g ? bits16<T>(at(ci + 1)) : 0u;
        word = lo | (hi << 16);
      }
    }
    wt[kmajor ? ((i - co - cw * co_pad) + (cw / 4) * co_pad * 4 + co * 4 + cw % 4) : i] = word;
  }
}

// One K step of a warp tile: acc[i][j] += A fragment i x B fragment j. 3xTF32 (exact fp32) splits each operand
// into hi + lo TF32 parts here and adds the small products first: hi*lo + lo*hi + hi*hi (error ~2^-22).
template <MmaKind K, int kMT, int kNT>
__device__ __forceinline__ void mma_warp_tile(float (&acc)[kMT][kNT][4], uint32_t (&af)[kMT][4],
                                              uint32_t (&bf)[kNT][2]) {
  if constexpr (K == MmaKind::k3xTF32) {
    uint32_t alo[kMT][4], blo[kNT][2];
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = __uint_as_float(af[i][e]);
        af[i][e] = to_tf32(v);
        alo[i][e] = to_tf32(v - __uint_as_float(af[i][e]));
      }
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = __uint_as_float(bf[j][e]);
        bf[j][e] = to_tf32(v);
        blo[j][e] = to_tf32(v - __uint_as_float(bf[j][e]));
      }
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        mma<MmaKind::kTF32>(acc[i][j], alo[i], bf[j]);
        mma<MmaKind::kTF32>(acc[i][j], af[i], blo[j]);
      }
  }
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j) mma<K == MmaKind::k3xTF32 ? MmaKind::kTF32 : K>(acc[i][j], af[i], bf[j]);
}

// Exact fp32 (3xTF32) sums each K stage's products into a zeroed partial sum and adds that to the running sum
// with fp32 adds (round to nearest). The tensor cores truncate every accumulation toward zero, so an output
// accumulated over K products in one mma accumulator drifts by about 7e-9 * K of its value (measured on an
// H200: 4e-6 at K = 576, 1e-5 at K = 1344), a bias that outgrows fp32 for deep reductions. With a fresh partial
// sum per stage the truncation applies to one stage's partial sum only, and those errors have random signs.
template <int kMT, int kNT>
__device__ __forceinline__ void zero_tile(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

template <int kMT, int kNT>
__device__ __forceinline__ void add_tile(float (&acc)[kMT][kNT][4], const float (&part)[kMT][kNT][4]) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = __fadd_rn(acc[i][j][e], part[i][j][e]);
}

// Epilogue staging: a warp tile's accumulators into shared memory as [channel][pixel] (row stride c_stride),
// the warp tile starting at pixel m0 and channel n0. Conflict-free when c_stride == 4 mod 32.
template <int kMT, int kNT>
__device__ __forceinline__ void stage_accumulators(float* cs, int c_stride, const float (&acc)[kMT][kNT][4], int m0,
                                                   int n0, int g8, int t4) {
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int mr = m0 + i * 16 + g8;
      const int nc = n0 + j * 8 + 2 * t4;
      cs[nc * c_stride + mr] = acc[i][j][0];
      cs[(nc + 1) * c_stride + mr] = acc[i][j][1];
      cs[nc * c_stride + mr + 8] = acc[i][j][2];
      cs[(nc + 1) * c_stride + mr + 8] = acc[i][j][3];
    }
}

__host__ __device__ inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace tc
}  // namespace deconv
