// Tiled attention on the GPU: one fused FlashAttention-2-style forward kernel.
//
// Computes out[b, h, i, :] = Σ_j softmax_j(scale · q_i·k_j) v_j for a block of query rows per
// thread block, streaming key/value tiles through shared memory with double-buffered
// asynchronous copies (cp.async); scores and the online-softmax state (OnlineSoftmaxRow, the
// same update the CPU and the trace use) stay in registers; each output row is written once.
// Inputs: query [B, H, Nq, P], key/value [B, Hkv, Nk, P] in one dtype, rows zero-padded to P
// (32, 64, 128 or 256). Outputs: out [B, H, Nq, dv] fp32, lse [B, H, Nq] fp32.
//
// Two kernels:
//   MmaKernel<T, P>  fp16/bf16: tensor cores (mma.sync m16n8k16, fp32 accumulation); 4 warps ×
//                    16 query rows; the probabilities stay in registers as the A operand of the
//                    P·V product (FlashAttention-2's register reuse).
//   Fp32Kernel<P>    fp32: exact fp32 FMA (no TF32); 4 warps × 4 query rows; lane j scores key j
//                    of a 32-key tile, then every lane accumulates its P/32 output columns.
// Causal: tiles past a block's last visible key are never loaded. GQA: query head h reads key
// head h / (H / Hkv) in place.
// Measured: not yet on a GPU (see docs/perf.md); the static checks
// (tests/static/cuda_static_check.sh) hold it to no spills and no stack frame.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/launch.h"
#include "kernels/online_softmax.h"

namespace attn::cuda {
namespace {

// --- Tunables ---------------------------------------------------------------------------------
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaRows = kWarps * 16;  // Query rows per block, tensor-core kernel.
constexpr int kSmemPad = 8;            // Elements appended to each shared row (16 bytes): banks.
constexpr int kFp32RowsPerWarp = 4;
constexpr int kFp32Rows = kWarps * kFp32RowsPerWarp;  // Query rows per block, fp32 kernel.
constexpr int kFp32Keys = 32;                         // Keys per tile, fp32 kernel: one per lane.

// Keys per tile of the tensor-core kernel: fewer for the widest heads to keep the output
// accumulators (P/2 floats per thread) and the scores in registers together.
template <int kDim>
constexpr int kMmaKeys = kDim >= 256 ? 32 : 64;

struct Params {
  const void* query;
  const void* key;
  const void* value;
  float* out;
  float* lse;
  int64_t heads, kv_heads, query_len, key_len, value_dim;
  int64_t row_blocks;  // Blocks per (batch, head).
  float scale;
  bool causal;
};

// Keys that query row `row` sees: j < VisibleKeys(row) (bottom-right causal alignment).
__device__ __forceinline__ int64_t VisibleKeys(const Params& p, int64_t row) {
  if (!p.causal) return p.key_len;
  const int64_t visible = row + p.key_len - p.query_len + 1;
  return visible < 0 ? 0 : (visible > p.key_len ? p.key_len : visible);
}

// The block's (batch·head, first row) and the key tiles its rows see.
struct BlockWork {
  int64_t batch_head, head, kv_head, row0, tiles;
};

__device__ __forceinline__ BlockWork WorkOf(const Params& p, int rows, int keys) {
  BlockWork work;
  work.batch_head = blockIdx.x / p.row_blocks;
  work.row0 = (blockIdx.x % p.row_blocks) * rows;
  work.head = work.batch_head % p.heads;
  const int64_t batch = work.batch_head / p.heads;
  work.kv_head = batch * p.kv_heads + work.head / (p.heads / p.kv_heads);
  const int64_t last_row = min(work.row0 + rows, p.query_len) - 1;
  work.tiles = (VisibleKeys(p, last_row) + keys - 1) / keys;
  return work;
}

// --- Asynchronous copies ----------------------------------------------------------------------
__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies `bytes` (4, 8 or 16) from global to shared memory, or writes zeros when !valid.
template <int kBytes>
__device__ __forceinline__ void CopyAsync(void* shared, const void* global, bool valid) {
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(shared)),
                 "l"(global), "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(SharedAddress(shared)),
                 "l"(global), "n"(kBytes), "r"(valid ? kBytes : 0));
  }
}

__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Loads rows [first, first + kRows) of a [len, kDim] matrix into shared rows of kPitch
// elements, kBytes per copy; rows at or past `len` become zeros.
template <class T, int kDim, int kPitch, int kRows, int kBytes>
__device__ __forceinline__ void LoadTile(T* shared, const T* global, int64_t first, int64_t len) {
  constexpr int kPerCopy = kBytes / sizeof(T);
  constexpr int kCopiesPerRow = kDim / kPerCopy;
  for (int c = threadIdx.x; c < kRows * kCopiesPerRow; c += kThreads) {
    const int r = c / kCopiesPerRow;
    const int part = c % kCopiesPerRow;
    const int64_t row = first + r;
    const bool valid = row < len;
    const T* source = global + (valid ? row : 0) * kDim + part * kPerCopy;
    CopyAsync<kBytes>(shared + r * kPitch + part * kPerCopy, source, valid);
  }
}

// --- Tensor cores -----------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void Mma<__half>(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                   const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as a packed pair of T (the first in the low half), rounded to nearest.
template <class T>
__device__ __forceinline__ uint32_t Pack(float low, float high);

template <>
__device__ __forceinline__ uint32_t Pack<__half>(float low, float high) {
  const __half2 pair = __floats2half2_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Two consecutive 16-bit elements of a shared row (the first in the low half).
template <class T>
__device__ __forceinline__ uint32_t PairAt(const T* shared, int index) {
  return *reinterpret_cast<const uint32_t*>(shared + index);
}

// Two 16-bit elements of one column from two rows (the first row's in the low half).
template <class T>
__device__ __forceinline__ uint32_t ColumnPairAt(const T* shared, int first, int second) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(shared);
  return static_cast<uint32_t>(bits[first]) | (static_cast<uint32_t>(bits[second]) << 16);
}

// Fragment coordinates (PTX ISA, mma.m16n8k16): lane = 4·group + quad; an A fragment holds
// rows {group, group + 8} × columns {2·quad, 2·quad + 1} (+8 for a[2], a[3]); a B fragment
// holds rows {2·quad, 2·quad + 1} (+8 for b[1]) of column `group`; a C fragment holds rows
// {group, group + 8} × columns {2·quad, 2·quad + 1}.
template <class T, int kDim>
__global__ void __launch_bounds__(kThreads, 1) MmaKernel(const Params p) {
  constexpr int kKeys = kMmaKeys<kDim>;
  constexpr int kPitch = kDim + kSmemPad;
  constexpr int kKeyBlocks = kKeys / 8;  // n-blocks of the score tile
  constexpr int kDimBlocks = kDim / 8;   // n-blocks of the output
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* q_tile = reinterpret_cast<T*>(shared_bytes);  // [kMmaRows][kPitch]
  T* k_tiles = q_tile + kMmaRows * kPitch;         // [2][kKeys][kPitch]
  T* v_tiles = k_tiles + 2 * kKeys * kPitch;       // [2][kKeys][kPitch]

  const BlockWork work = WorkOf(p, kMmaRows, kKeys);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / 4;
  const int quad = lane % 4;
  const T* query = static_cast<const T*>(p.query) + work.batch_head * p.query_len * kDim;
  const T* key = static_cast<const T*>(p.key) + work.kv_head * p.key_len * kDim;
  const T* value = static_cast<const T*>(p.value) + work.kv_head * p.key_len * kDim;

  // This thread's two query rows and the keys each sees.
  const int local_row[2] = {warp * 16 + group, warp * 16 + group + 8};
  int64_t visible[2];
  for (int r = 0; r < 2; ++r) visible[r] = VisibleKeys(p, work.row0 + local_row[r]);

  LoadTile<T, kDim, kPitch, kMmaRows, 16>(q_tile, query, work.row0, p.query_len);
  if (work.tiles > 0) {
    LoadTile<T, kDim, kPitch, kKeys, 16>(k_tiles, key, 0, p.key_len);
    LoadTile<T, kDim, kPitch, kKeys, 16>(v_tiles, value, 0, p.key_len);
  }
  CommitCopies();

  OnlineSoftmaxRow state[2];
  float out[kDimBlocks][4] = {};
  for (int64_t tile = 0; tile < work.tiles; ++tile) {
    const int buffer = tile % 2;
    if (tile + 1 < work.tiles) {
      const int next = 1 - buffer;
      LoadTile<T, kDim, kPitch, kKeys, 16>(k_tiles + next * kKeys * kPitch, key, (tile + 1) * kKeys,
                                           p.key_len);
      LoadTile<T, kDim, kPitch, kKeys, 16>(v_tiles + next * kKeys * kPitch, value,
                                           (tile + 1) * kKeys, p.key_len);
      CommitCopies();
      WaitCopies<1>();
    } else {
      WaitCopies<0>();
    }
    __syncthreads();
    const T* k_tile = k_tiles + buffer * kKeys * kPitch;
    const T* v_tile = v_tiles + buffer * kKeys * kPitch;

    // Scores: S = Q Kᵀ for this warp's 16 rows × kKeys keys.
    float scores[kKeyBlocks][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const int column = kk * 16 + quad * 2;
      uint32_t a[4];
      a[0] = PairAt(q_tile, local_row[0] * kPitch + column);
      a[1] = PairAt(q_tile, local_row[1] * kPitch + column);
      a[2] = PairAt(q_tile, local_row[0] * kPitch + column + 8);
      a[3] = PairAt(q_tile, local_row[1] * kPitch + column + 8);
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) {
        const int key_row = (nb * 8 + group) * kPitch;
        const uint32_t b[2] = {PairAt(k_tile, key_row + column),
                               PairAt(k_tile, key_row + column + 8)};
        Mma<T>(scores[nb], a, b);
      }
    }

    // Scale and mask; the tile's max per row (the four lanes of a group share a row).
    const int64_t key0 = tile * kKeys;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t key_index = key0 + nb * 8 + quad * 2 + e % 2;
        const float score = key_index < visible[r] ? scores[nb][e] * p.scale : -INFINITY;
        scores[nb][e] = score;
        tile_max[r] = fmaxf(tile_max[r], score);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    }

    // The online-softmax update: new max, rescale the running sums, weights of this tile.
    const float rescale[2] = {state[0].Rescale(tile_max[0]), state[1].Rescale(tile_max[1])};
#pragma unroll
    for (int nd = 0; nd < kDimBlocks; ++nd) {
      out[nd][0] *= rescale[0];
      out[nd][1] *= rescale[0];
      out[nd][2] *= rescale[1];
      out[nd][3] *= rescale[1];
    }
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float weight = state[e / 2].Weight(scores[nb][e]);
        state[e / 2].denominator += weight;  // This lane's share; the group sums at the end.
        scores[nb][e] = weight;
      }
    }

    // out += weights · V: the weights are already laid out as A fragments.
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc) {
      const uint32_t a[4] = {Pack<T>(scores[2 * kc][0], scores[2 * kc][1]),
                             Pack<T>(scores[2 * kc][2], scores[2 * kc][3]),
                             Pack<T>(scores[2 * kc + 1][0], scores[2 * kc + 1][1]),
                             Pack<T>(scores[2 * kc + 1][2], scores[2 * kc + 1][3])};
      const int key_row = kc * 16 + quad * 2;
#pragma unroll
      for (int nd = 0; nd < kDimBlocks; ++nd) {
        const int column = nd * 8 + group;
        const uint32_t b[2] = {
            ColumnPairAt(v_tile, key_row * kPitch + column, (key_row + 1) * kPitch + column),
            ColumnPairAt(v_tile, (key_row + 8) * kPitch + column, (key_row + 9) * kPitch + column)};
        Mma<T>(out[nd], a, b);
      }
    }
    __syncthreads();  // Every warp is done with this buffer before it is refilled.
  }
  WaitCopies<0>();

  // Sum the group's shares of each denominator, normalize, write.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    state[r].denominator += __shfl_xor_sync(0xffffffffu, state[r].denominator, 1);
    state[r].denominator += __shfl_xor_sync(0xffffffffu, state[r].denominator, 2);
  }
  float* out_rows = p.out + work.batch_head * p.query_len * p.value_dim;
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t row = work.row0 + local_row[e / 2];
      const int column = nd * 8 + quad * 2 + e % 2;
      if (row < p.query_len && column < p.value_dim) {
        out_rows[row * p.value_dim + column] = state[e / 2].Normalize(out[nd][e]);
      }
    }
  }
  if (p.lse != nullptr && quad == 0) {
    for (int r = 0; r < 2; ++r) {
      const int64_t row = work.row0 + local_row[r];
      if (row < p.query_len) p.lse[work.batch_head * p.query_len + row] = state[r].LogSumExp();
    }
  }
}

template <int kDim>
__global__ void __launch_bounds__(kThreads, 1) Fp32Kernel(const Params p) {
  constexpr int kColumns = kDim / 32;  // Output columns per lane: lane + 32·c.
  constexpr int kKeyPitch = kDim + 1;  // Lane j reads key row j: odd pitch, no bank conflicts.
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  float* q_tile = reinterpret_cast<float*>(shared_bytes);  // [kFp32Rows][kDim]
  float* k_tiles = q_tile + kFp32Rows * kDim;              // [2][kFp32Keys][kKeyPitch]
  float* v_tiles = k_tiles + 2 * kFp32Keys * kKeyPitch;    // [2][kFp32Keys][kDim]

  const BlockWork work = WorkOf(p, kFp32Rows, kFp32Keys);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float* query = static_cast<const float*>(p.query) + work.batch_head * p.query_len * kDim;
  const float* key = static_cast<const float*>(p.key) + work.kv_head * p.key_len * kDim;
  const float* value = static_cast<const float*>(p.value) + work.kv_head * p.key_len * kDim;

  int64_t visible[kFp32RowsPerWarp];
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    visible[r] = VisibleKeys(p, work.row0 + warp * kFp32RowsPerWarp + r);
  }

  LoadTile<float, kDim, kDim, kFp32Rows, 16>(q_tile, query, work.row0, p.query_len);
  if (work.tiles > 0) {
    LoadTile<float, kDim, kKeyPitch, kFp32Keys, 4>(k_tiles, key, 0, p.key_len);
    LoadTile<float, kDim, kDim, kFp32Keys, 16>(v_tiles, value, 0, p.key_len);
  }
  CommitCopies();

  OnlineSoftmaxRow state[kFp32RowsPerWarp];
  float out[kFp32RowsPerWarp][kColumns] = {};
  for (int64_t tile = 0; tile < work.tiles; ++tile) {
    const int buffer = tile % 2;
    if (tile + 1 < work.tiles) {
      const int next = 1 - buffer;
      LoadTile<float, kDim, kKeyPitch, kFp32Keys, 4>(k_tiles + next * kFp32Keys * kKeyPitch, key,
                                                     (tile + 1) * kFp32Keys, p.key_len);
      LoadTile<float, kDim, kDim, kFp32Keys, 16>(v_tiles + next * kFp32Keys * kDim, value,
                                                 (tile + 1) * kFp32Keys, p.key_len);
      CommitCopies();
      WaitCopies<1>();
    } else {
      WaitCopies<0>();
    }
    __syncthreads();
    const float* k_row = k_tiles + buffer * kFp32Keys * kKeyPitch + lane * kKeyPitch;
    const float* v_tile = v_tiles + buffer * kFp32Keys * kDim;

    // Lane j scores key j of the tile against the warp's rows.
    float score[kFp32RowsPerWarp] = {};
    for (int d = 0; d < kDim; ++d) {
      const float k = k_row[d];
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        score[r] += q_tile[(warp * kFp32RowsPerWarp + r) * kDim + d] * k;
      }
    }
    const int64_t key_index = tile * kFp32Keys + lane;
    float weight[kFp32RowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFp32RowsPerWarp; ++r) {
      const float s = key_index < visible[r] ? score[r] * p.scale : -INFINITY;
      float tile_max = s;
      for (int offset = 16; offset > 0; offset /= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float rescale = state[r].Rescale(tile_max);
      weight[r] = state[r].Weight(s);
      state[r].denominator += weight[r];  // This lane's share; the warp sums at the end.
#pragma unroll
      for (int c = 0; c < kColumns; ++c) out[r][c] *= rescale;
    }
    for (int j = 0; j < kFp32Keys; ++j) {
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        const float w = __shfl_sync(0xffffffffu, weight[r], j);
#pragma unroll
        for (int c = 0; c < kColumns; ++c) out[r][c] += w * v_tile[j * kDim + lane + 32 * c];
      }
    }
    __syncthreads();  // Every warp is done with this buffer before it is refilled.
  }
  WaitCopies<0>();

  float* out_rows = p.out + work.batch_head * p.query_len * p.value_dim;
#pragma unroll
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    for (int offset = 16; offset > 0; offset /= 2) {
      state[r].denominator += __shfl_xor_sync(0xffffffffu, state[r].denominator, offset);
    }
    const int64_t row = work.row0 + warp * kFp32RowsPerWarp + r;
    if (row >= p.query_len) continue;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = lane + 32 * c;
      if (column < p.value_dim)
        out_rows[row * p.value_dim + column] = state[r].Normalize(out[r][c]);
    }
    if (p.lse != nullptr && lane == 0) {
      p.lse[work.batch_head * p.query_len + row] = state[r].LogSumExp();
    }
  }
}

template <class T, int kDim>
constexpr int MmaSharedBytes() {
  return (kMmaRows + 4 * kMmaKeys<kDim>)*(kDim + kSmemPad) * static_cast<int>(sizeof(T));
}

template <int kDim>
constexpr int Fp32SharedBytes() {
  return (kFp32Rows * kDim + 2 * kFp32Keys * (kDim + 1) + 2 * kFp32Keys * kDim) *
         static_cast<int>(sizeof(float));
}

template <int kDim>
using Dim = std::integral_constant<int, kDim>;

// Calls f(Dim<P>{}) for the problem's padded size P.
template <class F>
auto ForPitch(int pitch, F&& f) {
  switch (pitch) {
    case 32:
      return f(Dim<32>{});
    case 64:
      return f(Dim<64>{});
    case 128:
      return f(Dim<128>{});
    default:
      return f(Dim<256>{});
  }
}

}  // namespace

int TiledBlockK(const DeviceProblem& problem) {
  if (problem.dtype == DType::kFloat32) return kFp32Keys;
  return ForPitch(problem.pitch, [](auto dim) { return kMmaKeys<decltype(dim)::value>; });
}

int TiledSharedBytes(const DeviceProblem& problem) {
  return ForPitch(problem.pitch, [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    if (problem.dtype == DType::kFloat32) return Fp32SharedBytes<kDim>();
    return MmaSharedBytes<__half, kDim>();  // bf16 has the same size.
  });
}

cudaError_t LaunchTiled(const DeviceProblem& problem, float* out, float* lse, cudaStream_t stream) {
  const Shape& s = problem.shape;
  const int rows = problem.dtype == DType::kFloat32 ? kFp32Rows : kMmaRows;
  Params params{problem.query,
                problem.key,
                problem.value,
                out,
                lse,
                s.heads,
                s.kv_heads,
                s.query_len,
                s.key_len,
                s.value_dim,
                (s.query_len + rows - 1) / rows,
                problem.scale,
                problem.causal};
  const int64_t blocks = s.batch * s.heads * params.row_blocks;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const int shared_bytes = TiledSharedBytes(problem);
  return ForPitch(problem.pitch, [&](auto dim) -> cudaError_t {
    constexpr int kDim = decltype(dim)::value;
    auto run = [&](auto kernel) {
      cudaError_t error =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
      if (error != cudaSuccess) return error;
      kernel<<<static_cast<unsigned>(blocks), kThreads, shared_bytes, stream>>>(params);
      return cudaGetLastError();
    };
    switch (problem.dtype) {
      case DType::kFloat32:
        return run(Fp32Kernel<kDim>);
      case DType::kFloat16:
        return run(MmaKernel<__half, kDim>);
      case DType::kBFloat16:
        return run(MmaKernel<__nv_bfloat16, kDim>);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace attn::cuda
