// ConvTranspose2d forward, warp-specialized on Hopper tensor cores (sm_90a wgmma; TF32, BF16, FP16): the halo
// kernel's tiles (conv_transpose2d_halo.cu: a TH x TW tile of one stride phase's pixels x BN output channels,
// every tap a shifted window of one staged input patch), with the loads and the multiplies in different warps.
//
// kCons consumer warpgroups and one producer warpgroup, persistent over the tiles (one block an SM, tile =
// (((image x spatial tile) x channel block) x group) x phase, phase fastest (WsTiles), decoded with host-made
// phase tables and fast divisions). Consumer warpgroup c owns pixels [c, c + 1) x BM / kCons as m64 blocks.
//
// The producer fills a ring of `stages` shared-memory buffers, each one stage of 8 K words (8 fp32 or 16 16-bit
// input channels): the patch with 16-byte cp.async from its 128 threads (zero-filled outside x), and the
// weights, packed K-major ([g][a][b][word / 4][co][4]), with one bulk copy per tap and K half (BN x 16 bytes)
// that completes as transactions on the stage's `full` barrier. Patches are published as they land (cp.async
// arrivals on `full`), so every buffer the consumers are not reading has its copies in flight, and fp32 inputs
// are rounded to TF32 (round to nearest, cvt.rna) by the consumers as they load their fragments. The 32-channel
// tile rounds in shared memory instead (kRoundSmem): there the producer rounds the landed patch once and publishes
// it one stage behind its copies (none with two buffers), at most two stages of copies in flight.
// Consumers wait for `full`, run the stage's taps (A: the patch window through registers in mma.sync's fragment
// layout, three register sets in rotation; B: the weights by descriptor), wait for their wgmma and arrive on
// `empty`, which the producer waits for before refilling the buffer. The epilogue stores straight from the
// accumulators (one warp store covers 8 neighbouring pixels x 4 channels), bias fused, while the producer already
// loads the next tile.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "phase.cuh"
#include "wgmma.cuh"

namespace deconv {
namespace {

// Tile decoding, made on the host: per-residue phases of both axes and the divisors of the tile index.
// Tile index = ((spatial tile * n_tiles + channel tile) * groups + group) * phases + phase: the stride phases of
// one output region, then its channel tiles, run on neighbouring blocks at the same time, so that their shared
// input patch is read from DRAM once and the output sectors that the phases each write a part of are completed in
// L2 (bench/NOTES.md v12: phase-slowest order moved 2.1x cuDNN's DRAM bytes on a stride-2 layer).
struct WsTiles {
  AxisPhase32 ah[kWsMaxStride], aw[kWsMaxStride];
  FastDiv phases, groups, n_tiles, tiles_img, tiles_w, stride_w;
  int total;  // tiles
};

// TF32 rounding of a stage's patch in place, by the producer's 128 threads.
__device__ __forceinline__ void round_patch_tf32(uint32_t* patch, int words, int ptid) {
  tc::round_tf32_inplace(patch, words, ptid, 128);
}

// Barrier among the producer warpgroup's 128 threads only (named barrier 1; consumers never use it).
__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }

template <typename T, tc::MmaKind K, int TH, int TW, int BN, int kCons>
__global__ void __launch_bounds__((kCons + 1) * 128, 1)
    conv_transpose2d_ws_kernel(const ConvTranspose2dParams p, const uint32_t* __restrict__ wt, int64_t ciw_pad,
                               int64_t co_pad, const HaloGeom geo, const __grid_constant__ WsTiles tiles) {
  constexpr int BM = TH * TW;
  constexpr int kWgM = BM / kCons;  // pixels a consumer warpgroup
  constexpr int kMT = kWgM / 64;    // m64 blocks a consumer warpgroup
  constexpr int kNT = BN / 8;
  constexpr int kKC = sizeof(T) == 4 ? 8 : 16;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kRS = patch_row_stride(TW, sizeof(T));
  constexpr int kCS = patch_channel_stride(TH, TW, sizeof(T));
  constexpr int kRing = 3;
  constexpr bool kTF32 = K == tc::MmaKind::kTF32;
  // Where fp32 patches are rounded to TF32. In the consumers' registers a patch word is converted once for each tap
  // that reads it (kMT x 4 cvt a thread against one m64 x BN x 8 wgmma), in shared memory once, by the producer,
  // which then holds back a stage. H100 (bench/NOTES.md v14): registers are faster at BN = 64 (dcgan_up1 b64 178
  // against 207 us, KernelBench 57 4.6-4.7 against 5.0-5.2 ms) and level at BN = 128 (69), but at BN = 32, where a
  // wgmma is half as long, slower with 21 taps (78: 1.45-1.54 against 1.30 ms).
  constexpr bool kRoundSmem = kTF32 && BN == 32;
  // Registers: a block starts with kLaunchRegs a thread (what __launch_bounds__ leaves ptxas: 168 for 384
  // threads, 96 for 640); the producer gives back down to kProdRegs and the consumers take what it freed
  // (setmaxnreg.inc waits for registers the block does not hold, forever). With four consumer warpgroups that is
  // 104, and ptxas serializes their wgmma (C7512).
  constexpr int kThreads = (kCons + 1) * 128;
  constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  constexpr int kProdRegs = kCons > 2 ? 40 : 72;
  constexpr int kConsRegs0 = (kLaunchRegs * kThreads - 128 * kProdRegs) / (kCons * 128) / 8 * 8;
  constexpr int kConsRegs = kConsRegs0 > 240 ? 240 : kConsRegs0;
  static_assert(kProdRegs <= kLaunchRegs && kConsRegs >= kLaunchRegs, "register budget");
  static_assert(TW == 32 && kWgM % 64 == 0 && (BN == 32 || BN == 64 || BN == 128) && K != tc::MmaKind::k3xTF32,
                "warp-specialized tiles");

  extern __shared__ __align__(16) uint32_t smem[];
  const int stages = geo.stages;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + geo.extra);
  uint64_t* empty = full + kMaxWsStages;

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  T* __restrict__ y = static_cast<T*>(p.y);
  const int wgi = threadIdx.x / 128;
  const bool producer = wgi == kCons;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      wg::mbar_init(&full[s], 128 + 1);       // the producer threads' arrivals + the weights' expect_tx
      wg::mbar_init(&empty[s], kCons * 128);  // every consumer thread
    }
  }
  __syncthreads();

  const int64_t cin_g = p.C_in / p.groups;
  const int64_t cout_g = p.C_out / p.groups;
  const int64_t hw_in = p.H_in * p.W_in;
  const int64_t hw_out = p.H_out * p.W_out;
  const int h_in = static_cast<int>(p.H_in), w_in = static_cast<int>(p.W_in);

  // A tile's place: false for tiles of phases smaller than the largest (nothing there).
  struct Tile {
    AxisPhase32 ah, aw;
    int64_t grp, n0;
    int img, qh0, qw0, taps_h, taps_w, ph, nchunks, hi0, wa, shift;
  };
  auto decode = [&](int tile, Tile& d) {
    const int r0 = fdiv(tile, tiles.phases);
    const int phase = tile - r0 * static_cast<int>(tiles.phases.d);
    const int r1 = fdiv(r0, tiles.groups);
    d.grp = r0 - r1 * static_cast<int>(tiles.groups.d);
    const int bx = fdiv(r1, tiles.n_tiles);
    d.n0 = int64_t(r1 - bx * static_cast<int>(tiles.n_tiles.d)) * BN;
    const int rh = fdiv(phase, tiles.stride_w);
    d.ah = tiles.ah[rh];
    d.aw = tiles.aw[phase - rh * static_cast<int>(tiles.stride_w.d)];
    if (d.ah.count == 0 || d.aw.count == 0) return false;
    d.img = fdiv(bx, tiles.tiles_img);
    const int rem = bx - d.img * static_cast<int>(tiles.tiles_img.d);
    const int tile_h = fdiv(rem, tiles.tiles_w);
    d.qh0 = tile_h * TH;
    d.qw0 = (rem - tile_h * static_cast<int>(tiles.tiles_w.d)) * TW;
    if (d.qh0 >= d.ah.count || d.qw0 >= d.aw.count) return false;
    d.taps_h = d.ah.taps;
    d.taps_w = d.aw.taps;
    const int taps = d.taps_h * d.taps_w;
    d.ph = TH + (d.taps_h > 0 ? d.taps_h - 1 : 0) * d.ah.dstep;
    d.nchunks = taps > 0 ? static_cast<int>(tc::div_up(cin_g, kKC)) : 0;
    d.hi0 = d.qh0 + d.ah.base - (d.taps_h > 0 ? d.taps_h - 1 : 0) * d.ah.dstep;
    const int wi0 = d.qw0 + d.aw.base - (d.taps_w > 0 ? d.taps_w - 1 : 0) * d.aw.dstep;
    d.wa = floor_div(wi0, kVec) * kVec;  // first column copied
    d.shift = wi0 - d.wa;
    return true;
  };
  uint32_t it = 0;  // stages issued (producer) or consumed (consumers) so far

  if (producer) {
    wg::setmaxnreg_dec<kProdRegs>();
    const int ptid = threadIdx.x - kCons * 128;
    // kRoundSmem: the stage whose copies were issued last, rounded and published once the next one is issued (or
    // at the end); -1: none.
    int pending = -1;
    auto publish_pending = [&]() {
      if constexpr (kRoundSmem) {
        if (pending < 0) return;
        producer_sync();  // every producer thread's copies of the pending stage have landed (waited before)
        round_patch_tf32(smem + pending * geo.stage_words, geo.patch_words, ptid);
        wg::mbar_arrive(&full[pending]);
        pending = -1;
      }
    };
    for (int tile = blockIdx.x; tile < tiles.total; tile += gridDim.x) {
      Tile d;
      if (!decode(tile, d)) continue;
      const int taps = d.taps_h * d.taps_w;
      const T* x_img = x + (int64_t(d.img) * p.C_in + d.grp * cin_g) * hw_in;
      const uint32_t* wt_grp = wt + d.grp * p.kH * p.kW * ciw_pad * co_pad + 4 * d.n0;
      const FastDiv pairs_div = make_fast_div(d.ph * geo.nvec);
      for (int c = 0; c < d.nchunks; ++c, ++it) {
        const int s = static_cast<int>(it % stages);
        wg::mbar_wait(&empty[s], ((it / stages) & 1) ^ 1);  // the consumers are done with the buffer
        uint32_t* st = smem + s * geo.stage_words;
        copy_patch_vec<T, kKC, kRS, kCS>(reinterpret_cast<T*>(st), x_img + int64_t(c) * kKC * hw_in, x, ptid, 128,
                                         d.ph, geo.nvec, pairs_div, geo.nvec_div, d.hi0, d.wa, h_in, w_in, hw_in,
                                         static_cast<int>(cin_g - int64_t(c) * kKC));
        if (ptid == 0) {
          uint32_t* wsm = st + geo.patch_words;
          wg::mbar_arrive_expect_tx(&full[s], static_cast<uint32_t>(taps * 2 * BN * 16));
          int th = 0, tw = 0;
          for (int t = 0; t < taps; ++t) {
            const int64_t tap = int64_t(d.ah.a0 + th * d.ah.step) * p.kW + d.aw.a0 + tw * d.aw.step;
#pragma unroll
            for (int h = 0; h < 2; ++h)
              wg::bulk_copy(wsm + (t * 2 + h) * BN * 4, wt_grp + ((tap * ciw_pad / 4 + 2 * c + h) * co_pad) * 4,
                            BN * 16, &full[s]);
            if (++tw == d.taps_w) {
              tw = 0;
              ++th;
            }
          }
        }
        if constexpr (kRoundSmem) {
          cp_async_commit();
          if (stages > 2) {
            cp_async_wait<1>();  // this thread's copies of the pending stage have landed
            publish_pending();
            pending = s;
          } else {  // two buffers: the consumers need this stage next, so it goes out now
            cp_async_wait<0>();
            pending = s;
            publish_pending();
          }
        } else {
          wg::cp_async_arrive_noinc(&full[s]);
        }
      }
    }
    if constexpr (kRoundSmem) {
      cp_async_wait<0>();
      publish_pending();
    }
    return;
  }

  // Consumers.
  wg::setmaxnreg_inc<kConsRegs>();
  const int lane = threadIdx.x & 31;
  const int wq = (threadIdx.x >> 5) & 3;  // warp in the warpgroup
  const int g8 = lane >> 2, t4 = lane & 3;
  const int m_warp = wgi * kWgM + wq * 16;  // first pixel of the warp's m16 slice of its first m64 block
  const int a_base = (m_warp / TW) * kRS + m_warp % TW + g8;
  for (int tile = blockIdx.x; tile < tiles.total; tile += gridDim.x) {
    Tile d;
    if (!decode(tile, d)) continue;
    const int taps = d.taps_h * d.taps_w;
    float acc[kMT][kNT][4];
    tc::zero_tile(acc);
    for (int c = 0; c < d.nchunks; ++c, ++it) {
      const int s = static_cast<int>(it % stages);
      wg::mbar_wait(&full[s], (it / stages) & 1);
      const uint32_t* st = smem + s * geo.stage_words;
      const uint64_t desc0 = wg::smem_desc(st + geo.patch_words, BN * 16, 128);
      constexpr uint64_t kTapStep = (2 * BN * 16) >> 4;  // descriptor address units a tap
      int tw = 0;
      int off = (d.taps_h - 1) * d.ah.dstep * kRS + (d.taps_w - 1) * d.aw.dstep + d.shift;  // tap 0's offset
      uint32_t af[kRing][kMT][4];
      for (int t0 = 0; t0 < taps; t0 += kRing) {
#pragma unroll
        for (int b = 0; b < kRing; ++b) {
          const int t = t0 + b;
          if (t < taps) {
            wg::wait<kRing - 1>();  // tap t - kRing is done with af[b]
            if constexpr (sizeof(T) == 4) {
              const uint32_t* pa = st + t4 * kCS + a_base + off;
#pragma unroll
              for (int i = 0; i < kMT; ++i) {
                const int o = i * (64 / TW) * kRS;
                af[b][i][0] = pa[o];
                af[b][i][1] = pa[o + 8];
                af[b][i][2] = pa[4 * kCS + o];
                af[b][i][3] = pa[4 * kCS + o + 8];
              }
              if constexpr (kTF32 && !kRoundSmem) {
#pragma unroll
                for (int i = 0; i < kMT; ++i)
#pragma unroll
                  for (int e = 0; e < 4; ++e) af[b][i][e] = tc::to_tf32(__uint_as_float(af[b][i][e]));
              }
            } else {
              const uint16_t* pa = reinterpret_cast<const uint16_t*>(st) + 2 * t4 * kCS + a_base + off;
#pragma unroll
              for (int i = 0; i < kMT; ++i) {
                const int o = i * (64 / TW) * kRS;
                af[b][i][0] = __byte_perm(pa[o], pa[kCS + o], 0x5410);
                af[b][i][1] = __byte_perm(pa[o + 8], pa[kCS + o + 8], 0x5410);
                af[b][i][2] = __byte_perm(pa[8 * kCS + o], pa[9 * kCS + o], 0x5410);
                af[b][i][3] = __byte_perm(pa[8 * kCS + o + 8], pa[9 * kCS + o + 8], 0x5410);
              }
            }
            if (++tw == d.taps_w) {
              tw = 0;
              off += (d.taps_w - 1) * d.aw.dstep - d.ah.dstep * kRS;
            } else {
              off -= d.aw.dstep;
            }
            wg::fence();
#pragma unroll
            for (int i = 0; i < kMT; ++i) wg::wgmma_rs<BN, K>(&acc[i][0][0], af[b][i], desc0 + t * kTapStep);
            wg::commit();
          }
        }
      }
      wg::wait<0>();
      wg::mbar_arrive(&empty[s]);
    }
    wg::pin<kMT * kNT * 4>(&acc[0][0][0]);

    // Epilogue: accumulator (i, j, e) is pixel m_warp + 64 i + g8 (+ 8 for e >= 2), channel 8 j + 2 t4 (+ 1 for
    // odd e).
    T* y_blk = y + (int64_t(d.img) * p.C_out + d.grp * cout_g + d.n0) * hw_out;
    const int nc_max = static_cast<int>(cout_g - d.n0 < BN ? cout_g - d.n0 : BN);
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int m = m_warp + i * 64 + g8 + 8 * r;
        const int qh = d.qh0 + m / TW, qw = d.qw0 + m % TW;
        if (qh >= d.ah.count || qw >= d.aw.count) continue;
        T* y_pix = y_blk + (d.ah.o0 + int64_t(qh) * p.stride_h) * p.W_out + d.aw.o0 + int64_t(qw) * p.stride_w;
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int nc = j * 8 + 2 * t4 + e;
            if (nc >= nc_max) continue;
            float v = acc[i][j][2 * r + e];
            if (bias != nullptr) v += to_acc(bias[d.grp * cout_g + d.n0 + nc]);
            y_pix[nc * hw_out] = from_acc<T>(v);
          }
      }
  }
}

template <typename T, tc::MmaKind K, int TH, int TW, int BN, int kCons>
cudaError_t launch_shape(const ConvTranspose2dParams& p, const HaloPlan& pl, const uint32_t* wt, int64_t ciw_pad,
                         int64_t co_pad, cudaStream_t stream) {
  auto kernel = conv_transpose2d_ws_kernel<T, K, TH, TW, BN, kCons>;
  const cudaError_t err = opt_in_shared_memory<conv_transpose2d_ws_kernel<T, K, TH, TW, BN, kCons>>();
  if (err != cudaSuccess) return err;
  WsTiles tl{};
  for (int64_t r = 0; r < p.stride_h; ++r) tl.ah[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) tl.aw[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  const int64_t n_tiles = co_pad / BN;
  const int64_t spatial = p.N * pl.geo.tiles_h * pl.geo.tiles_w;
  tl.phases = make_fast_div(static_cast<uint32_t>(p.stride_h * p.stride_w));
  tl.n_tiles = make_fast_div(static_cast<uint32_t>(n_tiles));
  tl.tiles_img = make_fast_div(static_cast<uint32_t>(pl.geo.tiles_h * pl.geo.tiles_w));
  tl.tiles_w = make_fast_div(static_cast<uint32_t>(pl.geo.tiles_w));
  tl.groups = make_fast_div(static_cast<uint32_t>(p.groups));
  tl.stride_w = make_fast_div(static_cast<uint32_t>(p.stride_w));
  tl.total = static_cast<int>(p.stride_h * p.stride_w * p.groups * n_tiles * spatial);  // < 2^31: halo_effective
  const int sms = sm_count() > 0 ? sm_count() : 1;
  const int grid = tl.total < sms ? tl.total : sms;
  kernel<<<grid, (kCons + 1) * 128, pl.smem, stream>>>(p, wt, ciw_pad, co_pad, pl.geo, tl);
  return cudaGetLastError();
}

template <typename T, tc::MmaKind K>
cudaError_t launch_kind(const ConvTranspose2dParams& p, int config, const HaloPlan& pl, const uint32_t* wt,
                        int64_t ciw_pad, int64_t co_pad, cudaStream_t stream) {
  switch (config) {
    case 5:
      return launch_shape<T, K, 8, 32, 64, 2>(p, pl, wt, ciw_pad, co_pad, stream);
    case 6:
      return launch_shape<T, K, 8, 32, 128, 2>(p, pl, wt, ciw_pad, co_pad, stream);
    case 7:
      return launch_shape<T, K, 16, 32, 32, 2>(p, pl, wt, ciw_pad, co_pad, stream);
    case 8:
      return launch_shape<T, K, 16, 32, 64, 4>(p, pl, wt, ciw_pad, co_pad, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_halo_ws(const ConvTranspose2dParams& p, int config, const HaloPlan& pl, const uint32_t* wt,
                           int64_t ciw_pad, int64_t co_pad, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32:
      return p.precision == Precision::kTF32
                 ? launch_kind<float, tc::MmaKind::kTF32>(p, config, pl, wt, ciw_pad, co_pad, stream)
                 : cudaErrorInvalidValue;  // exact fp32 runs the fallback tile (halo_effective)
    case DType::kFloat16:
      return launch_kind<__half, tc::MmaKind::kFP16>(p, config, pl, wt, ciw_pad, co_pad, stream);
    case DType::kBFloat16:
      return launch_kind<__nv_bfloat16, tc::MmaKind::kBF16>(p, config, pl, wt, ciw_pad, co_pad, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
