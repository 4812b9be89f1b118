// Problem: one validated attention problem, as the kernels see it.
//
// server/request.cc builds a Problem only after checking every invariant below, so kernels may
// assume them without checking again:
//   - batch, heads, kv_heads, query_len, key_len, head_dim, value_dim ≥ 1;
//   - heads % kv_heads == 0; block_k ≥ 1; scale finite;
//   - query, key and value point at dense row-major [batch, heads|kv_heads, len, dim] data
//     that outlives every call using the Problem; all element counts fit in int64;
//   - or, for attention over a cache, `pages` is set: batch is 1, key and value are unset, and
//     the first key_len tokens of the pages are the keys and values (pages->dtype is theirs).
// A Problem does not own its tensors. Thread-safe to share read-only.
#pragma once

#include <cstdint>
#include <optional>

#include "kernels/dtype.h"
#include "kernels/geometry.h"
#include "kernels/host_device.h"
#include "kernels/score_transform.h"

namespace attn {

// A read-only view of a dense tensor in its storage dtype.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;

  float operator[](int64_t i) const { return LoadElement(data, dtype, i); }
};

// A writable view of a dense tensor in its storage dtype.
struct MutableTensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;

  void Store(int64_t i, float value) const { StoreElement(data, dtype, i, value); }
};

// The keys and values of a server-resident cache, as fixed-size pages of page_tokens tokens in
// one dtype (kernels/kv_store.h owns them). Page p holds tokens [p·page_tokens, (p+1)·page_tokens)
// of every kv head: its key block is [kv_heads, page_tokens, key_width] and its value block
// [kv_heads, page_tokens, value_width], row-major; a key is the first head_dim elements of its
// row, a value the first value_dim of its own. An fp8 row (dtype.h) ends with its scale:
// Fp8RowScale(row, width) for a row of width (key_width or value_width) bytes. A latent cache
// (KvLayout::values_from_keys) has no value blocks: value_pages is key_pages and value_width
// key_width, so a value is the first value_dim columns of its key. The tables and the pages live in
// the backend's memory (device memory on a GPU) and stay unchanged while a Problem uses them.
struct PagedKv {
  const void* const* key_pages = nullptr;    // [pages] → key block
  const void* const* value_pages = nullptr;  // [pages] → value block (key_pages: latent)
  // The same tables in host memory, for the host's plans (which caches share pages: cascade.h):
  // key_pages and value_pages themselves where those are in host memory; a copy the store keeps
  // in step where they are not (a GPU's).
  const void* const* host_key_pages = nullptr;
  const void* const* host_value_pages = nullptr;
  int64_t page_tokens = 1;
  // Elements per row of a key block, StoredRowWidth(dtype, head_dim): head_dim, or for fp8 its
  // padded codes and scale.
  int64_t key_width = 1;
  // Elements per row of a value block, the same of value_dim (the key blocks': latent).
  int64_t value_width = 1;
  DType dtype = DType::kFloat32;

  // The offset, in elements, of token `token` of kv head `kv_head` from the start of its page's
  // key or value block.
  ATTN_HOST_DEVICE int64_t KeyOffsetInPage(int64_t kv_head, int64_t token) const {
    return (kv_head * page_tokens + token % page_tokens) * key_width;
  }
  ATTN_HOST_DEVICE int64_t ValueOffsetInPage(int64_t kv_head, int64_t token) const {
    return (kv_head * page_tokens + token % page_tokens) * value_width;
  }
  ATTN_HOST_DEVICE const void* KeyPage(int64_t token) const {
    return key_pages[token / page_tokens];
  }
  ATTN_HOST_DEVICE const void* ValuePage(int64_t token) const {
    return value_pages[token / page_tokens];
  }
};

struct Shape {
  int64_t batch = 1;
  int64_t heads = 1;     // Query heads.
  int64_t kv_heads = 1;  // Key/value heads; divides heads.
  int64_t query_len = 1;
  int64_t key_len = 1;
  int64_t head_dim = 1;   // Query/key width.
  int64_t value_dim = 1;  // Value/output width.
};

// One query row of one (batch, head).
struct RowRef {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

struct Problem {
  Shape shape;
  TensorView query;  // [batch, heads, query_len, head_dim]
  TensorView key;    // [batch, kv_heads, key_len, head_dim]
  TensorView value;  // [batch, kv_heads, key_len, value_dim]
  // Set instead of key and value when they come from a cache (server-resident, paged).
  const PagedKv* pages = nullptr;
  float scale = 1.f;
  // Softcap (kernels/score_transform.h): a scaled score s becomes softcap · tanh(s / softcap);
  // 0 = none, else finite and > 0.
  float softcap = 0.f;
  // ALiBi (kernels/score_transform.h): [heads] slopes, query head h adding
  // −alibi_slopes[h] · |p − t| to its scores; null = none, else each finite. Host memory, owned
  // like the tensors.
  const float* alibi_slopes = nullptr;
  // Attention sinks (OnlineSoftmax::AddSink): [heads] logits, one more in every row of query
  // head h that takes weight but has no value; null = none, else each finite. Host memory, owned
  // like the tensors.
  const float* sinks = nullptr;
  bool causal = false;
  // Positions (kernels/geometry.h): key j at key_position + j; query row i at query_position + i,
  // bottom-right against the keys when unset. Both in [0, kMaxPosition] when set.
  int64_t key_position = 0;
  std::optional<int64_t> query_position;
  // Sliding window (kernels/geometry.h): keys at t ≥ p − window_left and t ≤ p + window_right
  // only; kUnbounded (−1) = no bound. Both in [0, kMaxPosition] when set.
  int64_t window_left = kUnbounded;
  int64_t window_right = kUnbounded;
  // A ragged batch (kernels/geometry.h): batch is 1, and sequences + 1 cumulative lengths each
  // (starting at 0, never decreasing, ending at query_len and key_len) split the rows and keys
  // into sequences; the positions are then unset, and pages too (a cache is one sequence, so
  // Decode never meets one). sequences 0 = one sequence. Host memory, owned like the tensors.
  const int64_t* cu_seqlens_q = nullptr;
  const int64_t* cu_seqlens_k = nullptr;
  int64_t sequences = 0;
  // A token tree (kernels/geometry.h; a Decode item's tree_parents): query row i is new token i,
  // key tree_first + i; tree_ancestors holds (tree_count + 63) / 64 words a row. tree_count 0 =
  // none. Host memory, owned like the tensors.
  int64_t tree_first = 0;
  int64_t tree_count = 0;
  const uint64_t* tree_ancestors = nullptr;
  int block_k = 1;  // Keys per tile for Tiled and Trace.
  bool return_lse = false;
  DType output_dtype = DType::kFloat32;

  // The storage dtype of the keys and of the values: the pages' for a problem over a cache.
  DType key_dtype() const { return pages != nullptr ? pages->dtype : key.dtype; }
  DType value_dtype() const { return pages != nullptr ? pages->dtype : value.dtype; }

  // What becomes of every scaled score before the mask: of every head, of head h.
  ScoreTransforms transforms() const { return ScoreTransforms{softcap, alibi_slopes, sinks}; }
  ScoreTransform transform(int64_t head) const { return transforms().ForHead(head); }

  // The key/value head that query head h reads (KvHeadOf).
  int64_t KvHead(int64_t head) const { return KvHeadOf(head, shape.heads, shape.kv_heads); }

  // Which keys each query row sees, with the positions resolved.
  Geometry geometry() const {
    Geometry g = Geometry::BottomRight(shape.query_len, shape.key_len, causal, key_position);
    if (query_position) g.query_position = *query_position;
    g.window_left = window_left;
    g.window_right = window_right;
    g.cu_seqlens_q = cu_seqlens_q;
    g.cu_seqlens_k = cu_seqlens_k;
    g.sequences = sequences;
    g.tree_first = tree_first;
    g.tree_count = tree_count;
    g.tree_words = (tree_count + 63) / 64;
    g.tree_ancestors = tree_ancestors;
    return g;
  }

  // The keys query row i sees.
  KeyRange Visible(int64_t row) const { return geometry().Visible(row); }
  // Of those, the ones in key tile `tile` (of block_k keys).
  int64_t VisibleKeysInTile(int64_t row, int64_t tile) const {
    return geometry().VisibleKeysIn(row, tile * block_k, block_k);
  }

  // Key tiles Tiled visits for rows [first_row, last_row]: the tiles holding a key one of them
  // sees.
  KeyRange VisitedTiles(int64_t first_row, int64_t last_row) const {
    return geometry().VisitedTiles(first_row, last_row, block_k);
  }
  KeyRange VisitedTiles(int64_t row) const { return VisitedTiles(row, row); }
  int64_t TilesPerRow() const { return (shape.key_len + block_k - 1) / block_k; }

  // Element offsets of the first element of a row.
  int64_t QueryOffset(int64_t batch, int64_t head, int64_t row) const {
    return ((batch * shape.heads + head) * shape.query_len + row) * shape.head_dim;
  }
  int64_t KeyOffset(int64_t batch, int64_t kv_head, int64_t key) const {
    return ((batch * shape.kv_heads + kv_head) * shape.key_len + key) * shape.head_dim;
  }
  int64_t ValueOffset(int64_t batch, int64_t kv_head, int64_t key) const {
    return ((batch * shape.kv_heads + kv_head) * shape.key_len + key) * shape.value_dim;
  }
  int64_t OutputOffset(int64_t batch, int64_t head, int64_t row) const {
    return ((batch * shape.heads + head) * shape.query_len + row) * shape.value_dim;
  }
  int64_t LseOffset(int64_t batch, int64_t head, int64_t row) const {
    return (batch * shape.heads + head) * shape.query_len + row;
  }

  int64_t OutputElements() const {
    return shape.batch * shape.heads * shape.query_len * shape.value_dim;
  }
  int64_t LseElements() const { return shape.batch * shape.heads * shape.query_len; }

  // Unmasked (query, key) pairs over all batches and heads.
  double VisiblePairs() const {
    double per_head = 0;
    const Geometry g = geometry();
    if (!g.Masked()) {
      per_head = static_cast<double>(shape.query_len) * static_cast<double>(shape.key_len);
    } else {
      for (int64_t i = 0; i < shape.query_len; ++i) {
        const KeyRange visible = g.Visible(i);
        per_head += static_cast<double>(visible.size());
        for (int64_t key = g.tree_first; key < g.tree_first + g.tree_count; ++key) {
          per_head -= visible.Contains(key) && g.TreeHides(i, key) ? 1.0 : 0.0;
        }
      }
    }
    return per_head * static_cast<double>(shape.batch * shape.heads);
  }

  // FLOPs of the two matrix products per unmasked (query, key) pair: 2·d for q·k plus 2·dv
  // for w·v.
  double FlopsPerPair() const {
    return 2.0 * static_cast<double>(shape.head_dim + shape.value_dim);
  }

  // FLOPs of the two matrix products over unmasked pairs (Naive and Tiled).
  double Flops() const { return VisiblePairs() * FlopsPerPair(); }

  // FLOPs a trace spends on key tile `tile` of query row `row` (its visible pairs), and on the
  // whole row.
  double TraceTileFlops(int64_t row, int64_t tile) const {
    return static_cast<double>(VisibleKeysInTile(row, tile)) * FlopsPerPair();
  }
  double TraceRowFlops(int64_t row) const {
    return static_cast<double>(Visible(row).size()) * FlopsPerPair();
  }

  // What Naive stores: its fp32 score and weight matrices, 2·B·H·Nq·Nk·4 bytes (the caller has
  // checked that it fits in int64).
  int64_t NaiveStorageBytes() const {
    return 2 * shape.batch * shape.heads * shape.query_len * shape.key_len *
           static_cast<int64_t>(sizeof(float));
  }

  // The explainer's accounting of Naive's score and weight traffic: one fp32 write and one read
  // of each query_len × key_len matrix per (batch, head) = 16·B·H·Nq·Nk bytes. The caller has
  // checked that it fits in int64.
  int64_t NaiveIntermediateBytes() const {
    return 16 * shape.batch * shape.heads * shape.query_len * shape.key_len;
  }

  // The online softmax's scratch per query row: a tile of scores, the accumulators, the running
  // max and the denominator.
  int64_t TiledScratchFloatsPerRow() const { return block_k + shape.value_dim + 2; }
};

}  // namespace attn
