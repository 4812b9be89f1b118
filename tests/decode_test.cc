// CpuBackend::Decode (kernels/cpu/decode.h): a batch of problems of different lengths — over a
// KV store's pages and over contiguous tensors — against the float64 reference, with outputs
// poisoned first. Cases: a cache of one token, caches that split into several chunks (and end
// on and just past a chunk's edge), causal rows that see nothing, GQA groups larger than a row
// group, head widths with vector tails, thread counts, interrupts, and groups run on GEMM kernels,
// latent caches, and problems too tall for the decode kernel (given to Tiled).
#include "kernels/cpu/decode.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

struct Item {
  HostProblem host;
  std::unique_ptr<PagedCopy> paged;  // Null: contiguous.
  Problem problem;
};

Item MakeItem(Backend& backend, const Shape& shape, DType dtype, bool causal, bool paged,
              uint64_t seed) {
  Item item;
  item.host = RandomProblem(shape, dtype, causal, 16, seed);
  item.problem = item.host.View();
  if (paged) {
    absl::StatusOr<PagedCopy> copy = MakePaged(backend, item.host, {shape.key_len / 3, 1});
    EXPECT_TRUE(copy.ok()) << copy.status();
    if (copy.ok()) {
      item.paged = std::make_unique<PagedCopy>(*std::move(copy));
      item.problem = item.paged->problem;
    }
  }
  return item;
}

// Decode over every item into poisoned outputs.
std::vector<KernelRun> RunDecode(Backend& backend, const std::vector<Item>& items,
                                 Stats* stats = nullptr) {
  std::vector<PoisonedOutputs> poisoned;
  std::vector<Problem> problems;
  for (const Item& item : items) {
    poisoned.emplace_back(item.host);
    problems.push_back(item.problem);
  }
  std::vector<Outputs> outputs;
  for (PoisonedOutputs& p : poisoned) outputs.push_back(p.outputs());
  const absl::StatusOr<Stats> result = backend.Decode(problems, outputs);
  EXPECT_TRUE(result.ok()) << result.status();
  if (result.ok() && stats != nullptr) *stats = *result;
  std::vector<KernelRun> runs;
  for (PoisonedOutputs& p : poisoned) {
    KernelRun run;
    run.output = p.Output();
    run.output_bytes = p.output_bytes;
    run.lse = p.lse;
    runs.push_back(std::move(run));
  }
  return runs;
}

void ExpectMatches(const KernelRun& run, const Item& item) {
  const Reference ref = ReferenceAttention(item.host);
  if (item.host.output_dtype == DType::kFloat32) {
    ExpectMatchesReference(run, ref, 1e-5);
  } else {
    ExpectLowPrecisionMatches(run, item.host, ref);
  }
  const Shape& s = item.host.shape;
  if (item.host.causal && s.query_len > s.key_len) ExpectUnseeingRowsZero(run, item.host);
}

class DecodeTest : public ::testing::TestWithParam<DType> {};

TEST_P(DecodeTest, ABatchOfCachesOfDifferentLengthsMatchesTheReference) {
  const DType dtype = GetParam();
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  std::vector<Item> items;
  uint64_t seed = 700 + static_cast<int>(dtype) * 100;
  // (heads, kv_heads, query_len, key_len, head_dim, value_dim, causal, paged)
  struct Spec {
    int64_t heads, kv_heads, nq, nk, d, dv;
    bool causal, paged;
  };
  const std::vector<Spec> specs = {
      {8, 2, 1, 1, 32, 32, false, true},                      // A cache of one token.
      {8, 2, 1, 37, 17, 13, true, true},                      // Vector tails in d and dv.
      {6, 3, 1, 600, 24, 24, false, true},                    // Two chunks.
      {4, 1, 1, kDecodeChunkTokens, 16, 8, true, true},       // Exactly one chunk.
      {4, 2, 1, kDecodeChunkTokens + 1, 9, 40, false, true},  // One token into a second.
      {12, 2, 2, 1100, 33, 20, true, true},  // GQA 6 × 2 rows = 12 rows: row groups of 4.
      {4, 2, 3, 2, 8, 8, true, true},        // Causal: row 0 sees no key.
      {2, 1, 5, 3, 5, 7, true, false},       // Contiguous, rows 0 and 1 see nothing.
      {8, 8, 1, 257, 64, 64, false, false},  // Contiguous, no GQA.
      // The vector paths' whole pairs (2 · lanes elements) and their rests: d 128 is whole pairs
      // in 8 and 16 lanes, dv 96 two pairs of 16 lanes and one, d 80 two pairs and a rest of 16.
      {12, 4, 1, 700, 128, 96, true, true},   // GQA 3: a row group of three.
      {14, 2, 1, 530, 80, 112, false, true},  // GQA 7: row groups of four and three.
  };
  for (const Spec& spec : specs) {
    items.push_back(MakeItem(
        backend, MakeShape(1, spec.heads, spec.kv_heads, spec.nq, spec.nk, spec.d, spec.dv), dtype,
        spec.causal, spec.paged, seed++));
  }
  Stats stats;
  const std::vector<KernelRun> runs = RunDecode(backend, items, &stats);
  double flops = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    ExpectMatches(runs[i], items[i]);
    flops += items[i].problem.Flops();
  }
  EXPECT_EQ(stats.flops, flops);
  EXPECT_GT(stats.scratch_bytes, 0);
  EXPECT_GE(stats.peak_memory_bytes, stats.scratch_bytes);
}

// A token tree (DecodeItem.tree_parents): each row sees the keys before the new tokens, its
// ancestors and itself, against the reference's own walk up each chain — in the decode kernel's
// vector path, its GEMM path (groups taller than kDecodeMaxRows) and, past kDecodeGemmMaxRows,
// in Tiled; masks of more than one 64-bit word;
// causal or not (the tree alone hides the later tokens).
TEST_P(DecodeTest, ATokenTreeSeesOnlyEachRowsBranch) {
  const DType dtype = GetParam();
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  struct Spec {
    int64_t heads, kv_heads, nk, d, dv;
    bool causal;
    std::vector<int32_t> parents;
  };
  std::vector<int32_t> long_tree;  // 70 tokens: chains of 5 off the prefix, one branch deep.
  for (int32_t i = 0; i < 70; ++i) long_tree.push_back(i % 5 == 0 ? (i >= 10 ? 3 : -1) : i - 1);
  const std::vector<Spec> specs = {
      {8, 2, 300, 33, 20, true, {-1, 0, 0, 1, 1, 2, -1}},         // EAGLE-like, decode kernel.
      {12, 2, 150, 24, 24, true, {-1, 0, 1, 2, 0, 4, -1, 6, 6}},  // 54 rows: decode kernel.
      {16, 2, 200, 16, 16, true, {-1, 0, 1, 2, 0, 4, -1, 6, 6}},  // 72 rows: GEMM path.
      {60, 2, 90, 16, 16, true, {-1, 0, 1, 2, 0, 4, -1, 6, 6}},   // 270 rows: Tiled.
      {4, 1, 40, 8, 8, false, {-1, -1, 1, 2, 0}},                 // Not causal.
      {2, 1, 400, 8, 8, true, long_tree},                         // Two words a row: GEMM.
  };
  std::vector<Item> items;
  uint64_t seed = 900 + static_cast<int>(dtype) * 10;
  for (const Spec& spec : specs) {
    const int64_t nq = static_cast<int64_t>(spec.parents.size());
    Item item;
    item.host = RandomProblem(MakeShape(1, spec.heads, spec.kv_heads, nq, spec.nk, spec.d, spec.dv),
                              dtype, spec.causal, 16, seed++);
    item.host.SetTree(spec.parents);
    absl::StatusOr<PagedCopy> copy = MakePaged(backend, item.host, {spec.nk / 3, 1});
    ASSERT_TRUE(copy.ok()) << copy.status();
    item.paged = std::make_unique<PagedCopy>(*std::move(copy));
    item.problem = item.paged->problem;
    items.push_back(std::move(item));
  }
  Stats stats;
  const std::vector<KernelRun> runs = RunDecode(backend, items, &stats);
  double flops = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    ExpectMatches(runs[i], items[i]);
    flops += items[i].problem.Flops();
    // The tree hides pairs: fewer FLOPs than the same problem without it.
    Problem untreed = items[i].problem;
    untreed.tree_count = 0;
    EXPECT_LT(items[i].problem.Flops(), untreed.Flops());
  }
  EXPECT_EQ(stats.flops, flops);
}

// Groups of more than kDecodeMaxRows rows run on the GEMM kernels (decode.h), up to
// kDecodeGemmMaxRows, and latent caches (values_from_keys: a value is its key's first value_dim
// columns) on both paths: MLA-shaped (many query heads over one latent head), just past the
// vector path's limit, several query rows, sinks and ALiBi, dense keys, a cache long enough for
// the GEMM path's longer chunks; the reference reads each latent value from its key itself.
TEST_P(DecodeTest, GemmGroupsAndLatentCachesMatchTheReference) {
  const DType dtype = GetParam();
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  struct Spec {
    int64_t heads, kv_heads, nq, nk, d, dv;
    bool causal, paged, latent, transforms;
  };
  const std::vector<Spec> specs = {
      {128, 1, 1, 1300, 72, 40, false, true, true, false},  // MLA-like: 128 rows, GEMM.
      {96, 1, 2, 700, 33, 17, true, true, true, false},     // 192 rows, causal, GEMM.
      {130, 2, 1, 600, 24, 24, false, true, false, false},  // 65 rows: the first GEMM group.
      {64, 1, 1, 300, 40, 24, true, true, true, false},     // 64 rows: vector path, latent.
      {8, 2, 1, 200, 16, 16, false, true, true, true},      // Latent with sinks and ALiBi.
      {100, 1, 1, 500, 20, 20, false, false, false, true},  // Dense keys, GEMM, transforms.
      {65, 1, 1, 40000, 8, 8, false, true, true, false},    // Chunks of 1024 keys.
  };
  std::vector<Item> items;
  uint64_t seed = 1100 + static_cast<int>(dtype) * 10;
  for (const Spec& spec : specs) {
    Item item;
    item.host =
        RandomProblem(MakeShape(1, spec.heads, spec.kv_heads, spec.nq, spec.nk, spec.d, spec.dv),
                      dtype, spec.causal, 16, seed++);
    if (spec.latent) item.host.SetValuesFromKeys();
    if (spec.transforms) {
      for (int64_t h = 0; h < spec.heads; ++h) {
        item.host.sinks.push_back(0.5f - 0.1f * static_cast<float>(h % 7));
        item.host.alibi_slopes.push_back(0.01f * static_cast<float>(h % 5 + 1));
      }
    }
    item.problem = item.host.View();
    if (spec.paged) {
      absl::StatusOr<PagedCopy> copy = MakePaged(backend, item.host, {spec.nk / 3, 1});
      ASSERT_TRUE(copy.ok()) << copy.status();
      item.paged = std::make_unique<PagedCopy>(*std::move(copy));
      item.problem = item.paged->problem;
    }
    items.push_back(std::move(item));
  }
  EXPECT_EQ(DecodeChunkTokensOf(65, 40000), 2 * kDecodeChunkTokens);
  EXPECT_EQ(DecodeChunkTokensOf(64, 40000), kDecodeChunkTokens);
  const std::vector<KernelRun> runs = RunDecode(backend, items);
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    ExpectMatches(runs[i], items[i]);
  }
}

// A latent store holds keys only: half the bytes of one that stores values as wide, and its
// values are views of its keys' rows.
TEST(DecodeTest, ALatentStoreTakesTheKeysMemoryOnly) {
  CpuBackend backend(1, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 16);
  HostProblem host =
      RandomProblem(MakeShape(1, 4, 1, 1, 50, 64, 64), DType::kBFloat16, false, 16, 3);
  host.SetValuesFromKeys();
  absl::StatusOr<PagedCopy> latent = MakePaged(backend, host);
  ASSERT_TRUE(latent.ok()) << latent.status();
  host.values_from_keys = false;
  absl::StatusOr<PagedCopy> full = MakePaged(backend, host);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(2 * latent->store->bytes(), full->store->bytes());
  const PagedKv& pages = latent->store->pages();
  EXPECT_EQ(pages.value_pages, pages.key_pages);
  EXPECT_EQ(pages.value_width, 64);
}

// fp8 caches (kernels/dtype.h): every CPU path reads a store's rows as code · scale — the decode
// kernel's vector loops (tails in d and dv, row groups of 1 to 4, chunks, causal rows), its GEMM
// groups, latent caches (a value's scale is its key row's), Tiled and Naive over the pages —
// within the fp32 bound of the float64 reference on the dequantized keys and values. Run on
// every CPU path by kernels_cpu_baseline and kernels_cpu_avx2.
TEST(DecodeFp8Test, EveryPathReadsTheStoredCodesTimesTheirScales) {
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  struct Spec {
    int64_t heads, kv_heads, nq, nk, d, dv;
    bool causal, latent;
  };
  const std::vector<Spec> specs = {
      {8, 2, 1, 37, 17, 13, true, false},      // Vector tails in d and dv.
      {6, 3, 1, 600, 24, 24, false, false},    // Two chunks.
      {12, 4, 1, 700, 128, 96, true, false},   // Whole pairs; a row group of three.
      {14, 2, 1, 530, 80, 112, false, false},  // Row groups of four and three.
      {12, 2, 2, 1100, 33, 20, true, false},   // Two query rows, causal.
      {130, 2, 1, 600, 24, 24, false, false},  // 65 rows: GEMM.
      {128, 1, 1, 1300, 72, 40, false, true},  // MLA-like: latent, GEMM.
      {64, 1, 1, 300, 40, 24, true, true},     // Latent, vector path.
  };
  const DType fp8 = DType::kFloat8E4M3;
  std::vector<Item> items;
  std::vector<HostProblem> originals;
  uint64_t seed = 4100;
  for (const Spec& spec : specs) {
    HostProblem original =
        RandomProblem(MakeShape(1, spec.heads, spec.kv_heads, spec.nq, spec.nk, spec.d, spec.dv),
                      DType::kFloat32, spec.causal, 16, seed++);
    if (spec.latent) original.SetValuesFromKeys();
    absl::StatusOr<PagedCopy> copy = MakePaged(backend, original, {spec.nk / 3, 1}, nullptr, &fp8);
    ASSERT_TRUE(copy.ok()) << copy.status();
    Item item;
    item.paged = std::make_unique<PagedCopy>(*std::move(copy));
    item.host = DequantizedFrom(*item.paged->store, original);
    item.problem = item.host.View();
    item.problem.key = item.problem.value = TensorView{};
    item.problem.pages = &item.paged->store->pages();
    ASSERT_EQ(item.problem.key_dtype(), fp8);
    // Quantizing really changed the keys (else this would test nothing fp8 does).
    EXPECT_GT(MaxAbsError(item.host.key, original.key), 1e-3);
    items.push_back(std::move(item));
  }
  const std::vector<KernelRun> runs = RunDecode(backend, items);
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    const Reference ref = ReferenceAttention(items[i].host);
    ExpectMatchesReference(runs[i], ref, 1e-5);
    if (items[i].host.shape.heads > 16) continue;  // Tiled and Naive on the smaller ones.
    ExpectMatchesReference(RunKernel(backend, Kernel::kTiled, items[i].host, items[i].problem), ref,
                           1e-5);
    ExpectMatchesReference(RunKernel(backend, Kernel::kNaive, items[i].host, items[i].problem), ref,
                           1e-5);
  }
}

// The accuracy target: a cache of 4096 standard-normal tokens (8 kv heads, d 128) in fp8,
// decoded for 32 query heads, against the float64 reference on the unquantized tokens: max |out −
// ref| / max |ref| is 0.03–0.06 from draw to draw (E4M3's 3 mantissa bits: each stored element
// off by about 2.6% RMS, in keys and values alike; over 30 draws a mean of 0.040, σ 0.007). So
// over eight fresh draws (seeds printed) the mean is ≤ 0.05 (3.8 σ of the mean away) and each
// ≤ 0.08; a bf16 cache of the same tokens beside it for scale.
TEST(DecodeFp8Test, StandardNormalTokensStayWithinFivePercentOfTheUnquantizedReference) {
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 16);
  constexpr int kDraws = 8;
  double fp8_sum = 0;
  for (int draw = 0; draw < kDraws; ++draw) {
    const uint64_t seed = std::random_device{}();
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    HostProblem host =
        RandomProblem(MakeShape(1, 32, 8, 1, 4096, 128, 128), DType::kFloat32, false, 16, seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto [values, bytes] :
         {std::pair{&host.query, &host.query_bytes}, std::pair{&host.key, &host.key_bytes},
          std::pair{&host.value, &host.value_bytes}}) {
      for (float& x : *values) x = normal(rng);
      std::memcpy(bytes->data(), values->data(), values->size() * sizeof(float));
    }
    const Reference ref = ReferenceAttention(host);
    for (DType stored : {DType::kFloat8E4M3, DType::kBFloat16}) {
      if (stored == DType::kBFloat16 && draw > 0) continue;
      absl::StatusOr<PagedCopy> copy = MakePaged(backend, host, {}, nullptr, &stored);
      ASSERT_TRUE(copy.ok()) << copy.status();
      std::vector<Item> items(1);
      items[0].host = host;
      items[0].problem = copy->problem;
      const std::vector<KernelRun> runs = RunDecode(backend, items);
      const double error = MaxAbsError(runs[0].output, ref.output) / MaxAbs(ref.output);
      std::cout << "fp8 accuracy, seed " << seed << ": " << DTypeName(stored)
                << " cache, max |out - ref| / max |ref| = " << error << "\n";
      if (stored == DType::kBFloat16) continue;
      EXPECT_LE(error, 0.08);
      EXPECT_GT(error, 1e-4) << "nothing was quantized";
      fp8_sum += error;
    }
  }
  EXPECT_LE(fp8_sum / kDraws, 0.05);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DecodeTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// Decode equals Tiled on the same keys within the fp32 bound, contiguous (batch > 1) and paged.
TEST(DecodeTest, EqualsTiledOnTheSameKeys) {
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 5);
  std::vector<Item> items;
  items.push_back(
      MakeItem(backend, MakeShape(3, 8, 2, 1, 1500, 32, 16), DType::kFloat32, false, false, 1));
  items.push_back(
      MakeItem(backend, MakeShape(1, 8, 4, 3, 777, 20, 24), DType::kFloat32, true, true, 2));
  const std::vector<KernelRun> runs = RunDecode(backend, items);
  for (size_t i = 0; i < items.size(); ++i) {
    const KernelRun tiled = RunKernel(backend, Kernel::kTiled, items[i].host, items[i].problem);
    double error = 0, magnitude = 0;
    for (size_t e = 0; e < tiled.output.size(); ++e) {
      error = std::max<double>(error, std::abs(runs[i].output[e] - tiled.output[e]));
      magnitude = std::max<double>(magnitude, std::abs(tiled.output[e]));
    }
    EXPECT_LE(error, 1e-5 * magnitude) << "item " << i;
    for (size_t r = 0; r < tiled.lse.size(); ++r) {
      EXPECT_NEAR(runs[i].lse[r], tiled.lse[r], 1e-5 * std::max(1.f, std::abs(tiled.lse[r])));
    }
    ExpectMatches(runs[i], items[i]);
  }
}

// Chunks are fixed by the problem and merged in order, while the runs that group them into
// tasks follow the thread count (16 chunks here: runs of up to 4 on one thread, 2 on two, 1 on
// three): any thread count gives the same bits.
TEST(DecodeTest, OutputsAreBitIdenticalForAnyThreadCount) {
  CpuBackend one(1, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 11);
  std::vector<Item> items;
  items.push_back(
      MakeItem(one, MakeShape(1, 8, 2, 1, 2000, 40, 40), DType::kBFloat16, false, true, 5));
  items.push_back(
      MakeItem(one, MakeShape(1, 4, 4, 2, 901, 16, 16), DType::kFloat16, true, true, 6));
  const std::vector<KernelRun> baseline = RunDecode(one, items);
  for (int threads : {2, 3}) {
    CpuBackend backend(threads, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 11);
    const std::vector<KernelRun> runs = RunDecode(backend, items);
    for (size_t i = 0; i < items.size(); ++i) {
      EXPECT_EQ(runs[i].output_bytes, baseline[i].output_bytes) << "threads " << threads;
      EXPECT_EQ(std::memcmp(runs[i].lse.data(), baseline[i].lse.data(),
                            runs[i].lse.size() * sizeof(float)),
                0);
    }
  }
  for (size_t i = 0; i < items.size(); ++i) ExpectMatches(baseline[i], items[i]);
}

// Tokens [begin, end) of a host problem's keys or values (batch 1), dense [kv_heads, n, width]
// in its dtype, as an append sends them.
std::vector<uint8_t> TokenSlice(const HostProblem& host, bool keys, int64_t begin, int64_t end) {
  const Shape& s = host.shape;
  const int64_t width = keys ? s.head_dim : s.value_dim;
  const std::vector<float>& from = keys ? host.key : host.value;
  std::vector<uint8_t> bytes(s.kv_heads * (end - begin) * width * ElementSize(host.dtype));
  int64_t out = 0;
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    for (int64_t i = (h * s.key_len + begin) * width; i < (h * s.key_len + end) * width; ++i) {
      StoreElement(bytes.data(), host.dtype, out++, from[i]);
    }
  }
  return bytes;
}

// Forks of one prompt (KvStore::Fork, as ForkCache makes them) in one Decode batch, beside a
// cache of their own and a fork at a shorter length: the kernel runs the pages they share once
// for all their rows (cascade), and each answers bit for bit as when decoded alone, and as the
// float64 reference says. GQA groups of 3 rows (row groups straddling problems if stacked
// carelessly), causal steps of 1 and 2 rows, ALiBi and softcap through each row's transform.
TEST_P(DecodeTest, ForksOfOnePromptShareTheirPagesReadAndAnswerAsEachAlone) {
  const DType dtype = GetParam();
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 64);
  const int64_t prompt = 1300;  // 20 whole pages of 64: two chunks of 512 shared.
  const std::vector<int64_t> own = {7, 300, 41, 0, 650};
  const HostProblem source_host =
      RandomProblem(MakeShape(1, 6, 2, 1, prompt, 40, 24), dtype, true, 16, 900);
  absl::StatusOr<PagedCopy> source = MakePaged(backend, source_host, {500});
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<Item> items;
  std::vector<std::unique_ptr<KvStore>> forks;
  for (size_t i = 0; i < own.size() + 1; ++i) {
    // The last one forks the prompt's first 600 tokens only (one chunk), then adds 200.
    const int64_t kept = i < own.size() ? prompt : 600;
    const int64_t length = kept + (i < own.size() ? own[i] : 200);
    const int64_t nq = 1 + i % 2;
    Item item;
    item.host = RandomProblem(MakeShape(1, 6, 2, nq, length, 40, 24), dtype, true, 16, 910 + i);
    if (i == 2) item.host.alibi_slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f};
    if (i == 3) item.host.softcap = 20.f;
    // Its first `kept` tokens are the prompt's.
    for (bool keys : {true, false}) {
      const int64_t width = keys ? 40 : 24;
      std::vector<float>& to = keys ? item.host.key : item.host.value;
      const std::vector<float>& from = keys ? source_host.key : source_host.value;
      for (int64_t h = 0; h < 2; ++h) {
        std::copy(from.begin() + h * prompt * width, from.begin() + (h * prompt + kept) * width,
                  to.begin() + h * length * width);
      }
    }
    for (int64_t i = 0; i < static_cast<int64_t>(item.host.key.size()); ++i) {
      StoreElement(item.host.key_bytes.data(), dtype, i, item.host.key[i]);
    }
    for (int64_t i = 0; i < static_cast<int64_t>(item.host.value.size()); ++i) {
      StoreElement(item.host.value_bytes.data(), dtype, i, item.host.value[i]);
    }
    absl::StatusOr<std::unique_ptr<KvStore>> fork = source->store->Fork(kept);
    ASSERT_TRUE(fork.ok()) << fork.status();
    if (length > kept) {
      const std::vector<uint8_t> key = TokenSlice(item.host, true, kept, length);
      const std::vector<uint8_t> value = TokenSlice(item.host, false, kept, length);
      ASSERT_TRUE((*fork)
                      ->Append(TensorView{key.data(), dtype}, TensorView{value.data(), dtype},
                               length - kept)
                      .ok());
    }
    item.problem = item.host.View();
    item.problem.key = TensorView{};
    item.problem.value = TensorView{};
    item.problem.pages = &(*fork)->pages();
    forks.push_back(*std::move(fork));
    items.push_back(std::move(item));
  }
  items.push_back(MakeItem(backend, MakeShape(1, 6, 2, 1, 1500, 40, 24), dtype, true, true, 930));
  const std::vector<KernelRun> together = RunDecode(backend, items);
  ASSERT_EQ(together.size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "item " << i);
    ExpectMatches(together[i], items[i]);
    std::vector<Item> alone;
    alone.push_back(Item{items[i].host, nullptr, items[i].problem});
    const std::vector<KernelRun> by_itself = RunDecode(backend, alone);
    ASSERT_EQ(by_itself.size(), 1u);
    EXPECT_EQ(together[i].output_bytes, by_itself[0].output_bytes);
    EXPECT_EQ(std::memcmp(together[i].lse.data(), by_itself[0].lse.data(),
                          together[i].lse.size() * sizeof(float)),
              0);
  }
}

// Rows past kDecodeMaxRows go to Tiled in the same call; both kinds land in their outputs.
TEST(DecodeTest, TallProblemsGoToTiled) {
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 7);
  std::vector<Item> items;
  items.push_back(MakeItem(backend, MakeShape(1, 2, 1, kDecodeMaxRows, 90, 12, 12), DType::kFloat32,
                           true, true, 8));  // 128 rows a kv head.
  items.push_back(
      MakeItem(backend, MakeShape(1, 4, 2, 1, 90, 12, 12), DType::kFloat32, false, true, 9));
  ASSERT_GT(DecodeRowsOf(items[0].problem), kDecodeMaxRows);
  const std::vector<KernelRun> runs = RunDecode(backend, items);
  for (size_t i = 0; i < items.size(); ++i) ExpectMatches(runs[i], items[i]);
}

TEST(DecodeTest, AnInterruptAbandonsTheCall) {
  CpuBackend backend(2, 0);
  const HostProblem host =
      RandomProblem(MakeShape(1, 8, 2, 1, 3000, 32, 32), DType::kFloat32, false, 16, 10);
  PoisonedOutputs poisoned(host);
  Outputs outputs = poisoned.outputs();
  outputs.interrupt = [] { return absl::CancelledError("client went away"); };
  const absl::StatusOr<Stats> stats = backend.Decode({host.View()}, {outputs});
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kCancelled) << stats.status();
}

}  // namespace
