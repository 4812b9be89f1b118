// CpuKvStore: a KV cache's pages in host memory (kernels/kv_store.h's contract).
//
// Each page is two 64-byte-aligned blocks (keys [kv_heads, page_tokens, head_dim] and values
// [kv_heads, page_tokens, value_dim], the store's dtype; a latent store's only the first),
// allocated when an append first reaches
// it and freed when a truncation drops its last token. Appending writes only the new tokens:
// stored ones never move. Not thread-safe (the registry orders calls on one store).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/kv_store.h"

namespace attn {

// Where a store's page blocks come from: aligned host memory by default; tests inject one that
// fails to reach the all-or-nothing path. Allocate returns nullptr when it cannot.
struct PageAllocator {
  void* (*allocate)(size_t bytes) = nullptr;
  void (*free)(void* block) = nullptr;

  static PageAllocator Host();  // 64-byte-aligned operator new (nothrow), operator delete.
};

class CpuKvStore final : public KvStore {
 public:
  static constexpr size_t kPageAlignment = 64;

  // page_tokens ≥ 1; layout's sizes ≥ 1 (the caller validated them).
  CpuKvStore(const KvLayout& layout, int64_t page_tokens,
             PageAllocator allocator = PageAllocator::Host());
  ~CpuKvStore() override;
  CpuKvStore(const CpuKvStore&) = delete;
  CpuKvStore& operator=(const CpuKvStore&) = delete;

  const KvLayout& layout() const override { return layout_; }
  int64_t page_tokens() const override { return page_tokens_; }
  int64_t length() const override { return length_; }
  int64_t bytes() const override { return PagesBytes(static_cast<int64_t>(key_pages_.size())); }
  int64_t BytesFor(int64_t length) const override;

  absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) override;
  void Truncate(int64_t length) override;

  const PagedKv& pages() const override { return pages_; }

 private:
  int64_t KeyBlockBytes() const;
  int64_t ValueBlockBytes() const;
  int64_t PagesBytes(int64_t pages) const { return pages * (KeyBlockBytes() + ValueBlockBytes()); }
  void RefreshTables();  // pages_ after key_pages_ / value_pages_ changed.

  const KvLayout layout_;
  const int64_t page_tokens_;
  const PageAllocator allocator_;
  int64_t length_ = 0;
  std::vector<const void*> key_pages_, value_pages_;
  PagedKv pages_;
};

}  // namespace attn
