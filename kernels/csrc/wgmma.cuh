// Hopper warpgroup MMA (wgmma, sm_90a), mbarriers, bulk copies and register budgets for the warp-specialized
// kernel (conv_transpose2d_wgmma.cu).
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) multiplies a 64 x K tile of A held in registers
// (each warp its 16 rows, in mma.sync's m16 fragment layout: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
// a3 (g + 8, t + 4) for TF32 words; 16-bit pairs likewise) by a K x N tile of B read from shared memory through a
// matrix descriptor, into N / 2 fp32 accumulators a thread (n8 block j: d[4j .. 4j + 3] at rows g, g + 8 and
// columns 2t, 2t + 1, again mma.sync's layout). K is 8 TF32 words or 16 16-bit values: 8 words in both cases.
//
// B is stored K-major without swizzle: "core matrices" of 8 rows (output channels) x 16 bytes (4 words of K),
// each 128 contiguous bytes. The descriptor gives the start address, the byte distance between core matrices
// adjacent in K (leading byte offset) and between those adjacent in N (stride byte offset).
//
// The instructions exist only in sm_90a code (DECONV_WGMMA); elsewhere the wrappers do nothing or trap, and the
// host never launches a wgmma tile there (wgmma_device and halo_effective in conv_transpose2d_halo.cu).
#pragma once

#include <cstdint>

#include "mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DECONV_WGMMA 1
#else
#define DECONV_WGMMA 0
#endif

namespace deconv {
namespace wg {

using tc::MmaKind;

// Shared-memory matrix descriptor, no swizzle: start address, K-direction and N-direction core-matrix strides.
__device__ __forceinline__ uint64_t smem_desc(const void* start, uint32_t k_stride_bytes, uint32_t n_stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(k_stride_bytes >> 4) << 16) |
         (static_cast<uint64_t>(n_stride_bytes >> 4) << 32);
}

// Orders this thread's register writes (A fragments, accumulators) before the wgmma that follow.
__device__ __forceinline__ void fence() {
#if DECONV_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if DECONV_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wait() {
#if DECONV_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving accesses of `n` accumulators across the asynchronous wgmma instructions.
template <int N>
__device__ __forceinline__ void pin(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for A fragments held in registers by wgmma still in flight: their registers must keep their values until
// the wgmma that read them are done, which the compiler cannot see.
template <int N>
__device__ __forceinline__ void pin(uint32_t* a) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Register budget of the calling warpgroup (setmaxnreg): the producer of a warp-specialized kernel gives
// registers back, the consumers take them. Every warp of the warpgroup executes it.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if DECONV_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if DECONV_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Shared-memory barriers (mbarrier) between a producer warpgroup and its consumers.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if DECONV_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if DECONV_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Arrives and adds `bytes` to the transaction count that bulk copies completing on `bar` will pay off.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if DECONV_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}
// Waits until the phase of `bar` with this parity has completed; kCluster: acquiring at cluster scope what the
// arrivals released (split-K in a cluster, below), else with the default semantics (acquire at CTA scope).
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if DECONV_WGMMA
// One try_wait with the semantics qualifier SEM ("" or ".acquire.cluster").
#define DECONV_MBAR_TRY_WAIT(SEM)                                                        \
  asm volatile(                                                                          \
      "{\n.reg .pred p;\n"                                                               \
      "mbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%1], %2;\n"                   \
      "selp.u32 %0, 1, 0, p;\n}\n"                                                       \
      : "=r"(done)                                                                       \
      : "r"(smem_addr(bar)), "r"(parity)                                                 \
      : "memory")
  uint32_t done = 0;
  do {
    if constexpr (kCluster)
      DECONV_MBAR_TRY_WAIT(".acquire.cluster");
    else
      DECONV_MBAR_TRY_WAIT("");
  } while (!done);
#undef DECONV_MBAR_TRY_WAIT
#endif
}
// Thread-block clusters (conv_transpose2d_gemm.cu: a pair of blocks sharing their weights' stages, or a tile's
// split-K blocks): this block's rank in its cluster, a barrier over the cluster's threads, and the address of the same
// offset in block `rank`'s shared memory.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if DECONV_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {
#if DECONV_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ uint32_t cluster_peer_addr(const void* p, uint32_t rank) {
  uint32_t r = smem_addr(p);
#if DECONV_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(r), "r"(rank));
#endif
  return r;
}
// Arrivals of the lanes of a warp for which `pred` holds, predicated rather than branched. The remote one has the
// default semantics (release at CTA scope), as a local one: the buffer it frees was read by wgmma this thread has
// waited for. With release at cluster scope, pairs ran KernelBench 57 in BF16 in 2.7 ms against 1.4
// (bench/NOTES.md v34).
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
#if DECONV_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
                   smem_addr(bar)),
               "r"(static_cast<uint32_t>(pred))
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_cluster_if(uint32_t cluster_addr, bool pred) {
#if DECONV_WGMMA
  asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n" ::"r"(
                   cluster_addr),
               "r"(static_cast<uint32_t>(pred))
               : "memory");
#endif
}
// Split-K in a cluster (conv_transpose2d_gemm.cu): the blocks hand their partial sums over through distributed
// shared memory, so the hand-over orders memory at cluster scope: an arrival on a barrier in block `rank`'s shared
// memory (`cluster_addr`, from cluster_peer_addr) that releases this thread's earlier accesses to the cluster, the
// wait that acquires them (mbar_wait<true>), and a 16-byte load from another block's shared memory.
__device__ __forceinline__ void mbar_arrive_cluster_release(uint32_t cluster_addr) {
#if DECONV_WGMMA
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
#endif
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t cluster_addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if DECONV_WGMMA
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
#endif
  return v;
}
// A barrier over `threads` threads of the block, named barrier `id` (0 is __syncthreads's).
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on `bar` once every cp.async this thread has issued so far has landed (counts as one expected arrival).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
#if DECONV_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}
// Bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory,
// completing as transactions on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if DECONV_WGMMA
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

// d[0 .. N / 2) += A (registers) x B (descriptor), m64 x N x (8 words).
template <int N, MmaKind K>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t (&a)[4], uint64_t b);

// The specializations: one instruction per shape and operand type. Operands: the N / 2 accumulators, A's four
// registers, B's descriptor, then scale-d (1: add to the accumulators); imm-scale-a and -b are 1, and 16-bit types
// add imm-trans-b 0 (B K-major).
#define DECONV_WG_F8(d, i)                                                                                      \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define DECONV_WG_F16(d, i) DECONV_WG_F8(d, i), DECONV_WG_F8(d, i + 8)
#define DECONV_WG_OPS32(d) DECONV_WG_F16(d, 0)
#define DECONV_WG_OPS64(d) DECONV_WG_F16(d, 0), DECONV_WG_F16(d, 16)
#define DECONV_WG_OPS128(d) DECONV_WG_OPS64(d), DECONV_WG_F16(d, 32), DECONV_WG_F16(d, 48)
#define DECONV_WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define DECONV_WG_R16 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DECONV_WG_R32 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define DECONV_WG_R48 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DECONV_WG_D32 "{" DECONV_WG_R0 "}, {%16, %17, %18, %19}, %20"
#define DECONV_WG_D64 "{" DECONV_WG_R0 ", " DECONV_WG_R16 "}, {%32, %33, %34, %35}, %36"
#define DECONV_WG_D128 \
  "{" DECONV_WG_R0 ", " DECONV_WG_R16 ", " DECONV_WG_R32 ", " DECONV_WG_R48 "}, {%64, %65, %66, %67}, %68"
#define DECONV_WG_SCALE32 "%21"
#define DECONV_WG_SCALE64 "%37"
#define DECONV_WG_SCALE128 "%69"

#if DECONV_WGMMA
#define DECONV_WG_RS(N, KIND, TYPE, K, TRANS)                                                                      \
  template <>                                                                                                     \
  __device__ __forceinline__ void wgmma_rs<N, MmaKind::KIND>(float* d, const uint32_t(&a)[4], uint64_t b) {      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " DECONV_WG_SCALE##N ", 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TYPE "." TYPE " " DECONV_WG_D##N           \
                 ", p, 1, 1" TRANS ";\n}\n"                                                                      \
                 : DECONV_WG_OPS##N(d)                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));                                 \
  }
#else
#define DECONV_WG_RS(N, KIND, TYPE, K, TRANS)                                                                      \
  template <>                                                                                                     \
  __device__ __forceinline__ void wgmma_rs<N, MmaKind::KIND>(float* d, const uint32_t(&a)[4], uint64_t b) {      \
    (void)d, (void)a, (void)b;                                                                                    \
    __trap();                                                                                                     \
  }
#endif

DECONV_WG_RS(32, kTF32, "tf32", 8, "")
DECONV_WG_RS(64, kTF32, "tf32", 8, "")
DECONV_WG_RS(128, kTF32, "tf32", 8, "")
DECONV_WG_RS(32, kBF16, "bf16", 16, ", 0")
DECONV_WG_RS(64, kBF16, "bf16", 16, ", 0")
DECONV_WG_RS(128, kBF16, "bf16", 16, ", 0")
DECONV_WG_RS(32, kFP16, "f16", 16, ", 0")
DECONV_WG_RS(64, kFP16, "f16", 16, ", 0")
DECONV_WG_RS(128, kFP16, "f16", 16, ", 0")

}  // namespace wg
}  // namespace deconv
