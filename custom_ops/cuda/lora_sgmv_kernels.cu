// LoraSGMV CUDA kernels: SGMV / BGMV shrink and the tiled expand (see sgmv_launcher.h).
// Every pool row may start at any element (rows are packed into pages back to back), so loads
// are scalar; float32 accumulation throughout, one rounding to T when y_out is written.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/sgmv_launcher.h"

#ifdef ORT_LORA_CUDA_EMU  // host-only build for the CPU emulator (tests/cuda_emu_build.py)
#include "cuda/emu/cuda_emu.h"
#define ORT_LORA_LAUNCH(kernel, grid, block, stream, ...) \
  ((void)(stream), ORT_LORA_EMU_LAUNCH(kernel, grid, block, __VA_ARGS__))
#else
#define ORT_LORA_LAUNCH(kernel, grid, block, stream, ...) \
  kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

namespace ort_lora {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 64;        // columns of x / A staged per shrink iteration
constexpr int kShrinkRanks = 16;  // ranks per SGMV shrink block
constexpr int kWarps = kThreads / 32;
static_assert(kShrinkRanks * kTileRows == kThreads, "one SGMV shrink output per thread");
static_assert(kShrinkRanks == kTileRows, "ShrinkSgmv stages x and A rows in one loop over r");

__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// A row of the layer's pool share at pool element `offset` (validated on the host).
template <typename T>
__device__ __forceinline__ const T* PoolRow(const SgmvArgs& a, int64_t offset) {
  return offset < a.half ? static_cast<const T*>(a.key_cache) + offset
                         : static_cast<const T*>(a.value_cache) + (offset - a.half);
}

__device__ __forceinline__ int SlotRank(const SgmvArgs& a, int32_t slot) {
  return a.ranks[static_cast<int64_t>(a.layer) * a.num_slots + slot];
}

// The tile's rank at the layer: its terms' ranks summed (its v columns).
__device__ __forceinline__ int TileRank(const SgmvArgs& a, const SgmvTile& t) {
  int rank = 0;
  for (int i = 0; i < t.num_terms; ++i) rank += SlotRank(a, a.terms[t.term_begin + i].slot);
  return rank;
}

// The A row behind v column `c` of a tile and its scale (the term's weight * scale at the
// layer); slot -1 past the tile's rank.
struct TermColumn {
  int32_t slot;
  int32_t j;  // row j of the slot's A (and B^T)
  float scale;
};

__device__ __forceinline__ TermColumn FindColumn(const SgmvArgs& a, const SgmvTile& t, int c) {
  for (int i = 0; i < t.num_terms; ++i) {
    const SgmvTerm term = a.terms[t.term_begin + i];
    const int rank = SlotRank(a, term.slot);
    if (c < rank)
      return {term.slot, c,
              term.weight * a.scales[static_cast<int64_t>(a.layer) * a.num_slots + term.slot]};
    c -= rank;
  }
  return {-1, 0, 0.f};
}

template <typename T>
__device__ __forceinline__ const T* ARow(const SgmvArgs& a, const TermColumn& c) {
  return PoolRow<T>(a, a.a_offsets[static_cast<int64_t>(c.slot) * a.max_rank + c.j]);
}

// A DoRA tile's row D (one term whose slot has a DoRA row), else null.
template <typename T>
__device__ __forceinline__ const T* DoraRow(const SgmvArgs& a, const SgmvTile& t) {
  if (a.dora_offsets == nullptr || t.num_terms != 1) return nullptr;
  const int64_t offset = a.dora_offsets[a.terms[t.term_begin].slot];
  return offset < 0 ? nullptr : PoolRow<T>(a, offset);
}

// grid (num_sgmv_tiles, ceil(v_stride / 16)); thread (i, j) computes v[row i, column c0 + j].
template <typename T>
__global__ void __launch_bounds__(kThreads) ShrinkSgmv(SgmvArgs a) {
  const SgmvTile tile = a.tiles[blockIdx.x];
  const int rank = TileRank(a, tile);
  const int c0 = blockIdx.y * kShrinkRanks;
  if (c0 >= rank) return;                      // the whole block leaves: no barrier is skipped
  __shared__ float xs[kTileRows][kChunk + 1];  // +1: no bank conflicts reading as[j][k]
  __shared__ float as[kShrinkRanks][kChunk + 1];
  __shared__ const T* a_rows[kShrinkRanks];  // the block's A rows (null past the tile's rank)
  __shared__ float a_scales[kShrinkRanks];
  if (threadIdx.x < kShrinkRanks) {
    const TermColumn c = FindColumn(a, tile, c0 + threadIdx.x);
    a_rows[threadIdx.x] = c.slot < 0 ? nullptr : ARow<T>(a, c);
    a_scales[threadIdx.x] = c.scale;
  }
  __syncthreads();
  const T* x = static_cast<const T*>(a.x);
  const int i = threadIdx.x / kShrinkRanks, j = threadIdx.x % kShrinkRanks;
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < a.in_features; k0 += kChunk) {
    for (int e = threadIdx.x; e < kTileRows * kChunk; e += kThreads) {
      const int r = e / kChunk, k = e % kChunk;
      const bool col = k0 + k < a.in_features;
      const int64_t row = tile.row_begin + r;
      xs[r][k] = (r < tile.num_rows && col) ? ToFloat(x[row * a.in_features + k0 + k]) : 0.f;
      as[r][k] = (a_rows[r] != nullptr && col) ? ToFloat(a_rows[r][k0 + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll 16
    for (int k = 0; k < kChunk; ++k) acc += xs[i][k] * as[j][k];
    __syncthreads();
  }
  if (i < tile.num_rows && c0 + j < rank)
    a.v[static_cast<int64_t>(tile.row_begin + i) * a.v_stride + c0 + j] = a_scales[j] * acc;
}

// grid (num_bgmv_tiles, ceil(v_stride / 8)); warp w computes v[rows of the tile, column c].
template <typename T>
__global__ void __launch_bounds__(kThreads) ShrinkBgmv(SgmvArgs a) {
  const SgmvTile tile = a.tiles[a.num_sgmv_tiles + blockIdx.x];
  const int c = blockIdx.y * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const TermColumn column = FindColumn(a, tile, c);
  if (column.slot < 0) return;  // past the tile's rank; no barriers in this kernel
  const T* x = static_cast<const T*>(a.x);
  const T* a_row = ARow<T>(a, column);
  float acc[kBgmvMaxRows] = {};
  for (int64_t k = lane; k < a.in_features; k += 32) {
    const float w = ToFloat(a_row[k]);
#pragma unroll
    for (int r = 0; r < kBgmvMaxRows; ++r)
      if (r < tile.num_rows)
        acc[r] += w * ToFloat(x[static_cast<int64_t>(tile.row_begin + r) * a.in_features + k]);
  }
#pragma unroll
  for (int r = 0; r < kBgmvMaxRows; ++r) {
    float s = acc[r];
    for (int d = 16; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0 && r < tile.num_rows)
      a.v[static_cast<int64_t>(tile.row_begin + r) * a.v_stride + c] = column.scale * s;
  }
}

// grid (num tiles, ceil(out / 256)); thread o adds v[r, :] . Bt[:, o] to every row r, then
// scales by 1 + D[o] in a DoRA tile.
template <typename T>
__global__ void __launch_bounds__(kThreads) ExpandTiles(SgmvArgs a) {
  const SgmvTile tile = a.tiles[blockIdx.x];
  const int rank = TileRank(a, tile);
  if (rank == 0) return;                         // the whole block leaves: no barrier is skipped
  __shared__ float vs[kTileRows][kMaxCudaRank];  // 32 KiB
  for (int e = threadIdx.x; e < kTileRows * rank; e += kThreads) {
    const int r = e / rank, j = e % rank;
    vs[r][j] =
        r < tile.num_rows ? a.v[static_cast<int64_t>(tile.row_begin + r) * a.v_stride + j] : 0.f;
  }
  __syncthreads();
  const int64_t o = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (o >= a.out_features) return;
  float acc[kTileRows] = {};
  for (int i = 0, c0 = 0; i < tile.num_terms; ++i) {
    const int32_t slot = a.terms[tile.term_begin + i].slot;
    const int term_rank = SlotRank(a, slot);
    const int64_t* b_off = a.b_offsets + static_cast<int64_t>(slot) * a.max_rank;
    for (int j = 0; j < term_rank; ++j) {
      const float b = ToFloat(PoolRow<T>(a, b_off[j])[o]);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) acc[r] += vs[r][c0 + j] * b;
    }
    c0 += term_rank;
  }
  const T* dora = DoraRow<T>(a, tile);
  const float d = dora == nullptr ? 0.f : ToFloat(dora[o]);
  T* y = static_cast<T*>(a.y_out);
#pragma unroll  // constant indices keep acc in registers
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= tile.num_rows) break;
    T& out = y[static_cast<int64_t>(tile.row_begin + r) * a.out_features + o];
    const float sum = ToFloat(out) + acc[r];
    out = FromFloat<T>(sum + sum * d);
  }
}

unsigned Blocks(int64_t n, int64_t per) { return static_cast<unsigned>((n + per - 1) / per); }

template <typename T>
cudaError_t Launch(const SgmvArgs& a, cudaStream_t stream) {
  if (a.num_sgmv_tiles > 0) {
    ORT_LORA_LAUNCH(ShrinkSgmv<T>, dim3(a.num_sgmv_tiles, Blocks(a.v_stride, kShrinkRanks)),
                    kThreads, stream, a);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (a.num_bgmv_tiles > 0) {
    ORT_LORA_LAUNCH(ShrinkBgmv<T>, dim3(a.num_bgmv_tiles, Blocks(a.v_stride, kWarps)), kThreads,
                    stream, a);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  const int num_tiles = a.num_sgmv_tiles + a.num_bgmv_tiles;
  if (num_tiles > 0) {
    ORT_LORA_LAUNCH(ExpandTiles<T>, dim3(num_tiles, Blocks(a.out_features, kThreads)), kThreads,
                    stream, a);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchLoraSgmv(SgmvDtype dtype, const SgmvArgs& args, cudaStream_t stream) {
  return dtype == SgmvDtype::kFloat16 ? Launch<__half>(args, stream)
                                      : Launch<__nv_bfloat16>(args, stream);
}

}  // namespace ort_lora
