// ConvTranspose2d forward as a channel-major implicit GEMM on Hopper tensor cores (sm_90a wgmma; TF32, BF16, FP16,
// and exact fp32 as 3xTF32), for the channel-heavy layers of real decoders: many channels, few pixels
// (docs/architecture.md, "Kernels").
//
// Per stride phase (conv_transpose2d.cu) and group the problem is a GEMM with
//   M = N * rows_in_phase * cols_in_phase (output positions), N = C_out / groups, K = taps * C_in / groups,
// A[m, (tap, ci)] = x[n, hi, wi, ci] read from a channels-last (NHWC) input, so that every row of an A stage is a
// contiguous run of channels whatever the image size, and B[(tap, ci), co] = w[ci, co, a, b] packed once into
// [group][a][b][co][ci] (ci padded to a whole stage, TF32-rounded for TF32) -- or, for 16-bit weights already
// channels-last ([ci][a][b][co] in memory, what model.to(memory_format=torch.channels_last) makes), read as they are:
// wgmma takes that B N-major (transposed), so no packing pass runs. Unlike the halo tiles, which cover a
// 2-D window of one image's pixels, an M tile is a box of the phase's positions across images (GemmTiles): a 4 x 4
// input fills it as well as a 64 x 64.
//
// A block of 384 threads computes 128 x BN tiles, persistent over them: warpgroup 0 loads, warpgroups 1 and 2 each
// hold an m64 x BN wgmma accumulator in registers and read both operands from shared memory by descriptor. A stage
// is 128 bytes of K (32 fp32 or 64 16-bit channels of one tap) for the 128 A rows and the BN B rows, in wgmma's
// 128-byte swizzle, brought by two bulk tensor copies (TMA) that one loader thread issues: the input box of the
// stage's tap at its shifted origin (zero-filled past every border, which does the padding, the halo and the
// channel tail) and a box of packed weights; for 16-bit groups of at most 32 input channels (blocks alone) a stage is
// two taps of 64 bytes each in 64-byte swizzle (two boxes of each), not one tap padded with zeros. A ring of kStages
// buffers with full / empty mbarriers lets the loader run up to kStages stages ahead, across tile boundaries. TF32 A
// must be rounded to nearest (wgmma would truncate), unless x came rounded (an NCHW x is rounded by the layout change
// it needs anyway): the multipliers load their A fragments from the landed stage, round them in registers and
// multiply from registers; at BN = 256 three loader warps round each landed A box in place before the multipliers
// may read it (a third barrier, ready).
//
// Pairs (configurations 9-12): blocks run in thread-block clusters of two, on tiles of neighbouring M boxes with the
// same output channels; each block's loader brings half of every B stage, multicast into both blocks' buffers, and a
// buffer goes back to the loaders once the multipliers of both blocks are done with it.
//
// Split-K (few tiles for the SMs): blocks of a tile each reduce a contiguous part of K. Where the configuration
// allows it (gemm_cluster_k) and the device runs enough such clusters at once for at most two tiles each, the tile's
// blocks run as one thread-block cluster and the first adds the others' sums, read from their shared memory, to its
// accumulators (kClusterK); otherwise each writes its sums into an fp32 workspace, summed by a second kernel that
// adds the bias and writes the output. The epilogue adds the bias and stores straight from the accumulators (exact
// fp32 NCHW outputs at stride 1: through shared memory by bulk tensor copies, kTmaY). The output is written through
// its strides: NCHW or NHWC.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "gemm.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "phase.cuh"
#include "wgmma.cuh"
#include "wgmma_ss.cuh"

namespace deconv {
namespace {

constexpr int kGemmThreads = 384;  // a loader warpgroup and two multiplier warpgroups

constexpr size_t gemm_smem_bytes(const GemmShape& s, bool exact, bool tma_y = false) {
  // Stages (exact fp32: B twice, gemm_exact_stages of them), their three barriers, the two turn barriers, the two
  // barriers of split-K in a cluster, alignment slack; with bulk-stored NCHW output, the two warpgroups' chunks.
  return static_cast<size_t>(exact ? gemm_exact_stages(s, tma_y) : s.stages) *
             ((s.bm + (exact ? 2 : 1) * s.bn) * kGemmRowBytes + 24) +
         32 + 1024 + (tma_y ? kGemmYOffset + 2 * kGemmYChunk : 0);
}

// ---------------------------------------------------------------------------------------------------------
// The GEMM kernel.

// Persistent and warp-specialized: warpgroup 0 loads, warpgroups 1 and 2 multiply: together, each the tile's first or
// second BM / 2 rows as BM / 128 wgmma blocks of 64 rows, or with kPing by turns, each a whole tile of BM / 64
// blocks, so that one stores its tile's output while the other multiplies the next (layers whose K is a few stages
// spend much of their time in the epilogue). One loader thread issues a stage's two bulk tensor copies (the A box
// of the stage's tap and channels, the B rows of its packed weights) once the multipliers have released the buffer;
// TF32 A not rounded on its way in is rounded by the multipliers in their registers (kRegA), or at BN = 256 by warps
// 1-3 of the loader in place before the multipliers may read it. The loader runs through the same tiles as the
// multipliers, up to kStages stages ahead across tile boundaries, so the next tile's first stages land while the
// multipliers store the last one's output. kTransB: B is the channels-last weights as they are, brought as BN / 64
// boxes of 64 output channels x the stage's input channels (N-major).
// K = k3xTF32 (exact fp32): a stage also brings the weights' residual rows (the packed plane after the TF32 parts), the
// multipliers split each A fragment they load into its TF32 part and the TF32 rounding of its residual in registers
// (kRegA), and run A_lo x B_hi + A_hi x B_lo + A_hi x B_hi for each stage into zeroed partial sums that they add to
// their accumulators in fp32: the tensor cores truncate as they accumulate, and a sum over one stage keeps that error
// from growing with K (bench/NOTES.md v7, v30, v37). A is read from shared memory once a stage, as in TF32.
// kPaired: a block of a pair (a cluster of two, gemm_work); kTwo: two taps a stage. Both are template parameters so
// that the kernels without them compile as they did before them: as runtime flags, ptxas placed more wgmma waits in
// the multipliers' loop (16 against 6 in the TF32 kernels' code) and TF32 rows ran 10-17% slower (bench/NOTES.md
// v34).
// kClusterK: split-K in a cluster of tl.splits blocks, block r the tile's split r. Once its products are done, a
// block r > 0 writes its accumulators into its own stage buffers (the loader brings the next tile's stages only once
// they have been read), each thread its registers as float4s at thread-major places, and arrives on the first
// block's `red_full`; the first block's threads wait for it, add the same places of each other block (distributed
// shared memory) to their own accumulators in the blocks' order, arrive on each other block's `red_done` and run the
// epilogue. Each barrier completes once a tile, and a block r > 0 leaves only once its sums have been read.
// kTmaY (exact fp32, an NCHW output whose boxes split into whole chunks of 64 rows: gemm_tma_y): the epilogue writes
// each 64-row block's values, 64 output channels at a time, into its warpgroup's chunk of shared memory in the layout
// of a box of map_y (the output as [N][C_out][H_out][W_out]), and one thread stores the box by a bulk tensor copy,
// which runs on while the warpgroup multiplies the next tile. The scattered NCHW stores of 4-16 positions a channel
// cost the epilogue 344 us more than channels-last ones on KernelBench 69 (bench/NOTES.md v37).
template <typename T, tc::MmaKind K, int BM, int BN, int kStages, bool kPing, bool kTransB, bool kPaired, bool kTwo,
          bool kClusterK, bool kTmaY>
__global__ void __launch_bounds__(kGemmThreads, 1)
    conv_transpose2d_gemm_kernel(const GemmArgs g, const __grid_constant__ GemmTiles tl,
                                 const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                                 const __grid_constant__ CUtensorMap map_y) {
  constexpr bool kExact = K == tc::MmaKind::k3xTF32;
  constexpr tc::MmaKind KM = kExact ? tc::MmaKind::kTF32 : K;  // the wgmma instructions' kind
  constexpr int kParts = kExact ? 2 : 1;                       // exact fp32: TF32 parts and residuals
  constexpr int kCH = kGemmRowBytes / sizeof(T);  // channels a stage
  constexpr int kAStage = BM * kGemmRowBytes;  // A, then B (exact: its TF32 parts, then its residuals)
  constexpr int kStage = (BM + kParts * BN) * kGemmRowBytes;
  constexpr int kMW = kPing ? BM / 64 : BM / 128;  // 64-row wgmma blocks a multiplier warpgroup
  static_assert(kMW * BN / 2 * kParts <= 128, "accumulators (and partial sums): at most 128 registers a thread");
  constexpr int kKSteps = kGemmRowBytes / 32;  // wgmma k-steps a stage (k8 TF32 or k16 16-bit: 32 bytes)
  constexpr bool kTF32 = KM == tc::MmaKind::kTF32;
  // TF32: A rounded (exact fp32: split) in the multipliers' registers (unless x came rounded); at BN = 256 the
  // accumulators leave too few registers for fragments in flight (ptxas serializes the wgmma), and the loader warps
  // round in shared memory. Every exact configuration has BN <= 128 (its accumulators and partials fit 128 registers).
  constexpr bool kRegA = kTF32 && BN <= 128;
  static_assert(!kExact || kRegA, "exact fp32 splits A in registers");
  static_assert(!(kTF32 && kTransB), "TF32 wgmma reads K-major operands only");
  // kTwo (16-bit groups of at most 32 input channels): a stage holds two taps, each 64 bytes of K a row in 64-byte
  // swizzle (A: the first tap's BM rows, then the second's; B likewise), and a phase's last stage the one tap left
  // when its taps are odd.
  static_assert(!kTwo || (!kTF32 && !kTransB && !kPaired), "two taps a stage: 16-bit K-major weights, blocks alone");
  static_assert(!kClusterK || (!kPing && !kPaired && !kTwo && !kExact), "split-K in a cluster: gemm_cluster_k");
  static_assert(!kClusterK || BM * BN * 4 <= kStages * kStage, "a tile's fp32 sums fit in the stage buffers");
  static_assert(!kTmaY || (kExact && !kPaired && !kClusterK && BN % 64 == 0), "bulk-stored NCHW output: gemm_tma_y");
  static_assert(!kTmaY || (3 * kStages + 4) * 8 <= kGemmYOffset, "the stages' barriers end before the chunks");
  constexpr bool kCluster = kPaired || kClusterK;
  constexpr int kBChunk = 64 * kGemmRowBytes;  // an N-major B box: 64 input channels x 64 output channels
  static_assert(kGemmThreads == kWsThreads, "the register budgets of wgmma_ss.cuh");
  constexpr int kProdRegs = kWsLoaderRegs;
  constexpr int kConsRegs = kWsMultiplierRegs;

  extern __shared__ uint8_t gemm_smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(gemm_smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const smem = gemm_smem_raw + (base - raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStage);  // the copies landed
  uint64_t* ready = full + kStages;                                       // TF32: the A box rounded
  uint64_t* empty = ready + kStages;                                      // the multipliers are done with it
  uint64_t* turns = empty + kStages;  // kPing: warpgroup w has issued the products of its latest tile
  // kClusterK: the other blocks' sums of the tile are in their shared memory (the first block's), the first block has
  // read this block's (the others').
  uint64_t* red_full = turns + 2;
  uint64_t* red_done = turns + 3;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      wg::mbar_init(&full[s], 1);     // the issuing thread's expect_tx
      wg::mbar_init(&ready[s], 96);   // every rounding thread
      // Every multiplier thread reading the stage, once done; in a pair, one arrival a warp of both blocks.
      wg::mbar_init(&empty[s], kPaired ? 2 * (kPing ? 4 : 8) : (kPing ? 128 : 256));
    }
    wg::mbar_init(&turns[0], 128);
    wg::mbar_init(&turns[1], 128);
    if constexpr (kClusterK) {
      wg::mbar_init(red_full, (static_cast<int>(tl.splits.d) - 1) * 256);  // every multiplier thread of the others
      wg::mbar_init(red_done, 256);                                        // every multiplier thread of the first
    }
#if DECONV_WGMMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine and the pair
#endif
  }
  // A cluster: no block's copies nor arrivals reach another's barriers before they are initialized.
  if constexpr (kCluster) wg::cluster_sync_all();
  else __syncthreads();
  const int rank = kCluster ? static_cast<int>(wg::cluster_rank()) : 0;
  int first = kPaired ? static_cast<int>(blockIdx.x >> 1) : static_cast<int>(blockIdx.x);
  int step = kPaired ? static_cast<int>(gridDim.x >> 1) : static_cast<int>(gridDim.x);
  int items = kPaired ? tl.pairs : tl.total;
  if constexpr (kClusterK) {
    first = fdiv(first, tl.splits);
    step = fdiv(step, tl.splits);
    items = fdiv(items, tl.splits);
  }

  const int cpt = g.ci_pad / kCH;  // stages a tap
  const int wgi = threadIdx.x >> 7;
  const int rows = static_cast<int>(tl.bw.d * tl.bh.d) * tl.bni;  // A rows a box fills
  const uint32_t stage_bytes = static_cast<uint32_t>((rows + kParts * BN) * kGemmRowBytes);
  const uint32_t a_bytes = static_cast<uint32_t>(rows * kGemmRowBytes);
  uint32_t it = 0;  // stages loaded (loader) or consumed (multipliers) so far

  if (wgi == 0) {
    wg::setmaxnreg_dec<kProdRegs>();
    const int warp = threadIdx.x >> 5;
    if (warp == 0) {
      if (threadIdx.x != 0) return;
      // The issuing thread.
      [[maybe_unused]] uint32_t tiles = 0;  // kClusterK: the block's tiles so far
      for (int w = first; w < items; w += step) {
        GemmTile d;
        bool own;
        if (!gemm_work<kPaired, kTwo, kClusterK>(w, tl, g.n, BN, cpt, rank, d, own)) continue;
        if constexpr (kClusterK) {
          // The stage buffers held the sums of the tile before until the first block read them: its reads and this
          // block's multipliers' stores come before the copies that overwrite them.
          if (rank > 0 && tiles > 0) {
            wg::mbar_wait<true>(red_done, (tiles - 1) & 1);
            fence_async_smem();
          }
          ++tiles;
        }
        if constexpr (kTwo) {
          const int taps = d.ah.taps * d.aw.taps;
          for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
            const int s = static_cast<int>(it % kStages);
            const int nt = min(2, taps - 2 * k);  // taps this stage
            wg::mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
            wg::mbar_arrive_expect_tx(&full[s], nt * (a_bytes / 2 + BN * kGemmRowBytes / 2));
            const uint32_t st = base + s * kStage;
            for (int h = 0; h < nt; ++h) {
              const int th = (2 * k + h) / d.aw.taps, tw = 2 * k + h - th * d.aw.taps;
              tma_load_5d(st + h * BM * (kGemmRowBytes / 2), &map_x, 0, d.grp, d.qw0 + d.aw.base - tw * d.aw.dstep,
                          d.qh0 + d.ah.base - th * d.ah.dstep, d.n0, &full[s]);
              const int tap = (d.ah.a0 + th * d.ah.step) * g.kw + d.aw.a0 + tw * d.aw.step;
              tma_load_3d(st + kAStage + h * BN * (kGemmRowBytes / 2), &map_w, 0, d.c0, d.grp * g.kh * g.kw + tap,
                          &full[s]);
            }
          }
          continue;
        }
        const int tap0 = d.k_begin / cpt;
        int cc = d.k_begin - tap0 * cpt;
        // N-major B: only the chunks that hold output channels are brought (a box wholly past C_out / groups
        // costs the copy engine as much as a full one); the columns of the others are never stored.
        const int b_chunks = min(BN / 64, (g.cout_g - d.c0 + 63) / 64);
        // In a pair the other block's half of B lands here too (before this block's arrival, possibly: the count of
        // bytes still to come may go below zero for a while), and a block whose box lies past the phase loads no A.
        const uint32_t bytes =
            kPaired ? (own ? a_bytes : 0) + (kTransB ? b_chunks * kBChunk : kParts * BN * kGemmRowBytes)
                    : (kTransB ? a_bytes + b_chunks * kBChunk : stage_bytes);
        int th = tap0 / d.aw.taps;
        int tw = tap0 - th * d.aw.taps;
        for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
          const int s = static_cast<int>(it % kStages);
          wg::mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          wg::mbar_arrive_expect_tx(&full[s], bytes);
          const uint32_t st = base + s * kStage;
          if (!kPaired || own)
            tma_load_5d(st, &map_x, cc * kCH, d.grp, d.qw0 + d.aw.base - tw * d.aw.dstep,
                        d.qh0 + d.ah.base - th * d.ah.dstep, d.n0, &full[s]);
          const int tap = (d.ah.a0 + th * d.ah.step) * g.kw + d.aw.a0 + tw * d.aw.step;
          if constexpr (kPaired) {
            // This block's half of the stage's B, into both blocks: N-major, the upper or lower half of each
            // chunk's input channels; K-major, the first or second BN / 2 output channels (and residuals).
            if constexpr (kTransB) {
#pragma unroll
              for (int j = 0; j < BN / 64; ++j)
                if (j < b_chunks)
                  tma_load_3d_multicast(st + kAStage + j * kBChunk + rank * (kBChunk / 2), &map_w, d.c0 + 64 * j, tap,
                                        d.grp * g.cin_g + cc * kCH + rank * (kCH / 2), &full[s], 3);
            } else {
              const uint32_t half = rank * (BN / 2) * kGemmRowBytes;
              tma_load_3d_multicast(st + kAStage + half, &map_w, cc * kCH, d.c0 + rank * (BN / 2),
                                    d.grp * g.kh * g.kw + tap, &full[s], 3);
              if constexpr (kExact)
                tma_load_3d_multicast(st + kAStage + BN * kGemmRowBytes + half, &map_w, cc * kCH,
                                      d.c0 + rank * (BN / 2),
                                      (static_cast<int>(tl.groups.d) + d.grp) * g.kh * g.kw + tap, &full[s], 3);
            }
          } else if constexpr (kTransB) {
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)
              if (j < b_chunks)
                tma_load_3d(st + kAStage + j * kBChunk, &map_w, d.c0 + 64 * j, tap, d.grp * g.cin_g + cc * kCH,
                          &full[s]);
          } else {
            tma_load_3d(st + kAStage, &map_w, cc * kCH, d.c0, d.grp * g.kh * g.kw + tap, &full[s]);
            if constexpr (kExact)  // the residuals' plane: groups x taps rows further
              tma_load_3d(st + kAStage + BN * kGemmRowBytes, &map_w, cc * kCH, d.c0,
                          (static_cast<int>(tl.groups.d) + d.grp) * g.kh * g.kw + tap, &full[s]);
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
      // A pair: the other block's multipliers arrive on this block's barriers until they are done with the last
      // stages; this block (its shared memory) stays until then.
      if constexpr (kPaired)
        for (int j = 0; j < kStages; ++j, ++it) wg::mbar_wait(&empty[it % kStages], ((it / kStages) & 1) ^ 1);
      return;
    }
    if constexpr (kTF32 && !kRegA) {
      // Warps 1-3: round each landed A box to TF32 (nearest), as the weights were when packed; wgmma would truncate.
      // Not for an x rounded on its way in: the multipliers then wait for the copies alone. (Other TF32 tiles: the
      // multipliers round A in their registers, kRegA.)
      if (tl.a_rounded) return;
      const int rt = threadIdx.x - 32;
      for (int w = first; w < items; w += step) {
        GemmTile d;
        bool own;
        if (!gemm_work<kPaired, kTwo, kClusterK>(w, tl, g.n, BN, cpt, rank, d, own)) continue;
        for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
          const int s = static_cast<int>(it % kStages);
          wg::mbar_wait(&full[s], (it / kStages) & 1);
          tc::round_tf32_inplace(smem + s * kStage, rows * kGemmRowBytes / 4, rt, 96);
          fence_async_smem();
          wg::mbar_arrive(&ready[s]);
        }
      }
    }
    return;
  }

  // Multipliers.
  wg::setmaxnreg_inc<kConsRegs>();
  const int mw = wgi - 1;  // rows mw BM / 2 .. (mw + 1) BM / 2 - 1 of the tile, or with kPing the tiles of its turn
  const int row0 = kPing ? 0 : mw * (BM / 2);
  const int lane = threadIdx.x & 31;
  const int wq = (threadIdx.x >> 5) & 3;
  uint64_t* const landed = kTF32 && !kRegA && !tl.a_rounded ? ready : full;
  // TF32 with an x not rounded on its way in: each thread loads its A fragments from the landed stage, rounds them
  // to TF32 (nearest, as the weights were when packed; wgmma would truncate) and multiplies from registers. A stage's
  // bytes are read once either way, and no pass rounds them in shared memory first. Exact fp32 (never a rounded x):
  // each fragment is split into its TF32 part and the TF32 rounding of its residual, both multiplied from registers.
  const bool reg_a = kRegA && (kExact || !tl.a_rounded);
  // Channels-last output whose channel pairs (even co) start at even elements: pairs go out as one store.
  const bool pair_stores = g.ys_c == 1 && g.c_out % 2 == 0 && g.cout_g % 2 == 0;
  // 16-bit channels-last output in whole multiples of 4 channels, 8-byte aligned: quads of lanes store four channels
  // a lane (gemm_store_quad). Not for split-K partials (fp32 pairs already fill their sectors).
  const bool quad_stores = sizeof(T) == 2 && g.partial == nullptr && pair_stores && g.cout_g % 4 == 0 &&
                           g.ys_w % 4 == 0 && g.ys_h % 4 == 0 && g.ys_n % 4 == 0 &&
                           (reinterpret_cast<uintptr_t>(g.y) & 7) == 0;
  // A stage's buffer goes back to the loader: every thread arrives, or in a pair one lane a warp on this block's
  // barrier and one on the other block's (whose loader multicasts into this buffer too).
  // (The warp is converged after wgmma's wait, an aligned instruction.)
  const uint32_t peer_empty = kPaired ? wg::cluster_peer_addr(empty, rank ^ 1) : 0;
  const auto release = [&](int s) {
    if constexpr (kPaired) {
      wg::mbar_arrive_if(&empty[s], lane == 0);
      wg::mbar_arrive_cluster_if(peer_empty + 8 * s, lane == 1);
    } else {
      wg::mbar_arrive(&empty[s]);
    }
  };
  // kPing: the block's tiles alternate between the warpgroups, and each starts a tile's products only once the other
  // has issued those of the tile before (CUTLASS's ping-pong order): its epilogue then runs under the other's
  // products, and it never waits on a stage more than one pass of the ring ahead of the loader (a barrier's parity
  // tells only one pass from the next).
  int turn = 0, mine = 0;  // the block's tiles so far, this warpgroup's
  [[maybe_unused]] uint32_t sums = 0;  // kClusterK: the tiles whose sums were handed over so far
  for (int w = first; w < items; w += step) {
    GemmTile d;
    bool own;
    if (!gemm_work<kPaired, kTwo, kClusterK>(w, tl, g.n, BN, cpt, rank, d, own)) continue;
    if constexpr (kPing) {
      if ((turn++ & 1) != mw) {
        it += d.k_end - d.k_begin;  // the other warpgroup's stages
        continue;
      }
      if (mw == 1) wg::mbar_wait(&turns[0], mine & 1);  // warpgroup 0's tile before this one
      else if (mine > 0) wg::mbar_wait(&turns[1], (mine - 1) & 1);
    }
    float acc[kMW][BN / 2];
#pragma unroll
    for (int b = 0; b < kMW; ++b)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[b][i] = 0.f;
    [[maybe_unused]] float part[kExact ? kMW : 1][kExact ? BN / 2 : 1];  // exact fp32: one stage's sums
    int prev = -1;  // the stage whose wgmma may still run
    if constexpr (kRegA) {
      if (reg_a) {
        // A step is one k8 of a stage: each warp's fragments of its 16 rows (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
        // a3 (g + 8, t + 4)) by one ldmatrix a 64-row block from the swizzled rows, rounded, then one wgmma a block
        // from registers. The fragments of kRing steps are held: a step's loads run while the steps before
        // multiply, and a slot is written again only once the wgmma that read it are done (wait<kRing - 1> after
        // each step; narrow tiles, whose wgmma are short, keep more steps in flight). A stage goes back to the
        // loader once its last step is done.
        // Exact fp32: a fragment's TF32 parts (af) and residuals (al), three wgmma a block a step (the small
        // products first) into the stage's partial sums, which go into the accumulators once the stage is done.
        constexpr int kRing = kMW * BN / 2 <= 64 && !kExact ? 4 : 2;
        static_assert(kKSteps % kRing == 0, "a slot is the same step of every stage");
        uint32_t af[kRing][kMW][4];
        [[maybe_unused]] uint32_t al[kExact ? kRing : 1][kMW][4];
        const int lrow = row0 + wq * 16 + (lane & 15), lchunk = lane >> 4;  // this lane's ldmatrix row and chunk
        for (int k = d.k_begin; k < d.k_end; ++k, ++it) {
          const int s = static_cast<int>(it % kStages);
          wg::mbar_wait(&full[s], (it / kStages) & 1);
          const uint32_t a_st = base + s * kStage;
          const uint32_t b_addr = a_st + kAStage;
          if constexpr (kExact) {
#pragma unroll
            for (int b = 0; b < kMW; ++b)
#pragma unroll
              for (int i = 0; i < BN / 2; ++i) part[b][i] = 0.f;
          }
#pragma unroll
          for (int kk = 0; kk < kKSteps; ++kk) {
            const int r = kk % kRing;
#pragma unroll
            for (int b = 0; b < kMW; ++b) {
              ldmatrix_x4(af[r][b], a_st + swizzled(lrow + b * 64, 2 * kk + lchunk));
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float v = __uint_as_float(af[r][b][e]);
                af[r][b][e] = tc::to_tf32(v);
                if constexpr (kExact) al[r][b][e] = tc::tf32_residual(v, af[r][b][e]);
              }
            }
            wg::fence();
#pragma unroll
            for (int b = 0; b < kMW; ++b) {
              if constexpr (kExact) {
                const uint64_t b_hi = sw128_desc(b_addr + 32 * kk);
                const uint64_t b_lo = sw128_desc(b_addr + BN * kGemmRowBytes + 32 * kk);
                wg::wgmma_rs<BN, KM>(part[b], al[r][b], b_hi);
                wg::wgmma_rs<BN, KM>(part[b], af[r][b], b_lo);
                wg::wgmma_rs<BN, KM>(part[b], af[r][b], b_hi);
              } else {
                wg::wgmma_rs<BN, KM>(acc[b], af[r][b], sw128_desc(b_addr + 32 * kk));
              }
            }
            wg::commit();
            wg::wait<kRing - 1>();  // the step kRing - 1 back is done: its slot is the next one written
            wg::pin<kMW * 4>(&af[(kk + 1) % kRing][0][0]);
            if constexpr (kExact) wg::pin<kMW * 4>(&al[(kk + 1) % kRing][0][0]);
            if (!kExact && kk == kRing - 2 && prev >= 0) {  // the last step of the stage before is done
              release(prev);
              prev = -1;
            }
          }
          if constexpr (kExact) {  // the stage's sums, once done (the buffer goes back to the loader)
            wg::wait<0>();
            release(s);
#pragma unroll
            for (int b = 0; b < kMW; ++b) {
              wg::pin<BN / 2>(part[b]);
#pragma unroll
              for (int i = 0; i < BN / 2; ++i) acc[b][i] += part[b][i];
            }
            continue;
          }
          prev = s;
        }
      }
    }
    for (int k = d.k_begin; k < d.k_end && !reg_a; ++k, ++it) {
      const int s = static_cast<int>(it % kStages);
      wg::mbar_wait(&landed[s], (it / kStages) & 1);
      const uint32_t a_addr = base + s * kStage + row0 * (kTwo ? kGemmRowBytes / 2 : kGemmRowBytes);
      const uint32_t b_addr = base + s * kStage + kAStage;
      // Two taps a stage: k-steps 0-1 are the first tap's, 2-3 the second's (none past the phase's last tap).
      [[maybe_unused]] const bool second = kTwo && 2 * k + 1 < d.ah.taps * d.aw.taps;
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
        for (int b = 0; b < kMW; ++b) {
          const uint32_t ab = a_addr + b * 64 * kGemmRowBytes + 32 * kk;
          if constexpr (kTransB) {  // k16 steps are 16 rows of 128 bytes down each B chunk
            wgmma_ss<BN, KM, true>(acc[b], sw128_desc(ab), sw128_desc_nmajor(b_addr + 2048 * kk));
          } else if constexpr (kTwo) {
            constexpr int kHalf = kGemmRowBytes / 2;
            if (kk < kKSteps / 2 || second)
              wgmma_ss<BN, KM, false>(acc[b],
                                      sw64_desc(a_addr + (kk >> 1) * BM * kHalf + b * 64 * kHalf + 32 * (kk & 1)),
                                      sw64_desc(b_addr + (kk >> 1) * BN * kHalf + 32 * (kk & 1)));
          } else {
            wgmma_ss<BN, KM, false>(acc[b], sw128_desc(ab), sw128_desc(b_addr + 32 * kk));
          }
        }
      }
      wg::commit();
      wg::wait<1>();  // the previous stage's wgmma are done: its buffer goes back to the loader
      if (prev >= 0) release(prev);
      prev = s;
    }
    if constexpr (kPing) {
      wg::mbar_arrive(&turns[mw]);
      ++mine;
    }
    wg::wait<0>();
    if (prev >= 0) release(prev);
#pragma unroll
    for (int b = 0; b < kMW; ++b) wg::pin<BN / 2>(acc[b]);
    if constexpr (kPaired)
      if (!own) continue;  // a pair's block whose box lies past the phase or the batch
    if constexpr (kClusterK) {
      // This warpgroup's sums as float4s, float4 q of thread t at q * 128 + t: the same thread of every block holds
      // the same rows and columns, and a warp's 16-byte accesses are contiguous.
      constexpr int kQuads = kMW * BN / 8;
      const uint32_t red = base + static_cast<uint32_t>(mw * kQuads * 128 * 16 + (threadIdx.x & 127) * 16);
      if (rank > 0) {
        // Both warpgroups' products are done (each waited for its own) before either overwrites a stage buffer.
        wg::bar_sync(1, 256);
        float4* mine_red = reinterpret_cast<float4*>(smem + (red - base));
#pragma unroll
        for (int b = 0; b < kMW; ++b)
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
            mine_red[(b * (BN / 8) + j) * 128] =
                make_float4(acc[b][4 * j], acc[b][4 * j + 1], acc[b][4 * j + 2], acc[b][4 * j + 3]);
        fence_async_smem();  // before the copies that will overwrite them, once read
        wg::mbar_arrive_cluster_release(wg::cluster_peer_addr(red_full, 0));
        wg::mbar_wait<true>(red_done, sums++ & 1);
        continue;
      }
      wg::mbar_wait<true>(red_full, sums++ & 1);
      // Eight loads in flight before their sums: one at a time, each would wait out the remote latency.
      static_assert(kQuads % 8 == 0, "whole batches of eight float4s");
      for (int r = 1; r < static_cast<int>(tl.splits.d); ++r) {
        const uint32_t peer = wg::cluster_peer_addr(smem + (red - base), r);
#pragma unroll
        for (int c = 0; c < kQuads; c += 8) {
          float4 v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = wg::ld_cluster_f4(peer + (c + e) * 128 * 16);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float* a = &acc[(c + e) / (BN / 8)][4 * ((c + e) % (BN / 8))];
            a[0] += v[e].x;
            a[1] += v[e].y;
            a[2] += v[e].z;
            a[3] += v[e].w;
          }
        }
      }
      for (int r = 1; r < static_cast<int>(tl.splits.d); ++r)
        wg::mbar_arrive_cluster_release(wg::cluster_peer_addr(red_done, r));
    }

    if constexpr (kTmaY) {
      // A chunk is [image][channel][position] of the box: wh positions an image (the box's bw x bh, at most 64), 64
      // channels, 64 / wh images; row r of the block is position r % wh of image r / wh.
      const uint32_t chunk_off = kStages * kStage + kGemmYOffset + mw * kGemmYChunk;
      float* const chunk = reinterpret_cast<float*>(smem + chunk_off);
      const int wh = min(static_cast<int>(tl.bw.d * tl.bh.d), 64);
      const int wh_shift = __ffs(wh) - 1;
      const float* __restrict__ bias = static_cast<const float*>(g.bias);
      const bool leader = (threadIdx.x & 127) == 0;
#pragma unroll
      for (int b = 0; b < kMW; ++b)
#pragma unroll
        for (int h = 0; h < BN / 64; ++h) {
          if (leader) bulk_wait<true>();  // the chunk's previous box has been read
          wg::bar_sync(2 + mw, 128);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = wq * 16 + (lane >> 2) + 8 * half;
            float* const at = chunk + (r >> wh_shift) * 64 * wh + (r & (wh - 1));
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int col = 8 * j + 2 * (lane & 3) + e;
                const int co = d.c0 + 64 * h + col;
                float v = acc[b][4 * (8 * h + j) + 2 * half + e];
                if (bias != nullptr && co < g.cout_g) v += bias[co];
                at[col * wh] = v;
              }
          }
          fence_async_smem();  // the chunk's values, visible to the copy engine
          wg::bar_sync(2 + mw, 128);
          if (leader) {
            int nb, qh, qw;
            gemm_box_pos(tl, row0 + b * 64, nb, qh, qw);
            tma_store_4d(&map_y, base + chunk_off, d.aw.o0 + d.qw0 + qw, d.ah.o0 + d.qh0 + qh, d.c0 + 64 * h,
                         d.n0 + nb);
            bulk_commit();
          }
        }
    } else {
      // Epilogue. Accumulator 4j + e of block b: row b * 64 + (warp's 16) + lane / 4 (+ 8 for e >= 2), column
      // 8j + 2 (lane % 4) (+ 1 for odd e).
#pragma unroll
      for (int b = 0; b < kMW; ++b)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          int n = 0, ho = 0, wo = 0;
          const bool ok = gemm_row(g, tl, d, row0 + b * 64 + wq * 16 + (lane >> 2) + 8 * half, n, ho, wo);
          if constexpr (sizeof(T) == 2) {
            if (quad_stores) {  // the whole warp, rows past the tile included (shuffles)
#pragma unroll
              for (int j = 0; j < BN / 8; j += 2)
                gemm_store_quad<T>(g, d, ok, n, ho, wo, d.c0 + 8 * j + 2 * (lane & 3), acc[b][4 * j + 2 * half],
                                   acc[b][4 * j + 2 * half + 1], acc[b][4 * j + 4 + 2 * half],
                                   acc[b][4 * j + 5 + 2 * half]);
              continue;
            }
          }
          if (!ok) continue;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
            gemm_store_cols<T>(g, d, n, ho, wo, d.c0 + 8 * j + 2 * (lane & 3), acc[b][4 * j + 2 * half],
                               acc[b][4 * j + 2 * half + 1], pair_stores);
        }
    }
  }
  // The last boxes written before the block's shared memory goes.
  if constexpr (kTmaY)
    if ((threadIdx.x & 127) == 0) bulk_wait<false>();
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

// Packs w [C_in][cout_g][kH][kW] into [groups][kH][kW][cout_g][ci_pad] (zeros past cin_g), TF32-rounded for TF32
// (kMode 1), or for exact fp32 (kMode 2) split into the TF32 parts there and their residuals in a second such plane
// `plane` elements further (3xTF32):
// per group a transpose of [ci][j] into [j][ci], j = co * kH * kW + tap, through a tile of 64 ci x 32 kPackVec<T> j
// in shared memory, so that both the reads (j fastest) and the writes (ci fastest) are coalesced, 8 bytes a load
// and a store (kPackVec<T> elements; a load of one where `vec` is false: j rows whose length is no multiple of it,
// or an unaligned address), eight of each a thread in flight. kRows says where source row j goes (PackRows): the
// gemm kernel's rows are tap-major, the shuffle kernel's ([groups][cout_g][kH][kW][ci_pad]) output-channel-major;
// a channels-last w ([C_in][kH][kW][cout_g] in memory) has j = tap * cout_g + co. 256 threads; grid (j tiles, ci
// tiles, groups).
constexpr int kPackRows = 64;  // ci a tile
template <typename T>
constexpr int kPackVec = 8 / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kPackCols = 32 * kPackVec<T>;  // j a tile

template <typename T>
struct alignas(8) PackVec {
  T e[kPackVec<T>];
};

template <typename T, int kMode, PackRows kRows>
__global__ void __launch_bounds__(256)
    conv_transpose2d_gemm_pack(const T* __restrict__ w, T* __restrict__ dst, int cin_g, int cout_g, int khw,
                               int ci_pad, bool vec, int64_t plane) {
  constexpr int V = kPackVec<T>, kCols = kPackCols<T>;
  // Rows padded by one element: the column reads of the write phase spread over the banks (at most 2-way).
  __shared__ T tile[kPackRows][kCols + 1];
  // 32-bit indices: gemm_eligible keeps every packed size under 2^30 (64-bit divisions cost this kernel 3x).
  const int grp = blockIdx.z;
  const int jn = cout_g * khw;
  const int j0 = blockIdx.x * kCols, ci0 = blockIdx.y * kPackRows;
  const T* src = w + static_cast<int64_t>(grp) * cin_g * jn;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int jl = V * tx;  // this thread's V columns of the tile
  PackVec<T> v[kPackRows / 8];
#pragma unroll
  for (int i = 0; i < kPackRows / 8; ++i) {
    const int ci = ci0 + ty + 8 * i, j = j0 + jl;
#pragma unroll
    for (int e = 0; e < V; ++e) v[i].e[e] = from_acc<T>(0.f);
    if (ci < cin_g) {
      const T* row = src + static_cast<int64_t>(ci) * jn;
      if (vec) {
        if (j < jn) v[i] = *reinterpret_cast<const PackVec<T>*>(row + j);  // jn % V == 0: j + V <= jn too
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (j + e < jn) v[i].e[e] = row[j + e];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPackRows / 8; ++i)
#pragma unroll
    for (int e = 0; e < V; ++e) {
      T a = v[i].e[e];
      if constexpr (kMode == 1) a = __uint_as_float(tc::to_tf32(a));
      tile[ty + 8 * i][jl + e] = a;
    }
  __syncthreads();
  T* out = dst + static_cast<int64_t>(grp) * khw * cout_g * ci_pad;
  constexpr int kQ = kPackRows / V;        // threads along an output row's 64 ci
  constexpr int kRowsAPass = 256 / kQ;     // output rows a pass
  const int q = threadIdx.x % kQ, jr = threadIdx.x / kQ;
  const int ci = ci0 + V * q;  // ci_pad is a multiple of V: ci < ci_pad means ci + V <= ci_pad
#pragma unroll
  for (int pass = 0; pass < kCols / kRowsAPass; ++pass) {
    const int r = jr + pass * kRowsAPass, j = j0 + r;
    if (j >= jn || ci >= ci_pad) continue;
    int row = j;
    if constexpr (kRows == PackRows::kToTapMajor) {
      const int co = j / khw;
      row = (j - co * khw) * cout_g + co;
    } else if constexpr (kRows == PackRows::kToCoMajor) {
      const int tap = j / cout_g;
      row = (j - tap * cout_g) * khw + tap;
    }
    PackVec<T> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.e[e] = tile[V * q + e][r];
    if constexpr (kMode == 2) {
      PackVec<T> lo;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const uint32_t h = tc::to_tf32(o.e[e]);
        lo.e[e] = __uint_as_float(tc::tf32_residual(o.e[e], h));
        o.e[e] = __uint_as_float(h);
      }
      *reinterpret_cast<PackVec<T>*>(out + plane + static_cast<int64_t>(row) * ci_pad + ci) = lo;
    }
    *reinterpret_cast<PackVec<T>*>(out + static_cast<int64_t>(row) * ci_pad + ci) = o;
  }
}

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

// Whether the wgmma configurations run here: an sm_90 device and kernels built with sm_90a code.
bool gemm_wgmma_ready() {
#if defined(DECONV_SM90A_SASS)
  return gemm_device_cc() == 90;
#else
  return false;
#endif
}

// The problem as the gemm path tiles it. An axis whose input is one position wide gets the stride
// dil * (k - 1) + 1 (when that is larger and the phase tables hold it): the output is the same -- with one input
// position, output position o takes tap a only where o = a * dil - pad, whatever the stride -- but every phase then
// has at most one tap, so that a 1 x 1 input (the latent layer of a generator) is a plain GEMM per tap,
// M = N, K = C_in, instead of kH * kW stages of which all but one read zeros.
ConvTranspose2dParams gemm_view(const ConvTranspose2dParams& p) {
  ConvTranspose2dParams q = p;
  const int64_t sh = p.dil_h * (p.kH - 1) + 1, sw = p.dil_w * (p.kW - 1) + 1;
  if (p.H_in == 1 && sh > p.stride_h && sh <= kGemmMaxStride) q.stride_h = sh;
  if (p.W_in == 1 && sw > p.stride_w && sw <= kGemmMaxStride) q.stride_w = sw;
  return q;
}

int64_t gemm_ci_pad(const ConvTranspose2dParams& p) {
  const int64_t per_stage = kGemmRowBytes / (p.dtype == DType::kFloat32 ? 4 : 2);
  return tc::div_up(p.C_in / p.groups, per_stage) * per_stage;
}

int64_t gemm_elem_bytes(const ConvTranspose2dParams& p) { return p.dtype == DType::kFloat32 ? 4 : 2; }

// 16-bit groups of at most 32 input channels: the wgmma kernel's stages hold two taps of 64 bytes (GemmTiles).
bool gemm_two_taps(const ConvTranspose2dParams& p) {
  return p.dtype != DType::kFloat32 && p.C_in / p.groups * gemm_elem_bytes(p) <= kGemmRowBytes / 2;
}

// K stages of the phase with the most taps: taps x stages of input channels a tap (the wgmma kernel's, two taps a
// stage where they fit).
int64_t gemm_kiters(const ConvTranspose2dParams& p) {
  const int64_t taps = max_phase_taps(p.stride_h, p.dil_h, p.kH) * max_phase_taps(p.stride_w, p.dil_w, p.kW);
  return gemm_two_taps(p) ? (taps + 1) / 2 : taps * (gemm_ci_pad(p) * gemm_elem_bytes(p) / kGemmRowBytes);
}

// Elements from one position of x to the next.
int64_t gemm_x_pitch(const ConvTranspose2dParams& p) { return p.x_pitch > 0 ? p.x_pitch : p.C_in; }

// The M box of a problem (GemmTiles): for the largest phase (ch x cw positions an image), the bn x bh x bw box of at
// most 128 rows that wastes the fewest rows over the tiles that cover it (ties: the fewer tiles); widths and heights
// tried are the whole extent and powers of two below it.
struct GemmBox {
  int bw, bh, bni;
  int64_t w_tiles, h_tiles, n_tiles;
};
GemmBox gemm_box(const ConvTranspose2dParams& p, int64_t bm) {
  const int64_t ch = tc::div_up(p.H_out, p.stride_h), cw = tc::div_up(p.W_out, p.stride_w);
  GemmBox best{1, 1, 1, cw, ch, p.N};
  int64_t best_tiles = -1;
  for (int64_t bw = cw < bm ? cw : bm; bw >= 1; bw = bw > 1 && (bw & (bw - 1)) ? int64_t(1) << (63 - __builtin_clzll(bw)) : bw / 2) {
    const int64_t hmax = bm / bw < ch ? bm / bw : ch;
    for (int64_t bh = hmax; bh >= 1; bh = bh > 1 && (bh & (bh - 1)) ? int64_t(1) << (63 - __builtin_clzll(bh)) : bh / 2) {
      const int64_t bni = bm / (bw * bh) < p.N ? bm / (bw * bh) : p.N;
      const int64_t tiles = tc::div_up(cw, bw) * tc::div_up(ch, bh) * tc::div_up(p.N, bni);
      if (best_tiles < 0 || tiles < best_tiles) {
        best = {static_cast<int>(bw), static_cast<int>(bh), static_cast<int>(bni), tc::div_up(cw, bw),
                tc::div_up(ch, bh), tc::div_up(p.N, bni)};
        best_tiles = tiles;
      }
    }
  }
  return best;
}

// M tiles (boxes), channel tiles and tiles of one split.
struct GemmGrid {
  GemmBox box;
  int64_t m_tiles, n_tiles, tiles;
};
GemmGrid gemm_grid(const ConvTranspose2dParams& p, int config) {
  GemmGrid gr{};
  gr.box = gemm_box(p, kGemmShapes[config].bm);
  gr.m_tiles = gr.box.w_tiles * gr.box.h_tiles * gr.box.n_tiles;
  gr.n_tiles = tc::div_up(p.C_out / p.groups, kGemmShapes[config].bn);
  gr.tiles = gr.m_tiles * gr.n_tiles * p.groups * p.stride_h * p.stride_w;
  return gr;
}

// Exact fp32: 3xTF32 on the wgmma configurations that hold it (gemm_exact_fits).
bool gemm_exact(const ConvTranspose2dParams& p) {
  return p.dtype == DType::kFloat32 && p.precision != Precision::kTF32;
}

}  // namespace

bool gemm_eligible(const ConvTranspose2dParams& p_in) {
  const ConvTranspose2dParams p = gemm_view(p_in);
  if (p.dtype == DType::kFloat64 || (gemm_exact(p) && !gemm_wgmma_ready())) return false;
  if (gemm_device_cc() < 80) return false;  // mma.sync, ldmatrix and cp.async: sm_80
  const int64_t eb = gemm_elem_bytes(p);
  const int64_t cin_g = p.C_in / p.groups, pitch = gemm_x_pitch(p);
  // 16-byte rows of channels (a padded pitch: one group only), strides the phase tables hold, and every index in
  // 31 bits.
  if (p.x_pitch > 0 && (p.groups != 1 || p.x_pitch < p.C_in)) return false;
  if ((p.x_pitch > 0 ? pitch * eb : cin_g * eb) % 16 != 0) return false;
  if (p.stride_h > kGemmMaxStride || p.stride_w > kGemmMaxStride) return false;
  // A channels-last x at a 16-byte aligned address (the binding plans with x_channels_last set and a null or
  // channels-last x, then keeps the family: an NCHW x never plans the gemm kernel).
  if (!p.x_channels_last || reinterpret_cast<uintptr_t>(p.x) % 16 != 0) return false;
  const int64_t lim = int64_t(1) << 30;
  if (p.N * p.H_in * p.W_in * pitch >= lim || p.N * p.H_out * p.W_out >= lim || p.C_out >= lim ||
      p.groups * p.kH * p.kW * (p.C_out / p.groups) * gemm_ci_pad(p) >= lim)
    return false;
  if (tc::div_up(gemm_ci_pad(p), kPackRows) > 65535 || p.groups > 65535) return false;  // the packing kernel's grid
  return gemm_grid(p, 2).tiles * kGemmMaxSplit < (int64_t(1) << 31);
}

bool gemm_default_ready() { return gemm_wgmma_ready(); }

int gemm_config(const ConvTranspose2dParams& p_in) {
  const ConvTranspose2dParams p = gemm_view(p_in);
  const bool wgmma = gemm_wgmma_ready();
  if (gemm_exact(p)) {  // 128 x 128 tiles, 128 x 64 ones for few output channels
    if (p.force_config >= 0 && p.force_config < kNumGemmConfigs && gemm_exact_fits(kGemmShapes[p.force_config]))
      return p.force_config;
    return p.C_out / p.groups <= 64 ? 2 : 0;
  }
  if (p.force_config >= 0 && p.force_config < kNumGemmConfigs && (wgmma || kGemmShapes[p.force_config].sync))
    return p.force_config;
  const int64_t cout_g = p.C_out / p.groups;
  if (!wgmma) return cout_g <= 64 ? 4 : 3;
  const int64_t sms = sm_count() > 0 ? sm_count() : 132;
  // Rules from bench/kernels/gemm_probe.py on the zoo and KernelBench (bench/NOTES.md v18-v19); measured choice times
  // every configuration. Few output channels: 256-row tiles (5) halve the B traffic and the per-stage overhead a
  // product where they fill half the SMs, else 64-wide tiles (2) for more of them.
  if (cout_g <= 64) return 2 * gemm_grid(p, 5).tiles >= sms ? 5 : 2;
  const int64_t kiters = gemm_kiters(p);
  const bool few = 2 * gemm_grid(p, 0).tiles < sms;
  if (p.dtype == DType::kFloat32) {
    // TF32 rounds each landed A stage in shared memory once for all of the tile's output channels: 256 of them
    // halve that pass per product, where the channels fill them, K is long enough (16 stages) for it to outweigh
    // the wider tile's epilogue and the tiles keep half the SMs busy (v18: 1.23-1.45x). A short K (k2 s2 layers)
    // spends much of a tile in its epilogue, which the warpgroups' turns (7) hide under the other's products.
    if (cout_g >= 256 && kiters >= 16 && 2 * gemm_grid(p, 1).tiles >= sms) return 1;
    return kiters < 16 && !few ? 7 : 0;
  }
  // 16-bit: tiles by turns (7), or 64-wide tiles (2) where 128-wide ones leave most SMs idle (split-K shares the
  // rest).
  return few ? 2 : 7;
}

int gemm_split(const ConvTranspose2dParams& p_in, int config) {
  const ConvTranspose2dParams p = gemm_view(p_in);
  if (p.force_split > 0) return p.force_split < kGemmMaxSplit ? p.force_split : kGemmMaxSplit;
  const GemmGrid gr = gemm_grid(p, config);
  const int64_t sms = sm_count() > 0 ? sm_count() : 132;
  const int64_t kiters = gemm_kiters(p);
  if (2 * gr.tiles > sms) return 1;
  int64_t split = sms / (gr.tiles > 0 ? gr.tiles : 1);
  if (split > kiters / 4) split = kiters / 4;  // at least 4 stages a block
  if (split > kGemmMaxSplit) split = kGemmMaxSplit;
  return split >= 2 ? static_cast<int>(split) : 1;
}

bool gemm_reads_weights(const ConvTranspose2dParams& p, int config) {
  // 16-bit channels-last weights as TMA can read them: 16-byte rows of output channels at a 16-byte aligned address,
  // and a group's input channels in whole stages: a stage must not reach into the next group's rows, and stages
  // with channels past C_in would be boxes mostly zero-filled by the copy engine, which costs it as much as reading
  // them (KernelBench 71, 32 channels: 1.55 ms against 0.97 ms packed; bench/NOTES.md v17).
  if (!p.w_channels_last || p.dtype == DType::kFloat32 || p.dtype == DType::kFloat64) return false;
  if (kGemmShapes[config].sync) return false;  // the mma.sync kernel reads K-major weights only
  const int64_t cout_g = p.C_out / p.groups, cin_g = p.C_in / p.groups;
  const int64_t ch = kGemmRowBytes / 2;
  return cout_g % 8 == 0 && cin_g % ch == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0;
}

WeightPacking gemm_packing(const ConvTranspose2dParams& p, int config) {
  WeightPacking w{};
  if (gemm_reads_weights(p, config)) return w;  // read as they are
  const int64_t ci_pad = gemm_ci_pad(p);
  w.bytes = static_cast<size_t>(p.groups * p.kH * p.kW * (p.C_out / p.groups) * ci_pad * gemm_elem_bytes(p) *
                                (gemm_exact(p) ? 2 : 1));
  w.kind = static_cast<int64_t>(gemm_exact(p)                ? tc::MmaKind::k3xTF32
                                : p.dtype == DType::kFloat32 ? tc::MmaKind::kTF32
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
  // No room for packed weights when they come packed or are read as they are (gemm_packing's 0 bytes).
  const size_t packed = p.packed_weights == nullptr ? (gemm_packing(p, config).bytes + 255) / 256 * 256 : 0;
  const int split = gemm_split(p, config);
  const size_t partial =
      split > 1 ? static_cast<size_t>(split) * p.N * p.H_out * p.W_out * p.C_out * sizeof(float) : 0;
  return packed + partial;
}

namespace {
template <typename T, int kMode, PackRows kRows>
cudaError_t gemm_pack_as(const void* w, void* dst, int cin_g, int cout_g, int khw, int ci_pad, unsigned groups,
                         cudaStream_t stream) {
  const bool vec = cout_g * khw % kPackVec<T> == 0 && reinterpret_cast<uintptr_t>(w) % 8 == 0;
  const dim3 grid(static_cast<unsigned>(tc::div_up(cout_g * khw, kPackCols<T>)),
                  static_cast<unsigned>(tc::div_up(ci_pad, kPackRows)), groups);  // y and z < 65536: gemm_eligible
  if (grid.y > 65535 || grid.z > 65535) return cudaErrorInvalidValue;
  const int64_t plane = static_cast<int64_t>(groups) * khw * cout_g * ci_pad;  // kMode 2: the residuals' offset
  conv_transpose2d_gemm_pack<T, kMode, kRows><<<grid, 256, 0, stream>>>(
      static_cast<const T*>(w), static_cast<T*>(dst), cin_g, cout_g, khw, ci_pad, vec, plane);
  return cudaGetLastError();
}
}  // namespace

cudaError_t gemm_pack(const ConvTranspose2dParams& p, void* dst, cudaStream_t stream, bool co_major) {
  const int cin_g = static_cast<int>(p.C_in / p.groups), cout_g = static_cast<int>(p.C_out / p.groups);
  const int ci_pad = static_cast<int>(gemm_ci_pad(p)), khw = static_cast<int>(p.kH * p.kW);
  const unsigned groups = static_cast<unsigned>(p.groups);
  // Source rows are co-major ([ci][co][tap]) or, channels-last, tap-major ([ci][tap][co]); one kind is kept as is.
  const PackRows rows = p.w_channels_last ? (co_major ? PackRows::kToCoMajor : PackRows::kAsIs)
                                          : (co_major ? PackRows::kAsIs : PackRows::kToTapMajor);
  const auto as = [&](auto t, auto mode) -> cudaError_t {
    using T = decltype(t);
    constexpr int kMode = decltype(mode)::value;
    switch (rows) {
      case PackRows::kAsIs:
        return gemm_pack_as<T, kMode, PackRows::kAsIs>(p.w, dst, cin_g, cout_g, khw, ci_pad, groups, stream);
      case PackRows::kToTapMajor:
        return gemm_pack_as<T, kMode, PackRows::kToTapMajor>(p.w, dst, cin_g, cout_g, khw, ci_pad, groups, stream);
      case PackRows::kToCoMajor:
        return gemm_pack_as<T, kMode, PackRows::kToCoMajor>(p.w, dst, cin_g, cout_g, khw, ci_pad, groups, stream);
    }
    return cudaErrorInvalidValue;
  };
  if (gemm_exact(p)) return as(float{}, std::integral_constant<int, 2>{});
  if (p.dtype == DType::kFloat32) return as(float{}, std::integral_constant<int, 1>{});
  if (p.dtype == DType::kBFloat16) return as(__nv_bfloat16{}, std::integral_constant<int, 0>{});
  if (p.dtype == DType::kFloat16) return as(__half{}, std::integral_constant<int, 0>{});
  return cudaErrorInvalidValue;
}

namespace {

// Tensor maps of x ([N][H_in][W_in][groups][cin_g], boxes of one stage's channels x the M box) and of the packed
// weights ([groups * kH * kW][cout_g][ci_pad], boxes of one stage's channels x BN rows) or, read as they are, the
// channels-last weights ([C_in][kH * kW][cout_g], boxes of 64 output channels x one tap x one stage's channels), in
// 128-byte swizzle, zero-filled outside the tensors. `b_parts` 2: the weights' boxes are halves (a pair's block
// brings half of each B stage: half the output channels, or N-major half the input channels). `two_taps`: boxes of
// 64 bytes of channels (a tap's), in 64-byte swizzle.
bool gemm_maps(const ConvTranspose2dParams& p, const GemmArgs& a, const GemmBox& box, int bn, int b_parts,
               bool trans_b, bool two_taps, CUtensorMap* mx, CUtensorMap* mw) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const CUtensorMapDataType dt = p.dtype == DType::kFloat32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                 : p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint64_t eb = static_cast<cuuint64_t>(gemm_elem_bytes(p));
  const cuuint32_t ch = static_cast<cuuint32_t>((two_taps ? kGemmRowBytes / 2 : kGemmRowBytes) / eb);
  const CUtensorMapSwizzle swizzle = two_taps ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B;
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const cuuint64_t xdim[5] = {static_cast<cuuint64_t>(a.cin_g), static_cast<cuuint64_t>(p.groups),
                              static_cast<cuuint64_t>(p.W_in), static_cast<cuuint64_t>(p.H_in),
                              static_cast<cuuint64_t>(p.N)};
  // A padded pitch has one group: the group stride then only needs to be a whole 16-byte vector.
  const cuuint64_t pitch = static_cast<cuuint64_t>(a.c_in);
  const cuuint64_t xstride[4] = {p.groups == 1 ? pitch * eb : a.cin_g * eb, pitch * eb, p.W_in * pitch * eb,
                                 p.H_in * p.W_in * pitch * eb};
  const cuuint32_t xbox[5] = {ch, 1, static_cast<cuuint32_t>(box.bw), static_cast<cuuint32_t>(box.bh),
                              static_cast<cuuint32_t>(box.bni)};
  if (encode(mx, dt, 5, const_cast<void*>(a.x), xdim, xstride, xbox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  if (trans_b) {
    const cuuint64_t khw = static_cast<cuuint64_t>(p.kH * p.kW);
    const cuuint64_t tdim[3] = {static_cast<cuuint64_t>(a.cout_g), khw, static_cast<cuuint64_t>(p.C_in)};
    const cuuint64_t tstride[2] = {a.cout_g * eb, khw * a.cout_g * eb};
    const cuuint32_t tbox[3] = {64, 1, ch / static_cast<cuuint32_t>(b_parts)};
    return encode(mw, dt, 3, const_cast<void*>(a.wp), tdim, tstride, tbox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  // Exact fp32: the residuals' plane follows the TF32 parts' (groups x taps rows more).
  const cuuint64_t wdim[3] = {static_cast<cuuint64_t>(a.ci_pad), static_cast<cuuint64_t>(a.cout_g),
                              static_cast<cuuint64_t>(p.groups * p.kH * p.kW * (gemm_exact(p) ? 2 : 1))};
  const cuuint64_t wstride[2] = {a.ci_pad * eb, a.cout_g * a.ci_pad * eb};
  const cuuint32_t wbox[3] = {ch, static_cast<cuuint32_t>(bn / b_parts), 1};
  return encode(mw, dt, 3, const_cast<void*>(a.wp), wdim, wstride, wbox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The box of a 64-row chunk of a tile (the wgmma kernel's kTmaY) in the output's [N][C_out][H_out][W_out]: positions
// of the M box (bw x bh x bni, w fastest) 64 at a time, and 64 output channels.
struct GemmYBox {
  int w, h, n;
};
GemmYBox gemm_y_box(const GemmBox& box) {
  const int w = box.bw < 64 ? box.bw : 64;
  const int h = box.bw * box.bh <= 64 ? box.bh : 64 / w;
  return {w, h, 64 / (w * h)};
}

// The configurations whose exact kernel has a bulk-stored NCHW epilogue (kTmaY): wgmma blocks alone, whole chunks
// of 64 output channels.
constexpr bool gemm_tma_y_shape(const GemmShape& s) {
  return !s.sync && s.cluster == 1 && gemm_exact_fits(s) && s.bn % 64 == 0;
}

// Whether such a configuration (BM rows a tile) stores this problem's output by bulk tensor stores: exact fp32 stored
// straight into a dense NCHW y at a 16-byte aligned address, one group, stride 1 (a tile's positions are neighbours
// in y), no split, rows of whole 16-byte vectors (the tensor map's strides), and an M box that fills its BM rows and
// splits into chunks of 64 rows that are boxes themselves: bw a multiple of 4 that divides 64 (then bw x bh divides
// 64 or is a multiple of it) or a multiple of 64.
bool gemm_tma_y(const ConvTranspose2dParams& p, int bm, const GemmBox& box, int split) {
  if (!gemm_exact(p) || p.y_channels_last || split != 1 || p.groups != 1 || p.stride_h != 1 || p.stride_w != 1)
    return false;
  if (reinterpret_cast<uintptr_t>(p.y) % 16 != 0 || p.W_out % 4 != 0) return false;
  const int64_t bw = box.bw, bwh = static_cast<int64_t>(box.bw) * box.bh;
  if (bwh * box.bni != bm || bw % 4 != 0) return false;
  if (bw >= 64) return bw % 64 == 0;
  return 64 % bw == 0 && (bwh <= 64 ? 64 % bwh == 0 : bwh % 64 == 0);
}

// The tensor map of an NCHW fp32 y for kTmaY's stores: boxes of one chunk (gemm_y_box).
bool gemm_y_map(const ConvTranspose2dParams& p, const GemmBox& box, CUtensorMap* my) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const GemmYBox yb = gemm_y_box(box);
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  const cuuint64_t dim[4] = {static_cast<cuuint64_t>(p.W_out), static_cast<cuuint64_t>(p.H_out),
                             static_cast<cuuint64_t>(p.C_out), static_cast<cuuint64_t>(p.N)};
  const cuuint64_t stride[3] = {static_cast<cuuint64_t>(p.W_out) * 4, static_cast<cuuint64_t>(p.H_out * p.W_out) * 4,
                                static_cast<cuuint64_t>(p.C_out * p.H_out * p.W_out) * 4};
  const cuuint32_t boxdim[4] = {static_cast<cuuint32_t>(yb.w), static_cast<cuuint32_t>(yb.h), 64,
                                static_cast<cuuint32_t>(yb.n)};
  return encode(my, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.y, dim, stride, boxdim, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The launch's tables (GemmTiles) for a configuration's grid and split.
GemmTiles gemm_tiles(const ConvTranspose2dParams& p, const GemmGrid& gr, int split) {
  GemmTiles tl{};
  for (int64_t r = 0; r < p.stride_h; ++r) tl.ah[r] = make_axis_phase32(r, p.H_out, p.stride_h, p.pad_h, p.dil_h, p.kH);
  for (int64_t r = 0; r < p.stride_w; ++r) tl.aw[r] = make_axis_phase32(r, p.W_out, p.stride_w, p.pad_w, p.dil_w, p.kW);
  tl.w_tiles = make_fast_div(static_cast<uint32_t>(gr.box.w_tiles));
  tl.h_tiles = make_fast_div(static_cast<uint32_t>(gr.box.h_tiles));
  tl.bw = make_fast_div(static_cast<uint32_t>(gr.box.bw));
  tl.bh = make_fast_div(static_cast<uint32_t>(gr.box.bh));
  tl.bni = gr.box.bni;
  tl.n_tiles = make_fast_div(static_cast<uint32_t>(gr.n_tiles));
  tl.groups = make_fast_div(static_cast<uint32_t>(p.groups));
  tl.splits = make_fast_div(static_cast<uint32_t>(split));
  tl.phases = make_fast_div(static_cast<uint32_t>(p.stride_h * p.stride_w));
  tl.stride_w = make_fast_div(static_cast<uint32_t>(p.stride_w));
  tl.total = static_cast<int>(gr.tiles * split);
  const int64_t inner = gr.tiles / gr.m_tiles * split;  // tiles a box
  tl.inner = make_fast_div(static_cast<uint32_t>(inner));
  tl.pairs = static_cast<int>(inner * tc::div_up(gr.m_tiles, 2));
  tl.ng = make_fast_div(static_cast<uint32_t>(gr.n_tiles * p.groups));
  tl.a_rounded = p.dtype == DType::kFloat32 && p.x_tf32_rounded && !gemm_exact(p);
  return tl;
}

template <typename T, tc::MmaKind K, int kShape, bool kTransB, bool kPaired, bool kTwo, bool kClusterK,
          bool kTmaY = false>
constexpr auto gemm_kernel_of() {
  constexpr GemmShape s = kGemmShapes[kShape];
  constexpr int kStages = K == tc::MmaKind::k3xTF32 ? gemm_exact_stages(s, kTmaY) : s.stages;
  return conv_transpose2d_gemm_kernel<T, K, s.bm, s.bn, kStages, s.ping, kTransB, kPaired, kTwo, kClusterK, kTmaY>;
}

// How many clusters of `size` blocks of a wgmma kernel instance the device runs at once (0: none fits). The kernel's
// shared memory is opted into first: the occupancy query counts clusters of blocks that size.
template <typename T, tc::MmaKind K, int kShape, bool kTransB, bool kPaired, bool kClusterK>
int gemm_clusters(int size) {
  constexpr auto kKernel = gemm_kernel_of<T, K, kShape, kTransB, kPaired, false, kClusterK>();
  if (opt_in_shared_memory<kKernel>() != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return max_active_clusters(kKernel, kGemmThreads, gemm_smem_bytes(kGemmShapes[kShape], K == tc::MmaKind::k3xTF32),
                             size);
}

// A wgmma kernel instance: persistent, one block an SM, or in clusters one cluster for each of `clusters` groups of
// SMs: pairs (kPaired, two blocks), or a tile's `split` blocks (kClusterK).
template <typename T, tc::MmaKind K, int kShape, bool kTransB, bool kPaired, bool kTwo, bool kClusterK,
          bool kTmaY = false>
cudaError_t gemm_launch_instance(const ConvTranspose2dParams& p, const GemmArgs& a, const GemmGrid& gr, int split,
                                 int clusters, cudaStream_t stream) {
  constexpr GemmShape s = kGemmShapes[kShape];
  constexpr bool kExact = K == tc::MmaKind::k3xTF32;
  constexpr auto kKernel = gemm_kernel_of<T, K, kShape, kTransB, kPaired, kTwo, kClusterK, kTmaY>();
  constexpr size_t smem = gemm_smem_bytes(s, kExact, kTmaY);
  static_assert(smem <= kGemmSmemLimit, "a block's shared memory");
  const cudaError_t err = opt_in_shared_memory<kKernel>();
  if (err != cudaSuccess) return err;
  const GemmTiles tl = gemm_tiles(p, gr, split);
  CUtensorMap mx, mw, my{};
  if (!gemm_maps(p, a, gr.box, s.bn, kPaired ? 2 : 1, kTransB, kTwo, &mx, &mw)) return cudaErrorInvalidValue;
  if (kTmaY && !gemm_y_map(p, gr.box, &my)) return cudaErrorInvalidValue;
  if constexpr (!kPaired && !kClusterK) {
    const int sms = sm_count() > 0 ? sm_count() : 1;
    kKernel<<<tl.total < sms ? tl.total : sms, kGemmThreads, smem, stream>>>(a, tl, mx, mw, my);
    return cudaGetLastError();
  } else {
    const int size = kPaired ? 2 : split;
    const int items = kPaired ? tl.pairs : tl.total / split;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cluster_config(cfg, attr, dim3(static_cast<unsigned>(size * (items < clusters ? items : clusters))),
                   kGemmThreads, smem, size, stream);
    return cudaLaunchKernelEx(&cfg, kKernel, a, tl, mx, mw, my);
  }
}

// The wgmma kernel of a configuration: in pairs where the configuration says so and the device holds a cluster of
// two of its blocks (else alone: the configuration's tiles one a block); 16-bit groups of at most 32 input channels
// with two taps a stage where blocks run alone; a split-K tile's blocks as one cluster where gemm_cluster_k allows it
// and the device holds enough of those clusters at once for at most two tiles each (then `*partials` is cleared),
// else each split into the fp32 partials, which the caller sums.
template <typename T, tc::MmaKind K, int kShape, bool kTransB>
cudaError_t gemm_launch_wgmma(const ConvTranspose2dParams& p, const GemmArgs& a, const GemmGrid& gr, int split,
                              bool* partials, cudaStream_t stream) {
  constexpr GemmShape s = kGemmShapes[kShape];
  static_assert(s.cluster == 1 || s.cluster == 2, "blocks alone or in pairs");
  constexpr bool kExact = K == tc::MmaKind::k3xTF32;
  if constexpr (s.cluster == 2) {
    const int clusters = gemm_clusters<T, K, kShape, kTransB, true, false>(2);
    if (clusters > 0)
      return gemm_launch_instance<T, K, kShape, kTransB, true, false, false>(p, a, gr, split, clusters, stream);
  }
  if constexpr (kExact && gemm_tma_y_shape(s)) {
    if (gemm_tma_y(p, s.bm, gr.box, split))
      return gemm_launch_instance<T, K, kShape, kTransB, false, false, false, true>(p, a, gr, split, 0, stream);
  }
  const bool two = sizeof(T) == 2 && !kTransB && gemm_two_taps(p);
  if constexpr (gemm_cluster_k(s) && !kExact) {
    if (split > 1 && split <= kGemmMaxClusterK && !two) {
      // At most two tiles a cluster: the hand-over serializes a cluster's tiles (its blocks but the first bring the
      // next tile's stages only once their sums have been read), and with many tiles a cluster the fp32 partials are
      // faster (pix2pix-rgb, 4096 tiles, 16 bits, split 2: 477 against 199 us; bench/NOTES.md v35).
      const int clusters = gemm_clusters<T, K, kShape, kTransB, false, true>(split);
      if (clusters > 0 && gr.tiles <= 2 * static_cast<int64_t>(clusters)) {
        GemmArgs b = a;
        b.partial = nullptr;  // the epilogue stores the output
        *partials = false;
        return gemm_launch_instance<T, K, kShape, kTransB, false, false, true>(p, b, gr, split, clusters, stream);
      }
    }
  }
  if constexpr (sizeof(T) == 2 && !kTransB) {
    if (two) return gemm_launch_instance<T, K, kShape, false, false, true, false>(p, a, gr, split, 0, stream);
  }
  return gemm_launch_instance<T, K, kShape, kTransB, false, false, false>(p, a, gr, split, 0, stream);
}

// The wgmma launch of each configuration, indexed by configuration (null for the mma.sync ones and, for exact fp32,
// the tiles that do not hold it).
using WgmmaLaunch = cudaError_t (*)(const ConvTranspose2dParams&, const GemmArgs&, const GemmGrid&, int, bool*,
                                    cudaStream_t);
template <typename T, tc::MmaKind K, bool kTransB, int kShape>
constexpr WgmmaLaunch wgmma_launch() {
  if constexpr (kGemmShapes[kShape].sync ||
                (K == tc::MmaKind::k3xTF32 && !gemm_exact_fits(kGemmShapes[kShape]))) {
    return nullptr;
  } else {
    return &gemm_launch_wgmma<T, K, kShape, kTransB>;
  }
}
template <typename T, tc::MmaKind K, bool kTransB, int... kShapes>
constexpr std::array<WgmmaLaunch, sizeof...(kShapes)> wgmma_launches(std::integer_sequence<int, kShapes...>) {
  return {wgmma_launch<T, K, kTransB, kShapes>()...};
}

template <typename T, tc::MmaKind K, bool kTransB>
cudaError_t gemm_launch_kind(const ConvTranspose2dParams& p, int config, const GemmArgs& a, int split,
                             cudaStream_t stream) {
  static constexpr std::array<WgmmaLaunch, kNumGemmConfigs> kWgmma =
      wgmma_launches<T, K, kTransB>(std::make_integer_sequence<int, kNumGemmConfigs>{});
  const GemmGrid gr = gemm_grid(p, config);
  cudaError_t err = cudaErrorInvalidValue;
  bool partials = split > 1;  // split-K through the fp32 partials, summed here
  if (kGemmShapes[config].sync) {
    if (!kTransB && K != tc::MmaKind::k3xTF32)
      err = launch_gemm_sync(p.dtype, config, a, gemm_tiles(p, gr, split), stream);
  } else if (kWgmma[config] != nullptr) {
    err = kWgmma[config](p, a, gr, split, &partials, stream);
  }
  if (err != cudaSuccess || !partials) return err;
  const int64_t total = p.N * p.H_out * p.W_out * p.C_out;
  const int64_t blocks = tc::div_up(total, 256);
  conv_transpose2d_gemm_reduce<T><<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(a, split);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gemm(const ConvTranspose2dParams& p_in, int config, cudaStream_t stream) {
  const ConvTranspose2dParams p = gemm_view(p_in);
  if (!p.x_channels_last || config < 0 || config >= kNumGemmConfigs) return cudaErrorInvalidValue;
  GemmArgs a{};
  a.x = p.x;
  a.bias = p.bias;
  a.y = p.y;
  a.n = static_cast<int>(p.N);
  a.c_in = static_cast<int>(gemm_x_pitch(p));  // the row pitch of x
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
  const bool trans_b = gemm_reads_weights(p, config);
  if (trans_b) {
    a.wp = p.w;
  } else if (p.packed_weights != nullptr) {
    a.wp = p.packed_weights;
  } else {
    if (ws == nullptr) return cudaErrorInvalidValue;
    const cudaError_t err = gemm_pack(p, ws, stream);
    if (err != cudaSuccess) return err;
    a.wp = ws;
    ws += (gemm_packing(p, config).bytes + 255) / 256 * 256;
  }
  const int split = gemm_split(p, config);
  if (split > 1) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    a.partial = reinterpret_cast<float*>(ws);
  }
  switch (p.dtype) {
    case DType::kFloat32:
      return gemm_exact(p) ? gemm_launch_kind<float, tc::MmaKind::k3xTF32, false>(p, config, a, split, stream)
                           : gemm_launch_kind<float, tc::MmaKind::kTF32, false>(p, config, a, split, stream);
    case DType::kBFloat16:
      return trans_b ? gemm_launch_kind<__nv_bfloat16, tc::MmaKind::kBF16, true>(p, config, a, split, stream)
                     : gemm_launch_kind<__nv_bfloat16, tc::MmaKind::kBF16, false>(p, config, a, split, stream);
    case DType::kFloat16:
      return trans_b ? gemm_launch_kind<__half, tc::MmaKind::kFP16, true>(p, config, a, split, stream)
                     : gemm_launch_kind<__half, tc::MmaKind::kFP16, false>(p, config, a, split, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
