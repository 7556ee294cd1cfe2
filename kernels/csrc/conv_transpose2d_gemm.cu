// ConvTranspose2d forward as a channel-major implicit GEMM on Hopper tensor cores (sm_90a wgmma; TF32, BF16, FP16),
// for the channel-heavy layers of real decoders: many channels, few pixels (docs/architecture.md, "Kernels").
//
// Per stride phase (conv_transpose2d.cu) and group the problem is a GEMM with
//   M = N * rows_in_phase * cols_in_phase (output pixels), N = C_out / groups, K = taps * C_in / groups,
// A[m, (tap, ci)] = x[n, hi, wi, ci] read from a channels-last (NHWC) input, so that every row of an A tile is a
// contiguous run of channels whatever the image size, and B[(tap, ci), co] = w[ci, co, a, b] packed once into
// [group][a][b][co][ci] (ci padded to a whole stage, TF32-rounded for TF32). Unlike the halo tiles, which cover a
// 2-D window of one image's pixels, a 128-row M tile runs across images: a 4 x 4 input fills it as well as a 64 x 64.
//
// One block computes a 128 x BN tile with 256 threads: two warpgroups, each an m64 x BN wgmma accumulator in
// registers, both operands read from shared memory by descriptor. A stage is 128 bytes of K (32 fp32 or 64 16-bit
// channels of one tap) for the 128 A rows and the BN B rows, laid out as wgmma's 128-byte swizzle (16-byte chunk
// c of row r at chunk c ^ (r % 8)): every 16-byte cp.async of a warp lands in a different bank group, and a row is
// one 128-byte global line. A ring of kStages buffers keeps kStages - 2 stages of copies in flight ahead of the
// multiplies; wgmma of stage i overlaps the copies of i + 1 .. i + kStages - 2, and a buffer is refilled only once
// both warpgroups have waited for the wgmma that read it (the barrier at the top of each iteration).
//
// Split-K (few tiles for the SMs): blocks of a tile each reduce a contiguous part of K into an fp32 workspace,
// summed by a second kernel that adds the bias and writes the output; otherwise the epilogue adds the bias and
// stores straight from the accumulators. The output is written through its strides: NCHW or NHWC.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "mma.cuh"
#include "phase.cuh"
#include "wgmma.cuh"

namespace deconv {
namespace {

constexpr int kGemmThreads = 384;  // a loader warpgroup and two multiplier warpgroups
constexpr int kGemmBM = 128;
constexpr int kGemmRowBytes = 128;  // K bytes a stage: one swizzle row
constexpr int kGemmMaxSplit = 16;

struct GemmShape {
  int bn, stages;
};
// Tile configurations (force_config for the gemm path): 128 x BN, kStages buffers of (128 + BN) x 128 bytes.
constexpr GemmShape kGemmShapes[kNumGemmConfigs] = {{128, 6}, {256, 4}, {64, 8}};

constexpr size_t gemm_smem_bytes(const GemmShape& s) {
  // Stages, their full and empty barriers, alignment slack.
  return static_cast<size_t>(s.stages) * ((kGemmBM + s.bn) * kGemmRowBytes + 16) + 1024;
}

// Per-launch tables: each residue's phase on both axes, and the divisors of the tile index.
struct GemmTiles {
  AxisPhase32 ah[kGemmMaxStride], aw[kGemmMaxStride];
  FastDiv n_tiles, groups, splits, phases, stride_w;
  int total;
};

struct GemmArgs {
  const void* x;      // [N, H_in, W_in, C_in]
  const void* wp;     // [groups][kH][kW][cout_g][ci_pad]
  const void* bias;   // [C_out] or nullptr
  void* y;            // through ys*
  float* partial;     // split-K: [splits][N][H_out][W_out][C_out] fp32
  int n, c_in, h_in, w_in, c_out, h_out, w_out, kh, kw;
  int cin_g, cout_g, ci_pad, stride_h, stride_w;
  int64_t ys_n, ys_c, ys_h, ys_w;  // output strides in elements
};

// ---------------------------------------------------------------------------------------------------------
// wgmma with both operands in shared memory (128-byte swizzle, K-major).

// Descriptor of a K-major tile in 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (stride byte
// offset); the leading byte offset is unused when a row holds the whole K of the instruction. The tile must start
// 1024-byte aligned; advancing K inside the row adds bytes to the start address.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

template <int N, tc::MmaKind K>
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
// accumulate); imm-scale-a/b 1, and for 16-bit types imm-trans-a/b 0 (both K-major).
#define DECONV_GS(N, KIND, TYPE, K, TRANS)                                                                          \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<N, tc::MmaKind::KIND>(float* d, uint64_t a, uint64_t b) {              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " DECONV_GS_SCALE##N ", 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TYPE "." TYPE " " DECONV_GS_D##N            \
                 ", p, 1, 1" TRANS ";\n}\n"                                                                      \
                 : DECONV_GS_OPS##N(d)                                                                            \
                 : "l"(a), "l"(b), "n"(1));                                                                       \
  }
#else
#define DECONV_GS(N, KIND, TYPE, K, TRANS)                                                                          \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_ss<N, tc::MmaKind::KIND>(float* d, uint64_t a, uint64_t b) {              \
    (void)d, (void)a, (void)b;                                                                                     \
    __trap();                                                                                                      \
  }
#endif

DECONV_GS(64, kTF32, "tf32", 8, "")
DECONV_GS(128, kTF32, "tf32", 8, "")
DECONV_GS(256, kTF32, "tf32", 8, "")
DECONV_GS(64, kBF16, "bf16", 16, ", 0, 0")
DECONV_GS(128, kBF16, "bf16", 16, ", 0, 0")
DECONV_GS(256, kBF16, "bf16", 16, ", 0, 0")
DECONV_GS(64, kFP16, "f16", 16, ", 0, 0")
DECONV_GS(128, kFP16, "f16", 16, ", 0, 0")
DECONV_GS(256, kFP16, "f16", 16, ", 0, 0")

// Byte offset of 16-byte chunk `c` of row `r` in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t sw128(int r, int c) {
  return static_cast<uint32_t>(r * kGemmRowBytes + ((c ^ (r & 7)) << 4));
}

// ---------------------------------------------------------------------------------------------------------
// The GEMM kernel.

// Makes this thread's shared-memory stores visible to the tensor cores (the async proxy): the TF32 rounding of a
// stage, written with ordinary stores, before the consumers' wgmma read it.
__device__ __forceinline__ void fence_async_smem() {
#if DECONV_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// A tile's place: its phase, output rows and channels, and the range of K stages it reduces.
struct GemmTile {
  AxisPhase32 ah, aw;
  int grp, split, m0, n0, pix, m_phase, k_begin, k_end;
};

__device__ __forceinline__ bool gemm_decode(int t, const GemmTiles& tl, const GemmArgs& g, int bn, int cpt,
                                            GemmTile& d) {
  const int r0 = fdiv(t, tl.n_tiles);
  const int nt = t - r0 * static_cast<int>(tl.n_tiles.d);
  const int r1 = fdiv(r0, tl.groups);
  d.grp = r0 - r1 * static_cast<int>(tl.groups.d);
  const int r2 = fdiv(r1, tl.splits);
  d.split = r1 - r2 * static_cast<int>(tl.splits.d);
  const int mt = fdiv(r2, tl.phases);
  const int phase = r2 - mt * static_cast<int>(tl.phases.d);
  const int rh = fdiv(phase, tl.stride_w);
  d.ah = tl.ah[rh];
  d.aw = tl.aw[phase - rh * static_cast<int>(tl.stride_w.d)];
  d.pix = d.ah.count * d.aw.count;
  d.m_phase = g.n * d.pix;
  d.m0 = mt * kGemmBM;
  d.n0 = nt * bn;
  if (d.pix == 0 || d.m0 >= d.m_phase) return false;
  const int kiters = d.ah.taps * d.aw.taps * cpt;
  d.k_begin = static_cast<int>(static_cast<int64_t>(kiters) * d.split / tl.splits.d);
  d.k_end = static_cast<int>(static_cast<int64_t>(kiters) * (d.split + 1) / tl.splits.d);
  return true;
}

// Persistent and warp-specialized: warpgroup 0 loads, warpgroups 1 and 2 multiply (rows 0-63 and 64-127 of the
// tile). The loader runs through the same tiles as the multipliers, up to kStages stages ahead of them across tile
// boundaries, so the next tile's first stages land while the multipliers store the last one's output.
template <typename T, tc::MmaKind K, int BN, int kStages>
__global__ void __launch_bounds__(kGemmThreads, 1)
    conv_transpose2d_gemm_kernel(const GemmArgs g, const __grid_constant__ GemmTiles tl) {
  constexpr int kVec = 16 / sizeof(T);                // channels a 16-byte chunk
  constexpr int kCH = kGemmRowBytes / sizeof(T);      // channels a stage
  constexpr int kARows = kGemmBM * 8 / 128;           // A chunks a loader thread a stage (8)
  constexpr int kBRows = BN * 8 / 128;                // B chunks a loader thread a stage
  constexpr int kAStage = kGemmBM * kGemmRowBytes;
  constexpr int kStage = (kGemmBM + BN) * kGemmRowBytes;
  constexpr int kKSteps = kGemmRowBytes / 32;  // wgmma k-steps a stage (k8 TF32 or k16 16-bit: 32 bytes)
  constexpr bool kTF32 = K == tc::MmaKind::kTF32;
  // Registers: 168 a thread at launch (__launch_bounds__ with 384 threads); the loader gives back down to 112 and
  // the multipliers take what it freed (setmaxnreg.inc waits for registers the block does not hold, forever).
  constexpr int kLaunchRegs = 65536 / kGemmThreads / 8 * 8;
  constexpr int kProdRegs = 112;
  constexpr int kConsRegs0 = (kLaunchRegs * kGemmThreads - 128 * kProdRegs) / 256 / 8 * 8;
  constexpr int kConsRegs = kConsRegs0 > 240 ? 240 : kConsRegs0;

  extern __shared__ uint8_t gemm_smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(gemm_smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = gemm_smem_raw + (base - raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStage);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wg::mbar_init(&full[s], 128);   // every loader thread, once its copies of the stage have landed
      wg::mbar_init(&empty[s], 256);  // every multiplier thread, once its wgmma reading the stage are done
    }
  }
  __syncthreads();

  const int cpt = g.ci_pad / kCH;  // stages a tap
  const int wgi = threadIdx.x >> 7;
  uint32_t it = 0;  // stages loaded (loader) or consumed (multipliers) so far

  if (wgi == 0) {
    // Loader.
    wg::setmaxnreg_dec<kProdRegs>();
    const int tid = threadIdx.x;
    const int chunk = tid & 7;
    const int row0 = tid >> 3;  // first row this thread copies; then every 16th
    const T* __restrict__ x = static_cast<const T*>(g.x);
    const T* __restrict__ wp = static_cast<const T*>(g.wp);
    const int64_t w_tap = static_cast<int64_t>(g.cout_g) * g.ci_pad;  // elements a tap of one group
    int pending = -1;  // TF32: the stage whose copies were issued last, rounded and published one stage later
    auto publish = [&](int s) {
      if constexpr (kTF32) {
        uint8_t* st = smem + s * kStage;
#pragma unroll
        for (int r = 0; r < kARows; ++r) {
          uint4* v = reinterpret_cast<uint4*>(st + sw128(row0 + 16 * r, chunk));
          uint4 u = *v;
          u.x = tc::to_tf32(__uint_as_float(u.x));
          u.y = tc::to_tf32(__uint_as_float(u.y));
          u.z = tc::to_tf32(__uint_as_float(u.z));
          u.w = tc::to_tf32(__uint_as_float(u.w));
          *v = u;
        }
        fence_async_smem();
        wg::mbar_arrive(&full[s]);
      }
    };
    for (int t = blockIdx.x; t < tl.total; t += gridDim.x) {
      GemmTile d;
      if (!gemm_decode(t, tl, g, BN, cpt, d)) continue;
      // This thread's A rows: image and the input position of tap (0, 0); rows past M never read.
      int a_off[kARows], a_h[kARows], a_w[kARows];
#pragma unroll
      for (int i = 0; i < kARows; ++i) {
        const int m = d.m0 + row0 + 16 * i;
        if (m < d.m_phase) {
          const int n = m / d.pix;
          const int rem = m - n * d.pix;
          const int qh = rem / d.aw.count;
          a_off[i] = n * g.h_in;
          a_h[i] = qh + d.ah.base;
          a_w[i] = rem - qh * d.aw.count + d.aw.base;
        } else {
          a_off[i] = 0;
          a_h[i] = -(1 << 20);
          a_w[i] = 0;
        }
      }
      const T* x_grp = x + d.grp * g.cin_g + chunk * kVec;
      const T* w_grp = wp + static_cast<int64_t>(d.grp) * g.kh * g.kw * w_tap + chunk * kVec;
      const int tap0 = d.k_begin / cpt;
      int cc = d.k_begin - tap0 * cpt;
      int th = tap0 / d.aw.taps;
      int tw = tap0 - th * d.aw.taps;
      for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
        const int s = static_cast<int>(it % kStages);
        wg::mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);  // the multipliers are done with the buffer
        uint8_t* st = smem + s * kStage;
        const int dh = th * d.ah.dstep, dw = tw * d.aw.dstep;
        const int ci = cc * kCH + chunk * kVec;  // channel within the group
        const bool ci_ok = ci < g.cin_g;
#pragma unroll
        for (int i = 0; i < kARows; ++i) {
          const int hi = a_h[i] - dh, wi = a_w[i] - dw;
          const bool ok = ci_ok && hi >= 0 && hi < g.h_in && wi >= 0 && wi < g.w_in;
          const T* src = ok ? x_grp + (static_cast<int64_t>(a_off[i] + hi) * g.w_in + wi) * g.c_in + cc * kCH : x;
          cp_async16(st + sw128(row0 + 16 * i, chunk), src, ok ? 16 : 0);
        }
        const int tap = (d.ah.a0 + th * d.ah.step) * g.kw + d.aw.a0 + tw * d.aw.step;
        const T* w_src = w_grp + tap * w_tap + cc * kCH;
#pragma unroll
        for (int i = 0; i < kBRows; ++i) {
          const int co = d.n0 + row0 + 16 * i;
          const bool ok = co < g.cout_g;
          cp_async16(st + kAStage + sw128(row0 + 16 * i, chunk), ok ? w_src + static_cast<int64_t>(co) * g.ci_pad : wp,
                     ok ? 16 : 0);
        }
        if constexpr (kTF32) {
          cp_async_commit();
          if (pending >= 0) {
            cp_async_wait<1>();  // this thread's copies of the pending stage have landed
            publish(pending);
          }
          pending = s;
        } else {
          wg::cp_async_arrive_noinc(&full[s]);
        }
        if (++cc == cpt) {
          cc = 0;
          if (++tw == d.aw.taps) {
            tw = 0;
            ++th;
          }
        }
      }
    }
    if constexpr (kTF32) {
      cp_async_wait<0>();
      if (pending >= 0) publish(pending);
    }
    return;
  }

  // Multipliers.
  wg::setmaxnreg_inc<kConsRegs>();
  const int mw = wgi - 1;  // rows 64 mw .. 64 mw + 63 of the tile
  const int lane = threadIdx.x & 31;
  const int wq = (threadIdx.x >> 5) & 3;
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  T* __restrict__ y = static_cast<T*>(g.y);
  for (int t = blockIdx.x; t < tl.total; t += gridDim.x) {
    GemmTile d;
    if (!gemm_decode(t, tl, g, BN, cpt, d)) continue;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    int prev = -1;  // the stage whose wgmma may still run
    for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
      const int s = static_cast<int>(it % kStages);
      wg::mbar_wait(&full[s], (it / kStages) & 1);
      const uint32_t a_addr = base + s * kStage + mw * 64 * kGemmRowBytes;
      const uint32_t b_addr = base + s * kStage + kAStage;
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk)
        wgmma_ss<BN, K>(acc, sw128_desc(a_addr + 32 * kk), sw128_desc(b_addr + 32 * kk));
      wg::commit();
      wg::wait<1>();  // the previous stage's wgmma are done: its buffer goes back to the loader
      if (prev >= 0) wg::mbar_arrive(&empty[prev]);
      prev = s;
    }
    wg::wait<0>();
    if (prev >= 0) wg::mbar_arrive(&empty[prev]);
    wg::pin<BN / 2>(acc);

    // Epilogue. Accumulator 4j + e: row (warp's 16) + lane / 4 (+ 8 for e >= 2), column 8j + 2 (lane % 4) (+ 1
    // for odd e).
    const int co_base = d.grp * g.cout_g;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = d.m0 + mw * 64 + wq * 16 + (lane >> 2) + 8 * half;
      if (m >= d.m_phase) continue;
      const int n = m / d.pix;
      const int rem = m - n * d.pix;
      const int qh = rem / d.aw.count;
      const int qw = rem - qh * d.aw.count;
      const int ho = d.ah.o0 + qh * g.stride_h, wo = d.aw.o0 + qw * g.stride_w;
      if (g.partial != nullptr) {
        float* pp = g.partial +
                    ((((static_cast<int64_t>(d.split) * g.n + n) * g.h_out + ho) * g.w_out + wo) * g.c_out) + co_base;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int co = d.n0 + 8 * j + 2 * (lane & 3) + e;
            if (co < g.cout_g) pp[co] = acc[4 * j + 2 * half + e];
          }
        continue;
      }
      T* yp = y + n * g.ys_n + ho * g.ys_h + wo * g.ys_w + co_base * g.ys_c;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int co = d.n0 + 8 * j + 2 * (lane & 3) + e;
          if (co >= g.cout_g) continue;
          float v = acc[4 * j + 2 * half + e];
          if (bias != nullptr) v += to_acc(bias[co_base + co]);
          yp[co * g.ys_c] = from_acc<T>(v);
        }
    }
  }
}

// Split-K reduction: y = bias + the sum of the splits' partials, element by element (NHWC order).
template <typename T>
__global__ void conv_transpose2d_gemm_reduce(const GemmArgs g, int splits) {
  const int64_t total = static_cast<int64_t>(g.n) * g.h_out * g.w_out * g.c_out;
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  T* __restrict__ y = static_cast<T*>(g.y);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += g.partial[s * total + idx];
    const int co = static_cast<int>(idx % g.c_out);
    int64_t p = idx / g.c_out;
    const int wo = static_cast<int>(p % g.w_out);
    p /= g.w_out;
    const int ho = static_cast<int>(p % g.h_out);
    const int64_t n = p / g.h_out;
    if (bias != nullptr) v += to_acc(bias[co]);
    y[n * g.ys_n + co * g.ys_c + ho * g.ys_h + wo * g.ys_w] = from_acc<T>(v);
  }
}

// Packs w [C_in][cout_g][kH][kW] into [groups][kH][kW][cout_g][ci_pad] (zeros past cin_g), TF32-rounded for TF32.
template <typename T, bool kRound>
__global__ void conv_transpose2d_gemm_pack(const T* __restrict__ w, T* __restrict__ dst, int64_t groups, int64_t cin_g,
                                           int64_t cout_g, int64_t khw, int64_t ci_pad) {
  const int64_t total = groups * khw * cout_g * ci_pad;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ci = idx % ci_pad;
    int64_t r = idx / ci_pad;
    const int64_t co = r % cout_g;
    r /= cout_g;
    const int64_t tap = r % khw;
    const int64_t grp = r / khw;
    T v = from_acc<T>(0.f);
    if (ci < cin_g) {
      v = w[((grp * cin_g + ci) * cout_g + co) * khw + tap];
      if constexpr (kRound) v = __uint_as_float(tc::to_tf32(v));
    }
    dst[idx] = v;
  }
}

#if defined(DECONV_SM90A_SASS)
// Compute capability of the current device, read once per device.
int gemm_device_cc() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // cc + 1; 0: not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  int v = dev < kMaxDevices ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (v > 0) return v - 1;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return -1;
  v = major * 10 + minor;
  if (dev < kMaxDevices) cached[dev].store(v + 1, std::memory_order_relaxed);
  return v;
}
#endif

int64_t gemm_ci_pad(const ConvTranspose2dParams& p) {
  const int64_t per_stage = kGemmRowBytes / (p.dtype == DType::kFloat32 ? 4 : 2);
  return tc::div_up(p.C_in / p.groups, per_stage) * per_stage;
}

int64_t gemm_elem_bytes(const ConvTranspose2dParams& p) { return p.dtype == DType::kFloat32 ? 4 : 2; }

// Largest phase's pixels, M tiles and tiles of one split.
struct GemmGrid {
  int64_t m_tiles, n_tiles, tiles;
};
GemmGrid gemm_grid(const ConvTranspose2dParams& p, int config) {
  const int64_t rows = tc::div_up(p.H_out, p.stride_h) * tc::div_up(p.W_out, p.stride_w);
  GemmGrid gr{};
  gr.m_tiles = tc::div_up(p.N * rows, kGemmBM);
  gr.n_tiles = tc::div_up(p.C_out / p.groups, kGemmShapes[config].bn);
  gr.tiles = gr.m_tiles * gr.n_tiles * p.groups * p.stride_h * p.stride_w;
  return gr;
}

}  // namespace

bool gemm_eligible(const ConvTranspose2dParams& p) {
#if defined(DECONV_SM90A_SASS)
  const bool fp32 = p.dtype == DType::kFloat32;
  if (p.dtype == DType::kFloat64 || (fp32 && p.precision != Precision::kTF32)) return false;
  if (gemm_device_cc() != 90) return false;
  const int64_t eb = gemm_elem_bytes(p);
  const int64_t cin_g = p.C_in / p.groups;
  // 16-byte rows of channels, strides the phase tables hold, and every index in 31 bits.
  if ((cin_g * eb) % 16 != 0 || p.stride_h > kGemmMaxStride || p.stride_w > kGemmMaxStride) return false;
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0 && p.x_channels_last) return false;
  const int64_t lim = int64_t(1) << 30;
  if (p.N * p.H_in * p.W_in * p.C_in >= lim || p.N * p.H_out * p.W_out >= lim || p.C_out >= lim ||
      p.groups * p.kH * p.kW * (p.C_out / p.groups) * gemm_ci_pad(p) >= lim)
    return false;
  return gemm_grid(p, 2).tiles * kGemmMaxSplit < (int64_t(1) << 31);
#else
  (void)p;
  return false;
#endif
}

int gemm_config(const ConvTranspose2dParams& p) {
  if (p.force_config >= 0 && p.force_config < kNumGemmConfigs) return p.force_config;
  const int64_t cout_g = p.C_out / p.groups;
  if (cout_g <= 64) return 2;
  return 0;
}

int gemm_split(const ConvTranspose2dParams& p, int config) {
  if (p.force_split > 0) return p.force_split < kGemmMaxSplit ? p.force_split : kGemmMaxSplit;
  const GemmGrid gr = gemm_grid(p, config);
  const int64_t sms = sm_count() > 0 ? sm_count() : 132;
  const int64_t kiters = max_phase_taps(p.stride_h, p.dil_h, p.kH) * max_phase_taps(p.stride_w, p.dil_w, p.kW) *
                         (gemm_ci_pad(p) * gemm_elem_bytes(p) / kGemmRowBytes);
  if (2 * gr.tiles > sms) return 1;
  int64_t split = sms / (gr.tiles > 0 ? gr.tiles : 1);
  if (split > kiters / 4) split = kiters / 4;  // at least 4 stages a block
  if (split > kGemmMaxSplit) split = kGemmMaxSplit;
  return split >= 2 ? static_cast<int>(split) : 1;
}

WeightPacking gemm_packing(const ConvTranspose2dParams& p) {
  WeightPacking w{};
  const int64_t ci_pad = gemm_ci_pad(p);
  w.bytes = static_cast<size_t>(p.groups * p.kH * p.kW * (p.C_out / p.groups) * ci_pad * gemm_elem_bytes(p));
  w.kind = static_cast<int64_t>(p.dtype == DType::kFloat32 ? tc::MmaKind::kTF32
                                : p.dtype == DType::kBFloat16 ? tc::MmaKind::kBF16
                                                              : tc::MmaKind::kFP16);
  w.groups = p.groups;
  w.ciw_pad = ci_pad;
  w.co_pad = p.C_out / p.groups;
  w.kmajor = true;
  w.layout = 1;
  return w;
}

size_t gemm_workspace_bytes(const ConvTranspose2dParams& p, int config) {
  const size_t packed = p.packed_weights == nullptr ? (gemm_packing(p).bytes + 255) / 256 * 256 : 0;
  const int split = gemm_split(p, config);
  const size_t partial =
      split > 1 ? static_cast<size_t>(split) * p.N * p.H_out * p.W_out * p.C_out * sizeof(float) : 0;
  return packed + partial;
}

cudaError_t gemm_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream) {
  const int64_t cin_g = p.C_in / p.groups, cout_g = p.C_out / p.groups, ci_pad = gemm_ci_pad(p);
  const int64_t total = p.groups * p.kH * p.kW * cout_g * ci_pad;
  const int threads = 256;
  const int64_t blocks64 = tc::div_up(total, threads);
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65536 ? blocks64 : 65536);
  switch (p.dtype) {
    case DType::kFloat32:
      conv_transpose2d_gemm_pack<float, true><<<blocks, threads, 0, stream>>>(
          static_cast<const float*>(p.w), static_cast<float*>(dst), p.groups, cin_g, cout_g, p.kH * p.kW, ci_pad);
      break;
    case DType::kBFloat16:
      conv_transpose2d_gemm_pack<__nv_bfloat16, false><<<blocks, threads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(p.w), static_cast<__nv_bfloat16*>(dst), p.groups, cin_g, cout_g,
          p.kH * p.kW, ci_pad);
      break;
    case DType::kFloat16:
      conv_transpose2d_gemm_pack<__half, false><<<blocks, threads, 0, stream>>>(
          static_cast<const __half*>(p.w), static_cast<__half*>(dst), p.groups, cin_g, cout_g, p.kH * p.kW, ci_pad);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

namespace {

template <typename T, tc::MmaKind K, int kShape>
cudaError_t gemm_launch_shape(const ConvTranspose2dParams& p, const GemmArgs& a, int split, cudaStream_t stream) {
  constexpr GemmShape s = kGemmShapes[kShape];
  auto kernel = conv_transpose2d_gemm_kernel<T, K, s.bn, s.stages>;
  constexpr size_t smem = gemm_smem_bytes(s);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  GemmTiles tl{};
  for (int64_t r = 0; r < p.stride_h; ++r) tl.ah[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) tl.aw[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  const GemmGrid gr = gemm_grid(p, kShape);
  tl.n_tiles = make_fast_div(static_cast<uint32_t>(gr.n_tiles));
  tl.groups = make_fast_div(static_cast<uint32_t>(p.groups));
  tl.splits = make_fast_div(static_cast<uint32_t>(split));
  tl.phases = make_fast_div(static_cast<uint32_t>(p.stride_h * p.stride_w));
  tl.stride_w = make_fast_div(static_cast<uint32_t>(p.stride_w));
  tl.total = static_cast<int>(gr.tiles * split);
  const int sms = sm_count() > 0 ? sm_count() : 1;
  kernel<<<tl.total < sms ? tl.total : sms, kGemmThreads, smem, stream>>>(a, tl);
  err = cudaGetLastError();
  if (err != cudaSuccess || split == 1) return err;
  const int64_t total = p.N * p.H_out * p.W_out * p.C_out;
  const int64_t blocks = tc::div_up(total, 256);
  conv_transpose2d_gemm_reduce<T><<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(a, split);
  return cudaGetLastError();
}

template <typename T, tc::MmaKind K>
cudaError_t gemm_launch_kind(const ConvTranspose2dParams& p, int config, const GemmArgs& a, int split,
                             cudaStream_t stream) {
  switch (config) {
    case 0:
      return gemm_launch_shape<T, K, 0>(p, a, split, stream);
    case 1:
      return gemm_launch_shape<T, K, 1>(p, a, split, stream);
    case 2:
      return gemm_launch_shape<T, K, 2>(p, a, split, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_gemm(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  if (!p.x_channels_last || config < 0 || config >= kNumGemmConfigs) return cudaErrorInvalidValue;
  GemmArgs a{};
  a.x = p.x;
  a.bias = p.bias;
  a.y = p.y;
  a.n = static_cast<int>(p.N);
  a.c_in = static_cast<int>(p.C_in);
  a.h_in = static_cast<int>(p.H_in);
  a.w_in = static_cast<int>(p.W_in);
  a.c_out = static_cast<int>(p.C_out);
  a.h_out = static_cast<int>(p.H_out);
  a.w_out = static_cast<int>(p.W_out);
  a.kh = static_cast<int>(p.kH);
  a.kw = static_cast<int>(p.kW);
  a.cin_g = static_cast<int>(p.C_in / p.groups);
  a.cout_g = static_cast<int>(p.C_out / p.groups);
  a.ci_pad = static_cast<int>(gemm_ci_pad(p));
  a.stride_h = static_cast<int>(p.stride_h);
  a.stride_w = static_cast<int>(p.stride_w);
  if (p.y_channels_last) {
    a.ys_c = 1;
    a.ys_w = p.C_out;
    a.ys_h = p.W_out * p.C_out;
    a.ys_n = p.H_out * p.W_out * p.C_out;
  } else {
    a.ys_w = 1;
    a.ys_h = p.W_out;
    a.ys_c = p.H_out * p.W_out;
    a.ys_n = p.C_out * p.H_out * p.W_out;
  }
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  if (p.packed_weights != nullptr) {
    a.wp = p.packed_weights;
  } else {
    if (ws == nullptr) return cudaErrorInvalidValue;
    const cudaError_t err = gemm_pack(p, ws, stream);
    if (err != cudaSuccess) return err;
    a.wp = ws;
    ws += (gemm_packing(p).bytes + 255) / 256 * 256;
  }
  const int split = gemm_split(p, config);
  if (split > 1) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    a.partial = reinterpret_cast<float*>(ws);
  }
  switch (p.dtype) {
    case DType::kFloat32:
      return gemm_launch_kind<float, tc::MmaKind::kTF32>(p, config, a, split, stream);
    case DType::kBFloat16:
      return gemm_launch_kind<__nv_bfloat16, tc::MmaKind::kBF16>(p, config, a, split, stream);
    case DType::kFloat16:
      return gemm_launch_kind<__half, tc::MmaKind::kFP16>(p, config, a, split, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
