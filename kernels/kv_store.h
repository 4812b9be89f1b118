// KvStore: the memory of one server-resident KV cache — pages of keys and values in the
// backend's memory (host memory on the CPU, device memory on a GPU), in one dtype. The server's
// registry (server/caches.h) owns what a store means (its id, owner, budget, ordering); the
// backend that made it owns its memory.
//
// Storage: fixed-size pages of page_tokens tokens (PagedKv in problem.h), allocated as the cache
// grows; appending never moves or copies a stored token. Not thread-safe: the registry orders
// every call on one store (an append never runs beside a read of the same store).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kernels/problem.h"

namespace attn {

struct KvLayout {
  int64_t kv_heads = 1;
  int64_t head_dim = 1;
  int64_t value_dim = 1;
  DType dtype = DType::kFloat32;
  // A latent cache (MLA; CreateCacheRequest.values_from_keys): only keys are stored, and a
  // token's value is the first value_dim (≤ head_dim) columns of its key.
  bool values_from_keys = false;
};

// Elements of one token's value a store of this layout keeps per kv head: value_dim, or none
// for a latent cache (its values are its keys' columns).
inline int64_t StoredValueDim(const KvLayout& layout) {
  return layout.values_from_keys ? 0 : layout.value_dim;
}

// Bytes of one stored key row, and of one stored value row (none in a latent cache): one token of
// one kv head (StoredRowBytes: an fp8 row carries its scale).
inline int64_t KeyRowBytes(const KvLayout& layout) {
  return StoredRowBytes(layout.dtype, layout.head_dim);
}
inline int64_t StoredValueRowBytes(const KvLayout& layout) {
  return layout.values_from_keys ? 0 : StoredRowBytes(layout.dtype, layout.value_dim);
}

// Bytes one token takes in a store of this layout: every KV head's key and stored value.
inline int64_t TokenBytes(const KvLayout& layout) {
  return layout.kv_heads * (KeyRowBytes(layout) + StoredValueRowBytes(layout));
}

// Bytes of n tokens' keys, and of their stored values (none for a latent cache), dense.
inline int64_t KeyBytes(const KvLayout& layout, int64_t n) {
  return layout.kv_heads * n * KeyRowBytes(layout);
}
inline int64_t StoredValueBytes(const KvLayout& layout, int64_t n) {
  return layout.kv_heads * n * StoredValueRowBytes(layout);
}

// A latent cache's stored value row (StoredRowBytes(dtype, value_dim) bytes, as CopyOut gives
// it) from its token's stored key row: the key's first value_dim elements, and for fp8 zero
// padding and the key row's scale (a latent value's elements are its codes times that scale).
inline void LatentValueRow(const KvLayout& layout, const void* key_row, void* value_row) {
  const int64_t element = ElementSize(layout.dtype);
  char* to = static_cast<char*>(value_row);
  std::memcpy(to, key_row, layout.value_dim * element);
  if (layout.dtype != DType::kFloat8E4M3) return;
  const int64_t value_bytes = StoredRowBytes(layout.dtype, layout.value_dim);
  std::memset(to + layout.value_dim, 0, value_bytes - kFp8ScaleBytes - layout.value_dim);
  std::memcpy(to + value_bytes - kFp8ScaleBytes,
              static_cast<const char*>(key_row) + KeyRowBytes(layout) - kFp8ScaleBytes,
              kFp8ScaleBytes);
}

class KvStore {
 public:
  virtual ~KvStore() = default;

  virtual const KvLayout& layout() const = 0;
  virtual int64_t page_tokens() const = 0;
  virtual int64_t length() const = 0;  // Tokens stored.
  virtual int64_t bytes() const = 0;   // Memory its pages take now.
  // Memory the pages would take holding `length` tokens (whole pages), for the budget check
  // before an append.
  virtual int64_t BytesFor(int64_t length) const = 0;

  // Appends n tokens: key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] (dense,
  // host memory, any dtype: converted to the store's; a latent store ignores `value`, which
  // may be empty). All or nothing: on an error (e.g.
  // RESOURCE_EXHAUSTED when memory runs out) the store is as it was.
  virtual absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) = 0;
  // Drops the tokens from `length` on (length ≤ length()), freeing pages no longer needed: how
  // a failed Decode takes back the tokens it appended.
  virtual void Truncate(int64_t length) = 0;

  // The pages as kernels read them, valid until the next Append or Truncate.
  virtual const PagedKv& pages() const = 0;

  // Forks (ForkCache): a new store whose first `length` tokens (≤ length()) are this store's,
  // sharing its pages (nothing copied). A page is freed when the last store holding it lets go
  // of it; a store never writes into a page another holds (copy on write: an append into a
  // shared partly filled page copies that page first). Default: UNIMPLEMENTED.
  virtual absl::StatusOr<std::unique_ptr<KvStore>> Fork(int64_t length) const {
    return absl::UnimplementedError("this backend's KV caches cannot be forked");
  }
  // Bytes of its pages that another store holds too.
  virtual int64_t shared_bytes() const { return 0; }
  // Bytes of new pages an Append of n tokens allocates: the pages past its last one, and a
  // copy of its last page when that page is shared and the append writes into it. The Append
  // that follows allocates exactly that (it copies a page counted here even if the page's other
  // holders let go in between), so a budget reserved with it stays exact.
  virtual int64_t BytesToAppend(int64_t n) const { return BytesFor(length() + n) - bytes(); }
  // Called with a page's bytes each time one of this store's pages is freed (the last holder
  // let go), whichever store frees it; forks inherit it. Default: not called (no sharing).
  virtual void OnPageFreed(std::function<void(int64_t bytes)> freed) {}

  // Copies tokens [begin, end) out to dense host tensors of stored rows (the store's dtype; fp8
  // rows carry their scales: StoredRowBytes), key [kv_heads, end − begin, head_dim] and value
  // [kv_heads, end − begin, value_dim] (0 ≤ begin ≤ end ≤ length()); `value` null: the keys only
  // (for a latent store, whose values are its keys' first columns, what a file or an export
  // keeps). A snapshot for work that outlives the registry's hold on the cache (a trace's
  // stream), a chunk of an export, a record of the cache's file. Default: reads pages() on the
  // host, for a store in host memory; a device store overrides it (and may fail).
  virtual absl::Status CopyOut(int64_t begin, int64_t end, void* key, void* value) const {
    const KvLayout& l = layout();
    const PagedKv& p = pages();
    const int64_t element = ElementSize(l.dtype);
    const int64_t key_row = KeyRowBytes(l), value_row = StoredRowBytes(l.dtype, l.value_dim);
    const int64_t tokens_per_page = page_tokens();
    const int64_t n = end - begin;
    for (int64_t h = 0; h < l.kv_heads; ++h) {
      for (int64_t t = begin; t < end; t += tokens_per_page - t % tokens_per_page) {
        const int64_t run = std::min(end, t - t % tokens_per_page + tokens_per_page) - t;
        std::memcpy(static_cast<char*>(key) + (h * n + t - begin) * key_row,
                    static_cast<const char*>(p.KeyPage(t)) + p.KeyOffsetInPage(h, t) * element,
                    run * key_row);
        if (value == nullptr) continue;
        // A run of whole rows, or row by row where a value is part of its key's row (latent).
        const char* from =
            static_cast<const char*>(p.ValuePage(t)) + p.ValueOffsetInPage(h, t) * element;
        char* to = static_cast<char*>(value) + (h * n + t - begin) * value_row;
        if (!l.values_from_keys) {
          std::memcpy(to, from, run * value_row);
          continue;
        }
        for (int64_t i = 0; i < run; ++i) {
          LatentValueRow(l, from + i * p.value_width * element, to + i * value_row);
        }
      }
    }
    return absl::OkStatus();
  }
};

// Pages that `length` tokens fill, `page_tokens` to a page (the last one maybe partly).
inline int64_t PagesFor(int64_t length, int64_t page_tokens) {
  return length / page_tokens + (length % page_tokens != 0);
}

}  // namespace attn
