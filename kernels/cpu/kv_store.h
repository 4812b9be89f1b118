// CpuKvStore: a KV cache's pages in host memory (kernels/kv_store.h's contract).
//
// Each page is two 64-byte-aligned blocks (keys [kv_heads, page_tokens, head_dim] and values
// [kv_heads, page_tokens, value_dim], the store's dtype; a latent store's only the first),
// allocated when an append first reaches
// it and freed when a truncation drops its last token. Appending writes only the new tokens:
// stored ones never move. A fork (Fork) holds its source's pages rather than copies; a page is
// freed when the last store holding it lets go, and a store writes into a page no other store
// holds (an append into a shared partly filled page copies it first). Not thread-safe (the
// registry orders calls on one store); stores sharing pages may run on different threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
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
  int64_t bytes() const override { return static_cast<int64_t>(pages_.size()) * PageBytes(); }
  int64_t BytesFor(int64_t length) const override;

  absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) override;
  void Truncate(int64_t length) override;

  const PagedKv& pages() const override { return paged_; }

  absl::StatusOr<std::unique_ptr<KvStore>> Fork(int64_t length) const override;
  int64_t shared_bytes() const override;
  int64_t BytesToAppend(int64_t n) const override;
  void OnPageFreed(std::function<void(int64_t bytes)> freed) override;

 private:
  // One page: its key block and (unless latent) its value block, held by every store whose
  // tables name it; freed, and reported to `freed`, when the last lets go.
  struct Page {
    void* key = nullptr;
    void* value = nullptr;
    std::atomic<int> holders{1};
  };
  // What the pages of a store and its forks share: how they are allocated and reported.
  struct Pool {
    PageAllocator allocator;
    std::function<void(int64_t)> freed;
  };

  CpuKvStore(const KvLayout& layout, int64_t page_tokens, std::shared_ptr<Pool> pool);
  int64_t KeyBlockBytes() const;
  int64_t ValueBlockBytes() const;
  int64_t PageBytes() const { return KeyBlockBytes() + ValueBlockBytes(); }
  // A new page (its blocks), or null when memory runs out.
  Page* NewPage() const;
  void Unhold(Page* page) const;  // Lets go of a page: freed when no store holds it.
  // Whether the next append writes into the last page while another store holds it.
  bool LastPageShared() const;
  // Whether the last BytesToAppend counted a copy of the last page (Append makes it then).
  mutable bool copy_counted_ = false;
  void RefreshTables();  // paged_ after pages_ changed.

  const KvLayout layout_;
  const int64_t page_tokens_;
  const std::shared_ptr<Pool> pool_;
  int64_t length_ = 0;
  std::vector<Page*> pages_;  // Each held once by this store.
  std::vector<const void*> key_pages_, value_pages_;
  PagedKv paged_;
};

}  // namespace attn
