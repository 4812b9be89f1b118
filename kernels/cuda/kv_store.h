// CudaKvStore: a KvStore (kernels/kv_store.h) in device memory.
//
// Each page is one device allocation — its key block [kv_heads, page_tokens, head_dim], then its
// value block [kv_heads, page_tokens, value_dim] (none in a latent store, whose value table
// repeats the key table), in the store's dtype — charged to the
// device's memory budget (device_memory.h) like every other allocation of the backend. The page
// tables (PagedKv::key_pages and value_pages) are device arrays of pointers kept in step with
// the pages: an append writes the new pages' entries (or, when the tables are full, new tables
// twice as large) before it commits, so pages() always describes exactly the stored tokens.
//
// Append: the tokens are converted to the store's dtype on the host (into the slot's pinned
// staging memory), copied to the device once, and scattered into their pages by one kernel
// (LaunchScatter, pages.cu); new pages and tables are allocated first, so any failure (the
// budget, the device) frees them and leaves the store exactly as it was. Truncate frees whole
// pages past the new length. Every call leases one of the device's stream slots and waits for
// its work before returning, so a kernel reading pages() after an Append sees all of it.
// Not thread-safe (the registry orders calls on one store); holds the Device, so it may outlive
// the backend.
#pragma once

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
  int64_t BytesFor(int64_t length) const override {
    return PagesFor(length, page_tokens_) * PageBytes();
  }

  absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) override;
  void Truncate(int64_t length) override;
  const PagedKv& pages() const override { return paged_; }
  // Device → host, a page segment of one kv head at a time, through a stream slot.
  absl::Status CopyOut(int64_t begin, int64_t end, void* key, void* value) const override;
  // Called for each page Truncate or the destructor frees (no forks yet: no page is shared).
  void OnPageFreed(std::function<void(int64_t bytes)> freed) override { freed_ = std::move(freed); }

 private:
  int64_t KeyBlockBytes() const {
    return layout_.kv_heads * page_tokens_ * layout_.head_dim * ElementSize(layout_.dtype);
  }
  int64_t PageBytes() const { return page_tokens_ * TokenBytes(layout_); }

  const std::shared_ptr<Device> device_;
  const KvLayout layout_;
  const int64_t page_tokens_;
  int64_t length_ = 0;
  std::vector<DeviceBlock> pages_;
  // Device tables of table_capacity_ entries each; the host's copy of their first entries.
  DeviceBlock key_table_, value_table_;
  int64_t table_capacity_ = 0;
  std::vector<const void*> key_entries_, value_entries_;
  PagedKv paged_;
  std::function<void(int64_t bytes)> freed_;
};

}  // namespace attn::cuda
