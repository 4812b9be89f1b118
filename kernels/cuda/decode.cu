// Decode on the GPU: split-KV attention (flash-decoding) of a batch of sequences over the pages
// of their KV caches, read in place.
//
// Computes, for every item, query row i of head h: out = Σ_j softmax_j(s_j) v_j and lse, where
// s_j is the score of key j as every kernel takes it (ScoreOrHidden, score_transform.h): scale ·
// q·k_j, soft-capped and ALiBi-biased by the head's transform, −inf for a key the row does not
// see under the item's geometry (the positions of the cache's keys and of the new rows, causal,
// the windows: kernels/geometry.h). Inputs (launch.h):
// queries fp32 [heads, nq, head_dim]; keys and values in their pages (PagedKv), fp32, fp16,
// bf16 or fp8 (E4M3 codes, each row with its scale: dtype.h), rows of key_width / value_width
// elements. Outputs: [heads, nq, value_dim] in each item's output dtype, lse fp32.
//
// Two kernels, one launch each for the whole batch:
//   DecodeKernel<T, P>  one block per unit (item, kv head, group of ≤ R query rows of that kv
//                       head's GQA group, key chunk; in a cascade's unit, of the GQA groups of
//                       several forks over a chunk of the pages they share: DecodeUnit): the
//                       chunk's keys and values are read from global memory once, for all the rows,
//                       a tile of K keys at a time into shared memory (fp32, rows padded to P; an
//                       fp8 row's codes times its scale); each warp owns up to R/4 rows. Scoring:
//                       the 32/K lanes j, j + K, … of the warp each sum a part of key j's dot
//                       product with the row, added across them by shuffles; the row's
//                       OnlineSoftmax<WarpReduce> takes the tile (the one update step,
//                       online_softmax.h; lanes ≥ K hold no key); then every lane accumulates its
//                       P/32 value columns in fp32 registers. The chunk's unnormalized (acc, max,
//                       denominator) go to scratch.
//   MergeKernel         one block per (item, row): the row's chunks combined in order with
//                       OnlineSoftmax::MergeInto (the one merge rule), normalized and stored.
// Tiles (R rows × K keys, DecodeTileOf in launch.h): P = 32 … 256: 16 × 32, one lane per key;
// P = 576 (DeepSeek-V3's MLA decode, 128 heads over one latent kv head): 8 × 16, two lanes per
// key, which holds shared memory to 92 224 bytes. A latent cache's values are read from its key
// pages at their row stride (PagedKv::ValueOffsetInPage), into the value tile like any other.
// The host (decode_method.cc) splits each cache into chunks so that the grid fills the device,
// and the unit list covers the whole batch at once, whatever each cache's length.
// Tile loads: rows that are whole 4-byte words (RowsAreWords: fp8 always, bf16/fp16 at even
// widths, fp32) load as words, each thread a batch of up to kWordBatch key and value words in
// flight before it converts any (LoadTileWords); other rows element by element, one load in
// flight per thread (LoadTileElements). Not yet done: double-buffered (cp.async) tiles, loads
// wider than a word (an fp8 row of 128 codes is 132 bytes: on a word boundary only); at
// P = 576 a latent cache's value columns are loaded a second time (they are the key tile's
// first columns); fp8 codes are converted one at a time through fp16 (Fp8E4M3HalfBits), not by
// sm_89's cvt of code pairs.
// Measured: not yet on a GPU (docs/perf.md; tests/gpu/device_check.sh measures cache bytes read
// per second against the same-run copy bandwidth). The static checks
// (tests/static/cuda_static_check.sh) hold both kernels to no spills and no stack frame, and the
// shared memory of every instance to each built architecture's opt-in limit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/portable.h"
#include "kernels/cuda/reduce.h"
#include "kernels/dtype.h"
#include "kernels/online_softmax.h"

namespace attn::cuda {
namespace {

// --- Tunables ---------------------------------------------------------------------------------
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMergeThreads = 128;
// Words of keys, and as many of values, each thread has in flight at most while a tile loads
// (LoadTileWords).
constexpr int kWordBatch = 4;

// The tile at pitch P (DecodeTileOf, launch.h) and what follows from it.
template <int P>
struct Tile {
  static constexpr int kRows = DecodeTileOf(P).rows;  // Query rows per block.
  static constexpr int kKeys = DecodeTileOf(P).keys;  // Keys per tile.
  static constexpr int kRowsPerWarp = kRows / kWarps;
  static constexpr int kLanesPerKey = 32 / kKeys;  // Lanes j, j + K, … share key j's dot product.
  static constexpr int kSpan = P / kLanesPerKey;   // Columns of the dot product per lane.
  static constexpr int kSegments = kSpan / kKeys;  // Its pieces of K columns.
  static_assert(kRows % kWarps == 0 && 32 % kKeys == 0);
  // Lane j + K·part starts its sweep `part` pieces in: with key rows P + 1 ≡ 1 (mod 32) floats
  // apart and kSpan ≡ 0 (mod 32), the lanes of one step then read 32 different banks.
  static_assert(kSpan % 32 == 0 && kSpan % kKeys == 0);
};

// Every pitch's shared memory, dynamic and static, fits the smallest opt-in limit of the
// architectures built (99 KB on sm_86/sm_120; tests/static/cuda_static_check.sh checks each).
constexpr bool DecodeFitsSmallestLimit() {
  for (int pitch : kDecodeDims) {
    if (DecodeSharedBytes(pitch) + DecodeStaticSharedBytes(pitch) > 101376) return false;
  }
  return true;
}
static_assert(DecodeFitsSmallestLimit());

// An element of a stored row as fp32. An fp8 cache's rows are E4M3 codes (uint8_t here, a
// type of its own to the instances); a code's value times its row's scale (dtype.h) is the
// element: the tile loads multiply by the scale, which the other dtypes' rows do not have.
__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(uint8_t code) { return Fp8E4M3ToFloat(code); }
template <class T>
constexpr bool kScaledRows = std::is_same_v<T, uint8_t>;

// Element e (0 … 4 / sizeof(T) − 1) of a row's 4-byte word as ToFloat gives it (little-endian:
// the lowest bytes first). Unscaled, as ToFloat.
template <class T>
__device__ __forceinline__ float WordElement(uint32_t word, int e) {
  if constexpr (std::is_same_v<T, float>) {
    return BitsToFloat(word);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return BitsToFloat(e == 0 ? word << 16 : word & 0xffff0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    return ToFloat(__ushort_as_half(static_cast<unsigned short>(word >> (16 * e))));
  } else {  // fp8: through fp16 (dtype.h), exactly; 2^8 · (the code's value · 2^-8).
    const uint8_t code = static_cast<uint8_t>(word >> (8 * e));
    return ToFloat(__ushort_as_half(Fp8E4M3HalfBits(code))) * 256.f;
  }
}

// Whether a tile of these pages may load as 4-byte words (LoadTileWords): every stored row a
// whole number of words, and so every row on a word boundary (pages come from cudaMalloc,
// 256-byte aligned). Always for fp8 (its codes padded to 4 bytes, then the scale); for the
// others when width · sizeof(T) is (head_dim 128 in bf16: yes; 33: no).
template <class T>
__device__ __forceinline__ bool RowsAreWords(const PagedKv& pages) {
  return (pages.key_width * static_cast<int64_t>(sizeof(T))) % 4 == 0 &&
         (pages.value_width * static_cast<int64_t>(sizeof(T))) % 4 == 0;
}

// The largest divisor of n that is at most kWordBatch: words per thread per batch.
constexpr int WordBatchOf(int n) {
  int batch = kWordBatch < n ? kWordBatch : n;
  while (n % batch != 0) --batch;
  return batch;
}
template <int kThreadWords>
constexpr int kWordBatchOf = WordBatchOf(kThreadWords);  // (A constant for device code.)

// The tile's keys and values as fp32 in shared memory (key_tile [kKeys][P + 1], value_tile
// [kKeys][P]): rows j < n from key_rows / value_rows, every element past a row's width and every
// row past n zero; an fp8 code times its row's scale. The block's threads together.
//
// Element by element: a load of 1, 2 or 4 bytes, its conversion and its store, in turn, each
// load in its own branch (a row's end, the tile's end), so a thread waits out one load's whole
// latency before it issues the next. For rows that are not whole words (RowsAreWords).
template <class T, int P>
__device__ __forceinline__ void LoadTileElements(const T* const* key_rows,
                                                 const T* const* value_rows,
                                                 const float* key_scales, const float* value_scales,
                                                 int n, int64_t head_dim, int64_t value_dim,
                                                 float* key_tile, float* value_tile) {
  constexpr int kKeys = Tile<P>::kKeys;
  for (int i = threadIdx.x; i < kKeys * P; i += kThreads) {
    const int j = i / P;
    const int c = i % P;
    float key = j < n && c < head_dim ? ToFloat(key_rows[j][c]) : 0.f;
    float value = j < n && c < value_dim ? ToFloat(value_rows[j][c]) : 0.f;
    if constexpr (kScaledRows<T>) {
      key *= j < n ? key_scales[j] : 0.f;
      value *= j < n ? value_scales[j] : 0.f;
    }
    key_tile[j * (P + 1) + c] = key;
    value_tile[i] = value;
  }
}

// The same tiles, the same values, from 4-byte words: the tile is kKeys rows of P / (4 /
// sizeof(T)) words, word i of it thread i mod kThreads's (a warp's words consecutive in a row:
// coalesced). Each thread issues a batch of WordBatchOf(its words) key and value loads, none of
// them conditional (a word past the rows' data reads word 0 of row 0, which every tile has, and
// is dropped), before it converts and stores any: one load latency per batch, not per element.
// A row's last word may run past its width into its padding (fp8's zeros; a latent cache's value
// row, into its key's further columns): those elements are dropped too.
template <class T, int P>
__device__ __forceinline__ void LoadTileWords(const T* const* key_rows, const T* const* value_rows,
                                              const float* key_scales, const float* value_scales,
                                              int n, int64_t head_dim, int64_t value_dim,
                                              float* key_tile, float* value_tile) {
  constexpr int kKeys = Tile<P>::kKeys;
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));  // Elements per word.
  constexpr int kRowWords = P / kPerWord;
  constexpr int kThreadWords = kKeys * kRowWords / kThreads;
  static_assert(P % kPerWord == 0 && (kKeys * kRowWords) % kThreads == 0);
  constexpr int kBatch = kWordBatchOf<kThreadWords>;
  const int key_words = static_cast<int>((head_dim + kPerWord - 1) / kPerWord);
  const int value_words = static_cast<int>((value_dim + kPerWord - 1) / kPerWord);
#pragma unroll 1
  for (int first = 0; first < kThreadWords; first += kBatch) {
    uint32_t keys[kBatch], values[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = static_cast<int>(threadIdx.x) + (first + b) * kThreads;
      const int j = i / kRowWords, w = i % kRowWords;
      const int row = j < n ? j : 0;
      keys[b] = LoadWord(reinterpret_cast<const uint32_t*>(key_rows[row]) +
                         (j < n && w < key_words ? w : 0));
      values[b] = LoadWord(reinterpret_cast<const uint32_t*>(value_rows[row]) +
                           (j < n && w < value_words ? w : 0));
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = static_cast<int>(threadIdx.x) + (first + b) * kThreads;
      const int j = i / kRowWords, w = i % kRowWords;
      const bool row = j < n;
      float key_scale = 1.f, value_scale = 1.f;
      if constexpr (kScaledRows<T>) {
        key_scale = row ? key_scales[j] : 0.f;
        value_scale = row ? value_scales[j] : 0.f;
      }
#pragma unroll
      for (int e = 0; e < kPerWord; ++e) {
        const int c = w * kPerWord + e;
        const float key = row && c < head_dim ? WordElement<T>(keys[b], e) * key_scale : 0.f;
        const float value = row && c < value_dim ? WordElement<T>(values[b], e) * value_scale : 0.f;
        key_tile[j * (P + 1) + c] = key;
        value_tile[j * P + c] = value;
      }
    }
  }
}

// One query row of a block: its item (−1: none), its row i among that item's rows of the unit's
// kv head (DecodeUnit), and the keys [begin, end) it sees. No initializers: it lives in shared
// memory.
struct BlockRow {
  int32_t item, row;
  int64_t begin, end;
};

// Blocks per SM the kernel at pitch P asks registers for (__launch_bounds__'s minimum). Up to
// P = 128 a block's shared memory (at most 42 KB) leaves room for 4 on sm_80/sm_90, and the
// registers are held to 128 a thread so that they do too (LoadTileWords' batches of words took
// them to 140 at P = 64 otherwise); past it shared memory allows 2 at most, and a minimum of 1
// leaves ptxas the registers it needs (at 128, P = 256 spills). Without any minimum, ptxas for
// sm_90 caps the P = 64 kernels at 72 registers and spills.
constexpr int DecodeMinBlocks(int pitch) { return pitch <= 128 ? 4 : 1; }

template <class T, int P>
__global__ void __launch_bounds__(kThreads, DecodeMinBlocks(P))
    DecodeKernel(const DecodeBatch batch) {
  using Layout = Tile<P>;
  constexpr int kRows = Layout::kRows;
  constexpr int kKeys = Layout::kKeys;
  constexpr int kRowsPerWarp = Layout::kRowsPerWarp;
  ATTN_DYNAMIC_SHARED(float, shared);
  float* query_tile = shared;                      // [kRows][P]
  float* key_tile = query_tile + kRows * P;        // [kKeys][P + 1]
  float* value_tile = key_tile + kKeys * (P + 1);  // [kKeys][P]
  ATTN_SHARED_ARRAY(const T*, key_rows, kKeys);
  ATTN_SHARED_ARRAY(const T*, value_rows, kKeys);
  ATTN_SHARED_ARRAY(float, key_scales, kScaledRows<T> ? kKeys : 1);  // fp8: the rows' scales.
  ATTN_SHARED_ARRAY(float, value_scales, kScaledRows<T> ? kKeys : 1);

  // The block's rows (DecodeUnit): row0 + r of the unit's item, or in a cascade of its members'
  // rows stacked in item order; past them, item −1.
  ATTN_SHARED_ARRAY(BlockRow, block_rows, kRows);

  const DecodeUnit unit = batch.units[blockIdx.x];
  // The unit's (first) item: the pages, the widths and the chunks' keys, which a cascade's
  // members share.
  const DecodeItem& item = batch.items[unit.item];
  const int64_t head_dim = item.head_dim;
  const int64_t value_dim = item.value_dim;
  const bool words = RowsAreWords<T>(item.pages);  // How the tiles load.
  const int64_t row0 = int64_t{unit.row_group} * kRows;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // While scoring: the tile's key this lane works on, and which part of its columns.
  const int key_lane = lane % kKeys;
  const int part = Layout::kLanesPerKey == 1 ? 0 : lane / kKeys;

  if (threadIdx.x < kRows) {
    int64_t i = row0 + threadIdx.x;
    BlockRow row{-1, 0, 0, 0};
    for (int32_t m = 0; m < unit.members; ++m) {
      const DecodeItem& member = batch.items[unit.item + m];
      const int64_t member_rows =
          QueryHeadsPerKvHead(member.heads, member.kv_heads) * member.query_len;
      if (i < member_rows) {
        const KeyRange seen = member.geometry.Visible(i % member.query_len);
        row = BlockRow{unit.item + m, static_cast<int32_t>(i), seen.begin, seen.end};
        break;
      }
      i -= member_rows;
    }
    block_rows[threadIdx.x] = row;
  }
  __syncthreads();
  // The chunk's keys, cut to those some row of the block sees.
  int rows = 0;
  int64_t seen_begin = INT64_MAX, seen_end = 0;
  for (int r = 0; r < kRows && block_rows[r].item >= 0; ++r, ++rows) {
    seen_begin = min(seen_begin, block_rows[r].begin);
    seen_end = max(seen_end, block_rows[r].end);
  }
  const int64_t chunk_begin = unit.chunk * item.chunk_keys;
  const int64_t begin = max(chunk_begin, seen_begin);
  const int64_t end = min(min(chunk_begin + item.chunk_keys, item.key_len), seen_end);

  // The block's query rows, each times its item's scale, zero-padded to P; rows past `rows` all
  // zeros.
  for (int i = threadIdx.x; i < kRows * P; i += kThreads) {
    const int r = i / P;
    const int c = i % P;
    float q = 0.f;
    if (r < rows && c < head_dim) {
      const DecodeItem& row_item = batch.items[block_rows[r].item];
      const int64_t nq = row_item.query_len;
      const int64_t head = unit.kv_head * QueryHeadsPerKvHead(row_item.heads, row_item.kv_heads) +
                           block_rows[r].row / nq;
      q = row_item.query[(head * nq + block_rows[r].row % nq) * head_dim + c] * row_item.scale;
    }
    query_tile[i] = q;
  }

  OnlineSoftmax<WarpReduce> state[kRowsPerWarp];
  float acc[kRowsPerWarp][P / 32];
  KeyRange visible[kRowsPerWarp];  // The chunk's keys [begin, end) the row sees.
  ScoreTransform transform[kRowsPerWarp];
  int64_t distance[kRowsPerWarp];  // p − t of key 0 (Geometry::Distance).
  int query_row[kRowsPerWarp];     // Its row among its item's new tokens (a tree's row).
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    visible[k] = KeyRange{};
    transform[k] = ScoreTransform{};
    distance[k] = 0;
    query_row[k] = 0;
    if (r < rows) {
      const BlockRow row = block_rows[r];
      const DecodeItem& row_item = batch.items[row.item];
      const int64_t nq = row_item.query_len;
      query_row[k] = static_cast<int>(row.row % nq);
      visible[k] = KeyRange{max(row.begin, begin), min(row.end, end)};
      transform[k] = row_item.transforms.ForHead(
          unit.kv_head * QueryHeadsPerKvHead(row_item.heads, row_item.kv_heads) + row.row / nq);
      distance[k] = row_item.geometry.Distance(query_row[k], 0);
    }
#pragma unroll
    for (int m = 0; m < P / 32; ++m) acc[k][m] = 0.f;
  }

  for (int64_t tile = begin; tile < end; tile += kKeys) {
    const int n = static_cast<int>(min(int64_t{kKeys}, end - tile));
    __syncthreads();  // The previous tile is consumed.
    if (static_cast<int>(threadIdx.x) < n) {
      const int64_t token = tile + threadIdx.x;
      const int64_t page = token / item.pages.page_tokens;
      key_rows[threadIdx.x] = static_cast<const T*>(item.pages.key_pages[page]) +
                              item.pages.KeyOffsetInPage(unit.kv_head, token);
      value_rows[threadIdx.x] = static_cast<const T*>(item.pages.value_pages[page]) +
                                item.pages.ValueOffsetInPage(unit.kv_head, token);
      if constexpr (kScaledRows<T>) {
        key_scales[threadIdx.x] = Fp8RowScale(key_rows[threadIdx.x], item.pages.key_width);
        value_scales[threadIdx.x] = Fp8RowScale(value_rows[threadIdx.x], item.pages.value_width);
      }
    }
    __syncthreads();
    if (words) {
      LoadTileWords<T, P>(key_rows, value_rows, key_scales, value_scales, n, head_dim, value_dim,
                          key_tile, value_tile);
    } else {
      LoadTileElements<T, P>(key_rows, value_rows, key_scales, value_scales, n, head_dim, value_dim,
                             key_tile, value_tile);
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      if (r >= rows) continue;  // The same for the whole warp.
      // score = scale · q·k for key `key_lane` of the tile: this lane's part of the columns, its
      // pieces swept from piece `part` on (no bank conflicts: Tile), then the parts added.
      const float* q = query_tile + r * P + part * Layout::kSpan;
      const float* key = key_tile + key_lane * (P + 1) + part * Layout::kSpan;
      float dot = 0.f;
      for (int s = 0; s < Layout::kSegments; ++s) {
        const int piece = s + part < Layout::kSegments ? s + part : s + part - Layout::kSegments;
        const float* q_piece = q + piece * kKeys;
        const float* key_piece = key + piece * kKeys;
#pragma unroll 8
        for (int c = 0; c < kKeys; ++c) dot += q_piece[c] * key_piece[c];
      }
#pragma unroll
      for (int offset = kKeys; offset < 32; offset *= 2) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      }
      // Lanes past the tile's n keys hold keys past `end`, which visible[k] excludes; lanes ≥ kKeys
      // hold no key (their copies of the dot products are not scores); a token tree hides the new
      // tokens off the row's branch.
      // (A cascade's members have no tree: its first item's TreeHides hides nothing.)
      const int64_t token = tile + key_lane;
      const float score = lane >= kKeys || item.geometry.TreeHides(query_row[k], token)
                              ? -INFINITY
                              : ScoreOrHidden(transform[k], visible[k], distance[k], token, dot);
      // max, rescale, exp, sum: the one update step.
      const float rescale = state[k].Rescale(score);
      const float weight = state[k].AddScore(score);
      OnlineSoftmax<WarpReduce>::RescaleAccumulator(rescale, P / 32,
                                                    [&](int m) -> float& { return acc[k][m]; });
      // acc += weights · V_tile, lane owning columns lane + 32·m.
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffffu, weight, j);
        const float* value = value_tile + j * P + lane;
#pragma unroll
        for (int m = 0; m < P / 32; ++m) acc[k][m] += w * value[32 * m];
      }
    }
  }

  // The chunk's partial state of each row, unnormalized.
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    if (r >= rows) continue;
    state[k].Finish();
    // Slot (row, chunk) of the row's item: flat row kv_head · group · query_len + its row.
    const DecodeItem& row_item = batch.items[block_rows[r].item];
    const int64_t flat =
        unit.kv_head * QueryHeadsPerKvHead(row_item.heads, row_item.kv_heads) * row_item.query_len +
        block_rows[r].row;
    const int64_t slot = flat * row_item.chunks + unit.chunk;
    float* out = batch.partial_acc + row_item.partial_acc + slot * value_dim;
#pragma unroll
    for (int m = 0; m < P / 32; ++m) {
      const int64_t c = lane + 32 * m;
      if (c < value_dim) out[c] = acc[k][m];
    }
    if (lane == 0) {
      float* partial = batch.partial_state + row_item.partial_state + 2 * slot;
      partial[0] = state[k].max;
      partial[1] = state[k].denominator;
    }
  }
}

__global__ void __launch_bounds__(kMergeThreads) MergeKernel(const DecodeBatch batch) {
  const DecodeItem& item = batch.items[blockIdx.y];
  const int64_t flat = blockIdx.x;
  if (flat >= item.heads * item.query_len) return;
  const int64_t value_dim = item.value_dim;
  const float* states = batch.partial_state + item.partial_state + flat * item.chunks * 2;
  const float* accs = batch.partial_acc + item.partial_acc + flat * item.chunks * value_dim;
  for (int64_t c = threadIdx.x; c < value_dim; c += kMergeThreads) {
    // Every thread merges the (identical) scalars itself: no shared memory, no barrier.
    OnlineSoftmaxRow row;
    row.max = states[0];
    row.denominator = states[1];
    float acc = accs[c];
    for (int64_t chunk = 1; chunk < item.chunks; ++chunk) {
      OnlineSoftmaxRow other;
      other.max = states[2 * chunk];
      other.denominator = states[2 * chunk + 1];
      row.MergeInto(other, &accs[chunk * value_dim + c], &acc, 1);
    }
    const float factor = row.AddSink(item.transforms.Sink(flat / item.query_len));
    StoreElement(item.output, item.output_dtype, flat * value_dim + c, row.Normalize(acc * factor));
    if (c == 0 && item.lse != nullptr) item.lse[flat] = row.LogSumExp();
  }
}

template <class T, int P>
cudaError_t Run(const DecodeBatch& batch, cudaStream_t stream) {
  auto kernel = DecodeKernel<T, P>;
  constexpr int kShared = DecodeSharedBytes(P);  // DecodeTileOf(P)'s tiles.
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared);
  if (error != cudaSuccess) return error;
  return LaunchKernel(kernel, static_cast<unsigned>(batch.units_count), kThreads, kShared, stream,
                      batch);
}

template <class T>
cudaError_t RunPitch(const DecodeBatch& batch, cudaStream_t stream) {
  switch (batch.pitch) {
    case 32:
      return Run<T, 32>(batch, stream);
    case 64:
      return Run<T, 64>(batch, stream);
    case 128:
      return Run<T, 128>(batch, stream);
    case 256:
      return Run<T, 256>(batch, stream);
    case 576:
      return Run<T, 576>(batch, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchDecode(const DecodeBatch& batch, cudaStream_t stream) {
  if (batch.units_count <= 0 || batch.items_count <= 0) return cudaSuccess;
  if (batch.units_count > INT32_MAX || batch.max_rows > INT32_MAX || batch.items_count > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  cudaError_t error = cudaErrorInvalidValue;
  switch (batch.dtype) {
    case DType::kFloat32:
      error = RunPitch<float>(batch, stream);
      break;
    case DType::kFloat16:
      error = RunPitch<__half>(batch, stream);
      break;
    case DType::kBFloat16:
      error = RunPitch<__nv_bfloat16>(batch, stream);
      break;
    case DType::kFloat8E4M3:
      error = RunPitch<uint8_t>(batch, stream);
      break;
  }
  if (error != cudaSuccess) return error;
  const dim3 grid(static_cast<unsigned>(batch.max_rows), static_cast<unsigned>(batch.items_count));
  return LaunchKernel(MergeKernel, grid, kMergeThreads, 0, stream, batch);
}

}  // namespace attn::cuda
