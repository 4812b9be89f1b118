#include "kernels/cpu/kv_store.h"

#include <algorithm>
#include <limits>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/convert.h"

namespace attn {
namespace {

void* AllocateAligned(size_t bytes) {
  return ::operator new (bytes, std::align_val_t{CpuKvStore::kPageAlignment}, std::nothrow);
}

void FreeAligned(void* block) {
  ::operator delete (block, std::align_val_t{CpuKvStore::kPageAlignment});
}

}  // namespace

PageAllocator PageAllocator::Host() { return PageAllocator{&AllocateAligned, &FreeAligned}; }

CpuKvStore::CpuKvStore(const KvLayout& layout, int64_t page_tokens, PageAllocator allocator)
    : CpuKvStore(layout, page_tokens, std::make_shared<Pool>(Pool{allocator, nullptr})) {}

CpuKvStore::CpuKvStore(const KvLayout& layout, int64_t page_tokens, std::shared_ptr<Pool> pool)
    : layout_(layout), page_tokens_(std::max<int64_t>(page_tokens, 1)), pool_(std::move(pool)) {
  RefreshTables();
}

CpuKvStore::~CpuKvStore() { Truncate(0); }

int64_t CpuKvStore::KeyBlockBytes() const {
  return layout_.kv_heads * page_tokens_ * KeyRowBytes(layout_);
}

int64_t CpuKvStore::ValueBlockBytes() const {
  return layout_.kv_heads * page_tokens_ * StoredValueRowBytes(layout_);
}

int64_t CpuKvStore::BytesFor(int64_t length) const {
  const int64_t pages = PagesFor(length, page_tokens_);
  const int64_t per_page = PageBytes();
  if (pages > std::numeric_limits<int64_t>::max() / per_page) {
    return std::numeric_limits<int64_t>::max();
  }
  return pages * per_page;
}

void CpuKvStore::RefreshTables() {
  const bool latent = layout_.values_from_keys;
  key_pages_.resize(pages_.size());
  value_pages_.resize(latent ? 0 : pages_.size());
  for (size_t p = 0; p < pages_.size(); ++p) {
    key_pages_[p] = pages_[p]->key;
    if (!latent) value_pages_[p] = pages_[p]->value;
  }
  paged_.key_pages = paged_.host_key_pages = key_pages_.data();
  paged_.value_pages = paged_.host_value_pages = latent ? key_pages_.data() : value_pages_.data();
  paged_.page_tokens = page_tokens_;
  paged_.key_width = StoredRowWidth(layout_.dtype, layout_.head_dim);
  paged_.value_width = latent ? paged_.key_width : StoredRowWidth(layout_.dtype, layout_.value_dim);
  paged_.dtype = layout_.dtype;
}

CpuKvStore::Page* CpuKvStore::NewPage() const {
  const PageAllocator& allocator = pool_->allocator;
  void* key = allocator.allocate(static_cast<size_t>(KeyBlockBytes()));
  if (key == nullptr) return nullptr;
  void* value = nullptr;
  if (!layout_.values_from_keys) {
    value = allocator.allocate(static_cast<size_t>(ValueBlockBytes()));
    if (value == nullptr) {
      allocator.free(key);
      return nullptr;
    }
  }
  Page* page = new (std::nothrow) Page;
  if (page == nullptr) {
    allocator.free(key);
    if (value != nullptr) allocator.free(value);
    return nullptr;
  }
  page->key = key;
  page->value = value;
  return page;
}

void CpuKvStore::Unhold(Page* page) const {
  // acq_rel: every use of the page by a store letting go happens before its free.
  if (page->holders.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  pool_->allocator.free(page->key);
  if (page->value != nullptr) pool_->allocator.free(page->value);
  delete page;
  if (pool_->freed) pool_->freed(PageBytes());
}

bool CpuKvStore::LastPageShared() const {
  return length_ % page_tokens_ != 0 && pages_.back()->holders.load(std::memory_order_acquire) > 1;
}

int64_t CpuKvStore::shared_bytes() const {
  int64_t shared = 0;
  for (const Page* page : pages_) {
    shared += page->holders.load(std::memory_order_acquire) > 1 ? PageBytes() : 0;
  }
  return shared;
}

int64_t CpuKvStore::BytesToAppend(int64_t n) const {
  if (n <= 0) return 0;
  const int64_t grow = BytesFor(length_ + n);
  if (grow == std::numeric_limits<int64_t>::max()) return grow;
  copy_counted_ = LastPageShared();
  return grow - bytes() + (copy_counted_ ? PageBytes() : 0);
}

void CpuKvStore::OnPageFreed(std::function<void(int64_t bytes)> freed) {
  pool_->freed = std::move(freed);
}

absl::StatusOr<std::unique_ptr<KvStore>> CpuKvStore::Fork(int64_t length) const {
  if (length < 0 || length > length_) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fork keeps 0 … ", length_, " tokens, not ", length));
  }
  std::unique_ptr<CpuKvStore> fork(new (std::nothrow) CpuKvStore(layout_, page_tokens_, pool_));
  if (fork == nullptr) return absl::ResourceExhaustedError("out of host memory for a fork");
  const int64_t pages = PagesFor(length, page_tokens_);
  try {
    fork->pages_.reserve(pages);
    fork->key_pages_.reserve(pages);
    fork->value_pages_.reserve(pages);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of host memory for a fork's page tables");
  }
  for (int64_t p = 0; p < pages; ++p) {
    pages_[p]->holders.fetch_add(1, std::memory_order_relaxed);
    fork->pages_.push_back(pages_[p]);
  }
  fork->length_ = length;
  fork->RefreshTables();
  return std::unique_ptr<KvStore>(std::move(fork));
}

absl::Status CpuKvStore::Append(const TensorView& key, const TensorView& value, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  const int64_t new_length = length_ + n;
  const int64_t have = static_cast<int64_t>(pages_.size());
  const int64_t need = PagesFor(new_length, page_tokens_);
  auto exhausted = [&] {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not allocate ", BytesToAppend(n), " bytes of host memory for ", n,
                     " more tokens of a KV cache of ", length_, " tokens"));
  };
  if (new_length < length_ || BytesFor(new_length) == std::numeric_limits<int64_t>::max()) {
    return exhausted();
  }
  // Every allocation first (the new pages, the copy of a shared last page, the tables' room),
  // so that a failure leaves the store exactly as it was.
  // A copy BytesToAppend counted is made even if the page's other holders let go since: what
  // was reserved is what is allocated (the original, freed then, is reported freed).
  const bool copy_last = length_ % page_tokens_ != 0 && (LastPageShared() || copy_counted_);
  copy_counted_ = false;
  std::vector<Page*> added;
  bool failed = false;
  try {
    pages_.reserve(need);
    key_pages_.reserve(need);
    value_pages_.reserve(need);
    added.reserve(need - have + (copy_last ? 1 : 0));
  } catch (const std::bad_alloc&) {
    return exhausted();
  }
  RefreshTables();  // reserve may have moved the tables.
  for (int64_t p = have - (copy_last ? 1 : 0); p < need && !failed; ++p) {
    Page* page = NewPage();
    if (page == nullptr) failed = true;
    if (page != nullptr) added.push_back(page);
  }
  if (failed) {
    for (Page* page : added) Unhold(page);  // Never shared: freed (and reported) at once.
    return exhausted();
  }
  size_t next = 0;
  if (copy_last) {
    // Copy on write: the rows already in the shared last page (every kv head's) into this
    // store's own copy, which replaces it here; the other holders keep the original.
    Page* copy = added[next++];
    std::memcpy(copy->key, pages_.back()->key, static_cast<size_t>(KeyBlockBytes()));
    if (copy->value != nullptr) {
      std::memcpy(copy->value, pages_.back()->value, static_cast<size_t>(ValueBlockBytes()));
    }
    Unhold(pages_.back());
    pages_.back() = copy;
  }
  for (; next < added.size(); ++next) pages_.push_back(added[next]);  // Within capacity.
  RefreshTables();

  // The new tokens, a page segment of one kv head at a time.
  std::vector<float> scratch;
  auto copy = [&](const TensorView& source, bool keys, int64_t width) {
    // Rows of `width` elements: the blocks hold nothing else (a latent store has no value
    // blocks, so its rows are always whole keys).
    const int64_t source_row = StoredRowBytes(source.dtype, width);
    const int64_t row = StoredRowBytes(layout_.dtype, width);
    for (int64_t head = 0; head < layout_.kv_heads; ++head) {
      for (int64_t t = 0; t < n;) {
        const int64_t token = length_ + t;
        const int64_t rows = std::min(page_tokens_ - token % page_tokens_, n - t);
        const char* src = static_cast<const char*>(source.data) + (head * n + t) * source_row;
        Page* page = pages_[token / page_tokens_];
        char* dst = static_cast<char*>(keys ? page->key : page->value) +
                    (head * page_tokens_ + token % page_tokens_) * row;
        ToStoredRows(src, source.dtype, rows, width, dst, layout_.dtype, scratch);
        t += rows;
      }
    }
  };
  copy(key, /*keys=*/true, layout_.head_dim);
  if (!layout_.values_from_keys) copy(value, /*keys=*/false, layout_.value_dim);
  length_ = new_length;
  return absl::OkStatus();
}

void CpuKvStore::Truncate(int64_t length) {
  copy_counted_ = false;
  length = std::clamp<int64_t>(length, 0, length_);
  const int64_t keep = PagesFor(length, page_tokens_);
  while (static_cast<int64_t>(pages_.size()) > keep) {
    Unhold(pages_.back());
    pages_.pop_back();
  }
  length_ = length;
  RefreshTables();
}

}  // namespace attn
