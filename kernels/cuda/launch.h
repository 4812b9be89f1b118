// Launchers of the CUDA kernels (naive.cu, tiled.cu, trace.cu, decode.cu, pages.cu), callable
// from host code.
//
// Every launcher enqueues work on `stream` and returns the launch's error (cudaSuccess when it
// was queued); errors during execution surface at the next synchronizing call. Inputs are a
// DeviceProblem: query, key and value in one storage dtype, each row padded with zeros to
// `pitch` elements, so that kernels compiled for a few head sizes serve every head_dim 1..256.
// The decode kernel reads a cache's pages in place and takes one more, wider pitch (576:
// kDecodeDims); Naive, Tiled and Trace stop at kMaxHeadDim.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/problem.h"

namespace attn::cuda {

// Head sizes the fused kernels are compiled for; head_dim and value_dim are padded up to one.
constexpr int kCompiledDims[] = {32, 64, 128, 256};
constexpr int kMaxHeadDim = 256;

// The smallest of `dims` (ascending) ≥ max(head_dim, value_dim), or 0 when the shape is wider.
template <size_t N>
int PaddedTo(const int (&dims)[N], const Shape& shape) {
  for (int dim : dims) {
    if (shape.head_dim <= dim && shape.value_dim <= dim) return dim;
  }
  return 0;
}

// The padded size for a shape: the smallest compiled size ≥ max(head_dim, value_dim), or 0
// when the shape is too wide for the CUDA kernels.
inline int PaddedDim(const Shape& shape) { return PaddedTo(kCompiledDims, shape); }

struct DeviceProblem {
  Shape shape;
  DType dtype = DType::kFloat32;  // Of query, key and value alike.
  int pitch = 32;                 // Elements per row in memory: PaddedDim(shape).
  float scale = 1.f;
  ScoreTransforms transforms;   // Each head's score transform (kernels/score_transform.h);
                                // alibi_slopes in device memory.
  Geometry geometry;            // Which keys each query row sees (kernels/geometry.h).
  const void* query = nullptr;  // [batch, heads, query_len, pitch]
  const void* key = nullptr;    // [batch, kv_heads, key_len, pitch]
  const void* value = nullptr;  // [batch, kv_heads, key_len, pitch]
};

// --- Tiled (tiled.cu) -----------------------------------------------------------------------

// Keys per tile of the fused kernels: the CUDA backend's default block_k.
constexpr int kFusedBlockK = 32;

enum class TiledKernel {
  kMma,   // fp16/bf16, fused, tensor cores: tiles of kFusedBlockK keys.
  kFp32,  // fp32, fused: tiles of kFusedBlockK keys.
  kRows,  // Any dtype and block_k: one warp per query row, no shared memory (slower).
};

// How Tiled runs one problem.
struct TiledPlan {
  TiledKernel kernel = TiledKernel::kRows;
  int64_t block_k = kFusedBlockK;  // Keys per tile: always the request's.
  int shared_bytes = 0;            // Dynamic shared memory per block.
};

// Dynamic shared memory per block, bytes, of the fused kernel for `dtype` at `pitch`; −1 for a
// pitch that is not one of kCompiledDims.
int FusedSharedBytes(DType dtype, int pitch);

// The plan for tiles of block_k keys: the fused kernel when its tiles are the same (block_k is
// kFusedBlockK, or both hold every key) and its shared memory fits max_shared_bytes (the
// device's opt-in limit per block); else the row kernel, which honours any block_k and needs no
// shared memory.
TiledPlan PlanTiled(const DeviceProblem& problem, int64_t block_k, int max_shared_bytes);

const char* TiledKernelName(TiledKernel kernel);

// Online-softmax attention as planned: out [batch, heads, query_len, value_dim] fp32 and, when
// lse is not null, lse [batch, heads, query_len]. cudaErrorInvalidValue for a pitch that is not
// one of kCompiledDims.
cudaError_t LaunchTiled(const DeviceProblem& problem, const TiledPlan& plan, float* out, float* lse,
                        cudaStream_t stream);

// --- Naive's pieces (naive.cu); the two matrix products are cuBLAS calls --------------------

// Row-wise stable softmax of scores [B·H·Nq, Nk] (row r is query r % Nq of head r / Nq % heads)
// into weights, with the transforms (softcap, ALiBi: applied to the scores in place; slopes in
// device memory) and the mask (`geometry`) applied here; lse (nullable) gets each row's
// log-sum-exp.
cudaError_t LaunchSoftmax(float* scores, float* weights, float* lse, int64_t rows, int64_t heads,
                          const Geometry& geometry, const ScoreTransforms& transforms,
                          cudaStream_t stream);

// Dense fp32 copy [rows, cols] of a pitched tensor in `dtype`.
cudaError_t LaunchToFloat(const void* input, DType dtype, int64_t pitch, int64_t rows, int64_t cols,
                          float* output, cudaStream_t stream);

// output[i] = input[i] rounded to `dtype` (nearest even), for i < count.
cudaError_t LaunchStore(const float* input, int64_t count, DType dtype, void* output,
                        cudaStream_t stream);

// --- Trace (trace.cu) -----------------------------------------------------------------------

// Where the trace kernel records each step of each traced row (all device pointers). Row r's
// steps are first_step[r] .. first_step[r] + its visited tiles − 1.
struct TraceRecords {
  int rows = 0;
  int block_k = 1;
  const int64_t* row_refs = nullptr;    // [rows, 3]: batch, head, query row
  const int64_t* first_step = nullptr;  // [rows]
  float* scores = nullptr;              // [steps, block_k]
  float* scaled_scores = nullptr;       // [steps, block_k]: before the transform; null for identity
  float* weights = nullptr;             // [steps, block_k]
  float* scalars = nullptr;             // [steps, 4]: max_before, max_after, rescale, denominator
  float* accumulator = nullptr;         // [steps, value_dim]
  float* estimate = nullptr;            // [steps, value_dim]
  float* output = nullptr;              // [rows, value_dim]: the online result
  float* reference = nullptr;           // [rows, value_dim]: the full-matrix result
  float* lse = nullptr;                 // [rows]
  float* reference_scores = nullptr;    // [rows, key_len]: the full score → weight row
  float* biases = nullptr;              // [steps, block_k]: each key's ALiBi bias; null: none
  Hidden* hidden = nullptr;             // [steps, block_k]: what hides each key; null: no mask
};

constexpr int kTraceScalars = 4;

cudaError_t LaunchTrace(const DeviceProblem& problem, const TraceRecords& records,
                        cudaStream_t stream);

// --- KV cache pages (pages.cu) ----------------------------------------------------------------

// Dense [kv_heads, key_len, pitch] in out_dtype (rows zero-padded past `width`) of the first
// key_len tokens of a cache: its keys (width head_dim) or its values (width value_dim; a latent
// cache's are its keys' first columns); the tables and pages (pages.dtype) in device memory.
// How Naive, Tiled and Trace read a cache: they run on the gathered copy.
cudaError_t LaunchGather(const PagedKv& pages, bool keys, int64_t kv_heads, int64_t key_len,
                         int64_t width, void* out, DType out_dtype, int64_t pitch,
                         cudaStream_t stream);

// Writes dense stored rows [kv_heads, n] of row_bytes bytes each (an even count: StoredRowBytes;
// already as the pages keep them, device memory) as tokens first … first + n − 1 of the pages in
// `table` (a device array of blocks [kv_heads, page_tokens] of such rows). How a KV store
// appends.
cudaError_t LaunchScatter(const void* tokens, int64_t kv_heads, int64_t n, int64_t row_bytes,
                          void* const* table, int64_t page_tokens, int64_t first,
                          cudaStream_t stream);

// --- Decode (decode.cu): split-KV attention over the pages of a batch of caches --------------

// Head sizes the decode kernel is compiled for: kCompiledDims and 576, DeepSeek-V3's MLA decode
// (head_dim 576 over a latent cache whose values are the first 512 columns of each key). Only
// the decode kernel takes rows wider than kMaxHeadDim; PaddedDim, and so Naive, Tiled and Trace,
// do not.
constexpr int kDecodeDims[] = {32, 64, 128, 256, 576};
constexpr int kMaxDecodeDim = 576;

// The decode kernel's pitch for a shape: the smallest of kDecodeDims ≥ max(head_dim,
// value_dim), or 0 when the shape is too wide for it.
inline int PaddedDecodeDim(const Shape& shape) { return PaddedTo(kDecodeDims, shape); }

// The decode kernel's tile at one pitch, the one definition that the kernel and the host (which
// lists the units and rounds the chunks) both use. Up to kMaxHeadDim: 16 query rows per block
// (4 per warp) and 32 keys per tile (one per lane while scoring). Wider: 8 rows (2 per warp) and
// 16 keys, each key's dot product split between two lanes, so that the tiles fit the 99 KB
// opt-in limit of sm_86/sm_120 (92 224 bytes at 576, where 16 × 32 would take 184 KB).
struct DecodeTile {
  int rows;  // Query rows of one GQA group per block.
  int keys;  // Keys per tile; a multiple of it is every chunk's size.
};
constexpr DecodeTile DecodeTileOf(int pitch) {
  return pitch <= kMaxHeadDim ? DecodeTile{16, 32} : DecodeTile{8, 16};
}

// Dynamic shared memory of the decode kernel at `pitch`, bytes: the block's query rows, one key
// tile (rows padded by one float: no bank conflicts) and one value tile, fp32.
constexpr int DecodeSharedBytes(int pitch) {
  const DecodeTile tile = DecodeTileOf(pitch);
  return 4 * (tile.rows * pitch + tile.keys * (pitch + 1) + tile.keys * pitch);
}

// Its static shared memory at most, bytes: the tile's key and value row pointers, and their rows'
// scales (fp8 caches' instances; the others do not use them); each query row's item, row and
// visible keys (decode.cu's BlockRow).
constexpr int DecodeStaticSharedBytes(int pitch) {
  return 2 * DecodeTileOf(pitch).keys * (8 + 4) + DecodeTileOf(pitch).rows * 24;
}

// One sequence of the batch (device memory, read by both kernels). Its rows are
// flat = head · query_len + row; its keys split into `chunks` of chunk_keys (a multiple of the
// tile's keys, DecodeTileOf), chunk c holding keys [c · chunk_keys, (c + 1) · chunk_keys) ∩ [0,
// key_len).
struct DecodeItem {
  PagedKv pages;       // Tables and pages in device memory, pages.dtype the batch's dtype.
  const float* query;  // [heads, query_len, head_dim] fp32
  void* output;        // [heads, query_len, value_dim] in output_dtype
  DType output_dtype;
  float* lse;  // [heads, query_len], or null
  int64_t heads, kv_heads, query_len, key_len, head_dim, value_dim;
  float scale;
  ScoreTransforms transforms;  // Each head's score transform (kernels/score_transform.h);
                               // alibi_slopes in device memory.
  Geometry geometry;           // Which keys each query row sees (kernels/geometry.h).
  int64_t chunk_keys, chunks;
  int64_t partial_acc;    // Offset in DecodeBatch::partial_acc of its [rows, chunks, value_dim].
  int64_t partial_state;  // Offset in DecodeBatch::partial_state of its [rows, chunks, 2].
};

// One block of the split kernel: item, kv head, row group (DecodeTileOf(pitch).rows query rows
// of that kv head: row r of row group g is flat row (kv_head · group + i / query_len) ·
// query_len + i % query_len, i = g · rows + r, group = heads / kv_heads), key chunk; `members`
// items from `item` on. A cascade's unit (members ≥ 2: forks of one prompt, kernels/cascade.h)
// takes the rows of its members, each item's rows of the kv head after the previous one's (i
// counts through them), over a chunk of the pages they share, read once for all of them; each
// row's state goes to its own item's slot for that chunk, which that item's own units skip.
struct DecodeUnit {
  int32_t item, kv_head, row_group, chunk, members;
};

struct DecodeBatch {
  DType dtype = DType::kFloat32;  // Of every item's pages.
  int pitch = 32;                 // One of kDecodeDims ≥ every item's head_dim and value_dim.
  const DecodeItem* items = nullptr;
  int items_count = 0;
  const DecodeUnit* units = nullptr;
  int64_t units_count = 0;
  int64_t max_rows = 0;            // The largest heads · query_len.
  float* partial_acc = nullptr;    // Unnormalized accumulators of every (row, chunk).
  float* partial_state = nullptr;  // (max, denominator) of every (row, chunk).
};

// The split kernel over every unit, then the merge of every row's chunks into its output and
// lse. cudaErrorInvalidValue for a pitch that is not one of kDecodeDims;
// cudaErrorInvalidConfiguration for a grid the device cannot launch.
cudaError_t LaunchDecode(const DecodeBatch& batch, cudaStream_t stream);

}  // namespace attn::cuda
