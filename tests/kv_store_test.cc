// CpuKvStore (kernels/cpu/kv_store.h): pages in the store's dtype, appends that convert and
// never move stored tokens, truncation that frees pages, BytesFor, and all-or-nothing appends.
#include "kernels/cpu/kv_store.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/dtype.h"

namespace {

using namespace attn;

// Random values rounded to `dtype`, as the bytes of a dense tensor in that dtype.
struct Tensor {
  std::vector<float> values;
  std::vector<uint8_t> bytes;
  DType dtype;
  TensorView view() const { return TensorView{bytes.data(), dtype}; }
};

Tensor RandomTensor(int64_t count, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.f, 2.f);
  Tensor t{std::vector<float>(count), std::vector<uint8_t>(count * ElementSize(dtype)), dtype};
  for (int64_t i = 0; i < count; ++i) {
    StoreElement(t.bytes.data(), dtype, i, uniform(rng));
    t.values[i] = LoadElement(t.bytes.data(), dtype, i);
  }
  return t;
}

float RoundTo(float x, DType dtype) {
  uint8_t bytes[4];
  StoreElement(bytes, dtype, 0, x);
  return LoadElement(bytes, dtype, 0);
}

// Element c of token `token` of kv head `head` of the store's keys (or values), via its pages.
float StoredElement(const KvStore& store, bool key, int64_t head, int64_t token, int64_t c) {
  const PagedKv& pages = store.pages();
  const void* page = key ? pages.KeyPage(token) : pages.ValuePage(token);
  return LoadElement(
      page, pages.dtype,
      (key ? pages.KeyOffsetInPage(head, token) : pages.ValueOffsetInPage(head, token)) + c);
}

// The stored tokens [begin, begin + n) equal the appended ones, rounded to the store's dtype.
// The tensors hold `total` tokens (0: n), of which the first n are checked.
void ExpectHolds(const KvStore& store, const Tensor& key, const Tensor& value, int64_t begin,
                 int64_t n, int64_t total = 0) {
  const KvLayout& layout = store.layout();
  if (total == 0) total = n;
  for (int64_t h = 0; h < layout.kv_heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < layout.head_dim; ++c) {
        ASSERT_EQ(StoredElement(store, true, h, begin + t, c),
                  RoundTo(key.values[(h * total + t) * layout.head_dim + c], layout.dtype))
            << "key h=" << h << " token " << begin + t << " c=" << c;
      }
      for (int64_t c = 0; c < layout.value_dim; ++c) {
        ASSERT_EQ(StoredElement(store, false, h, begin + t, c),
                  RoundTo(value.values[(h * total + t) * layout.value_dim + c], layout.dtype))
            << "value h=" << h << " token " << begin + t << " c=" << c;
      }
    }
  }
}

constexpr KvLayout kLayout{.kv_heads = 3, .head_dim = 5, .value_dim = 7, .dtype = DType::kBFloat16};

TEST(KvStoreTest, AppendsConvertEveryInputDtypeAndPagesHoldTheTokens) {
  for (DType stored : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    KvLayout layout = kLayout;
    layout.dtype = stored;
    CpuKvStore store(layout, 4);
    int64_t length = 0;
    uint64_t seed = 1;
    for (DType input : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(input) << " into " << DTypeName(stored));
      const int64_t n = 2 + static_cast<int64_t>(seed) * 3;  // 5, 8, 11, 14: across pages.
      const Tensor key = RandomTensor(layout.kv_heads * n * layout.head_dim, input, seed++);
      const Tensor value = RandomTensor(layout.kv_heads * n * layout.value_dim, input, seed++);
      ASSERT_TRUE(store.Append(key.view(), value.view(), n).ok());
      ExpectHolds(store, key, value, length, n);
      length += n;
      EXPECT_EQ(store.length(), length);
      EXPECT_EQ(store.bytes(), store.BytesFor(length));
      EXPECT_EQ(store.pages().page_tokens, 4);
      EXPECT_EQ(store.pages().dtype, stored);
      for (int64_t p = 0; p < (length + 3) / 4; ++p) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(store.pages().key_pages[p]) % 64, 0u);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(store.pages().value_pages[p]) % 64, 0u);
      }
    }
  }
}

// An fp8 store (dtype.h): tokens of every input dtype quantized a row at a time, each row's
// codes and scale as QuantizeFp8Row makes them from the fp32 values; about half a bf16 store's
// bytes at d 128; its CopyOut appended to another fp8 store is copied, not quantized again
// (the same bytes), and a fork copies a shared partly filled page with its scales.
TEST(KvStoreTest, AnFp8StoreQuantizesEachRowAndCopiesStoredRowsAsTheyAre) {
  const KvLayout wide{
      .kv_heads = 8, .head_dim = 128, .value_dim = 128, .dtype = DType::kFloat8E4M3};
  KvLayout bf16 = wide;
  bf16.dtype = DType::kBFloat16;
  EXPECT_EQ(TokenBytes(wide), 8 * 2 * 132);
  EXPECT_LE(static_cast<double>(TokenBytes(wide)) / TokenBytes(bf16), 0.55);

  KvLayout layout = kLayout;
  layout.dtype = DType::kFloat8E4M3;
  CpuKvStore store(layout, 4);
  int64_t length = 0;
  uint64_t seed = 90;
  std::vector<float> keys, values;  // Every appended token's fp32 values, [n][kv_heads][width].
  for (DType input : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(input));
    const int64_t n = 5 + static_cast<int64_t>(seed % 7);
    const Tensor key = RandomTensor(layout.kv_heads * n * layout.head_dim, input, seed++);
    const Tensor value = RandomTensor(layout.kv_heads * n * layout.value_dim, input, seed++);
    ASSERT_TRUE(store.Append(key.view(), value.view(), n).ok());
    const int64_t key_row = KeyRowBytes(layout), value_row = StoredValueRowBytes(layout);
    std::vector<uint8_t> k(KeyBytes(layout, n)), v(StoredValueBytes(layout, n));
    ASSERT_TRUE(store.CopyOut(length, length + n, k.data(), v.data()).ok());
    for (int64_t row = 0; row < layout.kv_heads * n; ++row) {
      std::vector<uint8_t> expected(key_row);
      QuantizeFp8Row(key.values.data() + row * layout.head_dim, layout.head_dim, expected.data());
      ASSERT_EQ(std::memcmp(expected.data(), k.data() + row * key_row, key_row), 0) << row;
      expected.assign(value_row, 0);
      QuantizeFp8Row(value.values.data() + row * layout.value_dim, layout.value_dim,
                     expected.data());
      ASSERT_EQ(std::memcmp(expected.data(), v.data() + row * value_row, value_row), 0) << row;
    }
    length += n;
  }
  EXPECT_EQ(store.bytes(), store.BytesFor(length));
  EXPECT_EQ(store.pages().key_width, StoredRowWidth(DType::kFloat8E4M3, layout.head_dim));

  // Stored rows into a second store: the same bytes.
  std::vector<uint8_t> k(KeyBytes(layout, length)), v(StoredValueBytes(layout, length));
  ASSERT_TRUE(store.CopyOut(0, length, k.data(), v.data()).ok());
  CpuKvStore copy(layout, 3);
  ASSERT_TRUE(
      copy.Append(TensorView{k.data(), layout.dtype}, TensorView{v.data(), layout.dtype}, length)
          .ok());
  std::vector<uint8_t> k2(k.size()), v2(v.size());
  ASSERT_TRUE(copy.CopyOut(0, length, k2.data(), v2.data()).ok());
  EXPECT_EQ(k2, k);
  EXPECT_EQ(v2, v);

  // A fork's append into the shared partly filled last page copies the page, scales and all.
  const int64_t kept = length - 2;  // 23 of 25 tokens: a partly filled last page of 4.
  ASSERT_NE(kept % 4, 0);
  absl::StatusOr<std::unique_ptr<KvStore>> fork = store.Fork(kept);
  ASSERT_TRUE(fork.ok()) << fork.status();
  const Tensor key = RandomTensor(layout.kv_heads * layout.head_dim, DType::kFloat32, 7);
  const Tensor value = RandomTensor(layout.kv_heads * layout.value_dim, DType::kFloat32, 8);
  ASSERT_TRUE((*fork)->Append(key.view(), value.view(), 1).ok());
  std::vector<uint8_t> after(k.size()), after_values(v.size());
  ASSERT_TRUE(store.CopyOut(0, length, after.data(), after_values.data()).ok());
  EXPECT_EQ(after, k) << "the fork wrote into the source's page";
  EXPECT_EQ(after_values, v) << "the fork wrote into the source's page";
  std::vector<uint8_t> forked(KeyBytes(layout, kept)),
      forked_values(StoredValueBytes(layout, kept));
  ASSERT_TRUE((*fork)->CopyOut(0, kept, forked.data(), forked_values.data()).ok());
  const int64_t row = KeyRowBytes(layout);
  for (int64_t h = 0; h < layout.kv_heads; ++h) {
    EXPECT_EQ(std::memcmp(forked.data() + h * kept * row, k.data() + h * length * row, kept * row),
              0)
        << "head " << h;
  }
}

TEST(KvStoreTest, BytesForCountsWholePages) {
  CpuKvStore store(kLayout, 7);
  const int64_t page = 3 * 7 * (5 + 7) * 2;
  EXPECT_EQ(store.BytesFor(0), 0);
  EXPECT_EQ(store.BytesFor(1), page);
  EXPECT_EQ(store.BytesFor(7), page);
  EXPECT_EQ(store.BytesFor(8), 2 * page);
  EXPECT_EQ(store.BytesFor(700), 100 * page);
  EXPECT_EQ(store.bytes(), 0);
  EXPECT_EQ(store.length(), 0);
}

// Appending writes only the new tokens: earlier pages stay where they were, with their bytes.
TEST(KvStoreTest, AppendNeverMovesStoredTokens) {
  CpuKvStore store(kLayout, 5);
  const Tensor key = RandomTensor(3 * 6 * 5, DType::kFloat32, 10);
  const Tensor value = RandomTensor(3 * 6 * 7, DType::kFloat32, 11);
  ASSERT_TRUE(store.Append(key.view(), value.view(), 6).ok());
  const std::vector<const void*> first_pages(store.pages().key_pages, store.pages().key_pages + 2);
  std::vector<uint8_t> first_page(3 * 5 * 5 * 2);
  std::memcpy(first_page.data(), first_pages[0], first_page.size());
  for (int i = 0; i < 20; ++i) {  // Tables grow and are reallocated; pages never move.
    const Tensor k = RandomTensor(3 * 3 * 5, DType::kFloat16, 20 + i);
    const Tensor v = RandomTensor(3 * 3 * 7, DType::kFloat16, 40 + i);
    ASSERT_TRUE(store.Append(k.view(), v.view(), 3).ok());
  }
  EXPECT_EQ(store.length(), 66);
  EXPECT_EQ(store.pages().key_pages[0], first_pages[0]);
  EXPECT_EQ(store.pages().key_pages[1], first_pages[1]);
  EXPECT_EQ(std::memcmp(first_page.data(), store.pages().key_pages[0], first_page.size()), 0);
  ExpectHolds(store, key, value, 0, 6);
}

TEST(KvStoreTest, TruncateFreesPagesPastTheNewLengthAndAppendsContinue) {
  CpuKvStore store(kLayout, 5);
  const Tensor key = RandomTensor(3 * 23 * 5, DType::kFloat32, 30);
  const Tensor value = RandomTensor(3 * 23 * 7, DType::kFloat32, 31);
  ASSERT_TRUE(store.Append(key.view(), value.view(), 23).ok());
  EXPECT_EQ(store.bytes(), store.BytesFor(23));
  store.Truncate(11);
  EXPECT_EQ(store.length(), 11);
  EXPECT_EQ(store.bytes(), store.BytesFor(11));  // 3 pages of 5.
  EXPECT_EQ(store.bytes(), 3 * store.BytesFor(1));
  store.Truncate(11);  // Same length: nothing changes.
  EXPECT_EQ(store.length(), 11);
  // Tokens 11…: new ones, in the partly used page and past it.
  const Tensor more_key = RandomTensor(3 * 9 * 5, DType::kBFloat16, 32);
  const Tensor more_value = RandomTensor(3 * 9 * 7, DType::kBFloat16, 33);
  ASSERT_TRUE(store.Append(more_key.view(), more_value.view(), 9).ok());
  EXPECT_EQ(store.length(), 20);
  ExpectHolds(store, more_key, more_value, 11, 9);
  store.Truncate(0);
  EXPECT_EQ(store.length(), 0);
  EXPECT_EQ(store.bytes(), 0);
}

// An allocator that fails after `budget` blocks, counting what is outstanding.
int g_blocks_left = 0;
int g_outstanding = 0;
void* FailingAllocate(size_t bytes) {
  if (g_blocks_left-- <= 0) return nullptr;
  ++g_outstanding;
  return PageAllocator::Host().allocate(bytes);
}
void CountingFree(void* block) {
  --g_outstanding;
  PageAllocator::Host().free(block);
}

TEST(KvStoreTest, AnAppendThatCannotAllocateLeavesTheStoreAsItWas) {
  for (int budget : {2, 3, 4, 5}) {  // Fails on a key block, then on a value block, ….
    SCOPED_TRACE(::testing::Message() << "blocks " << budget);
    g_blocks_left = 2;  // The first page.
    g_outstanding = 0;
    {
      CpuKvStore store(kLayout, 4, PageAllocator{&FailingAllocate, &CountingFree});
      const Tensor key = RandomTensor(3 * 3 * 5, DType::kFloat32, 50);
      const Tensor value = RandomTensor(3 * 3 * 7, DType::kFloat32, 51);
      ASSERT_TRUE(store.Append(key.view(), value.view(), 3).ok());
      const PagedKv before = store.pages();
      const void* first_key_page = before.key_pages[0];
      std::vector<uint8_t> page(3 * 4 * 5 * 2);
      std::memcpy(page.data(), first_key_page, page.size());

      g_blocks_left = budget - 2;  // Not enough for the 3 more pages 12 tokens need.
      const Tensor big_key = RandomTensor(3 * 12 * 5, DType::kFloat32, 52);
      const Tensor big_value = RandomTensor(3 * 12 * 7, DType::kFloat32, 53);
      const absl::Status status = store.Append(big_key.view(), big_value.view(), 12);
      EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
      EXPECT_EQ(store.length(), 3);
      EXPECT_EQ(store.bytes(), store.BytesFor(3));
      EXPECT_EQ(store.pages().key_pages[0], first_key_page);
      EXPECT_EQ(std::memcmp(page.data(), store.pages().key_pages[0], page.size()), 0);
      EXPECT_EQ(g_outstanding, 2) << "the failed append's blocks were not all freed";
      ExpectHolds(store, key, value, 0, 3);

      g_blocks_left = 100;  // With memory again, the same append succeeds.
      ASSERT_TRUE(store.Append(big_key.view(), big_value.view(), 12).ok());
      ExpectHolds(store, big_key, big_value, 3, 12);
    }
    EXPECT_EQ(g_outstanding, 0);
  }
}

TEST(KvStoreTest, CpuBackendCreatesStoresWithItsPageSize) {
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  EXPECT_EQ(backend.kv_page_tokens(), 7);
  absl::StatusOr<std::unique_ptr<KvStore>> store = backend.CreateKvStore(kLayout);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->page_tokens(), 7);
  EXPECT_EQ((*store)->length(), 0);
  EXPECT_EQ((*store)->layout().value_dim, 7);
  EXPECT_EQ(CpuBackend(1, 0).kv_page_tokens(), CpuBackend::kDefaultKvPageTokens);
}

// Forks (KvStore::Fork): a fork holds its source's pages, nothing copied; an append into a shared
// partly filled page copies that page first (in either store), so neither ever sees the other's
// new tokens; a cut fork, a deleted source and a latent store keep every token; every page is
// freed once, when its last holder lets go, and reported to OnPageFreed with its bytes.
int64_t g_freed_bytes = 0;

TEST(KvStoreTest, AForkSharesPagesAndCopiesAPartlyFilledOneBeforeWritingIntoIt) {
  for (bool latent : {false, true}) {
    SCOPED_TRACE(latent ? "latent" : "keys and values");
    KvLayout layout = kLayout;
    if (latent) {
      layout.value_dim = 4;
      layout.values_from_keys = true;
    }
    g_outstanding = 0;
    g_blocks_left = 1000;
    g_freed_bytes = 0;
    int64_t page_bytes = 0;
    {
      auto source =
          std::make_unique<CpuKvStore>(layout, 4, PageAllocator{&FailingAllocate, &CountingFree});
      source->OnPageFreed([](int64_t bytes) { g_freed_bytes += bytes; });
      const int64_t width_v = layout.values_from_keys ? layout.head_dim : layout.value_dim;
      auto tokens = [&](int64_t n, uint64_t seed) {
        return std::pair{RandomTensor(3 * n * 5, DType::kFloat32, seed),
                         RandomTensor(3 * n * width_v, DType::kFloat32, seed + 1)};
      };
      // A latent store's value: the first value_dim columns of the key.
      auto values_of = [&](const std::pair<Tensor, Tensor>& t, int64_t n) {
        if (!layout.values_from_keys) return t.second;
        Tensor v{std::vector<float>(3 * n * layout.value_dim), {}, DType::kFloat32};
        for (int64_t row = 0; row < 3 * n; ++row) {
          for (int64_t c = 0; c < layout.value_dim; ++c) {
            v.values[row * layout.value_dim + c] = t.first.values[row * 5 + c];
          }
        }
        return v;
      };
      const auto prompt = tokens(10, 60);  // Pages of 4, 4 and 2 tokens.
      ASSERT_TRUE(source->Append(prompt.first.view(), prompt.second.view(), 10).ok());
      page_bytes = source->bytes() / 3;
      EXPECT_EQ(source->shared_bytes(), 0);

      // A fork of all ten: the same three pages.
      absl::StatusOr<std::unique_ptr<KvStore>> whole = source->Fork(10);
      ASSERT_TRUE(whole.ok()) << whole.status();
      KvStore& fork = **whole;
      EXPECT_EQ(fork.length(), 10);
      for (int p = 0; p < 3; ++p)
        EXPECT_EQ(fork.pages().key_pages[p], source->pages().key_pages[p]);
      EXPECT_EQ(source->shared_bytes(), 3 * page_bytes);
      EXPECT_EQ(fork.shared_bytes(), 3 * page_bytes);
      EXPECT_EQ(g_outstanding, latent ? 3 : 6);  // Nothing allocated.
      ExpectHolds(fork, prompt.first, values_of(prompt, 10), 0, 10);

      // The fork's append writes into the shared third page: it copies it first.
      EXPECT_EQ(fork.BytesToAppend(1), page_bytes);
      EXPECT_EQ(fork.BytesToAppend(3), page_bytes + page_bytes);
      const auto own = tokens(3, 70);
      ASSERT_TRUE(fork.Append(own.first.view(), own.second.view(), 3).ok());
      EXPECT_NE(fork.pages().key_pages[2], source->pages().key_pages[2]);
      EXPECT_EQ(fork.pages().key_pages[1], source->pages().key_pages[1]);
      EXPECT_EQ(source->shared_bytes(), 2 * page_bytes);
      ExpectHolds(fork, prompt.first, values_of(prompt, 10), 0, 10);
      ExpectHolds(fork, own.first, values_of(own, 3), 10, 3);
      // The source's third page is its own again: its append writes in place.
      EXPECT_EQ(source->BytesToAppend(1), 0);
      const auto next = tokens(1, 80);
      ASSERT_TRUE(source->Append(next.first.view(), next.second.view(), 1).ok());
      ExpectHolds(*source, prompt.first, values_of(prompt, 10), 0, 10);
      ExpectHolds(*source, next.first, values_of(next, 1), 10, 1);
      ExpectHolds(fork, own.first, values_of(own, 3), 10, 3);

      // A fork of six (inside the second page), cut to five, then appended: the shared second
      // page is copied, the source's tokens 5 … 7 stay.
      absl::StatusOr<std::unique_ptr<KvStore>> part = source->Fork(6);
      ASSERT_TRUE(part.ok());
      (*part)->Truncate(5);
      EXPECT_EQ((*part)->BytesToAppend(1), page_bytes);
      const auto branch = tokens(2, 90);
      ASSERT_TRUE((*part)->Append(branch.first.view(), branch.second.view(), 2).ok());
      ExpectHolds(**part, prompt.first, values_of(prompt, 10), 0, 5, 10);
      ExpectHolds(**part, branch.first, values_of(branch, 2), 5, 2);
      ExpectHolds(*source, prompt.first, values_of(prompt, 10), 0, 10);
      EXPECT_EQ(source->Fork(12).status().code(), absl::StatusCode::kInvalidArgument);

      // The source deleted: its forks keep every page they hold (ASan sees any use after free).
      const int64_t freed_before = g_freed_bytes;
      source.reset();
      EXPECT_EQ(g_freed_bytes - freed_before, page_bytes);  // Only its own third page.
      ExpectHolds(fork, prompt.first, values_of(prompt, 10), 0, 10);
      ExpectHolds(**part, prompt.first, values_of(prompt, 10), 0, 5, 10);
      EXPECT_EQ(fork.shared_bytes(), page_bytes);  // The first page, still shared with `part`.
    }
    // Every block freed, every page reported once: the source's 3, the fork's copy of the
    // third and its fourth, `part`'s copy of the second.
    EXPECT_EQ(g_outstanding, 0);
    EXPECT_EQ(g_freed_bytes, 6 * page_bytes);
  }
}

}  // namespace
