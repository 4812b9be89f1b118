#include "kernels/cpu/kv_store.h"

#include <algorithm>
#include <limits>
#include <new>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/fp32_rows.h"

namespace attn {
namespace {

void* AllocateAligned(size_t bytes) {
  return ::operator new (bytes, std::align_val_t{CpuKvStore::kPageAlignment}, std::nothrow);
}

void FreeAligned(void* block) {
  ::operator delete (block, std::align_val_t{CpuKvStore::kPageAlignment});
}

// count elements from src (any dtype) to dst (dtype `to`), through fp32 in chunks of `scratch`.
void ConvertRows(const void* src, DType from, int64_t count, void* dst, DType to,
                 std::vector<float>& scratch) {
  if (from == to) {
    std::copy_n(static_cast<const char*>(src), count * ElementSize(from), static_cast<char*>(dst));
    return;
  }
  constexpr int64_t kChunk = 4096;
  scratch.resize(kChunk);
  for (int64_t done = 0; done < count; done += kChunk) {
    const int64_t n = std::min(kChunk, count - done);
    ConvertToFloat(static_cast<const char*>(src) + done * ElementSize(from), from, n,
                   scratch.data());
    StoreFloats(scratch.data(), n, MutableTensorView{dst, to}, done);
  }
}

}  // namespace

PageAllocator PageAllocator::Host() { return PageAllocator{&AllocateAligned, &FreeAligned}; }

CpuKvStore::CpuKvStore(const KvLayout& layout, int64_t page_tokens, PageAllocator allocator)
    : layout_(layout), page_tokens_(std::max<int64_t>(page_tokens, 1)), allocator_(allocator) {
  RefreshTables();
}

CpuKvStore::~CpuKvStore() { Truncate(0); }

int64_t CpuKvStore::KeyBlockBytes() const {
  return layout_.kv_heads * page_tokens_ * layout_.head_dim * ElementSize(layout_.dtype);
}

int64_t CpuKvStore::ValueBlockBytes() const {
  return layout_.kv_heads * page_tokens_ * StoredValueDim(layout_) * ElementSize(layout_.dtype);
}

int64_t CpuKvStore::BytesFor(int64_t length) const {
  const int64_t pages = PagesFor(length, page_tokens_);
  const int64_t per_page = KeyBlockBytes() + ValueBlockBytes();
  if (pages > std::numeric_limits<int64_t>::max() / per_page) {
    return std::numeric_limits<int64_t>::max();
  }
  return pages * per_page;
}

void CpuKvStore::RefreshTables() {
  const bool latent = layout_.values_from_keys;
  pages_.key_pages = key_pages_.data();
  pages_.value_pages = latent ? key_pages_.data() : value_pages_.data();
  pages_.page_tokens = page_tokens_;
  pages_.key_width = layout_.head_dim;
  pages_.value_width = latent ? layout_.head_dim : layout_.value_dim;
  pages_.dtype = layout_.dtype;
}

absl::Status CpuKvStore::Append(const TensorView& key, const TensorView& value, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  const int64_t new_length = length_ + n;
  const int64_t have = static_cast<int64_t>(key_pages_.size());
  const int64_t need = PagesFor(new_length, page_tokens_);
  auto exhausted = [&] {
    return absl::ResourceExhaustedError(absl::StrCat(
        "could not allocate ", BytesFor(new_length) - bytes(), " bytes of host memory for ", n,
        " more tokens of a KV cache of ", length_, " tokens"));
  };
  if (new_length < length_ || BytesFor(new_length) == std::numeric_limits<int64_t>::max()) {
    return exhausted();
  }
  // Every allocation first (the page blocks and the tables' room), so that a failure leaves the
  // store exactly as it was.
  const bool latent = layout_.values_from_keys;  // No value blocks.
  std::vector<const void*> new_keys, new_values;
  try {
    key_pages_.reserve(need);
    if (!latent) value_pages_.reserve(need);
    new_keys.reserve(need - have);
    new_values.reserve(need - have);
  } catch (const std::bad_alloc&) {
    return exhausted();
  }
  RefreshTables();  // reserve may have moved the tables.
  bool failed = false;
  for (int64_t p = have; p < need && !failed; ++p) {
    const void* k = allocator_.allocate(static_cast<size_t>(KeyBlockBytes()));
    const void* v = k != nullptr && !latent
                        ? allocator_.allocate(static_cast<size_t>(ValueBlockBytes()))
                        : nullptr;
    if (k == nullptr || (v == nullptr && !latent)) {
      if (k != nullptr) allocator_.free(const_cast<void*>(k));
      failed = true;
      break;
    }
    new_keys.push_back(k);
    if (!latent) new_values.push_back(v);
  }
  if (failed) {
    for (const void* block : new_keys) allocator_.free(const_cast<void*>(block));
    for (const void* block : new_values) allocator_.free(const_cast<void*>(block));
    return exhausted();
  }
  key_pages_.insert(key_pages_.end(), new_keys.begin(), new_keys.end());  // Within capacity.
  value_pages_.insert(value_pages_.end(), new_values.begin(), new_values.end());
  RefreshTables();

  // The new tokens, a page segment of one kv head at a time.
  std::vector<float> scratch;
  auto copy = [&](const TensorView& source, const std::vector<const void*>& table, int64_t width) {
    // Rows of `width` elements: the blocks of `table` hold nothing else (a latent store has no
    // value table, so its rows are always whole keys).
    const int64_t source_element = ElementSize(source.dtype);
    const int64_t element = ElementSize(layout_.dtype);
    for (int64_t head = 0; head < layout_.kv_heads; ++head) {
      for (int64_t t = 0; t < n;) {
        const int64_t token = length_ + t;
        const int64_t rows = std::min(page_tokens_ - token % page_tokens_, n - t);
        const char* src =
            static_cast<const char*>(source.data) + (head * n + t) * width * source_element;
        char* dst = static_cast<char*>(const_cast<void*>(table[token / page_tokens_])) +
                    (head * page_tokens_ + token % page_tokens_) * width * element;
        ConvertRows(src, source.dtype, rows * width, dst, layout_.dtype, scratch);
        t += rows;
      }
    }
  };
  copy(key, key_pages_, layout_.head_dim);
  if (!latent) copy(value, value_pages_, layout_.value_dim);
  length_ = new_length;
  return absl::OkStatus();
}

void CpuKvStore::Truncate(int64_t length) {
  length = std::clamp<int64_t>(length, 0, length_);
  const int64_t keep = PagesFor(length, page_tokens_);
  while (static_cast<int64_t>(key_pages_.size()) > keep) {
    allocator_.free(const_cast<void*>(key_pages_.back()));
    key_pages_.pop_back();
    if (layout_.values_from_keys) continue;
    allocator_.free(const_cast<void*>(value_pages_.back()));
    value_pages_.pop_back();
  }
  length_ = length;
  RefreshTables();
}

}  // namespace attn
