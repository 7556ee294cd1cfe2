// ConvTranspose2d forward on tensor cores: the stride-phase implicit GEMM of conv_transpose2d.cu with
// mma.sync (sm_80+: TF32 m16n8k8, BF16/FP16 m16n8k16, fp32 accumulation).
//
// Per block: a BM (output pixels of one phase) x BN (output channels of one group) tile. K runs tap by tap and,
// inside a tap, over input channels in chunks of BKW 32-bit "words" (one fp32 value, or a pair of consecutive
// channels for 16-bit types). Because a chunk never crosses a tap, each thread computes its pixel's input
// address once per chunk.
//   A (pixels x channels) is gathered from NCHW x: a thread owns one pixel and walks channels, so a warp reads
//     32 neighbouring pixels of one channel row (coalesced). Registers stage chunk c+1 while chunk c computes.
//   B (channels x out-channels) comes from a packed copy of the weight made by pack_weights_kernel:
//     [group][a][b][channel word][out channel], zero-padded so that B tiles are whole 16-byte rows.
// Shared memory holds both operands as 32-bit words with row strides of (cols + 8) words: the mma fragment
// loads (rows t and t+4, columns g and g+8 of an 8-row slab) then hit 32 distinct banks.
// The epilogue stages the accumulators through shared memory so that each thread writes one pixel for a run of
// channels: a warp stores 32 neighbouring output pixels per channel (coalesced for stride_w == 1).
//
// Precision modes: TF32 (operands rounded to TF32 once, when staged), 3xTF32 for exact fp32 (each operand
// split into hi + lo TF32 parts; hi*hi + hi*lo + lo*hi, error ~2^-22), BF16 and FP16 (native, fp32 accumulate).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "phase.cuh"

namespace deconv {
namespace {

using tc::MmaKind;
using tc::bits16;
using tc::round_word;
using tc::pack_weights_kernel;

constexpr int kBKW = 16;  // K words per chunk (two mma k-slabs of 8 words)

struct TileShape {
  int bm, bn, warps_m, warps_n;
};
// Index = configuration number (force_config); chosen by output channels per group.
constexpr TileShape kTileShapes[kNumGatherConfigs] = {
    {128, 128, 4, 2},  // 0: C_out/groups > 64
    {128, 64, 4, 2},   // 1: 32 < C_out/groups <= 64
    {256, 32, 8, 1},   // 2: 16 < C_out/groups <= 32
    {256, 16, 8, 1},   // 3: C_out/groups <= 16
};

// Global loads as volatile asm: the compiler keeps them where they are written (before the chunk's mma, which
// are volatile asm too) instead of sinking them next to their use, so their latency overlaps the math.
__device__ __forceinline__ uint32_t ldg_b32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg_b16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.nc.b16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldg_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One 32-bit staging word of x: channel ci (and ci + 1 for 16-bit types) of one pixel; zero outside.
template <typename T, MmaKind K>
__device__ __forceinline__ uint32_t load_x_word(const T* __restrict__ px, int ci, int cin_g, int64_t hw) {
  if constexpr (sizeof(T) == 4) {
    // TF32 rounding happens when the word is stored to shared memory (round_word), after the load completes.
    return ci < cin_g ? ldg_b32(px + ci * hw) : 0u;
  } else {
    const uint32_t lo = ci < cin_g ? ldg_b16(px + ci * hw) : 0u;
    const uint32_t hi = ci + 1 < cin_g ? ldg_b16(px + (ci + 1) * hw) : 0u;
    return lo | (hi << 16);
  }
}

template <int BM, int BN>
constexpr size_t smem_bytes() {
  const size_t pipe = 2 * kBKW * ((BM + 8) + (BN + 8)) * 4;
  const size_t epi = size_t(BN) * (BM + 4) * 4;
  return pipe > epi ? pipe : epi;
}

// Two blocks per SM (128 registers a thread) hide the gather latency; the 128 x 128 tile holds 64 accumulators
// a thread, and exact fp32 a partial sum as large as its accumulators: those run one block per SM rather than
// spill.
template <MmaKind K, int BN>
constexpr int min_blocks() {
  return BN >= 128 || K == MmaKind::k3xTF32 ? 1 : 2;
}

template <typename T, MmaKind K, int BM, int BN, int WARPS_M, int WARPS_N>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32, min_blocks<K, BN>())
    conv_transpose2d_mma_kernel(const ConvTranspose2dParams p, const uint32_t* __restrict__ wt, int64_t ciw_pad,
                                int64_t co_pad) {
  constexpr int kThreads = WARPS_M * WARPS_N * 32;
  constexpr int kWarpM = BM / WARPS_M;  // warp tile rows (pixels)
  constexpr int kWarpN = BN / WARPS_N;  // warp tile cols (channels)
  constexpr int kMT = kWarpM / 16;      // m16 tiles per warp
  constexpr int kNT = kWarpN / 8;       // n8 tiles per warp
  constexpr int kAStride = BM + 8;
  constexpr int kBStride = BN + 8;
  constexpr int kCStride = BM + 4;
  constexpr int kARows = kBKW * BM / kThreads;  // A words per thread per chunk
  constexpr int kARowStep = kThreads / BM;
  constexpr int kBVecs = kBKW * BN / 4;  // 16-byte vectors in a B chunk
  constexpr int kBVecsPerThread = (kBVecs + kThreads - 1) / kThreads;
  constexpr int kPerWord = sizeof(T) == 4 ? 1 : 2;
  static_assert(kThreads % BM == 0 && kARows * kARowStep == kBKW, "A loader mapping");
  static_assert(kWarpM % 16 == 0 && kWarpN % 8 == 0, "warp tile");

  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* As = smem;                       // [2][kBKW][kAStride]
  uint32_t* Bs = smem + 2 * kBKW * kAStride;  // [2][kBKW][kBStride]
  float* Cs = reinterpret_cast<float*>(smem);  // [BN][kCStride], after the main loop

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % WARPS_M;
  const int wn = warp / WARPS_M;
  const int g8 = lane >> 2;  // mma groupID
  const int t4 = lane & 3;   // mma thread in group

  const int64_t cin_g = p.C_in / p.groups;
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t hw_out = p.H_out * p.W_out;
  const int64_t chunks_per_tap = ciw_pad / kBKW;
  const int64_t num_z = p.stride_h * p.stride_w * p.groups;

  for (int64_t z = blockIdx.z; z < num_z; z += gridDim.z) {
    const int64_t grp = z % p.groups;
    const int64_t phase = z / p.groups;
    const AxisPhase ah = make_axis_phase(phase / p.stride_w, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
    const AxisPhase aw = make_axis_phase(phase % p.stride_w, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
    const int64_t pix_per_img = ah.count * aw.count;
    const int64_t M = p.N * pix_per_img;
    const int num_chunks = static_cast<int>(ah.taps * aw.taps * chunks_per_tap);

    for (int64_t nt = blockIdx.y; nt * BN < cout_g; nt += gridDim.y) {
      const int64_t n0 = nt * BN;
      for (int64_t mt = blockIdx.x; mt * BM < M; mt += gridDim.x) {
        // This thread's pixel (same for A loads and epilogue stores).
        const int lm = tid % BM;
        const int64_t m = mt * BM + lm;
        const bool m_ok = m < M;
        int64_t img = 0, qh = 0, qw = 0;
        if (m_ok) {
          img = m / pix_per_img;
          const int64_t rem = m - img * pix_per_img;
          qh = rem / aw.count;
          qw = rem - qh * aw.count;
        }
        const T* x_img = x + (img * p.C_in + grp * cin_g) * hw_in;
        // 32-bit copies of what the K loop needs: fewer registers, so two blocks fit on an SM.
        const int hbase = static_cast<int>(qh + ah.base);
        const int wbase = static_cast<int>(qw + aw.base);
        const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);
        const int taps = static_cast<int>(ah.taps * aw.taps);
        const int taps_w = static_cast<int>(aw.taps);
        const int dstep_h = static_cast<int>(ah.dstep), dstep_w = static_cast<int>(aw.dstep);
        const int step_h = static_cast<int>(ah.step), step_w = static_cast<int>(aw.step);
        const int a0 = static_cast<int>(ah.a0), b0 = static_cast<int>(aw.a0);
        const int cin = static_cast<int>(cin_g);
        const int ksz_w = static_cast<int>(p.kW);
        const uint32_t* wt_grp = wt + grp * p.kH * p.kW * ciw_pad * co_pad + n0;

        uint32_t a_regs[kARows];
        uint4 b_regs[kBVecsPerThread];

        auto load_chunk = [&](int c) {
          // Channel chunk outer, taps inner: the taps of one chunk re-read neighbouring x rows while they are
          // still in L1.
          const int cchunk = c / taps;
          const int tap = c - cchunk * taps;
          const int cw0 = cchunk * kBKW;
          const int th = tap / taps_w;
          const int tw = tap - th * taps_w;
          const int hi = hbase - th * dstep_h;
          const int wi = wbase - tw * dstep_w;
          const bool ok = m_ok && hi >= 0 && hi < h_in && wi >= 0 && wi < w_in;
          const T* px = x_img + (ok ? int64_t(hi) * w_in + wi : 0);
#pragma unroll
          for (int r = 0; r < kARows; ++r) {
            const int ci = (cw0 + tid / BM + r * kARowStep) * kPerWord;
            a_regs[r] = ok ? load_x_word<T, K>(px, ci, cin, hw_in) : 0u;
          }
          const int a = a0 + th * step_h;
          const int b = b0 + tw * step_w;
          const uint32_t* src = wt_grp + ((int64_t(a) * ksz_w + b) * ciw_pad + cw0) * co_pad;
#pragma unroll
          for (int v = 0; v < kBVecsPerThread; ++v) {
            const int idx = tid + v * kThreads;
            if (idx < kBVecs) {
              const int row = idx / (BN / 4);
              const int col = (idx % (BN / 4)) * 4;
              b_regs[v] = ldg_v4(src + int64_t(row) * co_pad + col);
            }
          }
        };
        auto store_chunk = [&](int buf) {
          uint32_t* as = As + buf * kBKW * kAStride;
          uint32_t* bs = Bs + buf * kBKW * kBStride;
#pragma unroll
          for (int r = 0; r < kARows; ++r) as[(tid / BM + r * kARowStep) * kAStride + lm] = round_word<K>(a_regs[r]);
#pragma unroll
          for (int v = 0; v < kBVecsPerThread; ++v) {
            const int idx = tid + v * kThreads;
            if (idx < kBVecs) {
              const int row = idx / (BN / 4);
              const int col = (idx % (BN / 4)) * 4;
              *reinterpret_cast<uint4*>(bs + row * kBStride + col) = b_regs[v];
            }
          }
        };

        // Exact fp32 runs each chunk into `part` and adds it to `acc` (tc::add_tile says why).
        constexpr bool kPartial = K == MmaKind::k3xTF32;
        float acc[kMT][kNT][4];
        float part[kPartial ? kMT : 1][kPartial ? kNT : 1][4];
        tc::zero_tile(acc);

        if (num_chunks > 0) {
          load_chunk(0);
          store_chunk(0);
        }
        __syncthreads();
        for (int c = 0; c < num_chunks; ++c) {
          const int buf = c & 1;
          if (c + 1 < num_chunks) load_chunk(c + 1);  // global loads in flight during the mma below
          const uint32_t* as = As + buf * kBKW * kAStride + wm * kWarpM;
          const uint32_t* bs = Bs + buf * kBKW * kBStride + wn * kWarpN;
          if constexpr (kPartial) tc::zero_tile(part);
#pragma unroll
          for (int ks = 0; ks < kBKW; ks += 8) {
            uint32_t af[kMT][4], bf[kNT][2];
#pragma unroll
            for (int i = 0; i < kMT; ++i) {
              af[i][0] = as[(ks + t4) * kAStride + i * 16 + g8];
              af[i][1] = as[(ks + t4) * kAStride + i * 16 + g8 + 8];
              af[i][2] = as[(ks + t4 + 4) * kAStride + i * 16 + g8];
              af[i][3] = as[(ks + t4 + 4) * kAStride + i * 16 + g8 + 8];
            }
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
              bf[j][0] = bs[(ks + t4) * kBStride + j * 8 + g8];
              bf[j][1] = bs[(ks + t4 + 4) * kBStride + j * 8 + g8];
            }
            if constexpr (kPartial) {
              tc::mma_warp_tile<K>(part, af, bf);
            } else {
              tc::mma_warp_tile<K>(acc, af, bf);
            }
          }
          if constexpr (kPartial) tc::add_tile(acc, part);
          if (c + 1 < num_chunks) store_chunk(buf ^ 1);
          __syncthreads();
        }

        // Epilogue: accumulators -> shared [channel][pixel] -> bias, convert, NCHW stores.
        tc::stage_accumulators(Cs, kCStride, acc, wm * kWarpM, wn * kWarpN, g8, t4);
        __syncthreads();
        if (m_ok) {
          const int64_t ho = ah.o0 + qh * p.stride_h;
          const int64_t wo = aw.o0 + qw * p.stride_w;
          T* y_pix = y + (img * p.C_out + grp * cout_g) * hw_out + ho * p.W_out + wo;
          for (int nc = tid / BM; nc < BN; nc += kThreads / BM) {
            const int64_t co = n0 + nc;
            if (co >= cout_g) break;
            float v = Cs[nc * kCStride + lm];
            if (bias != nullptr) v += to_acc(bias[grp * cout_g + co]);
            y_pix[co * hw_out] = from_acc<T>(v);
          }
        }
        __syncthreads();  // Cs aliases the operand buffers of the next tile
      }
    }
  }
}

using tc::div_up;

struct Packing {
  int64_t ciw_pad, co_pad;
};

int config_block_n(int config) {
  return config < kNumGatherConfigs ? kTileShapes[config].bn : halo_block_n(config - kNumGatherConfigs);
}

// Packed weights: channel words padded to whole 16-word chunks, output channels to whole BN tiles.
Packing packing(const ConvTranspose2dParams& p, int config) {
  const int per_word = p.dtype == DType::kFloat32 ? 1 : 2;
  const int64_t cin_g = p.C_in / p.groups, cout_g = p.C_out / p.groups;
  const int64_t bn = config_block_n(config);
  return {div_up(div_up(cin_g, per_word), kBKW) * kBKW, div_up(cout_g, bn) * bn};
}

bool config_kmajor(const ConvTranspose2dParams& p, int config) {
  return config >= kNumGatherConfigs && halo_kmajor(p, config - kNumGatherConfigs);
}

template <typename T, MmaKind K>
cudaError_t pack_weights(const ConvTranspose2dParams& p, const Packing& pk, int config, void* dst,
                         cudaStream_t stream) {
  const int64_t total = p.groups * p.kH * p.kW * pk.ciw_pad * pk.co_pad;
  const int pack_blocks = static_cast<int>(div_up(total, 256) < 4096 ? div_up(total, 256) : 4096);
  pack_weights_kernel<T, K><<<pack_blocks, 256, 0, stream>>>(static_cast<const T*>(p.w), static_cast<uint32_t*>(dst),
                                                             p.groups, p.C_in / p.groups, p.C_out / p.groups, p.kH,
                                                             p.kW, pk.ciw_pad, pk.co_pad, config_kmajor(p, config));
  return cudaGetLastError();
}

template <typename T, MmaKind K, int BM, int BN, int WM, int WN>
cudaError_t launch_config(const ConvTranspose2dParams& p, const uint32_t* wt, const Packing& pk,
                          cudaStream_t stream) {
  auto kernel = conv_transpose2d_mma_kernel<T, K, BM, BN, WM, WN>;
  constexpr size_t smem = smem_bytes<BM, BN>();
  if (smem > 48 * 1024) {
    const cudaError_t err = opt_in_shared_memory<conv_transpose2d_mma_kernel<T, K, BM, BN, WM, WN>>();
    if (err != cudaSuccess) return err;
  }
  const int64_t max_m = p.N * div_up(p.H_out, p.stride_h) * div_up(p.W_out, p.stride_w);
  const int64_t m_tiles = div_up(max_m, BM);
  const int64_t n_tiles = pk.co_pad / BN;
  const int64_t z = p.stride_h * p.stride_w * p.groups;
  const dim3 grid(static_cast<unsigned>(m_tiles < 0x7fffffff ? m_tiles : 0x7fffffff),
                  static_cast<unsigned>(n_tiles < 65535 ? n_tiles : 65535),
                  static_cast<unsigned>(z < 65535 ? z : 65535));
  kernel<<<grid, WM * WN * 32, smem, stream>>>(p, wt, pk.ciw_pad, pk.co_pad);
  return cudaGetLastError();
}

template <typename T, MmaKind K>
cudaError_t launch_kind(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  const Packing pk = packing(p, config);
  const uint32_t* wt = static_cast<const uint32_t*>(p.packed_weights);
  if (wt == nullptr) {  // pack into the workspace first
    const cudaError_t err = pack_weights<T, K>(p, pk, config, p.workspace, stream);
    if (err != cudaSuccess) return err;
    wt = static_cast<const uint32_t*>(p.workspace);
  }
  switch (config) {
    case 0:
      return launch_config<T, K, 128, 128, 4, 2>(p, wt, pk, stream);
    case 1:
      return launch_config<T, K, 128, 64, 4, 2>(p, wt, pk, stream);
    case 2:
      return launch_config<T, K, 256, 32, 8, 1>(p, wt, pk, stream);
    case 3:
      return launch_config<T, K, 256, 16, 8, 1>(p, wt, pk, stream);
    default:
      return launch_halo(p, config - kNumGatherConfigs, wt, pk.ciw_pad, pk.co_pad, stream);
  }
}

MmaKind mma_kind(const ConvTranspose2dParams& p) {
  switch (p.dtype) {
    case DType::kFloat16:
      return MmaKind::kFP16;
    case DType::kBFloat16:
      return MmaKind::kBF16;
    default:
      return p.precision == Precision::kTF32 ? MmaKind::kTF32 : MmaKind::k3xTF32;
  }
}

}  // namespace

int tensor_core_config(const ConvTranspose2dParams& p) {
  if (p.dtype == DType::kFloat64) return -1;
  if (p.force_config >= 0) return p.force_config < kNumTensorCoreConfigs ? p.force_config : -1;
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t cin_g = p.C_in / p.groups;
  // Too few channels to fill an mma tile: the SIMT kernel wastes less.
  if (cin_g < 4 || cout_g < 4) return -1;
  const int halo = halo_choose(p);
  if (halo >= 0) return kNumGatherConfigs + halo;
  if (cout_g > 64) return 0;
  if (cout_g > 32) return 1;
  if (cout_g > 16) return 2;
  return 3;
}

size_t tensor_core_workspace_bytes(const ConvTranspose2dParams& p, int config) {
  if (config < 0) return 0;
  const Packing pk = packing(p, config);
  return static_cast<size_t>(p.groups * p.kH * p.kW * pk.ciw_pad * pk.co_pad) * 4;
}

WeightPacking tensor_core_packing(const ConvTranspose2dParams& p, int config) {
  if (config < 0) return WeightPacking{};
  const Packing pk = packing(p, config);
  return {tensor_core_workspace_bytes(p, config), static_cast<int64_t>(mma_kind(p)), p.groups, pk.ciw_pad,
          pk.co_pad, config_kmajor(p, config)};
}

cudaError_t tensor_core_pack(const ConvTranspose2dParams& p, int config, void* dst, cudaStream_t stream) {
  const Packing pk = packing(p, config);
  switch (mma_kind(p)) {
    case MmaKind::kTF32:
      return pack_weights<float, MmaKind::kTF32>(p, pk, config, dst, stream);
    case MmaKind::k3xTF32:
      return pack_weights<float, MmaKind::k3xTF32>(p, pk, config, dst, stream);
    case MmaKind::kFP16:
      return pack_weights<__half, MmaKind::kFP16>(p, pk, config, dst, stream);
    case MmaKind::kBF16:
      return pack_weights<__nv_bfloat16, MmaKind::kBF16>(p, pk, config, dst, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_tensor_core(const ConvTranspose2dParams& p, int config, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32:
      return p.precision == Precision::kTF32 ? launch_kind<float, MmaKind::kTF32>(p, config, stream)
                                             : launch_kind<float, MmaKind::k3xTF32>(p, config, stream);
    case DType::kFloat16:
      return launch_kind<__half, MmaKind::kFP16>(p, config, stream);
    case DType::kBFloat16:
      return launch_kind<__nv_bfloat16, MmaKind::kBF16>(p, config, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
