// Geometry: which keys a query row sees and which key/value head it reads — the one host-and-
// device definition every kernel (CPU and CUDA), every trace and the request checks use.
//
// Positions. Every key and query row has a position in the sequence: key j is at
// key_position + j, query row i at query_position + i. The request's defaults
// (server/request.cc) put the keys at 0 … key_len − 1 and the queries bottom-right, so the last
// query row sits at the last key (query_position = key_position + key_len − query_len, which may
// be negative when there are more query rows than keys: those first rows see no key). A client
// that splits a problem's keys (or queries) across servers sends each slice its own positions,
// and each slice then computes exactly its part of the whole (README, "Splitting the keys").
//
// Visibility: a query at position p sees a key at position t iff
//   t ≤ p                        when causal,
//   t ≥ p − window_left          when window_left is set (FlashAttention's window_size[0]),
//   t ≤ p + window_right         when window_right is set (window_size[1]).
// Every bound is a bound on t − p, so the keys row i sees are always one contiguous range
// Visible(i) = [begin, end) of the request's keys, and both ends never decrease with i: a block
// of consecutive rows sees at most keys [Visible(first).begin, Visible(last).end), and a key
// tile outside that range can be skipped by the whole block.
//
// Ragged batches (cu_seqlens): S sequences packed along the rows and the keys. Sequence s is
// rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and keys [cu_seqlens_k[s], cu_seqlens_k[s+1]); its
// rows see none of the other sequences' keys, and among its own the rules above apply with the
// sequence's own positions: its keys at 0 … and its rows bottom-right against them (Sequence()
// gives that geometry). Ranges stay contiguous and never decrease with the row, within a
// sequence as above and across sequences since the cumulative lengths never decrease; and for
// one row, p − t is still linear in the key index (Distance(row, key) = Distance(row, 0) − key).
//
// Token trees (a Decode item's tree_parents: speculative decoding's EAGLE/Medusa drafts): query
// row i is new token i, at key tree_first + i, and of the new tokens [tree_first, tree_first +
// tree_count) it sees only its ancestors and itself (TreeHides), on top of the rules above.
// Visible(i) stays the contiguous range around what it sees (a bound the kernels skip tiles by);
// the kernels hide the rest of the tree within it (MaskTreeTile, or TreeHides per key).
//
// Positions are checked to lie in [0, 2^62] (kMaxPosition), windows too, and key_len,
// query_len < 2^62, so p − key_position = query_position − key_position + row stays within
// (−2^63, 2^63) and no bound below overflows int64.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace attn {

// The largest position a request may give (both positions, the windows, and the lengths are at
// most this).
inline constexpr int64_t kMaxPosition = int64_t{1} << 62;

// A window side with no bound.
inline constexpr int64_t kUnbounded = -1;

// Keys [begin, end) of the request's keys (or, for tiles, tiles [begin, end)); empty when
// begin == end.
struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;

  ATTN_HOST_DEVICE int64_t size() const { return end - begin; }
  ATTN_HOST_DEVICE bool Contains(int64_t j) const { return j >= begin && j < end; }
};

// Why a key is hidden from a query row (Geometry::HiddenBy; TileStep.hidden in a trace).
enum class Hidden : int {
  kNone = 0,      // The row sees the key.
  kCausal = 1,    // t > p under the causal mask (first: causal wins over a window).
  kWindow = 2,    // Outside p − window_left … p + window_right.
  kSequence = 3,  // In another sequence of a ragged batch.
  kTree = 4,      // A new token that is not the row's ancestor in its token tree.
};

struct Geometry {
  int64_t query_len = 1;
  int64_t key_len = 1;
  int64_t query_position = 0;  // Position of query row 0 (resolved; may be negative, see above).
  int64_t key_position = 0;    // Position of key 0.
  bool causal = false;
  int64_t window_left = kUnbounded;   // Else keys at t ≥ p − window_left only.
  int64_t window_right = kUnbounded;  // Else keys at t ≤ p + window_right only.
  // A ragged batch (see above): sequences + 1 cumulative lengths each, in memory the kernel
  // reading them can (host or device); sequences 0 = one sequence, and the pointers unset.
  const int64_t* cu_seqlens_q = nullptr;
  const int64_t* cu_seqlens_k = nullptr;
  int64_t sequences = 0;
  // A token tree (see above; tree_count 0: none): row i's bit j of tree_ancestors (tree_words
  // 64-bit words a row, in memory the kernel reading them can) is set when new token j is its
  // ancestor or itself.
  int64_t tree_first = 0;
  int64_t tree_count = 0;
  int64_t tree_words = 0;
  const uint64_t* tree_ancestors = nullptr;

  // The request defaults: keys at key_position …, queries bottom-right against them.
  static ATTN_HOST_DEVICE Geometry BottomRight(int64_t query_len, int64_t key_len, bool causal,
                                               int64_t key_position = 0) {
    return Geometry{query_len, key_len, key_position + key_len - query_len, key_position, causal};
  }

  // The sequence holding query row `row`: the last s with cu_seqlens_q[s] ≤ row (so the one
  // non-empty sequence holding it); 0 when not ragged.
  ATTN_HOST_DEVICE int64_t SequenceOf(int64_t row) const {
    int64_t low = 0, high = sequences - 1;
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (cu_seqlens_q[mid] <= row) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    return low;
  }

  // Sequence s as a geometry of its own (one sequence: its positions, the mask and window), and
  // the packed indices of its first row and first key. Not ragged: this one, from 0 and 0.
  ATTN_HOST_DEVICE Geometry Sequence(int64_t s, int64_t& first_row, int64_t& first_key) const {
    if (sequences == 0) {
      first_row = first_key = 0;
      return *this;
    }
    first_row = cu_seqlens_q[s];
    first_key = cu_seqlens_k[s];
    Geometry own =
        BottomRight(cu_seqlens_q[s + 1] - first_row, cu_seqlens_k[s + 1] - first_key, causal);
    own.window_left = window_left;
    own.window_right = window_right;
    return own;
  }

  // The keys query row `row` sees (see above).
  ATTN_HOST_DEVICE KeyRange Visible(int64_t row) const {
    int64_t first_row, first_key;
    const Geometry own = Sequence(SequenceOf(row), first_row, first_key);
    const KeyRange range = own.VisibleInSequence(row - first_row);
    return KeyRange{range.begin + first_key, range.end + first_key};
  }

  // Of those, the ones in keys [begin, begin + n).
  ATTN_HOST_DEVICE int64_t VisibleKeysIn(int64_t row, int64_t begin, int64_t n) const {
    const KeyRange visible = Visible(row);
    const int64_t first = begin > visible.begin ? begin : visible.begin;
    const int64_t last = begin + n < visible.end ? begin + n : visible.end;
    return last > first ? last - first : 0;
  }

  // p − t for query row `row` and key `key` (the key taken at the row's sequence's positions
  // even when it lies in another sequence): the distance an ALiBi bias grows with
  // (kernels/score_transform.h).
  ATTN_HOST_DEVICE int64_t Distance(int64_t row, int64_t key) const {
    int64_t first_row, first_key;
    const Geometry own = Sequence(SequenceOf(row), first_row, first_key);
    return own.query_position - own.key_position + (row - first_row) - (key - first_key);
  }

  // Whether the token tree hides key `key` from row `row` (false without a tree, and for keys
  // before the new tokens).
  ATTN_HOST_DEVICE bool TreeHides(int64_t row, int64_t key) const {
    const int64_t j = key - tree_first;
    if (j < 0 || j >= tree_count) return false;
    return ((tree_ancestors[row * tree_words + j / 64] >> (j % 64)) & 1u) == 0;
  }

  // Sets to −inf the scores of a tile of n keys from key_begin that the token tree hides from
  // row `row` (no-op without a tree): what MaskTile leaves to a Decode item with tree_parents.
  ATTN_HOST_DEVICE void MaskTreeTile(int64_t row, int64_t key_begin, int64_t n,
                                     float* scores) const {
    if (tree_count == 0) return;
    const int64_t first = key_begin > tree_first ? key_begin : tree_first;
    const int64_t end =
        tree_first + tree_count < key_begin + n ? tree_first + tree_count : key_begin + n;
    for (int64_t key = first; key < end; ++key) {
      if (TreeHides(row, key)) scores[key - key_begin] = -INFINITY;
    }
  }

  // What hides key `key` from row `row` (kNone exactly when Visible(row) contains it and the
  // token tree does not hide it).
  ATTN_HOST_DEVICE Hidden HiddenBy(int64_t row, int64_t key) const {
    int64_t first_row, first_key;
    const Geometry own = Sequence(SequenceOf(row), first_row, first_key);
    if (key < first_key || key >= first_key + own.key_len) return Hidden::kSequence;
    const int64_t d = own.Distance(row - first_row, key - first_key);  // p − t
    if (causal && d < 0) return Hidden::kCausal;
    if (window_left != kUnbounded && d > window_left) return Hidden::kWindow;
    if (window_right != kUnbounded && -d > window_right) return Hidden::kWindow;
    if (TreeHides(row, key)) return Hidden::kTree;
    return Hidden::kNone;
  }

  // Key tiles of block_k keys holding a key that some row of [first_row, last_row] sees: the
  // tiles Tiled visits for that block of rows (for one row, first_row = last_row).
  ATTN_HOST_DEVICE KeyRange VisitedTiles(int64_t first_row, int64_t last_row,
                                         int64_t block_k) const {
    const int64_t begin = Visible(first_row).begin;
    const int64_t end = Visible(last_row).end;
    if (end <= begin) return KeyRange{0, 0};
    return KeyRange{begin / block_k, (end + block_k - 1) / block_k};
  }

  // Whether a row may see fewer than all the keys (a mask of any kind applies).
  ATTN_HOST_DEVICE bool Masked() const {
    return causal || window_left != kUnbounded || window_right != kUnbounded || sequences > 1 ||
           tree_count > 0;
  }

 private:
  // Visible(row) of one sequence: keys [0, key_len) at key_position …, row at query_position + row.
  ATTN_HOST_DEVICE KeyRange VisibleInSequence(int64_t row) const {
    const int64_t p =
        query_position - key_position + row;  // The row's position relative to key 0's.
    KeyRange range{0, key_len};
    if (window_left != kUnbounded && p - window_left > 0) {
      range.begin = p - window_left < key_len ? p - window_left : key_len;
    }
    int64_t right = window_right;  // The bound on t − p, if any.
    if (causal && (right == kUnbounded || right > 0)) right = 0;
    if (right != kUnbounded && right < key_len - p) {  // Then p + right + 1 ≤ key_len.
      range.end = p + right + 1 > 0 ? p + right + 1 : 0;
    }
    // begin ≤ end: a clamped begin (key_len) leaves end at key_len, a clamped end (0) begin at 0.
    return range;
  }
};

// Sets to −inf the scores of a tile of n keys from key_begin that lie outside a row's `visible`
// keys: the mask as every CPU kernel and trace applies it to a tile. The visible keys are one
// range, so the hidden ones are the tile's keys before it and after it (a loop testing each key
// took about a sixth of Tiled's softmax step; docs/perf.md).
ATTN_HOST_DEVICE void MaskTile(KeyRange visible, int64_t key_begin, int64_t n, float* scores) {
  const int64_t key_end = key_begin + n;
  const auto clamp = [](int64_t x, int64_t lo, int64_t hi) {
    return x < lo ? lo : x > hi ? hi : x;
  };
  const int64_t first = clamp(visible.begin, key_begin, key_end);
  const int64_t last = clamp(visible.end, first, key_end);  // An empty range hides every key.
  for (int64_t j = key_begin; j < first; ++j) scores[j - key_begin] = -INFINITY;
  for (int64_t j = last; j < key_end; ++j) scores[j - key_begin] = -INFINITY;
}

// Grouped-query attention: kv_heads divides heads, and each consecutive group of
// heads / kv_heads query heads shares one key/value head.
ATTN_HOST_DEVICE int64_t QueryHeadsPerKvHead(int64_t heads, int64_t kv_heads) {
  return heads / kv_heads;
}

// The key/value head that query head `head` reads.
ATTN_HOST_DEVICE int64_t KvHeadOf(int64_t head, int64_t heads, int64_t kv_heads) {
  return head / QueryHeadsPerKvHead(heads, kv_heads);
}

}  // namespace attn
