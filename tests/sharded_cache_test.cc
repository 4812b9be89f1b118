// A KV cache split over three attnd services (client/sharded_cache.h; issue 14): three
// in-process servers on loopback with the CPU backend, each holding a part. Every step's merged
// answer is checked against the same tokens in one unsharded cache (its Decode, fp32) and against
// the float64 reference; the placement (water-filling), the positions rule's refusals, and a
// server stopped or restarted mid-way (a clear error naming it, never a sum without its part).
// Also `attn decode --shard-keys` (client/cli/cache.h) over the three.
#include "client/sharded_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/cli/cache.h"
#include "client/client.h"
#include "client/multi_server_client.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "server/service.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using client::ShardedCache;
using testing::HostProblem;

constexpr int kServers = 3;

// Tokens [begin, end) of a [heads, len, width] tensor in `dtype`, as [heads, end − begin, width].
v1::Tensor Tokens(const std::vector<uint8_t>& bytes, DType dtype, int64_t heads, int64_t len,
                  int64_t width, int64_t begin, int64_t end) {
  const int64_t element = ElementSize(dtype);
  v1::Tensor tensor;
  for (const int64_t extent : {heads, end - begin, width}) tensor.add_shape(extent);
  tensor.set_dtype(ToProtoDType(dtype));
  for (int64_t h = 0; h < heads; ++h) {
    const uint8_t* first = bytes.data() + (h * len + begin) * width * element;
    tensor.mutable_data()->append(reinterpret_cast<const char*>(first),
                                  (end - begin) * width * element);
  }
  return tensor;
}

std::vector<float> Floats(const v1::Tensor& tensor) {
  absl::StatusOr<client::Array> array = client::FromTensor(tensor);
  EXPECT_TRUE(array.ok()) << array.status();
  return array.ok() ? array->values : std::vector<float>{};
}

// A sequence: `capacity` tokens of keys and values (a problem's, batch 1), handed out in order.
struct Sequence {
  HostProblem all;
  int64_t kv_heads() const { return all.shape.kv_heads; }
  v1::Tensor Keys(int64_t begin, int64_t end) const {
    return Tokens(all.key_bytes, all.dtype, kv_heads(), all.shape.key_len, all.shape.head_dim,
                  begin, end);
  }
  v1::Tensor Values(int64_t begin, int64_t end) const {
    return Tokens(all.value_bytes, all.dtype, kv_heads(), all.shape.key_len, all.shape.value_dim,
                  begin, end);
  }
  // The problem of query `q` (a problem with that query) over the first `length` tokens.
  HostProblem Over(const HostProblem& q, int64_t length, bool causal) const {
    HostProblem p = testing::KeyPrefix(all, length);
    p.shape.query_len = q.shape.query_len;
    p.shape.heads = q.shape.heads;
    p.query_bytes = q.query_bytes;
    p.query = q.query;
    p.causal = causal;
    p.return_lse = true;
    return p;
  }
};

v1::Tensor QueryTensor(const HostProblem& q) {
  const Shape& s = q.shape;
  v1::Tensor tensor;
  for (const int64_t extent : {s.heads, s.query_len, s.head_dim}) tensor.add_shape(extent);
  tensor.set_dtype(ToProtoDType(q.dtype));
  tensor.set_data(q.query_bytes.data(), q.query_bytes.size());
  return tensor;
}

// max |a − b| over finite pairs; +inf when one is −inf and the other is not, or either is NaN.
double LseError(const std::vector<float>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double error = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (std::isinf(expected[i]) && std::isinf(actual[i]) && actual[i] < 0) continue;
    const double diff =
        std::abs(double(actual[i]) - expected[i]) / std::max(1.0, std::abs(expected[i]));
    if (!std::isfinite(diff)) return std::numeric_limits<double>::infinity();
    error = std::max(error, diff);
  }
  return error;
}

std::vector<double> Doubles(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

class ShardedCacheTest : public ::testing::Test {
 protected:
  struct Server {
    std::unique_ptr<CpuBackend> backend;
    std::unique_ptr<AttentionService> service;
    std::unique_ptr<grpc::Server> server;
    int port = 0;
    std::string endpoint;
  };

  void SetUp() override {
    for (int i = 0; i < kServers; ++i) {
      Start(i);
      client::ClientOptions options;
      options.timeout = std::chrono::seconds(30);
      clients_[i] = std::make_unique<client::Client>(servers_[i].endpoint, options);
    }
  }
  void TearDown() override {
    for (Server& server : servers_) Stop(server);
  }

  // Starts server i (again on its old port when it had one: a restart, which forgets its
  // caches).
  void Start(int i) {
    Server& s = servers_[i];
    // Small odd pages, so parts cross page boundaries.
    s.backend = std::make_unique<CpuBackend>(2, 0, CpuBackend::kDefaultMaxPackedHeadBytes, 13);
    ServiceConfig config;
    config.caches = {.budget_bytes = int64_t{256} << 20, .idle_seconds = 0};
    s.service = std::make_unique<AttentionService>(*s.backend, config);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", s.port), grpc::InsecureServerCredentials(),
                             &port);
    builder.SetMaxReceiveMessageSize(1 << 30);
    builder.SetMaxSendMessageSize(1 << 30);
    builder.RegisterService(s.service.get());
    s.server = builder.BuildAndStart();
    ASSERT_NE(s.server, nullptr);
    ASSERT_TRUE(s.port == 0 || s.port == port);
    s.port = port;
    s.endpoint = absl::StrCat("127.0.0.1:", port);
  }
  static void Stop(Server& s) {
    if (s.server) s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    s.server.reset();
    s.service.reset();
    s.backend.reset();
  }
  // Waits until server i answers its client again (the channel reconnects after a restart).
  void AwaitServing(int i) {
    for (int attempt = 0; attempt < 200; ++attempt) {
      if (clients_[i]->Info().ok()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "server " << i << " did not come back";
  }

  std::vector<client::CacheEndpoint> Endpoints() {
    std::vector<client::CacheEndpoint> endpoints;
    for (int i = 0; i < kServers; ++i) {
      endpoints.push_back({.name = servers_[i].endpoint, .client = clients_[i].get()});
    }
    return endpoints;
  }

  static v1::CreateCacheRequest CreateRequest(const Shape& s, DType dtype) {
    v1::CreateCacheRequest request;
    request.set_kv_heads(s.kv_heads);
    request.set_head_dim(s.head_dim);
    request.set_value_dim(s.value_dim);
    request.set_dtype(ToProtoDType(dtype));
    return request;
  }

  ShardedCache NewSharded(const Sequence& seq) {
    absl::StatusOr<ShardedCache> cache =
        ShardedCache::Create(Endpoints(), CreateRequest(seq.all.shape, seq.all.dtype));
    EXPECT_TRUE(cache.ok()) << cache.status();
    return *std::move(cache);
  }

  Server servers_[kServers];
  std::unique_ptr<client::Client> clients_[kServers];
};

// Every global position [0, length) held exactly once, each part's segments in order, packed
// locally and adding up to its length.
void ExpectConsistent(const client::ShardedCacheInfo& info) {
  std::vector<int> held(info.length, 0);
  int64_t total = 0;
  for (const auto& part : info.parts) {
    int64_t local = 0;
    for (const client::CacheSegment& segment : part.segments) {
      EXPECT_EQ(segment.local_start, local) << part.cache_id;
      local += segment.length;
      for (int64_t g = segment.global_start; g < segment.global_start + segment.length; ++g) {
        ASSERT_LT(g, info.length);
        ++held[g];
      }
    }
    EXPECT_EQ(local, part.length) << part.cache_id;
    total += part.length;
  }
  EXPECT_EQ(total, info.length);
  for (int64_t g = 0; g < info.length; ++g) EXPECT_EQ(held[g], 1) << "global position " << g;
}

std::vector<int64_t> Lengths(const ShardedCache& cache) {
  std::vector<int64_t> lengths;
  for (const auto& part : cache.Info().parts) lengths.push_back(part.length);
  return lengths;
}

Sequence MakeSequence(std::mt19937_64& rng, DType dtype, int64_t capacity, int64_t* heads) {
  const int64_t kv_heads = 1 + rng() % 3, group = 1 + rng() % 3;
  const int64_t head_dim = 17 + 2 * (rng() % 24);
  int64_t value_dim = 9 + 2 * (rng() % 20);
  if (value_dim == head_dim) value_dim += 2;
  *heads = kv_heads * group;
  Sequence seq;
  seq.all = testing::RandomProblem(
      testing::MakeShape(1, *heads, kv_heads, 1, capacity, head_dim, value_dim), dtype, false, 64,
      rng());
  return seq;
}

TEST_F(ShardedCacheTest, AppendsWaterFillThePartsAndKeepTheirPositions) {
  std::mt19937_64 rng(7);
  int64_t heads;
  const Sequence seq = MakeSequence(rng, DType::kFloat32, 400, &heads);
  ShardedCache cache = NewSharded(seq);
  ASSERT_EQ(cache.parts(), kServers);
  int64_t at = 0;
  auto append = [&](int64_t n) {
    ASSERT_TRUE(cache.Append(seq.Keys(at, at + n), seq.Values(at, at + n)).ok());
    at += n;
  };
  append(7);  // 3, 2, 2: the extra token to the lowest index.
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{3, 2, 2}));
  append(1);  // The shortest (lowest index on a tie).
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{3, 3, 2}));
  append(1);
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{3, 3, 3}));
  append(10);
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{7, 6, 6}));
  const client::ShardedCacheInfo info = cache.Info();
  ASSERT_EQ(info.parts[0].segments.size(), 2u);
  EXPECT_EQ(info.parts[0].segments[1].global_start, 9);
  EXPECT_EQ(info.parts[0].segments[1].local_start, 3);
  EXPECT_EQ(info.parts[0].segments[1].length, 4);
  ASSERT_EQ(info.parts[1].segments.size(), 3u);  // [3, 5), [7, 8), [13, 16).
  EXPECT_EQ(info.parts[1].segments[1].global_start, 7);
  // Odd appends, large and small: always within one token.
  for (const int64_t n : {101, 1, 2, 57, 89, 3}) {
    append(n);
    const std::vector<int64_t> lengths = Lengths(cache);
    EXPECT_LE(*std::max_element(lengths.begin(), lengths.end()) -
                  *std::min_element(lengths.begin(), lengths.end()),
              1);
  }
  EXPECT_EQ(cache.length(), at);
  ExpectConsistent(cache.Info());
  // The servers agree.
  for (const auto& part : cache.Info().parts) {
    bool found = false;
    for (int i = 0; i < kServers; ++i) {
      if (part.endpoint != servers_[i].endpoint) continue;
      found = true;
      absl::StatusOr<v1::CacheInfo> info = clients_[i]->GetCacheInfo(part.cache_id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->length(), part.length);
    }
    EXPECT_TRUE(found) << part.endpoint;
  }
  // Malformed tensors are refused before anything is sent.
  EXPECT_EQ(cache.Append(seq.Keys(0, 3), seq.Values(0, 2)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Append(seq.Values(0, 3), seq.Values(0, 3)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.length(), at);

  ASSERT_TRUE(cache.Delete().ok());
  for (int i = 0; i < kServers; ++i) {
    absl::StatusOr<v1::ListCachesResponse> list = clients_[i]->ListCaches();
    ASSERT_TRUE(list.ok());
    EXPECT_EQ(list->caches_size(), 0) << servers_[i].endpoint;
  }
}

// The step kinds of a sequence: nq query rows with `fresh` new tokens. Causal steps keep
// fresh ≥ nq − 1 (or nq = 1), which the positions rule splits exactly.
struct Step {
  int64_t nq, fresh;
};

TEST_F(ShardedCacheTest, DecodeMatchesOneUnshardedCacheAndTheReference) {
  // Fresh shapes and inputs every run; the seed is printed to replay one.
  const uint64_t seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  std::mt19937_64 rng(seed);
  const Step steps[] = {{1, 1}, {1, 0}, {3, 3}, {4, 3}, {1, 1}, {2, 5}, {1, 1}, {5, 4}};
  double worst_vs_unsharded = 0, worst_lse_vs_unsharded = 0, worst_vs_reference = 0,
         worst_lse_vs_reference = 0;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), causal ? " causal" : " non-causal"));
      const int64_t filled = 151 + 2 * (rng() % 100);
      int64_t heads;
      const Sequence seq = MakeSequence(rng, dtype, filled + 64, &heads);
      const Shape& s = seq.all.shape;
      SCOPED_TRACE(absl::StrCat(heads, " heads, ", s.kv_heads, " kv heads, head_dim ", s.head_dim,
                                ", value_dim ", s.value_dim, ", ", filled, " filled"));
      ShardedCache cache = NewSharded(seq);
      absl::StatusOr<client::Cache> whole =
          client::Cache::Create(*clients_[0], CreateRequest(s, dtype));
      ASSERT_TRUE(whole.ok()) << whole.status();
      // Fill in odd chunks, so parts hold several segments.
      int64_t at = 0;
      while (at < filled) {
        const int64_t n = std::min<int64_t>(filled - at, 1 + 2 * (rng() % 40));
        ASSERT_TRUE(cache.Append(seq.Keys(at, at + n), seq.Values(at, at + n)).ok());
        ASSERT_TRUE(whole->Append(seq.Keys(at, at + n), seq.Values(at, at + n)).ok());
        at += n;
      }
      v1::AttentionOptions options;
      options.set_causal(causal);
      options.set_return_lse(true);
      options.set_output_dtype(v1::DTYPE_FLOAT32);
      for (const Step& step : steps) {
        SCOPED_TRACE(absl::StrCat("nq ", step.nq, ", ", step.fresh, " new at length ", at));
        const HostProblem q = testing::RandomProblem(
            testing::MakeShape(1, heads, s.kv_heads, step.nq, 1, s.head_dim, s.value_dim), dtype,
            causal, 64, rng());
        const v1::Tensor query = QueryTensor(q);
        const v1::Tensor key = seq.Keys(at, at + step.fresh);
        const v1::Tensor value = seq.Values(at, at + step.fresh);
        const bool fresh = step.fresh > 0;
        absl::StatusOr<client::ShardedDecodeResult> sharded =
            cache.Decode(query, fresh ? &key : nullptr, fresh ? &value : nullptr, options);
        ASSERT_TRUE(sharded.ok()) << sharded.status();
        absl::StatusOr<v1::DecodeResponse> one =
            whole->Decode(query, fresh ? &key : nullptr, fresh ? &value : nullptr, options);
        ASSERT_TRUE(one.ok()) << one.status();
        at += step.fresh;
        EXPECT_EQ(cache.length(), at);
        EXPECT_EQ(whole->length(), at);

        ASSERT_EQ(sharded->output.dtype(), v1::DTYPE_FLOAT32);
        ASSERT_TRUE(sharded->lse.has_value());
        const std::vector<float> output = Floats(sharded->output);
        const std::vector<float> lse = Floats(*sharded->lse);
        const std::vector<float> one_output = Floats(one->outputs(0));
        const std::vector<double> one_output_d = Doubles(one_output);
        const double vs_one = testing::MaxAbsError(output, one_output_d) /
                              std::max(1e-30, testing::MaxAbs(one_output_d));
        const double lse_vs_one = LseError(lse, Doubles(Floats(one->lse(0))));
        EXPECT_LE(vs_one, 3e-6);
        EXPECT_LE(lse_vs_one, 1e-4);

        const testing::Reference ref = testing::ReferenceAttention(seq.Over(q, at, causal));
        const double vs_ref =
            testing::MaxAbsError(output, ref.output) / std::max(1e-30, testing::MaxAbs(ref.output));
        const double lse_vs_ref = LseError(lse, ref.lse);
        EXPECT_LE(vs_ref, 1e-5);
        EXPECT_LE(lse_vs_ref, 1e-5);
        worst_vs_unsharded = std::max(worst_vs_unsharded, vs_one);
        worst_lse_vs_unsharded = std::max(worst_lse_vs_unsharded, lse_vs_one);
        worst_vs_reference = std::max(worst_vs_reference, vs_ref);
        worst_lse_vs_reference = std::max(worst_lse_vs_reference, lse_vs_ref);
        EXPECT_EQ(sharded->part_stats.size(), static_cast<size_t>(kServers));
        EXPECT_GT(sharded->request_bytes, 0);
      }
      ExpectConsistent(cache.Info());

      // The caller's output dtype (unspecified: the query's) and no lse unless asked.
      const HostProblem q = testing::RandomProblem(
          testing::MakeShape(1, heads, s.kv_heads, 1, 1, s.head_dim, s.value_dim), dtype, causal,
          64, rng());
      v1::AttentionOptions plain;
      plain.set_causal(causal);
      absl::StatusOr<client::ShardedDecodeResult> narrow =
          cache.Decode(QueryTensor(q), nullptr, nullptr, plain);
      ASSERT_TRUE(narrow.ok()) << narrow.status();
      EXPECT_EQ(narrow->output.dtype(), ToProtoDType(dtype));
      EXPECT_FALSE(narrow->lse.has_value());
      const testing::Reference ref = testing::ReferenceAttention(seq.Over(q, at, causal));
      // One rounding to the storage format on top of the fp32 answer.
      const double rounding = dtype == DType::kFloat32   ? 1e-5
                              : dtype == DType::kFloat16 ? 1e-3
                                                         : 8e-3;
      EXPECT_LE(testing::MaxAbsError(Floats(narrow->output), ref.output),
                rounding * std::max(1.0, testing::MaxAbs(ref.output)));

      ASSERT_TRUE(cache.Delete().ok());
      ASSERT_TRUE(whole->Delete().ok());
    }
  }
  std::printf(
      "seed %llu: largest errors: output vs unsharded %.3g (relative), lse vs unsharded %.3g; "
      "output vs float64 %.3g, lse vs float64 %.3g\n",
      static_cast<unsigned long long>(seed), worst_vs_unsharded, worst_lse_vs_unsharded,
      worst_vs_reference, worst_lse_vs_reference);
}

// Queries before the first key (nq > length): the positions are shifted up, rows that see no key
// come out zeros with lse −inf, as one cache answers.
TEST_F(ShardedCacheTest, CausalQueriesBeforeTheFirstKeySeeNothing) {
  std::mt19937_64 rng(5);
  int64_t heads;
  const Sequence seq = MakeSequence(rng, DType::kFloat32, 16, &heads);
  const Shape& s = seq.all.shape;
  ShardedCache cache = NewSharded(seq);
  ASSERT_TRUE(cache.Append(seq.Keys(0, 1), seq.Values(0, 1)).ok());
  v1::AttentionOptions options;
  options.set_causal(true);
  options.set_return_lse(true);
  options.set_output_dtype(v1::DTYPE_FLOAT32);
  int64_t at = 1;
  for (const Step step : {Step{3, 1}, Step{5, 1}}) {
    const HostProblem q = testing::RandomProblem(
        testing::MakeShape(1, heads, s.kv_heads, step.nq, 1, s.head_dim, s.value_dim),
        DType::kFloat32, true, 64, rng());
    const v1::Tensor key = seq.Keys(at, at + step.fresh), value = seq.Values(at, at + step.fresh);
    absl::StatusOr<client::ShardedDecodeResult> result =
        cache.Decode(QueryTensor(q), &key, &value, options);
    ASSERT_TRUE(result.ok()) << result.status();
    at += step.fresh;
    const testing::Reference ref = testing::ReferenceAttention(seq.Over(q, at, true));
    EXPECT_LE(testing::MaxAbsError(Floats(result->output), ref.output),
              1e-5 * std::max(1.0, testing::MaxAbs(ref.output)));
    EXPECT_LE(LseError(Floats(*result->lse), ref.lse), 1e-5);
    const std::vector<float> lse = Floats(*result->lse);
    EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0) << lse[0];  // Row 0 is before every key.
  }
  ASSERT_TRUE(cache.Delete().ok());
}

TEST_F(ShardedCacheTest, ACausalSplitThatIsNotExactIsRefused) {
  std::mt19937_64 rng(11);
  int64_t heads;
  const Sequence seq = MakeSequence(rng, DType::kFloat32, 128, &heads);
  const Shape& s = seq.all.shape;
  ShardedCache cache = NewSharded(seq);
  ASSERT_TRUE(cache.Append(seq.Keys(0, 101), seq.Values(0, 101)).ok());  // 34, 34, 33.
  v1::AttentionOptions options;
  options.set_causal(true);
  options.set_return_lse(true);
  options.set_output_dtype(v1::DTYPE_FLOAT32);
  auto query = [&](int64_t nq) {
    return QueryTensor(testing::RandomProblem(
        testing::MakeShape(1, heads, s.kv_heads, nq, 1, s.head_dim, s.value_dim), DType::kFloat32,
        true, 64, rng()));
  };
  // Two one-token steps: tokens 101 and 102 on parts 3 and 1.
  for (int64_t at = 101; at < 103; ++at) {
    const v1::Tensor key = seq.Keys(at, at + 1), value = seq.Values(at, at + 1);
    ASSERT_TRUE(cache.Decode(query(1), &key, &value, options).ok());
  }
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{35, 34, 34}));
  // Three causal rows (positions 100 … 102) would need part 1's token 102 hidden from row 100,
  // which its keys' positions cannot say.
  absl::StatusOr<client::ShardedDecodeResult> refused =
      cache.Decode(query(3), nullptr, nullptr, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("part 1 of 3"), std::string::npos) << refused.status();
  // Three rows with one new token: refused before anything is sent.
  const v1::Tensor key = seq.Keys(103, 104), value = seq.Values(103, 104);
  refused = cache.Decode(query(3), &key, &value, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_EQ(cache.length(), 103);
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{35, 34, 34}));
  // The same rows without the mask, or two causal rows with that token, split exactly.
  const HostProblem q3 = testing::RandomProblem(
      testing::MakeShape(1, heads, s.kv_heads, 3, 1, s.head_dim, s.value_dim), DType::kFloat32,
      false, 64, rng());
  v1::AttentionOptions open = options;
  open.set_causal(false);
  absl::StatusOr<client::ShardedDecodeResult> result =
      cache.Decode(QueryTensor(q3), nullptr, nullptr, open);
  ASSERT_TRUE(result.ok()) << result.status();
  testing::Reference ref = testing::ReferenceAttention(seq.Over(q3, 103, false));
  EXPECT_LE(testing::MaxAbsError(Floats(result->output), ref.output),
            1e-5 * testing::MaxAbs(ref.output));
  const HostProblem q2 = testing::RandomProblem(
      testing::MakeShape(1, heads, s.kv_heads, 2, 1, s.head_dim, s.value_dim), DType::kFloat32,
      true, 64, rng());
  result = cache.Decode(QueryTensor(q2), &key, &value, options);
  ASSERT_TRUE(result.ok()) << result.status();
  ref = testing::ReferenceAttention(seq.Over(q2, 104, true));
  EXPECT_LE(testing::MaxAbsError(Floats(result->output), ref.output),
            1e-5 * testing::MaxAbs(ref.output));
  // Positions are the sequence's: the caller may not set them.
  v1::AttentionOptions positioned = options;
  positioned.set_key_position(3);
  EXPECT_EQ(cache.Decode(query(1), nullptr, nullptr, positioned).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache.Delete().ok());
}

TEST_F(ShardedCacheTest, AStoppedOrRestartedServerFailsTheDecodeNamingIt) {
  std::mt19937_64 rng(3);
  int64_t heads;
  const Sequence seq = MakeSequence(rng, DType::kBFloat16, 128, &heads);
  const Shape& s = seq.all.shape;
  ShardedCache cache = NewSharded(seq);
  ASSERT_TRUE(cache.Append(seq.Keys(0, 90), seq.Values(0, 90)).ok());  // 30 each.
  v1::AttentionOptions options;
  options.set_causal(true);
  const v1::Tensor query = QueryTensor(testing::RandomProblem(
      testing::MakeShape(1, heads, s.kv_heads, 1, 1, s.head_dim, s.value_dim), DType::kBFloat16,
      true, 64, rng()));
  ASSERT_TRUE(cache.Decode(query, nullptr, nullptr, options).ok());
  const std::string lost_endpoint = servers_[1].endpoint;
  const std::string lost_id = cache.Info().parts[1].cache_id;

  Stop(servers_[1]);
  // No new tokens: the call fails whole, naming the part and its server; lengths unchanged.
  absl::StatusOr<client::ShardedDecodeResult> failed =
      cache.Decode(query, nullptr, nullptr, options);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("part 2 of 3"), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find(lost_endpoint), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find(lost_id), std::string::npos) << failed.status();
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{30, 30, 30}));
  // A new token goes to part 1 (the shortest, lowest index), which answers: it was kept there,
  // and the message says so.
  const v1::Tensor key = seq.Keys(90, 91), value = seq.Values(90, 91);
  failed = cache.Decode(query, &key, &value, options);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("part 2 of 3"), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find("kept on part 1 of 3"), std::string::npos)
      << failed.status();
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{31, 30, 30}));
  // The next token would go to part 2, the stopped one: not stored, the outcome unknown.
  const v1::Tensor key2 = seq.Keys(91, 92), value2 = seq.Values(91, 92);
  failed = cache.Decode(query, &key2, &value2, options);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("Refresh()"), std::string::npos) << failed.status();
  EXPECT_EQ(cache.Decode(query, nullptr, nullptr, options).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.Append(key2, value2).code(), absl::StatusCode::kFailedPrecondition);
  const absl::Status refresh = cache.Refresh();
  EXPECT_EQ(refresh.code(), absl::StatusCode::kUnavailable) << refresh;
  EXPECT_NE(refresh.message().find(lost_endpoint), std::string::npos) << refresh;

  // Restarted, the server has forgotten the part: NOT_FOUND, naming it, never a sum of two.
  Start(1);
  AwaitServing(1);
  const absl::Status lost = cache.Refresh();
  EXPECT_EQ(lost.code(), absl::StatusCode::kNotFound) << lost;
  EXPECT_NE(lost.message().find("part 2 of 3"), std::string::npos) << lost;
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{31, 30, 30}));
  // Delete removes the parts that are left (the lost one counts as gone).
  EXPECT_TRUE(cache.Delete().ok());
  for (int i : {0, 2}) {
    absl::StatusOr<v1::ListCachesResponse> list = clients_[i]->ListCaches();
    ASSERT_TRUE(list.ok());
    EXPECT_EQ(list->caches_size(), 0);
  }
}

TEST_F(ShardedCacheTest, ARestartedServerFailsTheNextDecodeAndAppendNotFound) {
  std::mt19937_64 rng(4);
  int64_t heads;
  const Sequence seq = MakeSequence(rng, DType::kFloat16, 128, &heads);
  const Shape& s = seq.all.shape;
  ShardedCache cache = NewSharded(seq);
  ASSERT_TRUE(cache.Append(seq.Keys(0, 60), seq.Values(0, 60)).ok());
  Stop(servers_[2]);
  Start(2);
  AwaitServing(2);
  const v1::Tensor query = QueryTensor(testing::RandomProblem(
      testing::MakeShape(1, heads, s.kv_heads, 2, 1, s.head_dim, s.value_dim), DType::kFloat16,
      false, 64, rng()));
  absl::StatusOr<client::ShardedDecodeResult> failed = cache.Decode(query);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kNotFound) << failed.status();
  EXPECT_NE(failed.status().message().find("part 3 of 3"), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find(servers_[2].endpoint), std::string::npos)
      << failed.status();
  // An append that reaches that part: the parts before it kept their chunks, the error says so.
  const absl::Status appended = cache.Append(seq.Keys(60, 63), seq.Values(60, 63));
  EXPECT_EQ(appended.code(), absl::StatusCode::kNotFound) << appended;
  EXPECT_NE(appended.message().find("part 3 of 3"), std::string::npos) << appended;
  EXPECT_NE(appended.message().find("tokens [0, 2) of this append were kept"), std::string::npos)
      << appended;
  EXPECT_EQ(Lengths(cache), (std::vector<int64_t>{21, 21, 20}));
  // Someone else writing to a part is caught by its expected_length.
  const std::string first_id = cache.Info().parts[0].cache_id;
  v1::AppendCacheRequest stray;
  stray.set_cache_id(first_id);
  *stray.mutable_key() = seq.Keys(0, 1);
  *stray.mutable_value() = seq.Values(0, 1);
  stray.set_expected_length(21);
  ASSERT_TRUE(clients_[0]->AppendCache(stray).ok());
  const absl::Status refresh = cache.Refresh();
  EXPECT_EQ(refresh.code(), absl::StatusCode::kFailedPrecondition) << refresh;
  EXPECT_NE(refresh.message().find("part 1 of 3"), std::string::npos) << refresh;
  (void)cache.Delete();
}

TEST_F(ShardedCacheTest, TheDecodeDemoShardsItsKeysOverEveryEndpoint) {
  std::vector<std::string> endpoints;
  for (const Server& server : servers_) endpoints.push_back(server.endpoint);
  client::MultiServerClient servers(endpoints);
  for (const auto dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    cli::CacheFlags flags;
    flags.heads = 6;
    flags.kv_heads = 2;
    flags.head_dim = 33;
    flags.value_dim = 19;
    flags.dtype = dtype;
    flags.tokens = 301;
    flags.steps = 4;
    flags.shard_keys = true;
    flags.options.set_causal(true);
    char* text = nullptr;
    size_t size = 0;
    std::FILE* out = open_memstream(&text, &size);
    const absl::Status status = cli::RunDecodeDemo(servers, flags, out);
    std::fclose(out);
    const std::string printed(text, size);
    std::free(text);
    ASSERT_TRUE(status.ok()) << status << "\n" << printed;
    EXPECT_NE(printed.find("keys sharded over 3 parts"), std::string::npos) << printed;
    EXPECT_NE(printed.find("parts hold 102 + 102 + 101 = 305 tokens"), std::string::npos)
        << printed;
    const size_t at = printed.find("/ max |reference| = ");
    ASSERT_NE(at, std::string::npos) << printed;
    // The demo's output is in the cache's dtype: bf16 rounds the answer once more.
    const double error = std::strtod(printed.c_str() + at + 20, nullptr);
    EXPECT_LE(error, dtype == v1::DTYPE_FLOAT32 ? 1e-5 : 8e-3) << printed;
    std::printf("%s", printed.c_str());
  }
  absl::StatusOr<v1::ListCachesResponse> list = servers.ListCaches();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->caches_size(), 0);
}

}  // namespace
}  // namespace attn
