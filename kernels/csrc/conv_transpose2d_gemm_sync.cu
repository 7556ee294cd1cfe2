// The gemm path's tiles on mma.sync (sm_80 and newer: TF32 m16n8k8, BF16/FP16 m16n8k16, fp32 accumulation): the
// channel-major implicit GEMM of conv_transpose2d_gemm.cu where wgmma and the Tensor Memory Accelerator are not
// (Ampere, Ada), and configurations measured choice may pick on Hopper too. Same tiles, K order and operand layouts
// (gemm.cuh); what differs is how a stage arrives and is multiplied.
//
// 256 threads, no specialization. Every thread copies its share of a stage with cp.async, 16 bytes each, zero-filled
// (source size 0) for positions outside the input -- the padding, the halo and the rows past the box -- and for
// channels past C_in / groups; the packed weights are padded already. A ring of kStages stages keeps kStages - 1
// stages in flight while the 8 warps multiply, each a (128 / WM) x (BN / WN) warp tile whose fragments come from
// ldmatrix: the same x4 address pattern serves 16-bit and fp32 rows, because a TF32 m16n8k8 fragment holds, per
// thread, the 32-bit words that an m16n8k16 one holds in 16-bit pairs. Rows of 128 bytes are stored with their eight
// 16-byte chunks permuted (chunk c of row r at c ^ (r % 8)), so that the copies and every ldmatrix phase touch 32
// distinct banks. TF32 rounds the A fragments to nearest in registers (the packed weights are rounded already), where
// the wgmma kernel spends a shared-memory pass on it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "conv_transpose2d.h"
#include "gemm.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace deconv {
namespace {

constexpr int kSyncThreads = 256;

template <typename T, tc::MmaKind K, int BN, int kStages, int WM, int WN>
__global__ void __launch_bounds__(kSyncThreads, 1)
    conv_transpose2d_gemm_sync_kernel(const GemmArgs g, const __grid_constant__ GemmTiles tl) {
  constexpr int kCH = kGemmRowBytes / sizeof(T);  // channels a stage
  constexpr int kVec = 16 / sizeof(T);            // channels a 16-byte chunk
  constexpr int kAStage = kGemmBM * kGemmRowBytes;
  constexpr int kStage = (kGemmBM + BN) * kGemmRowBytes;
  constexpr int kRowStep = kSyncThreads / 8;  // rows one pass of copies covers (8 chunks a row)
  constexpr int kARows = kGemmBM / kRowStep, kBRows = BN / kRowStep;
  constexpr int kWTM = kGemmBM / WM, kWTN = BN / WN;  // warp tile
  constexpr int kMT = kWTM / 16, kNT = kWTN / 8;
  static_assert(WM * WN * 32 == kSyncThreads && kWTM % 16 == 0 && kWTN % 16 == 0 && BN % kRowStep == 0,
                "tile shape");

  extern __shared__ __align__(128) uint8_t sync_smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(sync_smem));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % WM, wn = warp / WM;
  const int chunk = tid & 7, row0 = tid >> 3;  // this thread copies chunk `chunk` of rows row0 + kRowStep i
  const int cpt = g.ci_pad / kCH;              // stages a tap
  const T* __restrict__ x = static_cast<const T*>(g.x);
  const T* __restrict__ wp = static_cast<const T*>(g.wp);
  const bool pair_stores = g.ys_c == 1 && g.c_out % 2 == 0 && g.cout_g % 2 == 0;

  for (int t = blockIdx.x; t < tl.total; t += gridDim.x) {
    GemmTile d;
    if (!gemm_decode(t, tl, g.n, BN, cpt, d)) continue;
    // This thread's A rows: image (-1 past the box or the batch) and input position at tap (0, 0).
    int an[kARows], ah0[kARows], aw0[kARows];
#pragma unroll
    for (int i = 0; i < kARows; ++i) {
      int nb, qh, qw;
      gemm_box_pos(tl, row0 + kRowStep * i, nb, qh, qw);
      an[i] = nb < tl.bni && d.n0 + nb < g.n ? d.n0 + nb : -1;
      ah0[i] = d.qh0 + qh + d.ah.base;
      aw0[i] = d.qw0 + qw + d.aw.base;
    }
    const T* const xg = x + d.grp * g.cin_g;
    const T* const wg = wp + static_cast<int64_t>(d.grp) * g.kh * g.kw * g.cout_g * g.ci_pad;

    // Stage k of the tile's reduction into buffer `slot`: tap k / cpt (th, tw), channels (k % cpt) * kCH on.
    auto load = [&](int k, int slot) {
      const int tap = k / cpt, cc = k - tap * cpt;
      const int th = tap / d.aw.taps, tw = tap - th * d.aw.taps;
      const int ci = cc * kCH + chunk * kVec;
      const bool ci_ok = ci < g.cin_g;
      uint8_t* const st = sync_smem + slot * kStage;
#pragma unroll
      for (int i = 0; i < kARows; ++i) {
        const int hi = ah0[i] - th * d.ah.dstep, wi = aw0[i] - tw * d.aw.dstep;
        const bool ok = an[i] >= 0 && ci_ok && hi >= 0 && hi < g.h_in && wi >= 0 && wi < g.w_in;
        const T* src = ok ? xg + ((static_cast<int64_t>(an[i]) * g.h_in + hi) * g.w_in + wi) * g.c_in + ci : x;
        cp_async16(st + swizzled(row0 + kRowStep * i, chunk), src, ok ? 16 : 0);  // halo.cuh
      }
      const int wtap = (d.ah.a0 + th * d.ah.step) * g.kw + d.aw.a0 + tw * d.aw.step;
#pragma unroll
      for (int j = 0; j < kBRows; ++j) {
        const int co = d.c0 + row0 + kRowStep * j;
        const bool ok = co < g.cout_g;
        const T* src = ok ? wg + (static_cast<int64_t>(wtap) * g.cout_g + co) * g.ci_pad + cc * kCH + chunk * kVec
                          : wp;
        cp_async16(st + kAStage + swizzled(row0 + kRowStep * j, chunk), src, ok ? 16 : 0);
      }
    };

    float acc[kMT][kNT][4];
    tc::zero_tile(acc);
    const int kn = d.k_end - d.k_begin;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < kn) load(d.k_begin + s, s);
      cp_async_commit();  // empty groups too: the count of groups is what cp.async.wait_group tracks
    }
    for (int i = 0; i < kn; ++i) {
      cp_async_wait<kStages - 2>();  // stage i has landed (this thread's copies) ...
      __syncthreads();               // ... everyone's, and every warp is done with stage i - 1's buffer
      const int next = i + kStages - 1;
      if (next < kn) load(d.k_begin + next, next % kStages);
      cp_async_commit();
      const uint32_t a_st = base + (i % kStages) * kStage, b_st = a_st + kAStage;
#pragma unroll
      for (int kk = 0; kk < kGemmRowBytes / 32; ++kk) {  // k-steps of 32 bytes: chunks 2kk and 2kk + 1
        uint32_t af[kMT][4], bf[kNT][2];
#pragma unroll
        for (int mi = 0; mi < kMT; ++mi) {
          ldmatrix_x4(af[mi], a_st + swizzled(wm * kWTM + mi * 16 + (lane & 15), 2 * kk + (lane >> 4)));
          if constexpr (K == tc::MmaKind::kTF32) {
#pragma unroll
            for (int e = 0; e < 4; ++e) af[mi][e] = tc::to_tf32(__uint_as_float(af[mi][e]));
          }
        }
#pragma unroll
        for (int nj = 0; nj < kNT / 2; ++nj) {
          uint32_t q[4];
          ldmatrix_x4(q, b_st + swizzled(wn * kWTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3),
                                         2 * kk + ((lane >> 3) & 1)));
          bf[2 * nj][0] = q[0];
          bf[2 * nj][1] = q[1];
          bf[2 * nj + 1][0] = q[2];
          bf[2 * nj + 1][1] = q[3];
        }
        tc::mma_warp_tile<K, kMT, kNT>(acc, af, bf);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's copies may overwrite every buffer

    // Epilogue. acc[mi][nj][e]: row wm * kWTM + 16 mi + lane / 4 (+ 8 for e >= 2), column wn * kWTN + 8 nj +
    // 2 (lane % 4) (+ 1 for odd e).
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        int n, ho, wo;
        if (!gemm_row(g, tl, d, wm * kWTM + mi * 16 + (lane >> 2) + 8 * half, n, ho, wo)) continue;
#pragma unroll
        for (int nj = 0; nj < kNT; ++nj)
          gemm_store_cols<T>(g, d, n, ho, wo, d.c0 + wn * kWTN + nj * 8 + 2 * (lane & 3), acc[mi][nj][2 * half],
                             acc[mi][nj][2 * half + 1], pair_stores);
      }
  }
}

template <typename T, tc::MmaKind K, int kShape, int WM, int WN>
cudaError_t sync_launch_as(const GemmArgs& a, const GemmTiles& tl, cudaStream_t stream) {
  constexpr GemmShape s = kGemmShapes[kShape];
  static_assert(s.sync && s.bm == kGemmBM, "an mma.sync configuration");
  constexpr size_t smem = static_cast<size_t>(s.stages) * (kGemmBM + s.bn) * kGemmRowBytes;
  const cudaError_t err = opt_in_shared_memory<conv_transpose2d_gemm_sync_kernel<T, K, s.bn, s.stages, WM, WN>>();
  if (err != cudaSuccess) return err;
  conv_transpose2d_gemm_sync_kernel<T, K, s.bn, s.stages, WM, WN><<<tl.total, kSyncThreads, smem, stream>>>(a, tl);
  return cudaGetLastError();
}

// Warps over a tile: 128 x 128 as 2 x 4 warps of 64 x 32; 128 x 64 as 4 x 2 warps of 32 x 32.
template <typename T, tc::MmaKind K>
cudaError_t sync_launch_kind(int config, const GemmArgs& a, const GemmTiles& tl, cudaStream_t stream) {
  if (config == 3) return sync_launch_as<T, K, 3, 2, 4>(a, tl, stream);
  if (config == 4) return sync_launch_as<T, K, 4, 4, 2>(a, tl, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_gemm_sync(DType dtype, int config, const GemmArgs& a, const GemmTiles& tl, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return sync_launch_kind<float, tc::MmaKind::kTF32>(config, a, tl, stream);
    case DType::kBFloat16:
      return sync_launch_kind<__nv_bfloat16, tc::MmaKind::kBF16>(config, a, tl, stream);
    case DType::kFloat16:
      return sync_launch_kind<__half, tc::MmaKind::kFP16>(config, a, tl, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace deconv
