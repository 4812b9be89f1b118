#include "kernels/cuda/kv_store.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/convert.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.h"

namespace attn::cuda {

CudaKvStore::CudaKvStore(std::shared_ptr<Device> device, const KvLayout& layout,
                         int64_t page_tokens)
    : CudaKvStore(std::move(device), layout, page_tokens, std::make_shared<Pool>()) {}

CudaKvStore::CudaKvStore(std::shared_ptr<Device> device, const KvLayout& layout,
                         int64_t page_tokens, std::shared_ptr<Pool> pool)
    : device_(std::move(device)),
      layout_(layout),
      page_tokens_(page_tokens),
      pool_(std::move(pool)) {
  paged_.page_tokens = page_tokens_;
  paged_.key_width = StoredRowWidth(layout_.dtype, layout_.head_dim);
  paged_.value_width = layout_.values_from_keys ? paged_.key_width
                                                : StoredRowWidth(layout_.dtype, layout_.value_dim);
  paged_.dtype = layout_.dtype;
}

CudaKvStore::~CudaKvStore() {
  // A lost device: the pages are only let go of (the process's memory goes with the device).
  if (!device_->Start().ok()) {
    for (Page* page : pages_) Unhold(page, nullptr, false);
    return;
  }
  SlotPool::Lease lease(device_->slots());
  const cudaStream_t stream = lease.slot().stream;
  for (Page* page : pages_) Unhold(page, stream, true);
  key_table_.Free(device_->budget(), stream);
  value_table_.Free(device_->budget(), stream);
}

void CudaKvStore::Unhold(Page* page, cudaStream_t stream, bool device_ok) const {
  // acq_rel: every use of the page by a store letting go happens before its free.
  if (page->holders.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (device_ok) page->block.Free(device_->budget(), stream);
  delete page;
  if (pool_->freed) pool_->freed(PageBytes());
}

void CudaKvStore::RefreshTables() {
  paged_.key_pages = static_cast<const void* const*>(key_table_.get());
  paged_.value_pages = static_cast<const void* const*>(value_table_.get());
  paged_.host_key_pages = key_entries_.data();
  paged_.host_value_pages = value_entries_.data();
}

bool CudaKvStore::LastPageShared() const {
  return length_ % page_tokens_ != 0 && pages_.back()->holders.load(std::memory_order_acquire) > 1;
}

int64_t CudaKvStore::shared_bytes() const {
  int64_t shared = 0;
  for (const Page* page : pages_) {
    shared += page->holders.load(std::memory_order_acquire) > 1 ? PageBytes() : 0;
  }
  return shared;
}

int64_t CudaKvStore::BytesToAppend(int64_t n) const {
  if (n <= 0) return 0;
  copy_counted_ = LastPageShared();
  return BytesFor(length_ + n) - bytes() + (copy_counted_ ? PageBytes() : 0);
}

absl::Status CudaKvStore::UploadEntries(const std::vector<const void*>& key_entries,
                                        const std::vector<const void*>& value_entries,
                                        int64_t first, void* key_table, void* value_table,
                                        char* staged, Slot& slot) const {
  const int64_t count = static_cast<int64_t>(key_entries.size());
  const int64_t entry_bytes = (count - first) * static_cast<int64_t>(sizeof(void*));
  if (entry_bytes <= 0) return absl::OkStatus();
  std::memcpy(staged, key_entries.data() + first, entry_bytes);
  std::memcpy(staged + entry_bytes, value_entries.data() + first, entry_bytes);
  auto check = [&](cudaError_t error, const char* what) { return device_->Check(error, what); };
  absl::Status status =
      check(cudaMemcpyAsync(static_cast<char*>(key_table) + first * sizeof(void*), staged,
                            entry_bytes, cudaMemcpyHostToDevice, slot.stream),
            "cudaMemcpyAsync (key page table)");
  if (!status.ok()) return status;
  return check(
      cudaMemcpyAsync(static_cast<char*>(value_table) + first * sizeof(void*), staged + entry_bytes,
                      entry_bytes, cudaMemcpyHostToDevice, slot.stream),
      "cudaMemcpyAsync (value page table)");
}

absl::StatusOr<std::unique_ptr<KvStore>> CudaKvStore::Fork(int64_t length) const {
  if (length < 0 || length > length_) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fork keeps 0 … ", length_, " tokens, not ", length));
  }
  ATTN_RETURN_IF_ERROR(device_->Start());
  std::unique_ptr<CudaKvStore> fork(new CudaKvStore(device_, layout_, page_tokens_, pool_));
  const int64_t pages = PagesFor(length, page_tokens_);
  const int64_t capacity = std::max<int64_t>(pages, 16);
  const int64_t table_bytes = capacity * static_cast<int64_t>(sizeof(void*));
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  MemoryBudget& budget = device_->budget();
  // Its own tables, naming the first `pages` of this store's pages.
  ATTN_RETURN_IF_ERROR(slot.ReserveStaging(2 * table_bytes));
  absl::StatusOr<DeviceBlock> keys = DeviceBlock::Allocate(budget, table_bytes, slot.stream);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<DeviceBlock> values = DeviceBlock::Allocate(budget, table_bytes, slot.stream);
  if (!values.ok()) {
    keys->Free(budget, slot.stream);
    return values.status();
  }
  fork->key_table_ = *std::move(keys);
  fork->value_table_ = *std::move(values);
  fork->table_capacity_ = capacity;
  fork->key_entries_.assign(key_entries_.begin(), key_entries_.begin() + pages);
  fork->value_entries_.assign(value_entries_.begin(), value_entries_.begin() + pages);
  absl::Status status =
      UploadEntries(fork->key_entries_, fork->value_entries_, 0, fork->key_table_.get(),
                    fork->value_table_.get(), slot.staging, slot);
  if (status.ok()) status = device_->Check(cudaStreamSynchronize(slot.stream), "KV cache fork");
  if (!status.ok()) return status;  // The fork (its tables, no page yet) goes.
  for (int64_t p = 0; p < pages; ++p) {
    pages_[p]->holders.fetch_add(1, std::memory_order_relaxed);
    fork->pages_.push_back(pages_[p]);
  }
  fork->length_ = length;
  fork->RefreshTables();
  return std::unique_ptr<KvStore>(std::move(fork));
}

absl::Status CudaKvStore::Append(const TensorView& key, const TensorView& value, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  MemoryBudget& budget = device_->budget();
  const DType dtype = layout_.dtype;
  const int64_t key_bytes = KeyBytes(layout_, n);
  const int64_t token_bytes = key_bytes + StoredValueBytes(layout_, n);
  const int64_t old_pages = static_cast<int64_t>(pages_.size());
  const int64_t new_pages = PagesFor(length_ + n, page_tokens_);
  // Copy on write: a last page another store holds (or BytesToAppend counted as such) is copied
  // before the new tokens go into it.
  const bool copy_last = length_ % page_tokens_ != 0 && (LastPageShared() || copy_counted_);
  copy_counted_ = false;
  const bool grow_tables = new_pages > table_capacity_;
  const int64_t capacity =
      grow_tables ? std::max<int64_t>({new_pages, 2 * table_capacity_, 16}) : table_capacity_;
  const int64_t table_bytes = capacity * static_cast<int64_t>(sizeof(void*));

  // Host side first: the tokens as the store keeps them (ToStoredRows: converted, or quantized
  // into fp8 rows), then the new table entries, all staged.
  ATTN_RETURN_IF_ERROR(slot.ReserveStaging(token_bytes + 2 * table_bytes));
  char* staged = slot.staging;
  std::vector<float> row_scratch;
  ToStoredRows(key.data, key.dtype, layout_.kv_heads * n, layout_.head_dim, staged, dtype,
               row_scratch);
  if (!layout_.values_from_keys) {
    ToStoredRows(value.data, value.dtype, layout_.kv_heads * n, layout_.value_dim,
                 staged + key_bytes, dtype, row_scratch);
  }

  // Everything the append needs, allocated before anything is written: on failure `added` and
  // the new tables are freed and the store is untouched.
  std::vector<DeviceBlock> added;  // The copy of the last page first, when copy_last.
  DeviceBlock new_key_table, new_value_table;
  Allocations scratch(budget, slot.stream);
  auto roll_back = [&](absl::Status status) {
    for (DeviceBlock& page : added) page.Free(budget, slot.stream);
    new_key_table.Free(budget, slot.stream);
    new_value_table.Free(budget, slot.stream);
    return status;
  };
  for (int64_t p = old_pages - (copy_last ? 1 : 0); p < new_pages; ++p) {
    absl::StatusOr<DeviceBlock> page = DeviceBlock::Allocate(budget, PageBytes(), slot.stream);
    if (!page.ok()) return roll_back(page.status());
    added.push_back(*std::move(page));
  }
  if (grow_tables) {
    absl::StatusOr<DeviceBlock> keys = DeviceBlock::Allocate(budget, table_bytes, slot.stream);
    if (!keys.ok()) return roll_back(keys.status());
    new_key_table = *std::move(keys);
    absl::StatusOr<DeviceBlock> values = DeviceBlock::Allocate(budget, table_bytes, slot.stream);
    if (!values.ok()) return roll_back(values.status());
    new_value_table = *std::move(values);
  }
  absl::StatusOr<void*> tokens = scratch.Allocate(token_bytes);
  if (!tokens.ok()) return roll_back(tokens.status());

  // The tables after the append: entries [first_entry, new_pages) are uploaded (all of them
  // into new tables; only the new pages' into the current ones, past every entry in use).
  std::vector<const void*> key_entries = key_entries_, value_entries = value_entries_;
  if (copy_last) {
    key_entries.pop_back();
    value_entries.pop_back();
  }
  for (const DeviceBlock& page : added) {
    key_entries.push_back(page.get());
    value_entries.push_back(static_cast<const char*>(page.get()) +
                            (layout_.values_from_keys ? 0 : KeyBlockBytes()));
  }
  void* key_table = grow_tables ? new_key_table.get() : key_table_.get();
  void* value_table = grow_tables ? new_value_table.get() : value_table_.get();
  const int64_t first_entry = grow_tables ? 0 : old_pages - (copy_last ? 1 : 0);

  auto check = [&](cudaError_t error, const char* what) { return device_->Check(error, what); };
  absl::Status status = absl::OkStatus();
  if (copy_last) {  // The rows already in the shared page, into this store's own copy.
    status = check(cudaMemcpyAsync(added[0].get(), pages_.back()->block.get(), PageBytes(),
                                   cudaMemcpyDeviceToDevice, slot.stream),
                   "cudaMemcpyAsync (copy of a shared page)");
  }
  if (status.ok()) {
    status = UploadEntries(key_entries, value_entries, first_entry, key_table, value_table,
                           staged + token_bytes, slot);
  }
  if (status.ok()) {
    status =
        check(cudaMemcpyAsync(*tokens, staged, token_bytes, cudaMemcpyHostToDevice, slot.stream),
              "cudaMemcpyAsync (appended tokens)");
  }
  if (status.ok()) {
    status = check(
        LaunchScatter(*tokens, layout_.kv_heads, n, KeyRowBytes(layout_),
                      static_cast<void* const*>(key_table), page_tokens_, length_, slot.stream),
        "LaunchScatter (keys)");
  }
  if (status.ok() && !layout_.values_from_keys) {
    status =
        check(LaunchScatter(static_cast<char*>(*tokens) + key_bytes, layout_.kv_heads, n,
                            StoredValueRowBytes(layout_), static_cast<void* const*>(value_table),
                            page_tokens_, length_, slot.stream),
              "LaunchScatter (values)");
  }
  if (status.ok()) status = check(cudaStreamSynchronize(slot.stream), "KV cache append");
  if (!status.ok()) {
    if (copy_last && !grow_tables) {
      // The table in use may name the copy now: its entry for the shared page goes back first.
      if (UploadEntries(key_entries_, value_entries_, old_pages - 1, key_table_.get(),
                        value_table_.get(), staged + token_bytes, slot)
              .ok()) {
        (void)check(cudaStreamSynchronize(slot.stream), "KV cache append's table restored");
      }
    }
    return roll_back(status);
  }

  // Commit.
  if (grow_tables) {
    key_table_.Free(budget, slot.stream);
    value_table_.Free(budget, slot.stream);
    key_table_ = std::move(new_key_table);
    value_table_ = std::move(new_value_table);
    table_capacity_ = capacity;
  }
  for (size_t a = 0; a < added.size(); ++a) {
    Page* page = new Page;
    page->block = std::move(added[a]);
    if (a == 0 && copy_last) {
      Unhold(pages_.back(), slot.stream, true);  // The other holders keep the original.
      pages_.back() = page;
    } else {
      pages_.push_back(page);
    }
  }
  key_entries_ = std::move(key_entries);
  value_entries_ = std::move(value_entries);
  length_ += n;
  RefreshTables();
  return absl::OkStatus();
}

absl::Status CudaKvStore::CopyOut(int64_t begin, int64_t end, void* key, void* value) const {
  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  const cudaStream_t stream = lease.slot().stream;
  // Stored rows (an fp8 row carries its scale); a latent value is made from its key, below.
  const int64_t key_row = KeyRowBytes(layout_), value_row = StoredValueRowBytes(layout_);
  const int64_t n = end - begin;
  for (int64_t h = 0; h < layout_.kv_heads; ++h) {
    for (int64_t t = begin; t < end;) {
      const int64_t page = t / page_tokens_, in_page = t % page_tokens_;
      const int64_t run = std::min(end - t, page_tokens_ - in_page);
      const int64_t row_in_page = h * page_tokens_ + in_page;
      ATTN_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(static_cast<char*>(key) + (h * n + t - begin) * key_row,
                          static_cast<const char*>(key_entries_[page]) + row_in_page * key_row,
                          run * key_row, cudaMemcpyDeviceToHost, stream));
      if (value == nullptr || layout_.values_from_keys) {
        t += run;
        continue;
      }
      ATTN_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(static_cast<char*>(value) + (h * n + t - begin) * value_row,
                          static_cast<const char*>(value_entries_[page]) + row_in_page * value_row,
                          run * value_row, cudaMemcpyDeviceToHost, stream));
      t += run;
    }
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (value != nullptr && layout_.values_from_keys) {
    const int64_t latent_row = StoredRowBytes(layout_.dtype, layout_.value_dim);
    for (int64_t row = 0; row < layout_.kv_heads * n; ++row) {
      LatentValueRow(layout_, static_cast<const char*>(key) + row * key_row,
                     static_cast<char*>(value) + row * latent_row);
    }
  }
  return absl::OkStatus();
}

void CudaKvStore::Truncate(int64_t length) {
  copy_counted_ = false;
  length = std::clamp<int64_t>(length, 0, length_);
  const size_t keep = static_cast<size_t>(PagesFor(length, page_tokens_));
  if (keep < pages_.size()) {
    // On a lost device the pages are not freed (nothing can use them again), only let go of.
    if (device_->Start().ok()) {
      SlotPool::Lease lease(device_->slots());
      for (size_t p = keep; p < pages_.size(); ++p) Unhold(pages_[p], lease.slot().stream, true);
    } else {
      for (size_t p = keep; p < pages_.size(); ++p) Unhold(pages_[p], nullptr, false);
    }
    pages_.resize(keep);
    key_entries_.resize(keep);
    value_entries_.resize(keep);
  }
  length_ = length;
  RefreshTables();
}

}  // namespace attn::cuda
