// The CUDA backend's KV caches (kernels/cuda/kv_store.h) and attention over them: the store's
// append, truncate and all-or-nothing failure, read back from the device; forks (pages shared
// through tables of their own, copy on write, each page freed by its last holder); Decode's
// split-KV kernels (kernels/cuda/decode.cu) against the float64 reference (tests/reference.h) — odd
// page sizes, GQA, causal with several query rows, a batch of different lengths, fp32/fp16/bf16 by
// the project's rules (DESIGN.md, Numerics), fp8 caches against the reference on the rows they
// store (code · scale, to fp32's bound), small chunks that exercise the merge and the
// backend's own choice, DeepSeek-V3's MLA shape (128 heads over one latent kv head, head_dim
// 576, values the first 512 columns of each key) and other widths the wide (576) instance takes,
// which widths Decode takes and which it refuses; and Naive, Tiled and Trace over a cache against
// the same problem with contiguous keys (the gather makes the same device layout, so they agree
// bit for bit; an fp8 cache's gather gives its rows' code · scale, so it agrees with the
// dequantized keys and values). fp8 stores: every append quantized into rows with their scales,
// the rows copied out and in byte for byte. Forks of one prompt in one Decode batch: their shared
// chunks in cascade units, each fork's bits those of its decode alone.
//
// As in gpu_test.cc: without a CUDA device every test reports SKIPPED with the reason (fails
// with ATTN_REQUIRE_GPU=1, tests/backend_suite.h's GpuRequired); outputs are poisoned with NaN;
// inputs fresh and sizes odd.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cascade.h"
#include "kernels/convert.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/kv_store.h"
#include "kernels/problem.h"
#include "tests/backend_suite.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

// Backends for the suite: `odd` keeps 7-token pages and splits decode work into 64-key chunks
// (so that every cache of the tests spans many pages and many chunks); `plain` has the defaults
// (256-token pages, chunks chosen for the device).
class CudaKvTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    cuda::CudaBackendOptions odd;
    odd.kv_page_tokens = 7;
    odd.decode_chunk_keys = 64;
    odd_ = new absl::StatusOr<std::unique_ptr<Backend>>(cuda::MakeCudaBackend(0, odd));
    plain_ = new absl::StatusOr<std::unique_ptr<Backend>>(
        cuda::MakeCudaBackend(0, cuda::CudaBackendOptions{}));
  }
  static void TearDownTestSuite() {
    delete odd_;
    delete plain_;
    odd_ = plain_ = nullptr;
  }

 protected:
  void SetUp() override {
    if (odd_->ok() && plain_->ok()) return;
    std::string error;
    const int devices = cuda::DeviceCount(&error);
    if (devices > 0 || GpuRequired()) {
      FAIL() << "the CUDA backend did not open (" << devices
             << " device(s)): " << (odd_->ok() ? plain_->status() : odd_->status());
    }
    GTEST_SKIP() << "no CUDA device: " << odd_->status();
  }
  static Backend& odd() { return ***odd_; }
  static Backend& plain() { return ***plain_; }

 private:
  static inline absl::StatusOr<std::unique_ptr<Backend>>* odd_ = nullptr;
  static inline absl::StatusOr<std::unique_ptr<Backend>>* plain_ = nullptr;
};

// A store's layout for the problem's keys and values (a latent one after SetValuesFromKeys), in
// the problem's dtype or `stored`.
KvLayout LayoutOf(const HostProblem& host, std::optional<DType> stored = std::nullopt) {
  return KvLayout{host.shape.kv_heads, host.shape.head_dim, host.shape.value_dim,
                  stored.value_or(host.dtype), host.values_from_keys};
}

// Rows of `width` values as a store of `dtype` holds them: fp8 rows quantized
// (QuantizeFp8Row) and read back (code · scale); other dtypes' values are already rounded to it.
std::vector<float> AsStored(const std::vector<float>& values, int64_t width, DType dtype) {
  if (dtype != DType::kFloat8E4M3) return values;
  std::vector<float> out(values.size());
  std::vector<uint8_t> row(Fp8RowBytes(width));
  for (size_t r = 0; r * width < values.size(); ++r) {
    QuantizeFp8Row(values.data() + r * width, width, row.data());
    DequantizeFp8Row(row.data(), width, Fp8RowBytes(width), out.data() + r * width);
  }
  return out;
}

// Tokens [first, first + n) of a dense [kv_heads, len, width] tensor, dense [kv_heads, n, width]:
// as bytes of `dtype` (converted from the fp32 values, which are already rounded to it).
std::vector<uint8_t> Slice(const std::vector<float>& values, int64_t kv_heads, int64_t len,
                           int64_t width, int64_t first, int64_t n, DType dtype) {
  std::vector<uint8_t> bytes(kv_heads * n * width * ElementSize(dtype));
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < width; ++c) {
        StoreElement(bytes.data(), dtype, (h * n + t) * width + c,
                     values[(h * len + first + t) * width + c]);
      }
    }
  }
  return bytes;
}

// Appends the host problem's keys and values in pieces of the given sizes (then the rest), the
// pieces alternating between the store's dtype and fp32. A latent store (values_from_keys) gets
// NaN values, which it must ignore.
void AppendAll(KvStore& store, const HostProblem& host, std::vector<int64_t> pieces) {
  const Shape& s = host.shape;
  int64_t done = 0;
  int piece = 0;
  while (done < s.key_len) {
    const int64_t n = std::min<int64_t>(
        piece < static_cast<int>(pieces.size()) ? pieces[piece] : s.key_len, s.key_len - done);
    const DType dtype = piece % 2 == 0 ? host.dtype : DType::kFloat32;
    const std::vector<uint8_t> key =
        Slice(host.key, s.kv_heads, s.key_len, s.head_dim, done, n, dtype);
    const std::vector<uint8_t> value =
        store.layout().values_from_keys
            ? Slice(std::vector<float>(host.value.size(), NAN), s.kv_heads, s.key_len, s.value_dim,
                    done, n, dtype)
            : Slice(host.value, s.kv_heads, s.key_len, s.value_dim, done, n, dtype);
    const absl::Status status =
        store.Append(TensorView{key.data(), dtype}, TensorView{value.data(), dtype}, n);
    ASSERT_TRUE(status.ok()) << status;
    done += n;
    ++piece;
    ASSERT_EQ(store.length(), done);
  }
}

// The store's first `length` tokens, read back from the device as fp32 [kv_heads, length,
// width] (keys or values; an fp8 row's codes times its scale).
std::vector<float> ReadBack(const KvStore& store, bool keys, int64_t length) {
  const KvLayout& layout = store.layout();
  const PagedKv& pages = store.pages();
  const int64_t width = keys ? layout.head_dim : layout.value_dim;
  const int64_t page_count = (length + store.page_tokens() - 1) / store.page_tokens();
  std::vector<const void*> table(page_count);
  std::vector<float> out(layout.kv_heads * length * width, NAN);
  if (page_count == 0) return out;
  EXPECT_EQ(cudaMemcpy(table.data(), keys ? pages.key_pages : pages.value_pages,
                       page_count * sizeof(void*), cudaMemcpyDeviceToHost),
            cudaSuccess);
  const int64_t block =
      layout.kv_heads * store.page_tokens() * (keys ? pages.key_width : pages.value_width);
  std::vector<uint8_t> page(block * ElementSize(layout.dtype));
  for (int64_t p = 0; p < page_count; ++p) {
    EXPECT_EQ(cudaMemcpy(page.data(), table[p], page.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t h = 0; h < layout.kv_heads; ++h) {
      for (int64_t t = p * store.page_tokens(); t < std::min(length, (p + 1) * store.page_tokens());
           ++t) {
        const int64_t row = keys ? pages.KeyOffsetInPage(h, t) : pages.ValueOffsetInPage(h, t);
        for (int64_t c = 0; c < width; ++c) {
          float x = LoadElement(page.data(), layout.dtype, row + c);
          if (layout.dtype == DType::kFloat8E4M3) {  // The code times its row's scale.
            x *= Fp8RowScale(page.data() + row, keys ? pages.key_width : pages.value_width);
          }
          out[(h * length + t) * width + c] = x;
        }
      }
    }
  }
  return out;
}

std::vector<float> Prefix(const std::vector<float>& values, int64_t kv_heads, int64_t len,
                          int64_t width, int64_t length) {
  std::vector<float> out;
  for (int64_t h = 0; h < kv_heads; ++h) {
    out.insert(out.end(), values.begin() + h * len * width,
               values.begin() + (h * len + length) * width);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The store.

TEST_F(CudaKvTest, AppendTruncateAndReadBackInEveryDtype) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const HostProblem host =
        RandomProblem(MakeShape(1, 3, 3, 1, 40, 17, 11), dtype, false, 8, 9 + int(dtype));
    absl::StatusOr<std::unique_ptr<KvStore>> store = odd().CreateKvStore(LayoutOf(host));
    ASSERT_TRUE(store.ok()) << store.status();
    KvStore& kv = **store;
    EXPECT_EQ(kv.page_tokens(), 7);
    EXPECT_EQ(kv.length(), 0);
    EXPECT_EQ(kv.bytes(), 0);
    const int64_t page_bytes = 3 * 7 * (17 + 11) * ElementSize(dtype);
    EXPECT_EQ(kv.BytesFor(15), 3 * page_bytes);
    AppendAll(kv, host, {1, 5, 9, 13});  // Pieces across page boundaries, and a last one.
    EXPECT_EQ(kv.bytes(), 6 * page_bytes);
    EXPECT_EQ(ReadBack(kv, true, 40), host.key);
    EXPECT_EQ(ReadBack(kv, false, 40), host.value);

    kv.Truncate(15);  // Keeps three pages, the last one partly.
    EXPECT_EQ(kv.length(), 15);
    EXPECT_EQ(kv.bytes(), 3 * page_bytes);
    EXPECT_EQ(ReadBack(kv, true, 15), Prefix(host.key, 3, 40, 17, 15));
    // Appending again after a truncate overwrites the dropped tokens.
    const HostProblem other =
        RandomProblem(MakeShape(1, 3, 3, 1, 20, 17, 11), dtype, false, 8, 99 + int(dtype));
    const std::vector<uint8_t> key = Slice(other.key, 3, 20, 17, 0, 20, dtype);
    const std::vector<uint8_t> value = Slice(other.value, 3, 20, 11, 0, 20, dtype);
    ASSERT_TRUE(kv.Append({key.data(), dtype}, {value.data(), dtype}, 20).ok());
    EXPECT_EQ(kv.length(), 35);
    const std::vector<float> keys = ReadBack(kv, true, 35);
    for (int64_t h = 0; h < 3; ++h) {
      for (int64_t t = 0; t < 35; ++t) {
        for (int64_t c = 0; c < 17; ++c) {
          const float expected =
              t < 15 ? host.key[(h * 40 + t) * 17 + c] : other.key[(h * 20 + t - 15) * 17 + c];
          ASSERT_EQ(keys[(h * 35 + t) * 17 + c], expected) << h << " " << t << " " << c;
        }
      }
    }
    kv.Truncate(0);
    EXPECT_EQ(kv.length(), 0);
    EXPECT_EQ(kv.bytes(), 0);
  }
}

// fp8 stores (kernels/dtype.h): every append, in bf16 or fp32 pieces across pages, quantized into
// rows of codes, zero padding and the row's scale — exactly the bytes QuantizeFp8Row makes of each
// token's row — which CopyOut gives back for any range, and which an append of stored rows (a
// restore's, an import's) copies bit for bit; a latent store's value rows are its keys' first
// codes with the key's scale; a page's bytes are its stored rows'.
TEST_F(CudaKvTest, Fp8StoreQuantizesEveryAppendAndCopiesStoredRowsExactly) {
  const DType fp8 = DType::kFloat8E4M3;
  for (bool latent : {false, true}) {
    SCOPED_TRACE(latent ? "latent" : "keys and values");
    HostProblem host =
        RandomProblem(MakeShape(1, 3, 3, 1, 40, 17, 11), DType::kBFloat16, false, 8, 77 + latent);
    if (latent) host.SetValuesFromKeys();
    absl::StatusOr<std::unique_ptr<KvStore>> store = odd().CreateKvStore(LayoutOf(host, fp8));
    ASSERT_TRUE(store.ok()) << store.status();
    KvStore& kv = **store;
    const int64_t key_row = Fp8RowBytes(17), value_row = Fp8RowBytes(11);
    EXPECT_EQ(key_row, 24);  // 17 codes, 3 bytes of padding, the scale.
    EXPECT_EQ(kv.BytesFor(15), 3 * 3 * 7 * (key_row + (latent ? 0 : value_row)));
    AppendAll(kv, host, {1, 5, 9, 13});  // bf16 and fp32 pieces, across page boundaries.
    ASSERT_EQ(kv.length(), 40);

    // Every key row is QuantizeFp8Row's bytes of that token's keys; CopyOut of any range too.
    std::vector<uint8_t> want_keys(3 * 40 * key_row), want_values(3 * 40 * value_row);
    for (int64_t r = 0; r < 3 * 40; ++r) {
      QuantizeFp8Row(host.key.data() + r * 17, 17, want_keys.data() + r * key_row);
      if (latent) {  // The key's first 11 codes, zero padding, the key's scale.
        std::memcpy(want_values.data() + r * value_row, want_keys.data() + r * key_row, 11);
        std::memcpy(want_values.data() + (r + 1) * value_row - 4,
                    want_keys.data() + (r + 1) * key_row - 4, 4);
      } else {
        QuantizeFp8Row(host.value.data() + r * 11, 11, want_values.data() + r * value_row);
      }
    }
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 40}, {5, 33}, {39, 40}}) {
      SCOPED_TRACE(::testing::Message() << "CopyOut " << begin << " … " << end);
      const int64_t n = end - begin;
      std::vector<uint8_t> keys(3 * n * key_row, 0xa5), values(3 * n * value_row, 0xa5);
      ASSERT_TRUE(kv.CopyOut(begin, end, keys.data(), values.data()).ok());
      for (int64_t h = 0; h < 3; ++h) {
        EXPECT_EQ(0, std::memcmp(keys.data() + h * n * key_row,
                                 want_keys.data() + (h * 40 + begin) * key_row, n * key_row));
        EXPECT_EQ(0, std::memcmp(values.data() + h * n * value_row,
                                 want_values.data() + (h * 40 + begin) * value_row, n * value_row));
      }
    }
    // Read through the pages as the kernels do: code · scale, which quantizing really changed.
    const std::vector<float> keys = ReadBack(kv, true, 40);
    EXPECT_EQ(keys, AsStored(host.key, 17, fp8));
    EXPECT_GT(MaxAbsError(keys, host.key), 1e-3);
    if (!latent) {
      EXPECT_EQ(ReadBack(kv, false, 40), AsStored(host.value, 11, fp8));
    }

    // Stored rows appended as they are (dtype fp8: a restore's or an import's), bit for bit.
    absl::StatusOr<std::unique_ptr<KvStore>> copy = odd().CreateKvStore(LayoutOf(host, fp8));
    ASSERT_TRUE(copy.ok()) << copy.status();
    ASSERT_TRUE((*copy)
                    ->Append(TensorView{want_keys.data(), fp8},
                             TensorView{latent ? nullptr : want_values.data(), fp8}, 40)
                    .ok());
    std::vector<uint8_t> copied_keys(want_keys.size()), copied_values(want_values.size());
    ASSERT_TRUE((*copy)->CopyOut(0, 40, copied_keys.data(), copied_values.data()).ok());
    EXPECT_EQ(copied_keys, want_keys);
    EXPECT_EQ(copied_values, want_values);
    EXPECT_EQ((*copy)->bytes(), kv.bytes());
  }
}

// Forks (KvStore::Fork, ForkCache's): a fork names its source's pages in tables of its own (read
// back through them from the device), an append into a shared partly filled page copies it on the
// device first (the source reads as before), shared_bytes counts the pages another store holds,
// and each page is freed, and reported, once: by the last store that lets go of it.
TEST_F(CudaKvTest, AForkSharesPagesCopiesOnWriteAndFreesOnTheLastHolder) {
  for (DType stored : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(DTypeName(stored));
    // Tokens in the store's dtype; an fp8 store's in bf16 (it quantizes them).
    const DType dtype = stored == DType::kFloat8E4M3 ? DType::kBFloat16 : stored;
    const HostProblem host =
        RandomProblem(MakeShape(1, 4, 2, 1, 30, 17, 11), dtype, false, 8, 31 + int(dtype));
    const HostProblem other =
        RandomProblem(MakeShape(1, 4, 2, 1, 5, 17, 11), dtype, false, 8, 41 + int(dtype));
    absl::StatusOr<std::unique_ptr<KvStore>> made = odd().CreateKvStore(LayoutOf(host, stored));
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<KvStore> source = *std::move(made);
    int64_t freed = 0;
    source->OnPageFreed([&freed](int64_t) { ++freed; });
    AppendAll(*source, host, {30});  // Pages of 7: four whole, the fifth holding 2 tokens.
    const int64_t page_bytes = 2 * 7 * (StoredRowBytes(stored, 17) + StoredRowBytes(stored, 11));
    // What the store holds: an fp8 store's rows quantized (scales and all, copied with a page).
    const std::vector<float> host_key = AsStored(host.key, 17, stored);
    const std::vector<float> host_value = AsStored(host.value, 11, stored);
    const std::vector<float> other_key = AsStored(other.key, 17, stored);
    ASSERT_EQ(source->bytes(), 5 * page_bytes);
    absl::StatusOr<std::unique_ptr<KvStore>> whole = source->Fork(30);
    ASSERT_TRUE(whole.ok()) << whole.status();
    absl::StatusOr<std::unique_ptr<KvStore>> prefix = source->Fork(16);  // Into page 2.
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    EXPECT_EQ(source->Fork(31).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*whole)->shared_bytes(), 5 * page_bytes);
    EXPECT_EQ((*prefix)->bytes(), 3 * page_bytes);
    EXPECT_EQ(source->shared_bytes(), 5 * page_bytes);
    EXPECT_EQ(ReadBack(**whole, true, 30), host_key);
    EXPECT_EQ(ReadBack(**whole, false, 30), host_value);
    EXPECT_EQ(ReadBack(**prefix, true, 16), Prefix(host_key, 2, 30, 17, 16));

    // The whole fork's append: its last page copied, then written; the source as before.
    EXPECT_EQ((*whole)->BytesToAppend(5), page_bytes);
    const std::vector<uint8_t> key = Slice(other.key, 2, 5, 17, 0, 5, dtype);
    const std::vector<uint8_t> value = Slice(other.value, 2, 5, 11, 0, 5, dtype);
    ASSERT_TRUE((*whole)->Append({key.data(), dtype}, {value.data(), dtype}, 5).ok());
    EXPECT_EQ((*whole)->bytes(), 5 * page_bytes);
    EXPECT_EQ((*whole)->shared_bytes(), 4 * page_bytes);
    EXPECT_EQ(source->shared_bytes(), 4 * page_bytes);
    std::vector<float> expected;
    for (int64_t h = 0; h < 2; ++h) {
      expected.insert(expected.end(), host_key.begin() + h * 30 * 17,
                      host_key.begin() + (h + 1) * 30 * 17);
      expected.insert(expected.end(), other_key.begin() + h * 5 * 17,
                      other_key.begin() + (h + 1) * 5 * 17);
    }
    EXPECT_EQ(ReadBack(**whole, true, 35), expected);
    EXPECT_EQ(ReadBack(*source, true, 30), host_key);
    EXPECT_EQ(ReadBack(*source, false, 30), host_value);
    // The prefix fork's append copies page 2; the others read as before.
    ASSERT_TRUE((*prefix)->Append({key.data(), dtype}, {value.data(), dtype}, 3).ok());
    EXPECT_EQ((*prefix)->shared_bytes(), 2 * page_bytes);
    EXPECT_EQ(ReadBack(*source, true, 30), host_key);
    EXPECT_EQ(ReadBack(**whole, true, 35), expected);

    // Each page freed once, by its last holder: 5 of the source's and the 2 copies.
    source.reset();
    EXPECT_EQ(freed, 1);  // Its last page only: the others are the forks'.
    EXPECT_EQ(ReadBack(**whole, true, 35), expected);
    whole->reset();
    EXPECT_EQ(freed, 4);  // Pages 2, 3 and its copy of 4 (0 and 1 are the prefix fork's).
    EXPECT_EQ(ReadBack(**prefix, true, 16), Prefix(host_key, 2, 30, 17, 16));
    prefix->reset();
    EXPECT_EQ(freed, 7);
  }
}

// Over the device budget: RESOURCE_EXHAUSTED, and the store is exactly as it was (length, bytes,
// contents); a smaller append then fits.
TEST_F(CudaKvTest, AppendOverTheBudgetLeavesTheStoreUnchanged) {
  cuda::CudaBackendOptions options;
  options.kv_page_tokens = 5;
  options.memory_budget_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<Backend>> small = cuda::MakeCudaBackend(0, options);
  ASSERT_TRUE(small.ok()) << small.status();
  const HostProblem host =
      RandomProblem(MakeShape(1, 2, 2, 1, 23, 64, 64), DType::kFloat32, false, 8, 4242);
  absl::StatusOr<std::unique_ptr<KvStore>> store = (*small)->CreateKvStore(LayoutOf(host));
  ASSERT_TRUE(store.ok()) << store.status();
  KvStore& kv = **store;
  AppendAll(kv, host, {23});
  const int64_t bytes = kv.bytes();
  // 2 heads × 4000 tokens × 128 floats: 4 MB, over the 1 MB budget.
  const int64_t n = 4000;
  std::vector<float> big_key(2 * n * 64, 0.5f), big_value(2 * n * 64, -0.25f);
  const absl::Status status =
      kv.Append({big_key.data(), DType::kFloat32}, {big_value.data(), DType::kFloat32}, n);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(kv.length(), 23);
  EXPECT_EQ(kv.bytes(), bytes);
  EXPECT_EQ(ReadBack(kv, true, 23), host.key);
  EXPECT_EQ(ReadBack(kv, false, 23), host.value);
  ASSERT_TRUE(
      kv.Append({big_key.data(), DType::kFloat32}, {big_value.data(), DType::kFloat32}, 3).ok());
  EXPECT_EQ(kv.length(), 26);
}

// ---------------------------------------------------------------------------------------------
// Decode against the float64 reference.

struct DecodeCase {
  std::string name;
  DType dtype;
  std::vector<Shape> items;  // Batch 1 each; key_len is the cache's length.
  bool causal = false;
  bool alibi = false;  // ALiBi slopes 2^−(h+1) on every item (the split kernel's rows by head).
  bool sinks = false;  // Sinks 0.5·h − 1 on every item (added in the merge kernel, by head).
  // A token tree on every item (DecodeItem.tree_parents; query_len entries); empty: none.
  std::vector<int32_t> tree = {};
  // Latent caches (KvLayout::values_from_keys): each value the first value_dim columns of its key.
  bool latent = false;
  // fp8 caches of the (fp32) problem's tokens: the reference reads the rows they store (code ·
  // scale, DequantizedFrom), and the outputs are held to fp32's bound.
  bool fp8 = false;
};

// 70 new tokens, chains of five off the prefix and off token 3: masks of two 64-bit words.
std::vector<int32_t> LongTree() {
  std::vector<int32_t> parents;
  for (int32_t i = 0; i < 70; ++i) parents.push_back(i % 5 == 0 ? (i >= 10 ? 3 : -1) : i - 1);
  return parents;
}

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

class CudaDecodeTest : public CudaKvTest, public ::testing::WithParamInterface<DecodeCase> {};

// Runs one Decode of the case's batch on `backend` and checks every item: fp32 within 1e-5
// relative of float64; fp16/bf16 within twice a same-precision eager baseline's error plus the
// output store's rounding (the kernels keep weights in fp32: nothing else is rounded) + 1e-5,
// LowPrecisionAtol; lse within 1e-5 always.
void CheckDecode(Backend& backend, const DecodeCase& c, uint64_t seed) {
  std::vector<HostProblem> hosts;
  std::vector<std::unique_ptr<KvStore>> stores;
  for (size_t i = 0; i < c.items.size(); ++i) {
    hosts.push_back(RandomProblem(c.items[i], c.dtype, c.causal, 8, seed + i));
    for (int64_t h = 0; c.alibi && h < c.items[i].heads; ++h) {
      hosts.back().alibi_slopes.push_back(std::ldexp(1.f, -static_cast<int>(h) - 1));
    }
    for (int64_t h = 0; c.sinks && h < c.items[i].heads; ++h) {
      hosts.back().sinks.push_back(0.5f * static_cast<float>(h) - 1.f);
    }
    if (!c.tree.empty()) hosts.back().SetTree(c.tree);
    if (c.latent) hosts.back().SetValuesFromKeys();
  }
  std::vector<Problem> problems;
  std::vector<PoisonedOutputs> poisoned;
  poisoned.reserve(hosts.size());
  for (HostProblem& host : hosts) {
    absl::StatusOr<std::unique_ptr<KvStore>> store = backend.CreateKvStore(
        LayoutOf(host, c.fp8 ? std::optional(DType::kFloat8E4M3) : std::nullopt));
    ASSERT_TRUE(store.ok()) << store.status();
    AppendAll(**store, host, {3, 29, 1, 64});
    if (c.fp8) {
      ASSERT_EQ(c.dtype, DType::kFloat32);
      HostProblem stored = DequantizedFrom(**store, host);
      EXPECT_GT(MaxAbsError(stored.key, host.key), 1e-3) << "nothing was quantized";
      host = std::move(stored);
    }
    Problem problem = host.View();
    problem.key = {};
    problem.value = {};
    problem.pages = &(*store)->pages();
    problems.push_back(problem);
    stores.push_back(*std::move(store));
    poisoned.emplace_back(host);
  }
  std::vector<Outputs> outputs;
  for (PoisonedOutputs& p : poisoned) outputs.push_back(p.outputs());
  const absl::StatusOr<Stats> stats = backend.Decode(problems, outputs);
  ASSERT_TRUE(stats.ok()) << stats.status();
  double flops = 0;
  for (const Problem& p : problems) flops += p.Flops();
  EXPECT_EQ(stats->flops, flops);
  // The first item's kernel: 32-key tiles up to kMaxHeadDim, 16-key tiles at 576.
  EXPECT_EQ(stats->block_k, cuda::DecodeTileOf(cuda::PaddedDecodeDim(c.items[0])).keys);
  for (size_t i = 0; i < hosts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i << " key_len " << hosts[i].shape.key_len);
    const Reference ref = ReferenceAttention(hosts[i]);
    KernelRun run;
    run.output_bytes = poisoned[i].output_bytes;
    run.output = poisoned[i].Output();
    run.lse = poisoned[i].lse;
    if (c.dtype == DType::kFloat32) {
      ExpectMatchesReference(run, ref, 1e-5);
    } else {
      const double baseline = MaxAbsError(LowPrecisionBaseline(hosts[i], c.dtype), ref.output);
      const double atol = LowPrecisionAtol(hosts[i], ref);
      EXPECT_LE(MaxAbsError(run.output, ref.output), 2 * baseline + atol)
          << "baseline " << baseline;
      ExpectLseMatches(run, ref, 1e-5);
    }
    if (c.causal && hosts[i].shape.query_len > hosts[i].shape.key_len) {
      ExpectUnseeingRowsZero(run, hosts[i]);
    }
  }
}

TEST_P(CudaDecodeTest, MatchesFloat64ReferenceWithSmallChunksAndOddPages) {
  CheckDecode(odd(), GetParam(), std::hash<std::string>{}("decode odd " + GetParam().name));
}

TEST_P(CudaDecodeTest, MatchesFloat64ReferenceWithTheDevicesChunks) {
  CheckDecode(plain(), GetParam(), std::hash<std::string>{}("decode plain " + GetParam().name));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaDecodeTest,
    ::testing::Values(
        DecodeCase{"OneRowFp32", DType::kFloat32, {MakeShape(1, 2, 2, 1, 301, 17, 17)}},
        DecodeCase{"Gqa6Over2Fp32", DType::kFloat32, {MakeShape(1, 6, 2, 1, 200, 33, 20)}},
        DecodeCase{"Gqa32Over8Bf16", DType::kBFloat16, {MakeShape(1, 32, 8, 1, 517, 128, 128)}},
        DecodeCase{"Gqa32Over8F16", DType::kFloat16, {MakeShape(1, 32, 8, 1, 333, 128, 128)}},
        DecodeCase{
            "CausalThreeRowsGqa", DType::kFloat32, {MakeShape(1, 4, 2, 3, 130, 9, 13)}, true},
        DecodeCase{
            "CausalMoreRowsThanKeys", DType::kFloat32, {MakeShape(1, 2, 1, 9, 5, 8, 8)}, true},
        DecodeCase{"CausalRowGroupsOf16Bf16",
                   DType::kBFloat16,
                   {MakeShape(1, 12, 2, 5, 97, 64, 48)},
                   true},
        DecodeCase{"HeadDim256F16", DType::kFloat16, {MakeShape(1, 4, 4, 2, 150, 256, 200)}},
        DecodeCase{"OneToken", DType::kFloat32, {MakeShape(1, 3, 1, 1, 1, 5, 7)}},
        DecodeCase{"BatchOfLengthsBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 8, 2, 1, 1, 64, 64), MakeShape(1, 8, 2, 1, 37, 64, 64),
                    MakeShape(1, 8, 2, 1, 200, 64, 64), MakeShape(1, 8, 2, 1, 513, 64, 64),
                    MakeShape(1, 8, 2, 1, 1000, 64, 64)}},
        DecodeCase{"BatchOfShapesFp32",
                   DType::kFloat32,
                   {MakeShape(1, 4, 2, 2, 77, 30, 30), MakeShape(1, 2, 2, 1, 290, 100, 64),
                    MakeShape(1, 6, 3, 1, 45, 17, 5)},
                   true},
        DecodeCase{"AlibiCausalRowGroupsBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 12, 2, 5, 97, 64, 48), MakeShape(1, 12, 2, 1, 600, 64, 48)},
                   true,
                   true},
        // gpt-oss-like: GQA with sinks, causal, a long cache split in chunks and a short one.
        DecodeCase{"SinksCausalGqaF32",
                   DType::kFloat32,
                   {MakeShape(1, 8, 2, 3, 700, 64, 64), MakeShape(1, 8, 2, 1, 9, 64, 64)},
                   true,
                   false,
                   true},
        DecodeCase{"SinksAlibiBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 6, 3, 2, 131, 48, 40)},
                   true,
                   true,
                   true},
        // Speculative decoding's token trees: EAGLE-like over GQA with ALiBi, and a long one.
        DecodeCase{"TreeGqaAlibiF32",
                   DType::kFloat32,
                   {MakeShape(1, 8, 2, 7, 300, 64, 64)},
                   true,
                   true,
                   false,
                   {-1, 0, 0, 1, 1, 2, -1}},
        DecodeCase{"LongTreeBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 2, 1, 70, 400, 32, 32)},
                   true,
                   false,
                   false,
                   LongTree()},
        // DeepSeek-V3's MLA decode: 128 query heads over one latent kv head, head_dim 576 (the
        // wide instance: 8-row blocks, 16-key tiles), values the first 512 columns of each key.
        DecodeCase{"MlaLatent128HeadsBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 128, 1, 1, 77, 576, 512)},
                   false,
                   false,
                   false,
                   {},
                   true},
        DecodeCase{"MlaLatent128HeadsTwoRowsCausalBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 128, 1, 2, 300, 576, 512)},
                   true,
                   false,
                   false,
                   {},
                   true},
        // fp32, held to 1e-5: a batch of the MLA shape (fewer heads) and a short cache, with sinks.
        DecodeCase{"MlaLatentBatchSinksF32",
                   DType::kFloat32,
                   {MakeShape(1, 16, 1, 2, 131, 576, 512), MakeShape(1, 16, 1, 1, 5, 576, 512)},
                   true,
                   false,
                   true,
                   {},
                   true},
        // A draft tree at width 576 runs in the decode kernel (Tiled would refuse it).
        DecodeCase{"MlaLatentTreeAlibiF16",
                   DType::kFloat16,
                   {MakeShape(1, 16, 1, 5, 90, 576, 512)},
                   true,
                   true,
                   false,
                   {-1, 0, 0, 1, -1},
                   true},
        // Not latent, odd widths padded to 576: GQA, causal, two rows.
        DecodeCase{
            "Wide320x300GqaBf16", DType::kBFloat16, {MakeShape(1, 12, 2, 2, 131, 320, 300)}, true},
        DecodeCase{"Wide257x576F32", DType::kFloat32, {MakeShape(1, 3, 1, 1, 47, 257, 576)}},
        // Rows of 16-bit elements that are not whole 4-byte words (an odd key or value width)
        // load element by element (decode.cu, LoadTileElements); the cases above load as words.
        DecodeCase{
            "OddWidthsCausalBf16", DType::kBFloat16, {MakeShape(1, 6, 2, 3, 141, 33, 19)}, true},
        DecodeCase{"OddValueWidthF16", DType::kFloat16, {MakeShape(1, 4, 2, 1, 260, 64, 21)}},
        // A latent bf16 cache with an odd value_dim: its value rows (the key rows, 64 wide) load
        // as words, the last one running into the key's further columns, which are dropped.
        DecodeCase{"LatentOddValueWidthBf16",
                   DType::kBFloat16,
                   {MakeShape(1, 8, 1, 1, 90, 64, 33)},
                   false,
                   false,
                   false,
                   {},
                   true},
        // fp8 caches: GQA at d 128; odd widths (rows padded to 4 bytes) with ALiBi and sinks over
        // several causal rows; a batch of lengths; the MLA shape (a latent value's scale is its
        // key row's) at the wide instance.
        DecodeCase{"Fp8Gqa32Over8",
                   DType::kFloat32,
                   {MakeShape(1, 32, 8, 1, 517, 128, 128)},
                   false,
                   false,
                   false,
                   {},
                   false,
                   true},
        DecodeCase{"Fp8OddWidthsCausalAlibiSinks",
                   DType::kFloat32,
                   {MakeShape(1, 6, 3, 3, 131, 17, 13)},
                   true,
                   true,
                   true,
                   {},
                   false,
                   true},
        DecodeCase{"Fp8BatchOfLengths",
                   DType::kFloat32,
                   {MakeShape(1, 8, 2, 1, 1, 64, 64), MakeShape(1, 8, 2, 1, 200, 64, 64),
                    MakeShape(1, 8, 2, 1, 700, 64, 40)},
                   false,
                   false,
                   false,
                   {},
                   false,
                   true},
        DecodeCase{"Fp8MlaLatentSinks",
                   DType::kFloat32,
                   {MakeShape(1, 16, 1, 2, 131, 576, 512)},
                   true,
                   false,
                   true,
                   {},
                   true,
                   true}),
    [](const ::testing::TestParamInfo<DecodeCase>& info) { return info.param.name; });

// Forks of one prompt (KvStore::Fork, as ForkCache makes them) in one Decode batch, beside a
// cache of their own, a fork at a shorter length and forks the cascade may not take (a token
// tree; a window whose rows do not all see key 0): the kernel runs the chunks of the pages they
// share in cascade units, the rows of every fork in the same blocks (GQA groups of 3 rows, so row
// groups of 16 straddle forks; steps of 1 and 2 causal rows; ALiBi, softcap and another scale
// through each row's own item), and each fork answers bit for bit as when decoded alone (the
// same 64-key chunks), and as the float64 reference says. The host sees the shared pages through
// the stores' host tables.
TEST_F(CudaKvTest, ForksOfOnePromptReadTheirSharedChunksTogetherAndAnswerAsEachAlone) {
  const DType dtype = DType::kBFloat16;
  const int64_t prompt = 300;  // 42 whole pages of 7 (294 tokens): 4 chunks of 64 shared.
  const std::vector<int64_t> own = {7, 100, 41, 0, 150, 9, 20};
  const HostProblem source_host =
      RandomProblem(MakeShape(1, 6, 2, 1, prompt, 40, 24), dtype, true, 16, 950);
  absl::StatusOr<std::unique_ptr<KvStore>> source = odd().CreateKvStore(LayoutOf(source_host));
  ASSERT_TRUE(source.ok()) << source.status();
  AppendAll(**source, source_host, {100});
  std::vector<HostProblem> hosts;
  std::vector<std::unique_ptr<KvStore>> stores;
  for (size_t i = 0; i <= own.size(); ++i) {
    // The last one forks the prompt's first 150 tokens only, then adds 50 of its own.
    const int64_t kept = i < own.size() ? prompt : 150;
    const int64_t length = kept + (i < own.size() ? own[i] : 50);
    const int64_t nq = 1 + i % 2;
    HostProblem host =
        RandomProblem(MakeShape(1, 6, 2, nq, length, 40, 24), dtype, true, 16, 960 + i);
    if (i == 2) host.alibi_slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f};
    if (i == 3) host.softcap = 20.f;
    if (i == 4) host.scale = 0.3f;
    if (i == 5) host.SetTree({-1, 0});   // Not in the cascade: a tree.
    if (i == 6) host.window_left = 200;  // Not in the cascade: its row does not see key 0.
    for (bool keys : {true, false}) {    // Its first `kept` tokens are the prompt's.
      const int64_t width = keys ? 40 : 24;
      std::vector<float>& to = keys ? host.key : host.value;
      const std::vector<float>& from = keys ? source_host.key : source_host.value;
      for (int64_t h = 0; h < 2; ++h) {
        std::copy(from.begin() + h * prompt * width, from.begin() + (h * prompt + kept) * width,
                  to.begin() + h * length * width);
      }
      std::vector<uint8_t>& bytes = keys ? host.key_bytes : host.value_bytes;
      for (size_t e = 0; e < to.size(); ++e) StoreElement(bytes.data(), dtype, e, to[e]);
    }
    absl::StatusOr<std::unique_ptr<KvStore>> fork = (*source)->Fork(kept);
    ASSERT_TRUE(fork.ok()) << fork.status();
    if (length > kept) {
      const std::vector<uint8_t> key = Slice(host.key, 2, length, 40, kept, length - kept, dtype);
      const std::vector<uint8_t> value =
          Slice(host.value, 2, length, 24, kept, length - kept, dtype);
      ASSERT_TRUE((*fork)->Append({key.data(), dtype}, {value.data(), dtype}, length - kept).ok());
    }
    hosts.push_back(std::move(host));
    stores.push_back(*std::move(fork));
  }
  hosts.push_back(RandomProblem(MakeShape(1, 6, 2, 1, 400, 40, 24), dtype, true, 16, 990));
  absl::StatusOr<std::unique_ptr<KvStore>> unrelated = odd().CreateKvStore(LayoutOf(hosts.back()));
  ASSERT_TRUE(unrelated.ok()) << unrelated.status();
  AppendAll(**unrelated, hosts.back(), {});
  stores.push_back(*std::move(unrelated));

  std::vector<Problem> problems;
  for (size_t i = 0; i < hosts.size(); ++i) {
    Problem problem = hosts[i].View();
    problem.key = problem.value = TensorView{};
    problem.pages = &stores[i]->pages();
    problems.push_back(problem);
  }
  // What the planner sees (kernels/cascade.h): the forks' whole shared pages, through the host
  // copies of the device tables; which rows see the shared keys.
  EXPECT_EQ(SharedTokens(problems[0], problems[1]), 294);
  EXPECT_EQ(SharedTokens(problems[0], problems[own.size()]), 147);
  EXPECT_EQ(SharedTokens(problems[0], problems.back()), 0);
  EXPECT_GE(KeysEveryRowSees(problems[1]), prompt);
  EXPECT_EQ(KeysEveryRowSees(problems[5]), 0);
  EXPECT_EQ(KeysEveryRowSees(problems[6]), 0);

  auto decode = [](const std::vector<Problem>& batch, const std::vector<HostProblem*>& of) {
    std::vector<std::unique_ptr<PoisonedOutputs>> poisoned;
    std::vector<Outputs> outputs;
    for (HostProblem* host : of) {
      poisoned.push_back(std::make_unique<PoisonedOutputs>(*host));
      outputs.push_back(poisoned.back()->outputs());
    }
    const absl::StatusOr<Stats> stats = odd().Decode(batch, outputs);
    EXPECT_TRUE(stats.ok()) << stats.status();
    std::vector<KernelRun> runs;
    for (const auto& p : poisoned) {
      KernelRun run;
      run.output_bytes = p->output_bytes;
      run.output = p->Output();
      run.lse = p->lse;
      runs.push_back(std::move(run));
    }
    return runs;
  };
  std::vector<HostProblem*> all;
  for (HostProblem& host : hosts) all.push_back(&host);
  const std::vector<KernelRun> together = decode(problems, all);
  for (size_t i = 0; i < hosts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    const std::vector<KernelRun> alone = decode({problems[i]}, {&hosts[i]});
    EXPECT_EQ(together[i].output_bytes, alone[0].output_bytes);
    EXPECT_EQ(0, std::memcmp(together[i].lse.data(), alone[0].lse.data(),
                             together[i].lse.size() * sizeof(float)));
    const Reference ref = ReferenceAttention(hosts[i]);
    EXPECT_LE(MaxAbsError(together[i].output, ref.output),
              2 * MaxAbsError(LowPrecisionBaseline(hosts[i], dtype), ref.output) +
                  LowPrecisionAtol(hosts[i], ref));
    ExpectLseMatches(together[i], ref, 1e-5);
  }
}

// Which widths Decode takes: every head_dim and value_dim up to 576 in the decode kernel (a
// token tree too: Tiled, which stops at 256, would refuse it), one tile size per instance; past
// 576, a tree is refused (UNIMPLEMENTED, naming the limit) and an item without one goes to
// Tiled, which refuses it (INVALID_ARGUMENT).
TEST_F(CudaKvTest, DecodeTakesEveryWidthUpTo576AndRefusesTreesOnlyPastIt) {
  struct Case {
    int64_t head_dim, value_dim;
    bool latent;
  };
  for (const Case& c :
       {Case{256, 256, false}, Case{257, 64, false}, Case{64, 257, false}, Case{576, 576, true},
        Case{576, 512, true}, Case{575, 1, true}, Case{100, 576, false}, Case{577, 64, false},
        Case{64, 600, false}, Case{640, 512, true}}) {
    for (bool tree : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.head_dim << " / " << c.value_dim
                                        << (c.latent ? " latent" : "") << (tree ? " tree" : ""));
      HostProblem host = RandomProblem(MakeShape(1, 4, 2, 2, 19, c.head_dim, c.value_dim),
                                       DType::kBFloat16, true, 8, 31 + c.head_dim + c.value_dim);
      if (tree) host.SetTree({-1, -1});
      if (c.latent) host.SetValuesFromKeys();
      absl::StatusOr<std::unique_ptr<KvStore>> store = odd().CreateKvStore(LayoutOf(host));
      ASSERT_TRUE(store.ok()) << store.status();
      AppendAll(**store, host, {5});
      Problem problem = host.View();
      problem.key = {};
      problem.value = {};
      problem.pages = &(*store)->pages();
      PoisonedOutputs poisoned(host);
      const absl::StatusOr<Stats> stats = odd().Decode({problem}, {poisoned.outputs()});
      const int pitch = cuda::PaddedDecodeDim(host.shape);
      if (std::max(c.head_dim, c.value_dim) <= cuda::kMaxDecodeDim) {
        ASSERT_TRUE(stats.ok()) << stats.status();
        EXPECT_EQ(stats->block_k, pitch <= cuda::kMaxHeadDim ? 32 : 16);
        KernelRun run;
        run.output_bytes = poisoned.output_bytes;
        run.output = poisoned.Output();
        run.lse = poisoned.lse;
        const Reference ref = ReferenceAttention(host);
        EXPECT_LE(MaxAbsError(run.output, ref.output),
                  2 * MaxAbsError(LowPrecisionBaseline(host, host.dtype), ref.output) +
                      LowPrecisionAtol(host, ref));
        ExpectLseMatches(run, ref, 1e-5);
      } else if (tree) {
        EXPECT_EQ(pitch, 0);
        EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnimplemented) << stats.status();
        EXPECT_NE(stats.status().message().find("value_dim ≤ 576"), std::string::npos)
            << stats.status();
      } else {
        EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument) << stats.status();
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Naive, Tiled and Trace over a cache (a latent one too): the same results as over the contiguous
// keys.

TEST_F(CudaKvTest, NaiveTiledAndTraceOverPagesEqualContiguous) {
  struct Case {
    DType dtype;
    Shape shape;
    bool causal;
    int block_k;
    bool latent = false;  // A latent cache: values read from the keys' rows.
    bool fp8 = false;     // An fp8 cache: the contiguous problem holds its dequantized rows.
  };
  for (const Case& c :
       {Case{DType::kFloat32, MakeShape(1, 4, 2, 5, 61, 17, 13), true, 7},
        Case{DType::kBFloat16, MakeShape(1, 6, 3, 33, 100, 64, 64), false, 32},
        Case{DType::kFloat16, MakeShape(1, 2, 1, 3, 45, 100, 72), true, 32},
        Case{DType::kBFloat16, MakeShape(1, 8, 2, 4, 70, 48, 30), true, 32, true},
        Case{DType::kFloat32, MakeShape(1, 4, 2, 5, 61, 17, 13), true, 7, false, true},
        Case{DType::kFloat32, MakeShape(1, 8, 2, 4, 70, 48, 30), true, 32, true, true}}) {
    SCOPED_TRACE(::testing::Message() << DTypeName(c.dtype) << (c.latent ? " latent" : "")
                                      << (c.fp8 ? " fp8 cache" : ""));
    HostProblem host = RandomProblem(c.shape, c.dtype, c.causal, c.block_k, 77);
    if (c.latent) host.SetValuesFromKeys();
    absl::StatusOr<std::unique_ptr<KvStore>> store = odd().CreateKvStore(
        LayoutOf(host, c.fp8 ? std::optional(DType::kFloat8E4M3) : std::nullopt));
    ASSERT_TRUE(store.ok()) << store.status();
    AppendAll(**store, host, {10, 3});
    if (c.fp8) host = DequantizedFrom(**store, host);
    Problem contiguous = host.View();
    Problem paged = contiguous;
    paged.key = {};
    paged.value = {};
    paged.pages = &(*store)->pages();
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(KernelName(kernel));
      const KernelRun expected = RunKernel(odd(), kernel, host, contiguous);
      const KernelRun actual = RunKernel(odd(), kernel, host, paged);
      EXPECT_EQ(actual.output_bytes, expected.output_bytes);
      EXPECT_EQ(std::memcmp(actual.lse.data(), expected.lse.data(), 4 * actual.lse.size()), 0);
      ExpectLseMatches(actual, ReferenceAttention(host), 1e-5);
    }
    const std::vector<RowRef> rows = {{0, 0, 0}, {0, c.shape.heads - 1, c.shape.query_len - 1}};
    absl::StatusOr<std::unique_ptr<TraceCursor>> a = odd().Trace(contiguous, rows);
    absl::StatusOr<std::unique_ptr<TraceCursor>> b = odd().Trace(paged, rows);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    TraceItem x, y;
    int events = 0;
    while ((*a)->Next(&x)) {
      ASSERT_TRUE((*b)->Next(&y)) << "paged trace ends early";
      ++events;
      ASSERT_EQ(x.index(), y.index());
      if (const auto* step = std::get_if<TraceStep>(&x)) {
        const TraceStep& other = std::get<TraceStep>(y);
        EXPECT_EQ(step->scores, other.scores);
        EXPECT_EQ(step->weights, other.weights);
        EXPECT_EQ(step->accumulator, other.accumulator);
        EXPECT_EQ(step->denominator, other.denominator);
      } else {
        EXPECT_EQ(std::get<TraceRowDone>(x).output, std::get<TraceRowDone>(y).output);
        EXPECT_EQ(std::get<TraceRowDone>(x).reference, std::get<TraceRowDone>(y).reference);
      }
    }
    EXPECT_FALSE((*b)->Next(&y)) << "paged trace runs longer";
    EXPECT_GT(events, 2);
  }
}

}  // namespace
