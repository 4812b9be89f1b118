// CudaKvStore: a KvStore (kernels/kv_store.h) in device memory.
//
// Each page is one device allocation — its key block [kv_heads, page_tokens] of stored key rows,
// then its value block [kv_heads, page_tokens] of stored value rows (none in a latent store, whose
// value table repeats the key table), rows in the store's dtype (StoredRowBytes: an fp8 row
// carries its scale) — charged to the device's memory budget (device_memory.h) like every other
// allocation of the backend. The page tables (PagedKv::key_pages and value_pages) are device arrays
// of pointers kept in step with the pages: an append writes the new pages' entries (or, when the
// tables are full, new tables twice as large) before it commits, so pages() always describes
// exactly the stored tokens.
//
// Append: the tokens are made stored rows on the host (ToStoredRows, kernels/convert.h:
// converted, or quantized into fp8 rows, into the slot's pinned staging memory), copied to the
// device once, and scattered into their pages by one kernel (LaunchScatter, pages.cu); new pages
// and tables are allocated first, so any failure (the budget, the device) frees them and leaves the
// store exactly as it was. Truncate frees whole pages past the new length. A fork (Fork) holds its
// source's pages, not copies, with tables of its own; a page is freed when the last store holding
// it lets go, and a store never writes into a page another holds (an append into a shared partly
// filled last page copies it on the device first, in the append's stream, before the new tokens are
// scattered). Every call leases one of the device's stream slots and waits for its work before
// returning, so a kernel reading pages() after an Append sees all of it. Not thread-safe (the
// registry orders calls on one store); holds the Device, so it may outlive the backend.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_memory.h"
#include "kernels/kv_store.h"

namespace attn::cuda {

class CudaKvStore final : public KvStore {
 public:
  CudaKvStore(std::shared_ptr<Device> device, const KvLayout& layout, int64_t page_tokens);
  ~CudaKvStore() override;

  const KvLayout& layout() const override { return layout_; }
  int64_t page_tokens() const override { return page_tokens_; }
  int64_t length() const override { return length_; }
  int64_t bytes() const override { return static_cast<int64_t>(pages_.size()) * PageBytes(); }
  int64_t shared_bytes() const override;
  int64_t BytesToAppend(int64_t n) const override;
  absl::StatusOr<std::unique_ptr<KvStore>> Fork(int64_t length) const override;
  int64_t BytesFor(int64_t length) const override {
    return PagesFor(length, page_tokens_) * PageBytes();
  }

  absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) override;
  void Truncate(int64_t length) override;
  const PagedKv& pages() const override { return paged_; }
  // Device → host, a page segment of one kv head at a time, through a stream slot.
  absl::Status CopyOut(int64_t begin, int64_t end, void* key, void* value) const override;
  // Called for each page freed (its last holder let go), whichever store frees it.
  void OnPageFreed(std::function<void(int64_t bytes)> freed) override {
    pool_->freed = std::move(freed);
  }

 private:
  // One page, held by every store whose tables name it: freed (and reported) by the last.
  struct Page {
    DeviceBlock block;
    std::atomic<int> holders{1};
  };
  // What a store and its forks share: how freed pages are reported.
  struct Pool {
    std::function<void(int64_t bytes)> freed;
  };

  CudaKvStore(std::shared_ptr<Device> device, const KvLayout& layout, int64_t page_tokens,
              std::shared_ptr<Pool> pool);
  // Lets go of a page; the last holder frees it in `stream`'s order (a null stream: the device
  // is lost, the memory only forgotten) and reports it.
  void Unhold(Page* page, cudaStream_t stream, bool device_ok) const;
  // Points pages()'s tables at the device tables and their host copies (key_entries_, …).
  void RefreshTables();
  // Whether the next append writes into the last page while another store holds it.
  bool LastPageShared() const;
  // Uploads host entries [first, count) of both tables to `key_table`/`value_table` in `stream`.
  absl::Status UploadEntries(const std::vector<const void*>& key_entries,
                             const std::vector<const void*>& value_entries, int64_t first,
                             void* key_table, void* value_table, char* staged, Slot& slot) const;
  int64_t KeyBlockBytes() const { return layout_.kv_heads * page_tokens_ * KeyRowBytes(layout_); }
  int64_t PageBytes() const { return page_tokens_ * TokenBytes(layout_); }

  const std::shared_ptr<Device> device_;
  const KvLayout layout_;
  const int64_t page_tokens_;
  int64_t length_ = 0;
  const std::shared_ptr<Pool> pool_;
  std::vector<Page*> pages_;  // Each held once by this store.
  // Whether the last BytesToAppend counted a copy of the last page (Append makes it then).
  mutable bool copy_counted_ = false;
  // Device tables of table_capacity_ entries each; the host's copy of their first entries.
  DeviceBlock key_table_, value_table_;
  int64_t table_capacity_ = 0;
  std::vector<const void*> key_entries_, value_entries_;
  PagedKv paged_;
};

}  // namespace attn::cuda
