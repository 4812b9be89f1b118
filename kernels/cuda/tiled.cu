// Tiled attention on the GPU: FlashAttention-2-style fused forward kernels, and a row kernel
// for what they do not cover.
//
// Computes out[b, h, i, :] = Σ_j softmax_j(s_ij) v_j over key tiles of block_k keys, s_ij the score
// every kernel takes (ScoreOrHidden, score_transform.h: scale · q_i·k_j, soft-capped and
// ALiBi-biased by head h's transform, −inf where row i does not see key j), with the
// online-softmax state of each row (OnlineSoftmax, the same update the CPU and the trace
// use; online_softmax.h) in registers; each output row is written once. Inputs: query
// [B, H, Nq, P], key/value [B, Hkv, Nk, P] in one dtype, rows zero-padded to P (32, 64, 128 or
// 256). Outputs: out [B, H, Nq, dv] fp32, lse [B, H, Nq] fp32.
//
// Three kernels (PlanTiled chooses):
//   MmaKernel<T, P>  fp16/bf16, fused: tensor cores (mma.sync m16n8k16, fp32 accumulation);
//                    4 warps × 16 query rows; tiles of kFusedBlockK keys stream through shared
//                    memory, double-buffered with asynchronous copies (cp.async, Pipeline); the
//                    probabilities stay in registers as the A operand of the P·V product
//                    (FlashAttention-2's register reuse). A row's scores are spread over the
//                    four lanes of a quad (QuadReduce).
//   Fp32Kernel<P>    fp32, fused: exact fp32 FMA (no TF32); 4 warps × 4 query rows; lane j scores
//                    key j of a kFusedBlockK-key tile (WarpReduce), then every lane accumulates
//                    its P/32 output columns; the same pipeline.
//   RowKernel        any dtype and any block_k: one warp per query row, inputs read from global
//                    memory (no shared memory), each tile visited twice (its max, then its
//                    weights: scores are recomputed rather than stored). Runs when the request's
//                    block_k is not the fused kernels' or their shared memory passes the
//                    device's opt-in limit; far slower.
// Masks (positions, causal, windows, ragged sequences: kernels/geometry.h): tiles holding no key
// a block's (or row's) rows see are never loaded. GQA: query head h reads key head h / (H / Hkv)
// in place (KvHeadOf).
// Measured: not yet on a GPU (see docs/perf.md); the static checks
// (tests/static/cuda_static_check.sh) hold the fused kernels to no spills and no stack frame.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/device_rows.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/portable.h"
#include "kernels/cuda/reduce.h"
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
// Keys per tile of both fused kernels (kFusedBlockK, launch.h): one per lane in the fp32 kernel;
// in the tensor-core kernel few enough that the output accumulators (P/2 floats per thread) and
// the scores stay in registers together at P = 256.
constexpr int kKeys = kFusedBlockK;
static_assert(kKeys == 32, "the fp32 kernel scores one key per lane");
constexpr int kRowWarps = 4;  // Query rows (one per warp) per block, row kernel.

struct Params {
  const void* query;
  const void* key;
  const void* value;
  float* out;
  float* lse;
  int64_t heads, kv_heads, query_len, key_len, value_dim;
  int64_t row_blocks;  // Blocks per (batch, head).
  float scale;
  ScoreTransforms transforms;  // alibi_slopes in device memory.
  Geometry geometry;
};

// The block's rows and the key tiles they see, [tiles.begin, tiles.end). batch_head and
// batch_kv_head are flattened indices (batch · heads + head, batch · kv_heads + kv_head): the
// first matrix of each.
struct BlockWork {
  int64_t batch_head, batch_kv_head, row0;
  KeyRange tiles;
  ScoreTransform transform;  // The head's.
  float sink;                // The head's sink (−inf: none).
};

__device__ __forceinline__ BlockWork WorkOf(const Params& p, int rows) {
  BlockWork work;
  work.batch_head = blockIdx.x / p.row_blocks;
  work.row0 = (blockIdx.x % p.row_blocks) * rows;
  const int64_t head = work.batch_head % p.heads;
  const int64_t batch = work.batch_head / p.heads;
  work.batch_kv_head = batch * p.kv_heads + KvHeadOf(head, p.heads, p.kv_heads);
  work.transform = p.transforms.ForHead(head);
  work.sink = p.transforms.Sink(head);
  const int64_t last_row = min(work.row0 + rows, p.query_len) - 1;
  work.tiles = p.geometry.VisitedTiles(work.row0, last_row, kKeys);
  return work;
}

// --- Asynchronous copies (CopyAsync, CommitCopies, WaitCopies: portable.h) ----------------
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

// The double-buffered key/value pipeline of both fused kernels: tile t + 1's copies are in
// flight while tile t is computed. load(buffer, tile) issues the copies of key tile `tile` into
// buffer 0 or 1; compute(buffer, tile) then uses that buffer. The caller has issued its query
// tile's copies, which are committed (and waited for) with the first tile's.
template <class Load, class Compute>
__device__ __forceinline__ void Pipeline(KeyRange tiles, Load&& load, Compute&& compute) {
  if (tiles.size() > 0) load(0, tiles.begin);
  CommitCopies();
  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    const int buffer = (tile - tiles.begin) % 2;
    if (tile + 1 < tiles.end) {
      load(1 - buffer, tile + 1);
      CommitCopies();
      WaitCopies<1>();
    } else {
      WaitCopies<0>();
    }
    __syncthreads();
    compute(buffer, tile);
    __syncthreads();  // Every warp is done with this buffer before it is refilled.
  }
  WaitCopies<0>();
}

// --- Tensor cores (Mma: portable.h) ---------------------------------------------------------
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
  using Softmax = OnlineSoftmax<QuadReduce>;  // A row's scores are spread over a quad.
  constexpr int kPitch = kDim + kSmemPad;
  constexpr int kKeyBlocks = kKeys / 8;  // n-blocks of the score tile
  constexpr int kDimBlocks = kDim / 8;   // n-blocks of the output
  ATTN_DYNAMIC_SHARED(unsigned char, shared_bytes);
  T* q_tile = reinterpret_cast<T*>(shared_bytes);  // [kMmaRows][kPitch]
  T* k_tiles = q_tile + kMmaRows * kPitch;         // [2][kKeys][kPitch]
  T* v_tiles = k_tiles + 2 * kKeys * kPitch;       // [2][kKeys][kPitch]

  const BlockWork work = WorkOf(p, kMmaRows);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = lane / 4;
  const int quad = lane % 4;
  const T* query = static_cast<const T*>(p.query) + work.batch_head * p.query_len * kDim;
  const T* key = static_cast<const T*>(p.key) + work.batch_kv_head * p.key_len * kDim;
  const T* value = static_cast<const T*>(p.value) + work.batch_kv_head * p.key_len * kDim;

  // This thread's two query rows and the keys each sees.
  const int local_row[2] = {warp * 16 + group, warp * 16 + group + 8};
  KeyRange visible[2];
  int64_t distance[2];  // p − t of key 0 (Geometry::Distance(row, key) = this − key).
  for (int r = 0; r < 2; ++r) {
    visible[r] = p.geometry.Visible(work.row0 + local_row[r]);
    distance[r] = p.geometry.Distance(work.row0 + local_row[r], 0);
  }

  LoadTile<T, kDim, kPitch, kMmaRows, 16>(q_tile, query, work.row0, p.query_len);
  Softmax state[2];
  float out[kDimBlocks][4] = {};
  auto load = [&](int buffer, int64_t tile) {
    LoadTile<T, kDim, kPitch, kKeys, 16>(k_tiles + buffer * kKeys * kPitch, key, tile * kKeys,
                                         p.key_len);
    LoadTile<T, kDim, kPitch, kKeys, 16>(v_tiles + buffer * kKeys * kPitch, value, tile * kKeys,
                                         p.key_len);
  };
  auto compute = [&](int buffer, int64_t tile) {
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

    // Scale, transform (softcap, ALiBi) and mask: ScoreOrHidden; this thread's largest score of
    // each of its rows.
    const int64_t key0 = tile * kKeys;
    float thread_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t key_index = key0 + nb * 8 + quad * 2 + e % 2;
        const float score = ScoreOrHidden(work.transform, visible[r], distance[r], key_index,
                                          scores[nb][e] * p.scale);
        scores[nb][e] = score;
        thread_max[r] = fmaxf(thread_max[r], score);
      }
    }

    // The online-softmax step: the row's new max, the accumulators rescaled, the weights.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float rescale = state[r].Rescale(thread_max[r]);
      Softmax::RescaleAccumulator(rescale, 2 * kDimBlocks,
                                  [&](int i) -> float& { return out[i / 2][2 * r + i % 2]; });
    }
#pragma unroll
    for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) scores[nb][e] = state[e / 2].AddScore(scores[nb][e]);
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
  };
  Pipeline(work.tiles, load, compute);

  // The quad's shares of each denominator summed, the sink added; normalize, write.
  float factor[2];
  for (int r = 0; r < 2; ++r) {
    state[r].Finish();
    factor[r] = state[r].AddSink(work.sink);
  }
  float* out_rows = p.out + work.batch_head * p.query_len * p.value_dim;
#pragma unroll
  for (int nd = 0; nd < kDimBlocks; ++nd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t row = work.row0 + local_row[e / 2];
      const int column = nd * 8 + quad * 2 + e % 2;
      if (row < p.query_len && column < p.value_dim) {
        out_rows[row * p.value_dim + column] = state[e / 2].Normalize(out[nd][e] * factor[e / 2]);
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
  using Softmax = OnlineSoftmax<WarpReduce>;  // A row's scores are spread over the warp.
  constexpr int kColumns = kDim / 32;         // Output columns per lane: lane + 32·c.
  constexpr int kKeyPitch = kDim + 1;  // Lane j reads key row j: odd pitch, no bank conflicts.
  ATTN_DYNAMIC_SHARED(unsigned char, shared_bytes);
  float* q_tile = reinterpret_cast<float*>(shared_bytes);  // [kFp32Rows][kDim]
  float* k_tiles = q_tile + kFp32Rows * kDim;              // [2][kKeys][kKeyPitch]
  float* v_tiles = k_tiles + 2 * kKeys * kKeyPitch;        // [2][kKeys][kDim]

  const BlockWork work = WorkOf(p, kFp32Rows);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float* query = static_cast<const float*>(p.query) + work.batch_head * p.query_len * kDim;
  const float* key = static_cast<const float*>(p.key) + work.batch_kv_head * p.key_len * kDim;
  const float* value = static_cast<const float*>(p.value) + work.batch_kv_head * p.key_len * kDim;

  KeyRange visible[kFp32RowsPerWarp];
  int64_t distance[kFp32RowsPerWarp];  // p − t of key 0 (Geometry::Distance).
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    visible[r] = p.geometry.Visible(work.row0 + warp * kFp32RowsPerWarp + r);
    distance[r] = p.geometry.Distance(work.row0 + warp * kFp32RowsPerWarp + r, 0);
  }

  LoadTile<float, kDim, kDim, kFp32Rows, 16>(q_tile, query, work.row0, p.query_len);
  Softmax state[kFp32RowsPerWarp];
  float out[kFp32RowsPerWarp][kColumns] = {};
  auto load = [&](int buffer, int64_t tile) {
    LoadTile<float, kDim, kKeyPitch, kKeys, 4>(k_tiles + buffer * kKeys * kKeyPitch, key,
                                               tile * kKeys, p.key_len);
    LoadTile<float, kDim, kDim, kKeys, 16>(v_tiles + buffer * kKeys * kDim, value, tile * kKeys,
                                           p.key_len);
  };
  auto compute = [&](int buffer, int64_t tile) {
    const float* k_row = k_tiles + buffer * kKeys * kKeyPitch + lane * kKeyPitch;
    const float* v_tile = v_tiles + buffer * kKeys * kDim;

    // Lane j scores key j of the tile against the warp's rows.
    float score[kFp32RowsPerWarp] = {};
    for (int d = 0; d < kDim; ++d) {
      const float k = k_row[d];
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        score[r] += q_tile[(warp * kFp32RowsPerWarp + r) * kDim + d] * k;
      }
    }
    // The online-softmax step per row: the warp's max, the accumulators rescaled, the weight.
    const int64_t key_index = tile * kKeys + lane;
    float weight[kFp32RowsPerWarp];
#pragma unroll
    for (int r = 0; r < kFp32RowsPerWarp; ++r) {
      const float s =
          ScoreOrHidden(work.transform, visible[r], distance[r], key_index, score[r] * p.scale);
      const float rescale = state[r].Rescale(s);
      Softmax::RescaleAccumulator(rescale, kColumns, [&](int c) -> float& { return out[r][c]; });
      weight[r] = state[r].AddScore(s);
    }
    for (int j = 0; j < kKeys; ++j) {
#pragma unroll
      for (int r = 0; r < kFp32RowsPerWarp; ++r) {
        const float w = __shfl_sync(0xffffffffu, weight[r], j);
#pragma unroll
        for (int c = 0; c < kColumns; ++c) out[r][c] += w * v_tile[j * kDim + lane + 32 * c];
      }
    }
  };
  Pipeline(work.tiles, load, compute);

  float* out_rows = p.out + work.batch_head * p.query_len * p.value_dim;
#pragma unroll
  for (int r = 0; r < kFp32RowsPerWarp; ++r) {
    state[r].Finish();  // The warp's shares of the denominator summed.
    const float factor = state[r].AddSink(work.sink);
    const int64_t row = work.row0 + warp * kFp32RowsPerWarp + r;
    if (row >= p.query_len) continue;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = lane + 32 * c;
      if (column < p.value_dim)
        out_rows[row * p.value_dim + column] = state[r].Normalize(out[r][c] * factor);
    }
    if (p.lse != nullptr && lane == 0) {
      p.lse[work.batch_head * p.query_len + row] = state[r].LogSumExp();
    }
  }
}

// --- The row kernel -----------------------------------------------------------------------------
constexpr int kRowColumnsPerLane = kMaxHeadDim / 32;  // Output columns per lane: lane + 32·m.

struct RowParams {
  DeviceProblem problem;
  float* out;
  float* lse;
  int64_t block_k;
};

// One warp per query row, tiles of any block_k. Per tile: each lane scores keys lane, lane + 32,
// … of the tile for the row's max (WarpReduce); the accumulators are rescaled; then 32 keys at
// a time each lane scores its key again, turns it into a weight, and the warp adds every weight
// (shuffled from its lane) times that key's value columns to the lanes' accumulators.
// (At least one block per multiprocessor: without the 1, ptxas capped this kernel at 56
// registers and spilled once the geometry's positions joined its parameters.)
__global__ void __launch_bounds__(kRowWarps * 32, 1) RowKernel(const RowParams params) {
  using Softmax = OnlineSoftmax<WarpReduce>;
  const DeviceProblem& p = params.problem;
  const Shape& s = p.shape;
  const int lane = threadIdx.x % 32;
  const int64_t global_row = int64_t{blockIdx.x} * kRowWarps + threadIdx.x / 32;
  if (global_row >= s.batch * s.heads * s.query_len) return;  // The whole warp: no shuffles left.
  const int64_t row = global_row % s.query_len;
  const int64_t batch_head = global_row / s.query_len;
  const int64_t batch = batch_head / s.heads, head = batch_head % s.heads;
  const int64_t query_offset = QueryRowOffset(p, batch, head, row);
  const int64_t kv_offset = KeyValueHeadOffset(p, batch, head);
  const KeyRange visible = p.geometry.Visible(row);
  const KeyRange tiles = p.geometry.VisitedTiles(row, row, params.block_k);
  const ScoreTransform transform = p.transforms.ForHead(head);
  const int64_t distance = p.geometry.Distance(row, 0);  // p − t of key 0.
  auto score = [&](int64_t key) {
    return transform(p.scale * Dot(p, query_offset, kv_offset + key * p.pitch), distance - key);
  };

  Softmax state;
  float acc[kRowColumnsPerLane] = {};
  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    // The tile's visible keys; the others have weight 0.
    const int64_t begin = max(tile * params.block_k, visible.begin);
    const int64_t end = min(tile * params.block_k + params.block_k, visible.end);
    float thread_max = -INFINITY;
    for (int64_t key = begin + lane; key < end; key += 32)
      thread_max = fmaxf(thread_max, score(key));
    const float rescale = state.Rescale(thread_max);
    Softmax::RescaleAccumulator(rescale, kRowColumnsPerLane,
                                [&](int m) -> float& { return acc[m]; });
    for (int64_t chunk = begin; chunk < end; chunk += 32) {
      const float weight = chunk + lane < end ? state.AddScore(score(chunk + lane)) : 0.f;
      const int count = static_cast<int>(min(int64_t{32}, end - chunk));
      for (int i = 0; i < count; ++i) {
        const float w = __shfl_sync(0xffffffffu, weight, i);
#pragma unroll
        for (int m = 0; m < kRowColumnsPerLane; ++m) {
          const int64_t column = lane + 32 * m;
          if (column < s.value_dim) acc[m] += w * ValueAt(p, kv_offset, chunk + i, column);
        }
      }
    }
  }
  state.Finish();
  const float factor = state.AddSink(p.transforms.Sink(head));
  float* out_row = params.out + global_row * s.value_dim;
#pragma unroll
  for (int m = 0; m < kRowColumnsPerLane; ++m) {
    const int64_t column = lane + 32 * m;
    if (column < s.value_dim) out_row[column] = state.Normalize(acc[m] * factor);
  }
  if (params.lse != nullptr && lane == 0) params.lse[global_row] = state.LogSumExp();
}

// --- Footprints and launch ----------------------------------------------------------------------
template <int kDim>
constexpr int MmaSharedBytes() {  // fp16 and bf16 alike.
  return (kMmaRows + 4 * kKeys) * (kDim + kSmemPad) * static_cast<int>(sizeof(__half));
}

template <int kDim>
constexpr int Fp32SharedBytes() {
  return (kFp32Rows * kDim + 2 * kKeys * (kDim + 1) + 2 * kKeys * kDim) *
         static_cast<int>(sizeof(float));
}

template <int kDim>
using Dim = std::integral_constant<int, kDim>;

// f(Dim<P>{}) for a compiled pitch P (kCompiledDims); `unexpected` for any other pitch.
template <class R, class F>
R ForPitch(int pitch, R unexpected, F&& f) {
  switch (pitch) {
    case 32:
      return f(Dim<32>{});
    case 64:
      return f(Dim<64>{});
    case 128:
      return f(Dim<128>{});
    case 256:
      return f(Dim<256>{});
    default:
      return unexpected;
  }
}

}  // namespace

int FusedSharedBytes(DType dtype, int pitch) {
  return ForPitch(pitch, -1, [&](auto dim) {
    constexpr int kDim = decltype(dim)::value;
    return dtype == DType::kFloat32 ? Fp32SharedBytes<kDim>() : MmaSharedBytes<kDim>();
  });
}

TiledPlan PlanTiled(const DeviceProblem& problem, int64_t block_k, int max_shared_bytes) {
  TiledPlan plan;
  plan.block_k = block_k;
  const int64_t key_len = problem.shape.key_len;
  // Same tiles: the fused kernels' kKeys, or one tile holding every key either way.
  const bool same_tiles = block_k == kKeys || (block_k >= key_len && kKeys >= key_len);
  const int fused_bytes = FusedSharedBytes(problem.dtype, problem.pitch);
  if (same_tiles && fused_bytes >= 0 && fused_bytes <= max_shared_bytes) {
    plan.kernel = problem.dtype == DType::kFloat32 ? TiledKernel::kFp32 : TiledKernel::kMma;
    plan.shared_bytes = fused_bytes;
  } else {
    plan.kernel = TiledKernel::kRows;
    plan.shared_bytes = 0;
  }
  return plan;
}

const char* TiledKernelName(TiledKernel kernel) {
  switch (kernel) {
    case TiledKernel::kMma:
      return "fused tensor-core kernel";
    case TiledKernel::kFp32:
      return "fused fp32 kernel";
    case TiledKernel::kRows:
      return "row kernel";
  }
  return "?";
}

cudaError_t LaunchTiled(const DeviceProblem& problem, const TiledPlan& plan, float* out, float* lse,
                        cudaStream_t stream) {
  const Shape& s = problem.shape;
  if (FusedSharedBytes(problem.dtype, problem.pitch) < 0) return cudaErrorInvalidValue;
  if (plan.kernel == TiledKernel::kRows) {
    const int64_t blocks = (s.batch * s.heads * s.query_len + kRowWarps - 1) / kRowWarps;
    if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
    return LaunchKernel(RowKernel, static_cast<unsigned>(blocks), kRowWarps * 32, 0, stream,
                        RowParams{problem, out, lse, plan.block_k});
  }
  const int rows = plan.kernel == TiledKernel::kFp32 ? kFp32Rows : kMmaRows;
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
                problem.transforms,
                problem.geometry};
  const int64_t blocks = s.batch * s.heads * params.row_blocks;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  return ForPitch(problem.pitch, cudaErrorInvalidValue, [&](auto dim) -> cudaError_t {
    constexpr int kDim = decltype(dim)::value;
    auto run = [&](auto kernel) {
      cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               plan.shared_bytes);
      if (error != cudaSuccess) return error;
      return LaunchKernel(kernel, static_cast<unsigned>(blocks), kThreads, plan.shared_bytes,
                          stream, params);
    };
    switch (problem.dtype) {
      case DType::kFloat32:
        return run(Fp32Kernel<kDim>);
      case DType::kFloat16:
        return run(MmaKernel<__half, kDim>);
      case DType::kBFloat16:
        return run(MmaKernel<__nv_bfloat16, kDim>);
      case DType::kFloat8E4M3:  // A cache's dtype only: an fp8 cache is gathered as fp32.
        break;
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace attn::cuda
