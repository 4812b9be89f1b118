// CpuKvStore (kernels/cpu/kv_store.h): pages in the store's dtype, appends that convert and
// never move stored tokens, truncation that frees pages, BytesFor, and all-or-nothing appends.
#include "kernels/cpu/kv_store.h"

#include <cstdint>
#include <cstring>
#include <random>
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
void ExpectHolds(const KvStore& store, const Tensor& key, const Tensor& value, int64_t begin,
                 int64_t n) {
  const KvLayout& layout = store.layout();
  for (int64_t h = 0; h < layout.kv_heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < layout.head_dim; ++c) {
        ASSERT_EQ(StoredElement(store, true, h, begin + t, c),
                  RoundTo(key.values[(h * n + t) * layout.head_dim + c], layout.dtype))
            << "key h=" << h << " token " << begin + t << " c=" << c;
      }
      for (int64_t c = 0; c < layout.value_dim; ++c) {
        ASSERT_EQ(StoredElement(store, false, h, begin + t, c),
                  RoundTo(value.values[(h * n + t) * layout.value_dim + c], layout.dtype))
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

}  // namespace
