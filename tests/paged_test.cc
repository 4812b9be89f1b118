// Naive and Tiled over a KV store's pages (Problem::pages) on the CPU backend: the same bits as
// the same problem with contiguous keys and values (every kernel reads both layouts through
// Fp32Rows::LoadKeys/LoadValues), and the float64 reference. Odd page sizes, block_k not a
// multiple of the page, GQA, causal with several query rows, every dtype.
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/checks.h"
#include "tests/reference.h"

namespace {

using namespace attn;
using namespace attn::testing;

struct PagedCase {
  std::string name;
  Shape shape;
  DType dtype;
  bool causal;
  int block_k;
  int64_t page_tokens;
  std::vector<int64_t> appends;  // Token counts of the appends that fill the store.
};

void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.name; }

class PagedTest : public ::testing::TestWithParam<PagedCase> {};

void ExpectSameBits(const KernelRun& paged, const KernelRun& contiguous) {
  EXPECT_EQ(paged.output_bytes, contiguous.output_bytes);
  ASSERT_EQ(paged.lse.size(), contiguous.lse.size());
  EXPECT_EQ(std::memcmp(paged.lse.data(), contiguous.lse.data(), paged.lse.size() * sizeof(float)),
            0);
}

TEST_P(PagedTest, NaiveAndTiledEqualContiguousBitForBitAndMatchTheReference) {
  const PagedCase& c = GetParam();
  const HostProblem host =
      RandomProblem(c.shape, c.dtype, c.causal, c.block_k, std::hash<std::string>{}(c.name));
  const Reference ref = ReferenceAttention(host);
  // The second backend packs every tile again for every row block (Tiled's other path).
  for (int64_t max_packed : {CpuBackend::kDefaultMaxPackedHeadBytes, int64_t{0}}) {
    CpuBackend backend(2, 0, max_packed, c.page_tokens);
    absl::StatusOr<PagedCopy> paged = MakePaged(backend, host, c.appends);
    ASSERT_TRUE(paged.ok()) << paged.status();
    ASSERT_EQ(paged->store->length(), c.shape.key_len);
    for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
      SCOPED_TRACE(::testing::Message() << KernelName(kernel) << " max_packed=" << max_packed);
      const KernelRun contiguous = RunKernel(backend, kernel, host);
      const KernelRun run = RunKernel(backend, kernel, host, paged->problem);
      ExpectSameBits(run, contiguous);
      if (c.dtype == DType::kFloat32) {
        ExpectMatchesReference(run, ref, 1e-5);
      } else {
        ExpectLowPrecisionMatches(run, host, ref);
      }
      if (c.causal && c.shape.query_len > c.shape.key_len) ExpectUnseeingRowsZero(run, host);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PagedTest,
    ::testing::Values(
        PagedCase{"Fp32Page5",
                  MakeShape(1, 2, 2, 13, 41, 9, 11),
                  DType::kFloat32,
                  false,
                  7,
                  5,
                  {3, 10, 1}},
        PagedCase{"Fp32Page1", MakeShape(1, 1, 1, 5, 17, 6, 4), DType::kFloat32, false, 4, 1, {}},
        PagedCase{"Fp32PageLargerThanKeys",
                  MakeShape(1, 2, 1, 7, 19, 5, 5),
                  DType::kFloat32,
                  true,
                  16,
                  64,
                  {}},
        PagedCase{"Fp32GqaCausal",
                  MakeShape(1, 6, 2, 23, 57, 17, 13),
                  DType::kFloat32,
                  true,
                  16,
                  7,
                  {7, 8, 20}},
        PagedCase{"Fp32CausalMoreQueries",
                  MakeShape(1, 4, 2, 31, 19, 8, 9),
                  DType::kFloat32,
                  true,
                  6,
                  5,
                  {2, 2}},
        PagedCase{
            "Fp32BlockKOne", MakeShape(1, 2, 2, 3, 23, 12, 7), DType::kFloat32, true, 1, 3, {}},
        PagedCase{"Fp32ManyRowBlocks",
                  MakeShape(1, 2, 1, 150, 101, 10, 6),
                  DType::kFloat32,
                  true,
                  9,
                  7,
                  {50}},
        PagedCase{"F16Gqa", MakeShape(1, 4, 2, 11, 47, 33, 20), DType::kFloat16, true, 9, 5, {4}},
        PagedCase{
            "F16Decode", MakeShape(1, 8, 2, 1, 300, 32, 32), DType::kFloat16, false, 64, 7, {}},
        PagedCase{"Bf16Gqa",
                  MakeShape(1, 6, 3, 9, 61, 16, 17),
                  DType::kBFloat16,
                  true,
                  10,
                  7,
                  {1, 1, 30}},
        PagedCase{"Bf16CausalMoreQueries",
                  MakeShape(1, 2, 2, 29, 13, 7, 7),
                  DType::kBFloat16,
                  true,
                  4,
                  3,
                  {}}),
    [](const ::testing::TestParamInfo<PagedCase>& info) { return info.param.name; });

// Keys appended in another dtype are stored in the cache's: the paged problem then equals the
// contiguous one over the rounded values.
TEST(PagedTest, AppendsInAnotherDtypeAreStoredInTheCachesDtype) {
  const HostProblem host =
      RandomProblem(MakeShape(1, 4, 2, 5, 29, 11, 9), DType::kBFloat16, true, 8, 99);
  CpuBackend backend(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 5);
  const DType fp32 = DType::kFloat32;  // bf16 values, exact in fp32.
  absl::StatusOr<PagedCopy> paged = MakePaged(backend, host, {6, 6}, &fp32);
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ(paged->store->pages().dtype, DType::kBFloat16);
  const KernelRun contiguous = RunKernel(backend, Kernel::kTiled, host);
  const KernelRun run = RunKernel(backend, Kernel::kTiled, host, paged->problem);
  ExpectSameBits(run, contiguous);
}

}  // namespace
