// wgmma with both operands in shared memory in the 128-byte swizzle that bulk tensor copies (TMA) land, the copies
// themselves, and the driver's tensor-map encoder: shared by the kernels that read their operands through TMA
// (conv_transpose2d_gemm.cu, conv_transpose2d_shuffle.cu; sm_90a). Elsewhere the instructions trap or do nothing,
// and the host never launches them there.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mma.cuh"
#include "wgmma.cuh"

namespace deconv {

// Register budgets of the warp-specialized kernels of 384 threads (a loader warpgroup and two multiplier
// warpgroups): 168 a thread at launch (__launch_bounds__(384, 1)); the loader gives back down to kWsLoaderRegs and
// the multipliers take what it freed, at most 240 (setmaxnreg.inc waits for registers the block does not hold,
// forever).
constexpr int kWsThreads = 384;
constexpr int kWsLoaderRegs = 56;
constexpr int kWsMultiplierRegs = ((65536 / kWsThreads / 8 * 8) * kWsThreads - 128 * kWsLoaderRegs) / 256 / 8 * 8 > 240
                                      ? 240
                                      : ((65536 / kWsThreads / 8 * 8) * kWsThreads - 128 * kWsLoaderRegs) / 256 / 8 * 8;

// ---------------------------------------------------------------------------------------------------------
// wgmma with both operands in shared memory (128-byte swizzle, K-major).

// Descriptor of a K-major tile in 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte
// offset); the leading byte offset is unused when a row holds the whole K of the instruction. The tile must start
// 1024-byte aligned; advancing K inside the row adds bytes to the start address.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The same in 64-byte swizzle: rows of 64 bytes, 8-row groups 512 bytes apart; the tile starts 512-byte aligned.
__device__ __forceinline__ uint64_t sw64_desc(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(512 >> 4) << 32) | (static_cast<uint64_t>(2) << 62);
}

// Descriptor of an N-major (transposed) B tile in 128-byte swizzle, as TMA lands the channels-last weights: chunks
// of 64 output channels (128 bytes) x the stage's K rows, each chunk K rows of 128 bytes, 8-row groups 1024 bytes
// apart (stride byte offset, along K), chunks 8192 bytes apart (leading byte offset, along N).
__device__ __forceinline__ uint64_t sw128_desc_nmajor(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(8192 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// kTransB: B is N-major (16-bit types only; TF32 wgmma reads K-major operands only).
template <int N, tc::MmaKind K, bool kTransB>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b);

#define DECONV_GS_F8(d, i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define DECONV_GS_F32(d, i) DECONV_GS_F8(d, i), DECONV_GS_F8(d, i + 8), DECONV_GS_F8(d, i + 16), DECONV_GS_F8(d, i + 24)
#define DECONV_GS_OPS64(d) DECONV_GS_F32(d, 0)
#define DECONV_GS_OPS128(d) DECONV_GS_F32(d, 0), DECONV_GS_F32(d, 32)
#define DECONV_GS_OPS256(d) DECONV_GS_F32(d, 0), DECONV_GS_F32(d, 32), DECONV_GS_F32(d, 64), DECONV_GS_F32(d, 96)
#define DECONV_GS_D64  \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}, %32, %33"
#define DECONV_GS_SCALE64 "%34"
#define DECONV_GS_D128  \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}, %64, %65"
#define DECONV_GS_SCALE128 "%66"
#define DECONV_GS_D256  \
  "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" "}, %128, %129"
#define DECONV_GS_SCALE256 "%130"

#if DECONV_WGMMA
// Operands: the N / 2 accumulators, A's and B's descriptors, scale-d (a predicate set from the immediate 1:
// accumulate); imm-scale-a/b 1, and for 16-bit types imm-trans-a 0 (K-major) and imm-trans-b 0 or 1 (N-major).
#define DECONV_GS(N, KIND, TYPE, K, TRANS, TB)                                                                      \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<N, tc::MmaKind::KIND, TB>(float* d, uint64_t a, uint64_t b) {          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " DECONV_GS_SCALE##N ", 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TYPE "." TYPE " " DECONV_GS_D##N            \
                 ", p, 1, 1" TRANS ";\n}\n"                                                                      \
                 : DECONV_GS_OPS##N(d)                                                                            \
                 : "l"(a), "l"(b), "n"(1));                                                                       \
  }
#else
#define DECONV_GS(N, KIND, TYPE, K, TRANS, TB)                                                                      \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<N, tc::MmaKind::KIND, TB>(float* d, uint64_t a, uint64_t b) {          \
    (void)d, (void)a, (void)b;                                                                                     \
    __trap();                                                                                                      \
  }
#endif

DECONV_GS(64, kTF32, "tf32", 8, "", false)
DECONV_GS(128, kTF32, "tf32", 8, "", false)
DECONV_GS(256, kTF32, "tf32", 8, "", false)
DECONV_GS(64, kBF16, "bf16", 16, ", 0, 0", false)
DECONV_GS(128, kBF16, "bf16", 16, ", 0, 0", false)
DECONV_GS(256, kBF16, "bf16", 16, ", 0, 0", false)
DECONV_GS(64, kFP16, "f16", 16, ", 0, 0", false)
DECONV_GS(128, kFP16, "f16", 16, ", 0, 0", false)
DECONV_GS(256, kFP16, "f16", 16, ", 0, 0", false)
DECONV_GS(64, kBF16, "bf16", 16, ", 0, 1", true)
DECONV_GS(128, kBF16, "bf16", 16, ", 0, 1", true)
DECONV_GS(256, kBF16, "bf16", 16, ", 0, 1", true)
DECONV_GS(64, kFP16, "f16", 16, ", 0, 1", true)
DECONV_GS(128, kFP16, "f16", 16, ", 0, 1", true)
DECONV_GS(256, kFP16, "f16", 16, ", 0, 1", true)

// Makes this thread's shared-memory stores visible to the tensor cores (the async proxy): the TF32 rounding of a
// stage, written with ordinary stores, before the consumers' wgmma read it.
__device__ __forceinline__ void fence_async_smem() {
#if DECONV_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Bulk tensor copies (the Tensor Memory Accelerator) into shared memory, completing as transactions on `bar`.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            int c4, uint64_t* bar) {
#if DECONV_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(wg::smem_addr(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
#if DECONV_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(wg::smem_addr(bar))
      : "memory");
#endif
}

// The same 3-D copy into this block's and every other block of `mask`'s shared memory (its cluster's blocks by
// rank), at the same offset, completing on each block's barrier at the same offset as `bar`.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                      uint64_t* bar, uint16_t mask) {
#if DECONV_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(wg::smem_addr(bar)), "h"(mask)
      : "memory");
#endif
}

// A bulk tensor copy out of shared memory: the 4-D box at (c0, c1, c2, c3) of `map`'s tensor from `src`, laid out as
// the box (first dimension fastest); elements past the tensor's bounds are not written. It joins this thread's
// current bulk group (bulk_commit), which bulk_wait<true> waits for until the copy has read `src`, bulk_wait<false>
// until it has written the global memory too.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
#if DECONV_WGMMA
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if DECONV_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <bool kReadOnly>
__device__ __forceinline__ void bulk_wait() {
#if DECONV_WGMMA
  if constexpr (kReadOnly)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no link against the driver library).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = []() -> EncodeTiled {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace deconv
