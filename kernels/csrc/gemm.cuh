// Shared by the gemm path's two kernels: the wgmma kernel (conv_transpose2d_gemm.cu, sm_90a) and the mma.sync kernel
// (conv_transpose2d_gemm_sync.cu, sm_80 and newer). Both compute the same tiles in the same K order from the same
// operand layouts: an M tile is a box of one stride phase's output positions across images, a K stage one tap's 128
// bytes of input channels (the wgmma kernel's 16-bit groups of at most 32 channels: two taps' 64), A rows read from
// the channels-last input, B rows from the packed weights [group][a][b][co][ci_pad] (docs/architecture.md,
// "Kernels").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "halo.cuh"
#include "phase.cuh"

namespace deconv {

constexpr int kGemmBM = 128;        // output positions a tile of the mma.sync kernel (the wgmma kernel: 128 or 256)
constexpr int kGemmRowBytes = 128;  // K bytes a stage: 32 fp32 or 64 16-bit channels of one tap
constexpr int kGemmMaxSplit = 16;

// Four 8 x 8 matrices of 16-bit values (rows of 16 bytes, one address a lane: lanes 8m .. 8m + 7 give matrix m's
// rows) into mma.sync's fragment layout: register m of lane L holds the 32-bit word L % 4 of row L / 4 of matrix m.
// For 32-bit values that is a TF32 m16n8k8 A fragment when the matrices are rows 0-7 and 8-15 of two 4-word chunks.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte chunk c of row r among rows of 128 bytes, permuted as the 128-byte swizzle of the bulk
// tensor copies and of wgmma lays them out (chunk c of row r at c ^ (r % 8); rows from a 1024-byte aligned base).
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * kGemmRowBytes + ((c ^ (r & 7)) << 4));
}

// Where the weight packer puts source row j of a group's [ci][j] weights (conv_transpose2d_gemm_pack): kept as is,
// from co-major (j = co * kH * kW + tap, PyTorch's layout) to the gemm kernel's tap-major rows, or from tap-major
// (a channels-last weight) to the shuffle kernel's co-major rows.
enum class PackRows : int { kAsIs, kToTapMajor, kToCoMajor };

// Tile configurations (force_config for the gemm path): BM x BN tiles in kStages buffers of (BM + BN) x 128 bytes;
// `sync` ones run the mma.sync kernel, the others the wgmma kernel (sm_90a), whose two multiplier warpgroups share
// each tile or, `ping`, take the tiles by turns. `cluster` 2: blocks run in pairs (thread-block clusters), the two
// tiles of a pair in neighbouring M boxes with the same output channels, and each block brings half of every B
// stage into both blocks' shared memory (one multicast copy), so that a pair reads its weights from L2 once.
struct GemmShape {
  int bm, bn, stages;
  bool sync, ping;
  int cluster = 1;
};
constexpr GemmShape kGemmShapes[kNumGemmConfigs] = {
    {128, 128, 6, false, false}, {128, 256, 4, false, false}, {128, 64, 8, false, false},  // 0-2: wgmma
    {128, 128, 3, true, false},  {128, 64, 4, true, false},                               // 3-4: mma.sync
    {256, 64, 5, false, false},  {256, 128, 4, false, false},  // 5-6: wgmma, 128 rows a warpgroup
    {128, 128, 6, false, true},  {128, 64, 8, false, true},    // 7-8: wgmma, a tile a warpgroup by turns
    {256, 64, 5, false, false, 2}, {256, 128, 4, false, false, 2},  // 9-12: 5, 6, 7 and 1 in pairs
    {128, 128, 6, false, true, 2}, {128, 256, 4, false, false, 2},
};

// Split-K in a cluster (the wgmma kernel's kClusterK): the `split` blocks of a tile run as one thread-block cluster
// (at most 8, the portable size) and the first adds the others' partial sums, read from their shared memory, to its
// accumulators before its epilogue: no fp32 partials in global memory and no second kernel. For the configurations
// whose two multiplier warpgroups share each tile, blocks alone (0, 1, 2, 5 and 6), in TF32 and 16 bits (not exact
// fp32, not two taps a stage), where the clusters the device runs at once take at most two tiles each; other
// splits go through fp32 partials.
constexpr int kGemmMaxClusterK = 8;
constexpr bool gemm_cluster_k(const GemmShape& s) { return !s.sync && !s.ping && s.cluster == 1; }

// Exact fp32 (3xTF32) on the wgmma kernel: a stage holds B twice (its TF32 parts and the TF32 roundings of what is
// left; the multipliers split A in their registers), and a multiplier sums each stage into partial sums beside its
// accumulators, so only the wgmma tiles whose accumulators take at most 64 registers a thread run it (0, 2, 5, 8 and
// 9), with as many stages as fit in the shared memory a block may have.
// An exact kernel that stores an NCHW output by bulk tensor stores (the wgmma kernel's kTmaY) also holds a chunk of
// 64 rows x 64 output channels in fp32 for each multiplier warpgroup, after the stages' barriers.
constexpr int kGemmSmemLimit = 227 * 1024;
constexpr int kGemmYChunk = 64 * 64 * 4;
constexpr int kGemmYOffset = 256;  // from the end of the stages: past their barriers, 128-byte aligned
constexpr bool gemm_exact_fits(const GemmShape& s) {
  return !s.sync && (s.ping ? s.bm / 64 : s.bm / 128) * s.bn / 2 <= 64;
}
constexpr int gemm_exact_stages(const GemmShape& s, bool tma_y = false) {
  const int fit = (kGemmSmemLimit - 1040 - (tma_y ? kGemmYOffset + 2 * kGemmYChunk : 0)) /
                  ((s.bm + 2 * s.bn) * kGemmRowBytes + 24);
  return fit < s.stages ? fit : s.stages;
}

// Per-launch tables: each residue's phase on both axes, and the divisors of the tile index.
// An M tile is a box of the phase's output positions, bn images x bh rows x bw columns (<= 128 rows in all, w
// fastest): the input it reads for one tap is the same box shifted, zero-filled past every border.
struct GemmTiles {
  AxisPhase32 ah[kGemmMaxStride], aw[kGemmMaxStride];
  FastDiv n_tiles, groups, splits, phases, stride_w, w_tiles, h_tiles, bw, bh;
  int bni;  // images a box
  int total;
  // Pairs (the wgmma kernel's kPaired): tiles a box (channel tiles x groups x splits x phases), pairs of boxes' tiles.
  int pairs;
  FastDiv inner;
  // Split-K in a cluster (kClusterK): tiles of one split a group and phase of a box (channel tiles x groups).
  FastDiv ng;
  // TF32: x's values are TF32 already (x_tf32_rounded), so the landed A stages need no rounding. Kept here, not in
  // GemmArgs: that struct stays within 128 bytes, which the compiler keeps in registers (at 136 it read the fields
  // from parameter memory inside the loops, and the channels-last TF32 rows ran up to 1.4x slower, bench/NOTES.md
  // v22).
  int a_rounded;
};

struct GemmArgs {
  const void* x;      // [N, H_in, W_in, c_in]: channels-last, rows of c_in >= C_in elements (x_pitch)
  const void* wp;     // [groups][kH][kW][cout_g][ci_pad], or the channels-last weights [C_in][kH][kW][cout_g]
  const void* bias;   // [C_out] or nullptr
  void* y;            // through ys*
  float* partial;     // split-K: [splits][N][H_out][W_out][C_out] fp32
  int n, c_in, h_in, w_in, c_out, h_out, w_out, kh, kw;  // c_in: x's row pitch
  int cin_g, cout_g, ci_pad, stride_h, stride_w;
  int64_t ys_n, ys_c, ys_h, ys_w;  // output strides in elements
};

// A tile's place: its phase, box origin (image, phase row and column) and channels, and the range of K stages it
// reduces.
struct GemmTile {
  AxisPhase32 ah, aw;
  int grp, split, n0, qh0, qw0, c0, k_begin, k_end;
};

// Tile t of the launch (output channels fastest, then groups, splits, phases, M boxes); false when its box lies
// wholly past the phase or the batch (kFill: d is filled either way). cpt: K stages a tap; kTwo: two taps a stage
// (16-bit groups of at most 32 input channels, the wgmma kernel).
template <bool kFill = false, bool kTwo = false>
__device__ __forceinline__ bool gemm_decode(int t, const GemmTiles& tl, int n_img, int bn, int cpt, GemmTile& d) {
  const int r0 = fdiv(t, tl.n_tiles);
  d.c0 = (t - r0 * static_cast<int>(tl.n_tiles.d)) * bn;
  const int r1 = fdiv(r0, tl.groups);
  d.grp = r0 - r1 * static_cast<int>(tl.groups.d);
  const int r2 = fdiv(r1, tl.splits);
  d.split = r1 - r2 * static_cast<int>(tl.splits.d);
  const int mt = fdiv(r2, tl.phases);
  const int phase = r2 - mt * static_cast<int>(tl.phases.d);
  const int rh = fdiv(phase, tl.stride_w);
  d.ah = tl.ah[rh];
  d.aw = tl.aw[phase - rh * static_cast<int>(tl.stride_w.d)];
  const int m1 = fdiv(mt, tl.w_tiles);
  d.qw0 = (mt - m1 * static_cast<int>(tl.w_tiles.d)) * static_cast<int>(tl.bw.d);
  const int nb = fdiv(m1, tl.h_tiles);
  d.qh0 = (m1 - nb * static_cast<int>(tl.h_tiles.d)) * static_cast<int>(tl.bh.d);
  d.n0 = nb * tl.bni;
  const bool inside = d.qw0 < d.aw.count && d.qh0 < d.ah.count && d.n0 < n_img;
  if (!kFill && !inside) return false;
  const int kiters = kTwo ? (d.ah.taps * d.aw.taps + 1) >> 1 : d.ah.taps * d.aw.taps * cpt;
  d.k_begin = static_cast<int>(static_cast<int64_t>(kiters) * d.split / tl.splits.d);
  d.k_end = static_cast<int>(static_cast<int64_t>(kiters) * (d.split + 1) / tl.splits.d);
  return inside;
}

// Work item w of a block, whose items are w = first, first + step, ... below tl.total alone (first: the block's
// index, step: the grid's blocks), tl.pairs in pairs or tl.total / splits with split-K in a cluster (first: the
// cluster's index, step: the grid's clusters). Alone, item w is tile w and is run where its box holds output (own).
// In a pair, item w is two tiles that differ only in their M box (boxes 2 (w / inner) and the next, same channels,
// group, split and phase, so the same B stages), block `rank` the one or the other: both run it unless both boxes
// lie past the phase or the batch, since each brings half of the pair's B stages; a block whose own box does (own
// false) loads no A and stores nothing. With split-K in a cluster (kClusterK), item w is one tile's splits, block
// `rank` its split `rank`: all blocks of the cluster run it or none.
template <bool kPaired, bool kTwo, bool kClusterK = false>
__device__ __forceinline__ bool gemm_work(int w, const GemmTiles& tl, int n_img, int bn, int cpt, int rank,
                                          GemmTile& d, bool& own) {
  if constexpr (kClusterK) {
    const int ng = static_cast<int>(tl.ng.d);
    const int r = fdiv(w, tl.ng);  // the item's box and phase
    const int t = (r * static_cast<int>(tl.splits.d) + rank) * ng + (w - r * ng);
    own = gemm_decode<false, kTwo>(t, tl, n_img, bn, cpt, d);
    return own;
  } else if constexpr (!kPaired) {
    own = gemm_decode<false, kTwo>(w, tl, n_img, bn, cpt, d);
    return own;
  } else {
    const int mp = fdiv(w, tl.inner);
    const int i = w - mp * static_cast<int>(tl.inner.d);
    own = gemm_decode<true, kTwo>((2 * mp + rank) * static_cast<int>(tl.inner.d) + i, tl, n_img, bn, cpt, d);
    GemmTile other;
    return gemm_decode<false, kTwo>((2 * mp + 1 - rank) * static_cast<int>(tl.inner.d) + i, tl, n_img, bn, cpt,
                                    other) ||
           own;
  }
}

// Row r of a tile's box as (image, box row, box column), without bounds checks.
__device__ __forceinline__ void gemm_box_pos(const GemmTiles& tl, int r, int& nb, int& qh, int& qw) {
  const int r1 = fdiv(r, tl.bw);
  qw = r - r1 * static_cast<int>(tl.bw.d);
  nb = fdiv(r1, tl.bh);
  qh = r1 - nb * static_cast<int>(tl.bh.d);
}

// The output pixel of row r of a tile: false for rows past the box, the phase or the batch (computed from whatever
// the buffers held, and dropped).
__device__ __forceinline__ bool gemm_row(const GemmArgs& g, const GemmTiles& tl, const GemmTile& d, int r, int& n,
                                         int& ho, int& wo) {
  int nb, qh, qw;
  gemm_box_pos(tl, r, nb, qh, qw);
  n = d.n0 + nb;
  qh += d.qh0;
  qw += d.qw0;
  if (nb >= tl.bni || n >= g.n || qh >= d.ah.count || qw >= d.aw.count) return false;
  ho = d.ah.o0 + qh * g.stride_h;
  wo = d.aw.o0 + qw * g.stride_w;
  return true;
}

// Two neighbouring output channels in one store (the address is aligned to the pair).
__device__ __forceinline__ void store_pair(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = {a, b}; }
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// Two neighbouring 16-bit output values as one 32-bit word (the lower channel in the low half).
__device__ __forceinline__ uint32_t pack_pair(__nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_pair(__half*, float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Sixteen output channels of one row of a warp's accumulators, 16-bit channels-last output: columns 16J .. 16J + 15
// of the tile are held as pairs, lane q of a quad (q = lane % 4) holding columns 2q, 2q + 1 (v0, v1) and 8 + 2q,
// 9 + 2q (v2, v3). Stored as such, a warp instruction writes half of each 32-byte sector it touches, and the
// other half comes with the next instruction: twice the L2 writes. Here the quad trades its pairs first, so that
// lane q stores columns 4q .. 4q + 3 as one 8-byte store and a warp instruction fills whole sectors. Every lane of
// the warp must call it (shuffles); `ok` says whether this lane's row is stored. `co` is the lane's first column
// (16J + 2q in the tile's group, plus the tile's first column); the bias is added here.
template <typename T>
__device__ __forceinline__ void gemm_store_quad(const GemmArgs& g, const GemmTile& d, bool ok, int n, int ho, int wo,
                                                int co, float v0, float v1, float v2, float v3) {
  const int co_base = d.grp * g.cout_g;
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  if (bias != nullptr && co < g.cout_g) {  // C_out / groups is a multiple of 4: a pair is all in or all out
    v0 += to_acc(bias[co_base + co]);
    v1 += to_acc(bias[co_base + co + 1]);
  }
  if (bias != nullptr && co + 8 < g.cout_g) {
    v2 += to_acc(bias[co_base + co + 8]);
    v3 += to_acc(bias[co_base + co + 9]);
  }
  const uint32_t lo_pair = pack_pair(static_cast<T*>(nullptr), v0, v1);
  const uint32_t hi_pair = pack_pair(static_cast<T*>(nullptr), v2, v3);
  const int lane = threadIdx.x & 31, q = lane & 3;
  // Lane q's columns 4q .. 4q + 3 are the pairs of lanes 2 (q % 2) and 2 (q % 2) + 1, in the low group for q < 2.
  const int src = (lane & ~3) | ((q & 1) << 1);
  const uint32_t a_lo = __shfl_sync(0xffffffffu, lo_pair, src), a_hi = __shfl_sync(0xffffffffu, hi_pair, src);
  const uint32_t b_lo = __shfl_sync(0xffffffffu, lo_pair, src + 1), b_hi = __shfl_sync(0xffffffffu, hi_pair, src + 1);
  const int c = co - 2 * q + 4 * q;  // the first of this lane's four columns: co - 2q is the sixteen's first
  if (!ok || c >= g.cout_g) return;
  T* yp = static_cast<T*>(g.y) + n * g.ys_n + ho * g.ys_h + wo * g.ys_w + co_base + c;
  *reinterpret_cast<uint2*>(yp) = q < 2 ? make_uint2(a_lo, b_lo) : make_uint2(a_hi, b_hi);
}

// Output channels co and co + 1 of the tile's group (those below C_out / groups) at one output pixel: into the
// split's fp32 partial sums, or with the bias into y through its strides (one store for both when `pair_stores`:
// a channels-last y whose channel pairs start at even elements).
template <typename T>
__device__ __forceinline__ void gemm_store_cols(const GemmArgs& g, const GemmTile& d, int n, int ho, int wo, int co,
                                                float v0, float v1, bool pair_stores) {
  const int co_base = d.grp * g.cout_g;
  if (g.partial != nullptr) {
    float* pp = g.partial +
                ((((static_cast<int64_t>(d.split) * g.n + n) * g.h_out + ho) * g.w_out + wo) * g.c_out) + co_base;
    if (co < g.cout_g) pp[co] = v0;
    if (co + 1 < g.cout_g) pp[co + 1] = v1;
    return;
  }
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  T* yp = static_cast<T*>(g.y) + n * g.ys_n + ho * g.ys_h + wo * g.ys_w + co_base * g.ys_c;
  if (bias != nullptr) {
    if (co < g.cout_g) v0 += to_acc(bias[co_base + co]);
    if (co + 1 < g.cout_g) v1 += to_acc(bias[co_base + co + 1]);
  }
  if (pair_stores && co + 1 < g.cout_g) {
    store_pair(yp + co, v0, v1);
  } else {
    if (co < g.cout_g) yp[co * g.ys_c] = from_acc<T>(v0);
    if (co + 1 < g.cout_g) yp[(co + 1) * g.ys_c] = from_acc<T>(v1);
  }
}

// The mma.sync kernel's launch (conv_transpose2d_gemm_sync.cu) for a sync configuration, with the packed weights.
cudaError_t launch_gemm_sync(DType dtype, int config, const GemmArgs& a, const GemmTiles& tl, cudaStream_t stream);

}  // namespace deconv
