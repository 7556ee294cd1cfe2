// Layers with few output channels: FCN's 8x, 16x and 32x score up-samplers (21 classes, kernel 2s, stride s), RGB
// and one-channel output layers (GAN generators, super-resolution), other class-map and mask up-samplers. The phase
// GEMMs of the other kernels have C_out columns and write every s_w-th element of a row: a 64-column tile then does
// a small part of its work, and with a wide stride 8 tiles finish each 32-byte sector. This kernel folds the
// stride's column phases into the GEMM's columns instead (docs/architecture.md, "Kernels"). For one row phase py
// (output rows oy = a s_h + py - pad_h) and the positions (a, b) of a tile:
//   Y[(a, b), (co, px)] = sum over taps (t, u) and ci of x[n, ci, a - t, b - u] w[ci, co, py + t s_h, px + u s_w],
//   y[n, co, a s_h + py - pad_h, b s_w + px - pad_w] = Y[(a, b), (co, px)] + bias[co],
// one GEMM of M = positions, N = C_out s_w (every column phase px of every output channel, padded with zero columns
// to a multiple of 8), K = the taps a phase has times C_in. An n8 tile of N is then 8 neighbouring output columns
// (NCHW y: column phases of one channel, or of neighbouring channels when s_w < 8; channels-last y: 8 neighbouring
// (px, co) elements of one row), and an m16 tile is two rows of 8 positions b, so that with s_w = 8 a warp's pair
// stores write 256 contiguous bytes of an NCHW row, straight from the accumulators.
//
// A block (256 threads, 8 warps) keeps one row phase's weights for a chunk of at most 22 n8 tiles (8 in exact
// fp32) in shared memory and computes 16 x 8 positions a tile (warps: 4 along a, 2 along N), persistent over a
// contiguous run of tiles ordered (chunk, row phase, image, a, b) so that it loads the weights again only when its
// run crosses into the next row phase. With a single n8 tile (N <= 8: RGB and one-channel layers) the two warps
// along N take alternate k8 steps of it instead, and one adds the other's sums through shared memory. A tile's
// input patch (its rows and columns plus the taps' halo, every input channel) is loaded into shared memory as fp32
// words, then the products run on mma.sync m16n8k8 TF32: fp32 inputs rounded to TF32 as cuDNN's allow_tf32 does,
// bf16 and fp16 inputs exactly (both are TF32 values), all summed in fp32. Exact fp32 splits each operand into a
// TF32 part and a TF32 residual in registers (3xTF32, mma.cuh) and sums every 4 k8 steps' products into a fresh
// partial sum added with fp32 adds. x, w and y are read and written in either layout as they are: one kernel a
// call, no packing.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "convert.cuh"
#include "gemm.cuh"
#include "halo.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace deconv {
namespace {

constexpr int kFoldThreads = 256;   // 8 warps
constexpr int kFoldWarpsM = 4;      // warps along the tile's positions: 2 m16 tiles (4 rows a) each
constexpr int kFoldWarpsN = 2;      // warps along N: n8 tiles wn, wn + 2, ...
constexpr int kFoldTilesM = 2;      // m16 tiles a warp
constexpr int kFoldTileA = kFoldWarpsM * kFoldTilesM * 2;  // 16 rows a a tile
constexpr int kFoldTileB = 8;                              // 8 positions b a tile
// n8 tiles a warp, at most: 11 (a chunk of 22), or 4 (a chunk of 8) in exact fp32, whose partial sums double the
// accumulators a thread holds.
template <bool kExact>
constexpr int kFoldWarpTilesN = kExact ? 4 : 11;
constexpr int kFoldExactGroup = 4;  // exact fp32: k8 steps a warp sums into one partial sum
// Shared memory a block may take: two blocks an SM on sm_90 (228 KiB) and sm_80 (164 KiB: one).
constexpr size_t kFoldSmemLimit = 110 * 1024;
constexpr int kFoldMaxStride = 64;

// Division by a divisor fixed at launch, for numerators in [0, 2^31): a multiply-high, an add and a shift
// (q = (umulhi(n, mul) + n) >> shift, the round-up method of Granlund and Montgomery) instead of the ~20
// instructions of an integer division, in the loops that turn a flat element index into its coordinates.
struct FoldDiv {
  uint32_t mul = 1, shift = 0;
  void set(uint32_t d) {
    shift = 0;
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ int operator()(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), mul) + static_cast<uint32_t>(n)) >> shift);
  }
};

struct FoldArgs {
  const void* x;
  const void* w;
  const void* bias;
  void* y;
  // Element strides: x [n, ci, iy, ix], w [ci, co, ky, kx], y [n, co, oy, ox] (either layout).
  int64_t xs_n, xs_c, xs_h, xs_w;
  int64_t ws_i, ws_o, ws_h, ws_w;
  int64_t ys_n, ys_c, ys_h, ys_w;
  int n, c_in, h_in, w_in, c_out, h_out, w_out, kh, kw, s_h, s_w, pad_h, pad_w;
  bool y_cl;      // N columns ordered (px, co) rather than (co, px)
  bool round;     // fp32 inputs in TF32: round to TF32 (exact fp32 keeps every bit and splits in registers)
  // Geometry (fold_geometry).
  int th, tw;     // taps a phase per axis
  int cip;        // input channels padded to 8
  int ksteps;     // k8 steps: th tw cip / 8
  int ncols;      // N: C_out s_w
  int ntiles;     // n8 tiles of N: ceil(C_out s_w / 8)
  int ntc;        // n8 tiles a chunk
  int pr, pc, pp; // patch rows, columns, words a channel plane
  int a_blocks, b_blocks;
  int b_first;    // the first position b (its columns may be cropped)
  int64_t tiles;
  // Every pair of columns (n, n + 1) of an even n starts at an even element of y, in every row of every image
  // (offsets whose parity the pair stores' alignment needs).
  bool pairs_even;
  // Divisions by cols (ntc * 8), cip, tw, the column order's inner count (C_out for a channels-last y, else s_w),
  // the patch's plane (pr pc) and row (pc), and C_in.
  FoldDiv by_cols, by_cip, by_tw, by_inner, by_plane, by_pc, by_cin;
};

// Shared-memory words a channel plane of the patch takes: at least `words`, and 8 more than a multiple of 32, so
// that the four channel planes a quad of lanes reads fall in disjoint 8-bank groups.
__host__ __device__ inline int conflict_free(int words) { return words + ((8 - words % 32) + 32) % 32; }

template <typename T>
__device__ __forceinline__ uint32_t tf32_word(T v, bool round) {
  const float f = to_acc(v);
  return round ? tc::to_tf32(f) : __float_as_uint(f);
}

// Copies `total` elements of src into shared memory as TF32 words, 8 (kBatch) a thread at a time, every load of a
// batch issued before any is used, so that they are in flight together (one by one, each waits its own round trip).
// at(e, from) gives element e's word in dst and sets `from` to its offset in src, or -1 for a zero.
template <int kBatch, typename T, typename At>
__device__ __forceinline__ void fold_gather(uint32_t* dst, const T* __restrict__ src, int total, bool round, At at) {
  for (int e0 = threadIdx.x; e0 < total; e0 += kBatch * kFoldThreads) {
    T v[kBatch];
    int to[kBatch];
    bool ok[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kFoldThreads;
      int64_t from = -1;
      to[u] = e < total ? at(e, from) : -1;
      ok[u] = from >= 0;
      if (ok[u]) v[u] = src[from];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (to[u] >= 0) dst[to[u]] = ok[u] ? tf32_word(v[u], round) : 0u;
  }
}

template <typename T, bool kExact>
__global__ void __launch_bounds__(kFoldThreads, 2) conv_transpose2d_fold_kernel(const FoldArgs g) {
  constexpr int kWarpTilesN = kFoldWarpTilesN<kExact>;
  extern __shared__ __align__(16) uint32_t smem[];
  const int kwords = g.ksteps * 8, cols = g.ntc * 8;
  // A row phase's weights for a chunk, [k8 step][column][k % 4][k / 4 % 2]: a lane's two B words (k and k + 4) are
  // one 8-byte load, and a warp's loads of an n8 tile 256 contiguous bytes.
  uint32_t* bs = smem;
  uint32_t* patch = bs + kwords * cols;       // [cip][pr][pc] (plane pitch pp)
  int* koff = reinterpret_cast<int*>(patch + g.cip * g.pp);  // a k8 step's patch offset
  int* col_at = koff + (g.ksteps + 1) / 2 * 2;  // a chunk column's y offset (channel and column phase) ...
  int* col_px = col_at + cols;                // ... its column phase px (-1: past N)
  float* col_bias = reinterpret_cast<float*>(col_px + cols);  // ... and its bias
  const T* __restrict__ x = static_cast<const T*>(g.x);
  const T* __restrict__ w = static_cast<const T*>(g.w);
  const T* __restrict__ bias = static_cast<const T*>(g.bias);
  T* __restrict__ y = static_cast<T*>(g.y);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int gq = lane / 4, tq = lane % 4;  // the mma fragments' row group and column pair
  const int wm = warp % kFoldWarpsM, wn = warp / kFoldWarpsM;
  const int steps_per_tap = g.cip / 8;
  for (int s = tid; s < g.ksteps; s += kFoldThreads) {
    const int tap = s / steps_per_tap, ci0 = (s % steps_per_tap) * 8;
    const int t = tap / g.tw, u = tap % g.tw;
    koff[s] = ci0 * g.pp + (g.th - 1 - t) * g.pc + (g.tw - 1 - u);
  }
  // The patch's planes past x's channels (the k8 steps' padding) stay zeros.
  for (int e = g.c_in * g.pp + tid; e < g.cip * g.pp; e += kFoldThreads) patch[e] = 0;
  // Patch offset of this lane's A fragments: channel tq, row 4 wm (+ 2 a second m16 tile, + 1 its second row),
  // column gq.
  const int a_base = tq * g.pp + (wm * kFoldTilesM * 2) * g.pc + gq;
  const bool pairs_aligned = reinterpret_cast<uintptr_t>(y) % (2 * sizeof(T)) == 0;
  // One n8 tile (block-uniform, as every chunk of such a layer has one): the warps along N split its k8 steps.
  const bool ksplit = g.ntiles == 1;
  const int wnt = ksplit ? 0 : wn;  // this warp's first n8 tile
  const int s_first = ksplit ? wn : 0, s_step = ksplit ? kFoldWarpsN : 1;

  const int64_t per = g.tiles / gridDim.x, extra = g.tiles % gridDim.x;
  const int64_t first = blockIdx.x * per + (blockIdx.x < extra ? blockIdx.x : extra);
  const int64_t last = first + per + (blockIdx.x < extra ? 1 : 0);
  int loaded = -1;  // chunk * s_h + py of the weights in shared memory
  for (int64_t tile = first; tile < last; ++tile) {
    int64_t r = tile;
    const int bb = static_cast<int>(r % g.b_blocks);
    r /= g.b_blocks;
    const int ab = static_cast<int>(r % g.a_blocks);
    r /= g.a_blocks;
    const int img = static_cast<int>(r % g.n);
    r /= g.n;
    const int py = static_cast<int>(r % g.s_h), chunk = static_cast<int>(r / g.s_h);
    const int a0 = (g.pad_h - py + g.s_h - 1) / g.s_h + ab * kFoldTileA;  // first row a of the tile
    const int b0 = g.b_first + bb * kFoldTileB;
    const int n0 = chunk * cols;                            // first column of the chunk
    const int ntc = min(g.ntc, g.ntiles - chunk * g.ntc);   // n8 tiles of this chunk
    __syncthreads();  // the last tile's products have read the patch (and the weights)
    if (chunk * g.s_h + py != loaded) {
      loaded = chunk * g.s_h + py;
      for (int nl = tid; nl < cols; nl += kFoldThreads) {
        const int n = n0 + nl;
        const int q = g.by_inner(n), rem = n - q * (g.y_cl ? g.c_out : g.s_w);
        const int co = g.y_cl ? rem : q, px = g.y_cl ? q : rem;
        const bool in = nl < ntc * 8 && n < g.ncols;
        col_at[nl] = in ? static_cast<int>(co * g.ys_c + px * g.ys_w) : 0;
        col_px[nl] = in ? px : -1;
        col_bias[nl] = in && bias != nullptr ? to_acc(bias[co]) : 0.f;
      }
      fold_gather<8>(bs, w, kwords * cols, g.round, [&](int e, int64_t& from) {
        const int k = g.by_cols(e), nl = e - k * cols;
        const int tap = g.by_cip(k), ci = k - tap * g.cip;
        const int t = g.by_tw(tap), u = tap - t * g.tw;
        const int ky = py + t * g.s_h;
        const int n = n0 + nl;
        const int q = g.by_inner(n), rem = n - q * (g.y_cl ? g.c_out : g.s_w);
        const int co = g.y_cl ? rem : q, px = g.y_cl ? q : rem;
        const int kx = px + u * g.s_w;
        from = ci < g.c_in && ky < g.kh && kx < g.kw && nl < ntc * 8 && n < g.ncols
                   ? ci * g.ws_i + co * g.ws_o + ky * g.ws_h + kx * g.ws_w : -1;
        return (k >> 3) * cols * 8 + nl * 8 + (k & 3) * 2 + ((k >> 2) & 1);
      });
    }
    {  // the patch: rows a0 - th + 1 .. a0 + 15, columns b0 - tw + 1 .. b0 + 7 of x's channels; zeros outside x
      const int iy0 = a0 - (g.th - 1), ix0 = b0 - (g.tw - 1);
      const int plane = g.pr * g.pc;
      const bool cl = g.xs_c == 1;  // channels-last x: channels fastest
      fold_gather<8>(patch, x + img * g.xs_n, g.c_in * plane, g.round, [&](int e, int64_t& from) {
        int ci, pos;
        if (cl) {
          pos = g.by_cin(e);
          ci = e - pos * g.c_in;
        } else {
          ci = g.by_plane(e);
          pos = e - ci * plane;
        }
        const int pr = g.by_pc(pos), pc = pos - pr * g.pc;
        const int iy = iy0 + pr, ix = ix0 + pc;
        from = iy >= 0 && iy < g.h_in && ix >= 0 && ix < g.w_in ? ci * g.xs_c + iy * g.xs_h + ix * g.xs_w : -1;
        return ci * g.pp + pos;
      });
    }
    __syncthreads();

    // The products of k8 step s into sums: one TF32 product a pair of fragments, or three in exact fp32 (the
    // residuals' products first: lo x hi, hi x lo, hi x hi).
    auto step = [&](float (&sums)[kFoldTilesM][kWarpTilesN][4], int s) {
      const int ko = koff[s];
      uint32_t a[kFoldTilesM][4], alo[kFoldTilesM][4];
#pragma unroll
      for (int i = 0; i < kFoldTilesM; ++i) {
        const uint32_t* pa = patch + a_base + i * 2 * g.pc + ko;
        a[i][0] = pa[0];
        a[i][1] = pa[g.pc];
        a[i][2] = pa[4 * g.pp];
        a[i][3] = pa[4 * g.pp + g.pc];
        if constexpr (kExact) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float v = __uint_as_float(a[i][e]);
            a[i][e] = tc::to_tf32(v);
            alo[i][e] = tc::tf32_residual(v, a[i][e]);
          }
        }
      }
      const uint2* pb = reinterpret_cast<const uint2*>(bs) + s * cols * 4 + gq * 4 + tq;
#pragma unroll
      for (int j = 0; j < kWarpTilesN; ++j) {
        const int nt = wnt + j * kFoldWarpsN;
        if (nt < ntc) {
          const uint2 bw = pb[nt * 32];
          uint32_t b[2] = {bw.x, bw.y};
          if constexpr (kExact) {
            uint32_t blo[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float v = __uint_as_float(b[e]);
              b[e] = tc::to_tf32(v);
              blo[e] = tc::tf32_residual(v, b[e]);
            }
#pragma unroll
            for (int i = 0; i < kFoldTilesM; ++i) {
              tc::mma<tc::MmaKind::kTF32>(sums[i][j], alo[i], b);
              tc::mma<tc::MmaKind::kTF32>(sums[i][j], a[i], blo);
            }
          }
#pragma unroll
          for (int i = 0; i < kFoldTilesM; ++i) tc::mma<tc::MmaKind::kTF32>(sums[i][j], a[i], b);
        }
      }
    };
    float acc[kFoldTilesM][kWarpTilesN][4];
    tc::zero_tile(acc);
    if constexpr (kExact) {
      // A fresh partial sum every kFoldExactGroup steps, added with fp32 adds (mma.cuh: the tensor cores' truncated
      // accumulation would otherwise drift with K).
      for (int s0 = s_first; s0 < g.ksteps; s0 += kFoldExactGroup * s_step) {
        float part[kFoldTilesM][kWarpTilesN][4];
        tc::zero_tile(part);
        for (int q = 0, s = s0; q < kFoldExactGroup && s < g.ksteps; ++q, s += s_step) step(part, s);
        tc::add_tile(acc, part);
      }
    } else {
      for (int s = s_first; s < g.ksteps; s += s_step) step(acc, s);
    }
    if (ksplit) {  // the second warp along N hands its sums to the first through the patch's words
      float* sums = reinterpret_cast<float*>(patch);  // 1024 words: the patch has at least 8 x 136
      __syncthreads();  // every warp's products have read the patch
      if (wn == 1) {
#pragma unroll
        for (int i = 0; i < kFoldTilesM; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) sums[((wm * kFoldTilesM + i) * 4 + e) * 32 + lane] = acc[i][0][e];
      }
      __syncthreads();
      if (wn == 1) continue;
#pragma unroll
      for (int i = 0; i < kFoldTilesM; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[i][0][e] = __fadd_rn(acc[i][0][e], sums[((wm * kFoldTilesM + i) * 4 + e) * 32 + lane]);
    }

    // Epilogue: bias, rounding to T, stores straight from the accumulators.
    const int b = b0 + gq;
    const int ox0 = b * g.s_w - g.pad_w;  // the output column of px = 0
    // A tile whose every row and column lands in y, pair stores aligned throughout: one vector store a pair with no
    // checks but N's end (most tiles of a large layer). The others check each element. Pairs start at even columns
    // n and N is even where pairs_even holds, so a pair is wholly inside N or wholly past it.
    const bool inside = (a0 + kFoldTileA - 1) * g.s_h + py - g.pad_h < g.h_out && b0 * g.s_w - g.pad_w >= 0 &&
                        (b0 + kFoldTileB) * g.s_w - g.pad_w <= g.w_out;
    if (inside && g.pairs_even && pairs_aligned) {
#pragma unroll
      for (int i = 0; i < kFoldTilesM; ++i) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int oy = (a0 + (wm * kFoldTilesM + i) * 2 + rr) * g.s_h + py - g.pad_h;
          T* row = y + (img * g.ys_n + oy * g.ys_h + ox0 * g.ys_w);
#pragma unroll
          for (int j = 0; j < kWarpTilesN; ++j) {
            const int nt = wnt + j * kFoldWarpsN;
            const int nl = nt * 8 + 2 * tq;
            if (nt < ntc && col_px[nl] >= 0) {
              const float2 bv = *reinterpret_cast<const float2*>(col_bias + nl);
              store_pair(row + col_at[nl], acc[i][j][2 * rr] + bv.x, acc[i][j][2 * rr + 1] + bv.y);
            }
          }
        }
      }
      continue;
    }
#pragma unroll
    for (int j = 0; j < kWarpTilesN; ++j) {
      const int nt = wnt + j * kFoldWarpsN;
      if (nt >= ntc) continue;
      int64_t col[2];  // y offset of columns n, n + 1 within an image's row (-1: cropped or past N)
      float bv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int nl = nt * 8 + 2 * tq + h;
        const int ox = ox0 + col_px[nl];
        col[h] = col_px[nl] >= 0 && ox >= 0 && ox < g.w_out ? col_at[nl] + static_cast<int64_t>(ox0) * g.ys_w : -1;
        bv[h] = col_bias[nl];
      }
      const bool pair = pairs_aligned && col[0] >= 0 && col[1] == col[0] + 1;
#pragma unroll
      for (int i = 0; i < kFoldTilesM; ++i) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int oy = (a0 + (wm * kFoldTilesM + i) * 2 + rr) * g.s_h + py - g.pad_h;
          if (oy >= g.h_out) continue;
          const int64_t row_at = img * g.ys_n + oy * g.ys_h;
          T* row = y + row_at;
          const float v0 = acc[i][j][2 * rr] + bv[0], v1 = acc[i][j][2 * rr + 1] + bv[1];
          if (pair && (row_at + col[0]) % 2 == 0) {
            store_pair(row + col[0], v0, v1);
          } else {
            if (col[0] >= 0) row[col[0]] = from_acc<T>(v0);
            if (col[1] >= 0) row[col[1]] = from_acc<T>(v1);
          }
        }
      }
    }
  }
}

// Exact fp32: 3xTF32 products (the kernel's kExact form).
bool fold_exact(const ConvTranspose2dParams& p) {
  return p.dtype == DType::kFloat32 && p.precision == Precision::kExactFp32;
}

// The kernel's geometry for `p`; tiles 0 when it cannot run it.
FoldArgs fold_geometry(const ConvTranspose2dParams& p) {
  FoldArgs g{};
  g.th = static_cast<int>(tc::div_up(p.kH, p.stride_h));
  g.tw = static_cast<int>(tc::div_up(p.kW, p.stride_w));
  g.cip = static_cast<int>(tc::div_up(p.C_in, 8) * 8);
  g.ksteps = g.th * g.tw * g.cip / 8;
  g.ncols = static_cast<int>(p.C_out * p.stride_w);
  g.ntiles = static_cast<int>(tc::div_up(g.ncols, 8));
  const int chunk_tiles = kFoldWarpsN * (fold_exact(p) ? kFoldWarpTilesN<true> : kFoldWarpTilesN<false>);
  const int chunks = static_cast<int>(tc::div_up(g.ntiles, chunk_tiles));
  g.ntc = static_cast<int>(tc::div_up(g.ntiles, chunks));
  g.pr = kFoldTileA + g.th - 1;
  g.pc = kFoldTileB + g.tw - 1;
  g.pp = conflict_free(g.pr * g.pc);
  int a_rows = 0;  // the most rows a of any row phase
  for (int py = 0; py < p.stride_h; ++py) {
    const int64_t hi = p.H_out - 1 + p.pad_h - py;
    if (hi < 0) continue;
    const int64_t rows = hi / p.stride_h - (p.pad_h - py + p.stride_h - 1) / p.stride_h + 1;
    if (rows > a_rows) a_rows = static_cast<int>(rows);
  }
  g.a_blocks = static_cast<int>(tc::div_up(a_rows, kFoldTileA));
  g.b_first = floor_div(static_cast<int>(p.pad_w - p.stride_w + 1), static_cast<int>(p.stride_w));
  const int b_last = floor_div(static_cast<int>(p.W_out - 1 + p.pad_w), static_cast<int>(p.stride_w));
  g.b_blocks = static_cast<int>(tc::div_up(b_last - g.b_first + 1, kFoldTileB));
  g.tiles = static_cast<int64_t>(chunks) * p.stride_h * p.N * g.a_blocks * g.b_blocks;
  return g;
}

size_t fold_smem(const FoldArgs& g) {
  return static_cast<size_t>(g.ksteps * 8 * g.ntc * 8 + g.cip * g.pp + (g.ksteps + 1) / 2 * 2 + 3 * g.ntc * 8) * 4;
}

template <typename T, bool kExact = false>
cudaError_t fold_launch_as(const ConvTranspose2dParams& p, FoldArgs g, cudaStream_t stream) {
  const cudaError_t err = opt_in_shared_memory<conv_transpose2d_fold_kernel<T, kExact>>();
  if (err != cudaSuccess) return err;
  const int sms = sm_count() > 0 ? sm_count() : 1;
  const int64_t blocks = g.tiles < 2 * sms ? g.tiles : 2 * sms;
  conv_transpose2d_fold_kernel<T, kExact><<<static_cast<unsigned>(blocks), kFoldThreads, fold_smem(g), stream>>>(g);
  return cudaGetLastError();
}

}  // namespace

bool fold_eligible(const ConvTranspose2dParams& p) {
  if (p.dtype == DType::kFloat64) return false;
  if (p.groups != 1 || p.x_pitch > 0) return false;
  if ((p.kH > 1 && p.dil_h != 1) || (p.kW > 1 && p.dil_w != 1)) return false;
  if (p.stride_w > kFoldMaxStride || p.stride_h > kFoldMaxStride) return false;
  if (p.N < 1 || p.C_in < 1 || p.C_out < 1) return false;
  // Every offset of x, y and w, and every count, fits a 32-bit int (offsets are formed in 64 bits).
  const int64_t lim = int64_t(1) << 30;
  if (p.N * p.C_in * p.H_in * p.W_in >= lim || p.N * p.C_out * p.H_out * p.W_out >= lim ||
      p.C_in * p.C_out * p.kH * p.kW >= lim || p.H_out + p.pad_h >= lim || p.W_out + p.pad_w >= lim)
    return false;
  const FoldArgs g = fold_geometry(p);
  if (g.tiles <= 0 || g.tiles >= lim) return false;
  const size_t smem = fold_smem(g);
  return smem <= kFoldSmemLimit && smem <= max_dynamic_smem();
}

// Preferred where eligible with a column stride that is a multiple of 8 and at most kFoldMaxPreferredCin input
// channels, unless the tiled narrow kernel is preferred (at most 8 output channels over many pixels). The class-map
// up-samplers of FCN (19-21 channels, strides 8-32) run 1.06-3.19x faster here than on any other kernel of ours,
// where the phase GEMMs leave most of a tile's columns idle (1.44-1.62x in exact fp32); but a one-channel mask
// up-sampler runs 1.7-2.4x faster on the tiled narrow kernel, and with 32 input channels the gemm kernel is
// 1.02-1.13x faster (bench/NOTES.md v32 and v38, `probes fold`). With a narrower column stride the input patch a
// tile loads serves few columns: RGB and one-channel output layers ran 2.9-3.6x slower here than on the tiled narrow
// kernel (v38).
constexpr int64_t kFoldMaxPreferredCin = 24;

bool fold_preferred(const ConvTranspose2dParams& p) {
  if (p.stride_w % 8 != 0 || p.C_in > kFoldMaxPreferredCin) return false;
  if (narrow_tiled_eligible(p) && narrow_tiled_preferred(p)) return false;
  return fold_eligible(p);
}

cudaError_t launch_fold(const ConvTranspose2dParams& p, cudaStream_t stream) {
  if (!fold_eligible(p)) return cudaErrorInvalidValue;
  FoldArgs g = fold_geometry(p);
  g.x = p.x;
  g.w = p.w;
  g.bias = p.bias;
  g.y = p.y;
  const int64_t hw_in = p.H_in * p.W_in, hw_out = p.H_out * p.W_out;
  if (p.x_channels_last) {
    g.xs_n = hw_in * p.C_in, g.xs_c = 1, g.xs_h = p.W_in * p.C_in, g.xs_w = p.C_in;
  } else {
    g.xs_n = p.C_in * hw_in, g.xs_c = hw_in, g.xs_h = p.W_in, g.xs_w = 1;
  }
  if (p.w_channels_last) {  // [C_in][kH][kW][C_out]
    g.ws_i = p.kH * p.kW * p.C_out, g.ws_o = 1, g.ws_h = p.kW * p.C_out, g.ws_w = p.C_out;
  } else {
    g.ws_i = p.C_out * p.kH * p.kW, g.ws_o = p.kH * p.kW, g.ws_h = p.kW, g.ws_w = 1;
  }
  if (p.y_channels_last) {
    g.ys_n = hw_out * p.C_out, g.ys_c = 1, g.ys_h = p.W_out * p.C_out, g.ys_w = p.C_out;
  } else {
    g.ys_n = p.C_out * hw_out, g.ys_c = hw_out, g.ys_h = p.W_out, g.ys_w = 1;
  }
  g.n = static_cast<int>(p.N), g.c_in = static_cast<int>(p.C_in), g.h_in = static_cast<int>(p.H_in);
  g.w_in = static_cast<int>(p.W_in), g.c_out = static_cast<int>(p.C_out), g.h_out = static_cast<int>(p.H_out);
  g.w_out = static_cast<int>(p.W_out), g.kh = static_cast<int>(p.kH), g.kw = static_cast<int>(p.kW);
  g.s_h = static_cast<int>(p.stride_h), g.s_w = static_cast<int>(p.stride_w);
  g.pad_h = static_cast<int>(p.pad_h), g.pad_w = static_cast<int>(p.pad_w);
  g.y_cl = p.y_channels_last;
  g.round = p.dtype == DType::kFloat32 && !fold_exact(p);
  // Pair n, n + 1 (n even) starts at img ys_n + oy ys_h + (b s_w - pad_w) ys_w + [co ys_c + px ys_w]; the bracket
  // is n itself for a channels-last y (n = px C_out + co), and co ys_c + px with px even for an NCHW one (s_w even).
  g.pairs_even = g.ys_n % 2 == 0 && g.ys_h % 2 == 0 && (p.stride_w * g.ys_w) % 2 == 0 && (p.pad_w * g.ys_w) % 2 == 0 &&
                 (p.y_channels_last || g.ys_c % 2 == 0);
  g.by_cols.set(g.ntc * 8);
  g.by_cip.set(g.cip);
  g.by_tw.set(g.tw);
  g.by_inner.set(static_cast<uint32_t>(p.y_channels_last ? p.C_out : p.stride_w));
  g.by_plane.set(g.pr * g.pc);
  g.by_pc.set(g.pc);
  g.by_cin.set(static_cast<uint32_t>(p.C_in));
  switch (p.dtype) {
    case DType::kFloat32:
      return fold_exact(p) ? fold_launch_as<float, true>(p, g, stream) : fold_launch_as<float>(p, g, stream);
    case DType::kFloat16:
      return fold_launch_as<__half>(p, g, stream);
    case DType::kBFloat16:
      return fold_launch_as<__nv_bfloat16>(p, g, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
