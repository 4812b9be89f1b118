// The C++ client's recovery protocol (client/client.h Cache, CopyCache, MoveCache; issue 29)
// against in-process attnd services on loopback, CPU backend:
// - a server restarted from a copy of its --cache-dir taken at a Flush (a crash that lost the
//   appends after it): Refresh sends the lost tokens again from the Cache's tail (appends, a
//   Decode's token, a batched Decode item's), and Tiled over the recovered cache is bit-identical
//   to the original's;
// - a kept append that straddles the server's length is sliced (rank-2 tensors of one kv head);
// - DATA_LOSS, the Cache unchanged, when the tail does not reach back (a server without
//   --cache-dir keeps none; one with it drops what it said was durable);
// - a cache moved away (CacheRegistry::MarkMoved, as a drain does) is followed once, not twice;
// - ExportCache's chunks and CRC32C, MoveCache deleting the source only after the copy checked
//   out, and refusing (DATA_LOSS, source kept, copy deleted) a target whose answer differs;
// - a cut whose answer is lost (a LosingService in front of a real one answers UNAVAILABLE after
//   applying TruncateCache or a Decode's truncate_to, or before sending it): the Cache cuts its
//   tail and Refresh sends nothing past the lowest such cut (taking the server's info when it
//   holds at least that many), a refusal leaves the Cache as it was, CallFailed does the same for
//   a batched item, and a restarted server holding fewer tokens gets them only up to that cut;
// - Cache::Decode's tree_parents: each row of a token tree equal to a plain causal Decode over
//   the prefix and that row's branch, a count that does not fit refused naming the field;
// - a latent cache (values_from_keys): keys alone, through Refresh and a ShardedCache.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/client.h"
#include "client/sharded_cache.h"
#include "common/crc32c.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/service.h"

namespace attn {
namespace {

namespace v1 = attention::v1;

// One in-process server, with its cache directory when given; `client` calls it.
struct Server {
  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<AttentionService> service;
  std::unique_ptr<grpc::Server> grpc;
  std::string endpoint;
  std::unique_ptr<client::Client> client;

  ~Server() {
    if (grpc) grpc->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
};

client::ClientOptions Options() {
  client::ClientOptions options;
  options.timeout = std::chrono::seconds(30);
  return options;
}

std::unique_ptr<Server> StartServer(const std::string& dir = "") {
  auto server = std::make_unique<Server>();
  server->backend = std::make_unique<CpuBackend>(2, 0);
  ServiceConfig config;
  // The write-behind thread runs every sync_seconds / 2: an hour keeps it out of a test, so the
  // disk holds exactly what the test's Flush calls wrote.
  config.caches = {
      .budget_bytes = int64_t{256} << 20, .idle_seconds = 0, .dir = dir, .sync_seconds = 3600};
  server->service = std::make_unique<AttentionService>(*server->backend, config);
  const absl::StatusOr<std::vector<std::string>> restored = server->service->caches().Restore();
  EXPECT_TRUE(restored.ok()) << restored.status();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(server->service.get());
  server->grpc = builder.BuildAndStart();
  EXPECT_NE(server->grpc, nullptr);
  server->endpoint = absl::StrCat("127.0.0.1:", port);
  server->client = std::make_unique<client::Client>(server->endpoint, Options());
  return server;
}

// A sequence's keys [kv_heads, length, head_dim] and values [kv_heads, length, value_dim],
// uniform in [-1, 1), sent in `dtype`.
struct Sequence {
  int64_t kv_heads, head_dim, value_dim, length;
  v1::DType dtype;
  std::vector<float> keys, values;

  Sequence(int64_t kv_heads, int64_t head_dim, int64_t value_dim, int64_t length, v1::DType dtype,
           uint64_t seed)
      : kv_heads(kv_heads), head_dim(head_dim), value_dim(value_dim), length(length), dtype(dtype) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> uniform(-1.f, 1.f);
    keys.resize(kv_heads * length * head_dim);
    values.resize(kv_heads * length * value_dim);
    for (float& x : keys) x = uniform(rng);
    for (float& x : values) x = uniform(rng);
  }

  v1::CreateCacheRequest Create() const {
    v1::CreateCacheRequest request;
    request.set_kv_heads(kv_heads);
    request.set_head_dim(head_dim);
    request.set_value_dim(value_dim);
    request.set_dtype(dtype);
    return request;
  }
  // Tokens [begin, end): [kv_heads, n, dim], or [n, dim] with rank2 (one kv head).
  v1::Tensor Keys(int64_t begin, int64_t end, bool rank2 = false) const {
    return Slice(keys, head_dim, begin, end, rank2);
  }
  v1::Tensor Values(int64_t begin, int64_t end, bool rank2 = false) const {
    return Slice(values, value_dim, begin, end, rank2);
  }

 private:
  v1::Tensor Slice(const std::vector<float>& all, int64_t width, int64_t begin, int64_t end,
                   bool rank2) const {
    client::Array array;
    array.shape = rank2 ? std::vector<int64_t>{end - begin, width}
                        : std::vector<int64_t>{kv_heads, end - begin, width};
    for (int64_t h = 0; h < kv_heads; ++h) {
      const auto first = all.begin() + (h * length + begin) * width;
      array.values.insert(array.values.end(), first, first + (end - begin) * width);
    }
    return client::ToTensor(array, dtype);
  }
};

// A query of 4 heads over `seq`'s kv heads, 3 rows.
v1::Tensor Query(const Sequence& seq, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  client::Array query;
  query.shape = {4, 3, seq.head_dim};
  query.values.resize(4 * 3 * seq.head_dim);
  for (float& x : query.values) x = uniform(rng);
  return client::ToTensor(query, seq.dtype);
}

// Tiled of a fixed query over cache `id` on `client`: its output's and lse's bytes.
std::string TiledBytes(client::Client& client, const std::string& id, const Sequence& seq) {
  v1::AttentionOptions options;
  options.set_causal(true);
  options.set_block_k(16);
  options.set_return_lse(true);
  const absl::StatusOr<v1::AttentionResponse> response =
      client.Tiled(client::CacheRequest(id, Query(seq, 99), options));
  EXPECT_TRUE(response.ok()) << response.status();
  if (!response.ok()) return "";
  EXPECT_FALSE(response->output().data().empty());
  return response->output().data() + response->lse().data();
}

// Puts tokens [0, n) of `seq` under `id` on `client` (ImportCache of one chunk): a server that
// lost the tokens after them.
absl::StatusOr<v1::CacheInfo> ImportPrefix(client::Client& client, const std::string& id,
                                           const Sequence& seq, int64_t n) {
  v1::CacheChunk chunk;
  v1::CacheInfo& info = *chunk.mutable_info();
  info.set_cache_id(id);
  info.set_kv_heads(seq.kv_heads);
  info.set_head_dim(seq.head_dim);
  info.set_value_dim(seq.value_dim);
  info.set_dtype(seq.dtype);
  info.set_length(n);
  *chunk.mutable_key() = seq.Keys(0, n);
  *chunk.mutable_value() = seq.Values(0, n);
  const std::string& key = chunk.key().data();
  const std::string& value = chunk.value().data();
  chunk.set_crc32c(Crc32c(value.data(), value.size(), Crc32c(key.data(), key.size())));
  bool sent = false;
  return client.ImportCache([&](v1::CacheChunk* next) -> absl::StatusOr<bool> {
    if (sent) return false;
    *next = chunk;
    sent = true;
    return true;
  });
}

int64_t LengthOn(client::Client& client, const std::string& id) {
  const absl::StatusOr<v1::CacheInfo> info = client.GetCacheInfo(id);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->length() : -1;
}

class ClientRecoveryTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const std::string& dir : dirs_) std::filesystem::remove_all(dir);
  }
  // A new empty directory, removed after the test.
  std::string TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "client_recovery.XXXXXX");
    EXPECT_NE(mkdtemp(pattern.data()), nullptr);
    dirs_.push_back(pattern);
    return pattern;
  }

 private:
  std::vector<std::string> dirs_;
};

// A latent cache (values_from_keys) through client::Cache: a value refused before any RPC, keys
// alone appended and decoded, the replay tail keeping keys only so that Refresh after a restart
// from the disk gives bit-identical Tiled output; an ordinary cache refusing a key alone; a
// ShardedCache over two servers passing the flag to every part and equal to one cache.
TEST_F(ClientRecoveryTest, LatentCacheAppendsKeysAloneAndRefreshResendsThem) {
  const std::string dir = TempDir(), copy = TempDir();
  std::unique_ptr<Server> one = StartServer(dir);
  const Sequence seq(1, 72, 72, 80, v1::DTYPE_BFLOAT16, 7);
  v1::CreateCacheRequest create = seq.Create();
  create.set_value_dim(40);
  create.set_values_from_keys(true);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*one->client, create);
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  EXPECT_TRUE(cache.values_from_keys());
  // A value refused before any RPC.
  const v1::Tensor k0 = seq.Keys(0, 10), v0 = seq.Values(0, 10);
  absl::StatusOr<v1::CacheInfo> refused = cache.Append(k0, v0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "value: ")) << refused.status();
  const v1::Tensor q = Query(seq, 3);
  const v1::Tensor k1 = seq.Keys(10, 11), v1v = seq.Values(10, 11);
  absl::StatusOr<v1::DecodeResponse> refused_decode = cache.Decode(q, &k1, &v1v);
  EXPECT_EQ(refused_decode.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.length(), 0);
  for (const auto& [begin, end] : {std::pair{0, 10}, {10, 25}, {25, 40}}) {
    ASSERT_TRUE(cache.Append(seq.Keys(begin, end)).ok());
  }
  EXPECT_EQ(cache.info().bytes(), cache.info().page_tokens() * 72 * 2);
  ASSERT_TRUE(one->service->caches().Flush().ok());
  std::filesystem::copy(
      dir, copy,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  ASSERT_TRUE(cache.Append(seq.Keys(40, 60)).ok());
  ASSERT_TRUE(cache.Append(seq.Keys(60, 75)).ok());
  const v1::Tensor decode_key = seq.Keys(75, 76);
  absl::StatusOr<v1::DecodeResponse> step = cache.Decode(q, &decode_key);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->outputs(0).shape(2), 40);
  const v1::Tensor item_key = seq.Keys(76, 79);
  v1::DecodeRequest batch;
  *batch.add_items() = cache.Item(q, &item_key);
  const absl::StatusOr<v1::DecodeResponse> decoded = one->client->Decode(batch);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  cache.Update(decoded->caches(0), batch.items(0));
  ASSERT_EQ(cache.length(), 79);
  EXPECT_EQ(cache.kept_from(), 40);
  // A cut inside the tail (slices the straddling append, keys alone).
  ASSERT_TRUE(cache.Truncate(78).ok());
  std::unique_ptr<Server> two = StartServer(copy);
  ASSERT_EQ(LengthOn(*two->client, cache.id()), 40);
  client::Cache recovered = cache;
  recovered.Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = recovered.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 78);
  EXPECT_TRUE(refreshed->values_from_keys());
  EXPECT_EQ(TiledBytes(*two->client, cache.id(), seq), TiledBytes(*one->client, cache.id(), seq));
  // Ordinary cache: Append(key) refused.
  absl::StatusOr<client::Cache> ordinary = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(ordinary.ok());
  EXPECT_EQ(ordinary->Append(k0).status().code(), absl::StatusCode::kInvalidArgument);

  // Sharded latent over both servers.
  std::vector<client::CacheEndpoint> endpoints = {{"one", one->client.get()},
                                                  {"two", two->client.get()}};
  absl::StatusOr<client::ShardedCache> sharded = client::ShardedCache::Create(endpoints, create);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_TRUE(sharded->shape().values_from_keys());
  EXPECT_EQ(sharded->Append(seq.Keys(0, 10), seq.Values(0, 10)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(sharded->Append(seq.Keys(0, 70)).ok());
  const v1::Tensor sk = seq.Keys(70, 71), sv = seq.Values(70, 71);
  EXPECT_EQ(sharded->Decode(q, &sk, &sv).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sharded->Decode(q, nullptr, &sv).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<client::ShardedDecodeResult> merged = sharded->Decode(q, &sk);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(sharded->length(), 71);
  // Against one cache holding the same keys.
  absl::StatusOr<client::Cache> whole = client::Cache::Create(*one->client, create);
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE(whole->Append(seq.Keys(0, 71)).ok());
  v1::AttentionOptions options;
  options.set_output_dtype(v1::DTYPE_FLOAT32);
  absl::StatusOr<v1::DecodeResponse> direct = whole->Decode(q, nullptr, nullptr, options);
  ASSERT_TRUE(direct.ok());
  absl::StatusOr<client::Array> a = client::FromTensor(merged->output);
  absl::StatusOr<client::Array> b = client::FromTensor(direct->outputs(0));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->values.size(), b->values.size());
  for (size_t i = 0; i < a->values.size(); ++i) EXPECT_NEAR(a->values[i], b->values[i], 1e-3);
  EXPECT_TRUE(sharded->Delete().ok());
}

TEST_F(ClientRecoveryTest, RefreshSendsAgainWhatARestartFromTheDiskLost) {
  const std::string dir = TempDir(), copy = TempDir();
  std::unique_ptr<Server> one = StartServer(dir);
  const Sequence seq(2, 16, 8, 80, v1::DTYPE_BFLOAT16, 1);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  for (const auto& [begin, end] : {std::pair{0, 10}, {10, 25}, {25, 40}}) {
    ASSERT_TRUE(cache.Append(seq.Keys(begin, end), seq.Values(begin, end)).ok());
  }
  ASSERT_TRUE(cache.info().has_durable_length());
  EXPECT_EQ(cache.info().durable_length(), 0);
  EXPECT_EQ(cache.kept_from(), 0);  // Nothing durable yet: every append kept.

  // The disk gets the first 40 tokens; the copy is what a crash from now on would leave.
  ASSERT_TRUE(one->service->caches().Flush().ok());
  std::filesystem::copy(
      dir, copy,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);

  // The answers now say 40 are durable: the appends up to there are dropped from the tail.
  ASSERT_TRUE(cache.Append(seq.Keys(40, 60), seq.Values(40, 60)).ok());
  EXPECT_EQ(cache.info().durable_length(), 40);
  EXPECT_EQ(cache.kept_from(), 40);
  ASSERT_TRUE(cache.Append(seq.Keys(60, 75), seq.Values(60, 75)).ok());
  // A Decode's token and a batched Decode item's two join the tail too.
  const v1::Tensor decode_key = seq.Keys(75, 76), decode_value = seq.Values(75, 76);
  ASSERT_TRUE(cache.Decode(Query(seq, 5), &decode_key, &decode_value).ok());
  const v1::Tensor item_key = seq.Keys(76, 78), item_value = seq.Values(76, 78);
  v1::DecodeRequest batch;
  *batch.add_items() = cache.Item(Query(seq, 6), &item_key, &item_value);
  const absl::StatusOr<v1::DecodeResponse> decoded = one->client->Decode(batch);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  cache.Update(decoded->caches(0), batch.items(0));
  ASSERT_EQ(cache.length(), 78);
  EXPECT_EQ(cache.kept_from(), 40);

  // The "restarted" server holds the 40 flushed tokens; Refresh sends tokens [40, 78) again.
  std::unique_ptr<Server> two = StartServer(copy);
  ASSERT_EQ(LengthOn(*two->client, cache.id()), 40);
  client::Cache recovered = cache;
  recovered.Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = recovered.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 78);
  EXPECT_EQ(recovered.length(), 78);
  EXPECT_EQ(LengthOn(*two->client, cache.id()), 78);
  EXPECT_EQ(recovered.kept_from(), 40);  // The restarted server's disk still holds 40.
  EXPECT_EQ(cache.length(), 78);         // The copy it came from is untouched.
  EXPECT_EQ(&cache.client(), one->client.get());

  // The recovered cache is the original, bit for bit.
  EXPECT_EQ(TiledBytes(*two->client, cache.id(), seq), TiledBytes(*one->client, cache.id(), seq));

  // Once the restarted server has flushed, a Refresh learns it and keeps nothing.
  ASSERT_TRUE(two->service->caches().Flush().ok());
  ASSERT_TRUE(recovered.Refresh().ok());
  EXPECT_EQ(recovered.info().durable_length(), 78);
  EXPECT_EQ(recovered.kept_from(), 78);
}

// Speculative decoding's cuts (Truncate, Decode's truncate_to) reach the kept tail: a Refresh
// after a restart sends the accepted tokens again, never a cut draft.
TEST_F(ClientRecoveryTest, RefreshAfterACutNeverSendsTheCutTokens) {
  const std::string dir = TempDir(), copy = TempDir();
  std::unique_ptr<Server> one = StartServer(dir);
  const Sequence seq(2, 16, 8, 80, v1::DTYPE_BFLOAT16, 3);
  const Sequence drafts(2, 16, 8, 80, v1::DTYPE_BFLOAT16, 4);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  ASSERT_TRUE(cache.Append(seq.Keys(0, 20), seq.Values(0, 20)).ok());
  ASSERT_TRUE(one->service->caches().Flush().ok());
  std::filesystem::copy(
      dir, copy,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  // Drafts appended and cut back, twice: by Truncate, then by the Decode that appends the
  // accepted tokens (a kept append straddling the second cut is sliced).
  ASSERT_TRUE(cache.Append(drafts.Keys(0, 6), drafts.Values(0, 6)).ok());
  EXPECT_EQ(cache.kept_from(), 20);
  const absl::StatusOr<v1::CacheInfo> cut = cache.Truncate(20);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cache.length(), 20);
  ASSERT_TRUE(cache.Append(seq.Keys(20, 24), seq.Values(20, 24)).ok());
  ASSERT_TRUE(cache.Append(drafts.Keys(6, 9), drafts.Values(6, 9)).ok());
  const v1::Tensor key = seq.Keys(22, 25), value = seq.Values(22, 25);
  const absl::StatusOr<v1::DecodeResponse> stepped =
      cache.Decode(Query(seq, 3), &key, &value, {}, /*truncate_to=*/22);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(cache.length(), 25);
  EXPECT_EQ(LengthOn(*one->client, cache.id()), 25);

  std::unique_ptr<Server> two = StartServer(copy);  // Holds the 20 flushed tokens.
  client::Cache recovered = cache;
  recovered.Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = recovered.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 25);
  // Both are seq's first 25 tokens, as a cache that never saw a draft.
  absl::StatusOr<client::Cache> clean = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(clean.ok());
  ASSERT_TRUE(clean->Append(seq.Keys(0, 25), seq.Values(0, 25)).ok());
  const std::string want = TiledBytes(*one->client, clean->id(), seq);
  EXPECT_EQ(TiledBytes(*one->client, cache.id(), seq), want);
  EXPECT_EQ(TiledBytes(*two->client, cache.id(), seq), want);
}

TEST_F(ClientRecoveryTest, RefreshSlicesTheAppendThatStraddlesTheServersLength) {
  std::unique_ptr<Server> one = StartServer(TempDir());
  std::unique_ptr<Server> two = StartServer();  // Not persistent.
  const Sequence seq(1, 16, 16, 50, v1::DTYPE_BFLOAT16, 2);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  // Rank-2 tensors (one kv head), so the slice is along their axis 0.
  ASSERT_TRUE(cache.Append(seq.Keys(0, 20, true), seq.Values(0, 20, true)).ok());
  ASSERT_TRUE(one->service->caches().Flush().ok());
  ASSERT_TRUE(cache.Append(seq.Keys(20, 50, true), seq.Values(20, 50, true)).ok());
  EXPECT_EQ(cache.kept_from(), 20);

  // Server two holds the first 35 tokens: 15 of the kept append's 30 must be sent again.
  const absl::StatusOr<v1::CacheInfo> prefix = ImportPrefix(*two->client, cache.id(), seq, 35);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  cache.Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = cache.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 50);
  EXPECT_EQ(LengthOn(*two->client, cache.id()), 50);
  EXPECT_EQ(TiledBytes(*two->client, cache.id(), seq), TiledBytes(*one->client, cache.id(), seq));
  // Server two does not persist (no durable_length): the Cache keeps nothing from now on.
  EXPECT_FALSE(cache.info().has_durable_length());
  EXPECT_EQ(cache.kept_from(), 50);
}

// An fp8 cache takes tokens of any dtype, so a Cache's tail may hold fp32 and bf16 appends side
// by side: Refresh sends each run in its own dtype (never one dtype's bytes read as another's),
// and the server that lost everything quantizes them into the same rows: the same Tiled bits.
TEST_F(ClientRecoveryTest, RefreshResendsAnFp8CachesTokensEachInTheDtypeItWasSent) {
  std::unique_ptr<Server> one = StartServer(TempDir());
  std::unique_ptr<Server> two = StartServer();
  const Sequence f32(2, 16, 12, 60, v1::DTYPE_FLOAT32, 5);
  const Sequence bf16(2, 16, 12, 60, v1::DTYPE_BFLOAT16, 5);  // The same values, rounded.
  v1::CreateCacheRequest create = f32.Create();
  create.set_dtype(v1::DTYPE_FLOAT8_E4M3);
  absl::StatusOr<client::Cache> cache = client::Cache::Create(*one->client, create);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Append(f32.Keys(0, 20), f32.Values(0, 20)).ok());
  ASSERT_TRUE(cache->Append(bf16.Keys(20, 45), bf16.Values(20, 45)).ok());
  ASSERT_TRUE(cache->Append(f32.Keys(45, 60), f32.Values(45, 60)).ok());
  EXPECT_EQ(cache->kept_from(), 0);
  // Server two has the cache, empty (an import of no tokens).
  v1::CacheChunk chunk;
  *chunk.mutable_info() = cache->info();
  chunk.mutable_info()->set_length(0);
  chunk.mutable_info()->clear_durable_length();
  chunk.set_crc32c(0);
  bool sent = false;
  const absl::StatusOr<v1::CacheInfo> empty =
      two->client->ImportCache([&](v1::CacheChunk* next) -> absl::StatusOr<bool> {
        if (sent) return false;
        *next = chunk;
        sent = true;
        return true;
      });
  ASSERT_TRUE(empty.ok()) << empty.status();
  cache->Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = cache->Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 60);
  EXPECT_EQ(refreshed->dtype(), v1::DTYPE_FLOAT8_E4M3);
  EXPECT_EQ(TiledBytes(*two->client, cache->id(), f32), TiledBytes(*one->client, cache->id(), f32));
}

TEST_F(ClientRecoveryTest, RefreshSendsALongTailInSeveralAppends) {
  std::unique_ptr<Server> one = StartServer(TempDir());
  std::unique_ptr<Server> two = StartServer();
  // 2 × (64 + 64) fp32 = 1 KiB a token: the 11 000 lost tokens take two appends of at most
  // kReplayAppendBytes (8192 tokens, then 2808), the first ending inside the second kept append.
  const Sequence seq(2, 64, 64, 12000, v1::DTYPE_FLOAT32, 7);
  static_assert(client::Cache::kReplayAppendBytes == 8192 * 1024);
  absl::StatusOr<client::Cache> cache = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Append(seq.Keys(0, 4000), seq.Values(0, 4000)).ok());
  ASSERT_TRUE(cache->Append(seq.Keys(4000, 12000), seq.Values(4000, 12000)).ok());
  EXPECT_EQ(cache->kept_from(), 0);
  ASSERT_TRUE(ImportPrefix(*two->client, cache->id(), seq, 1000).ok());
  cache->Rebind(*two->client);
  const absl::StatusOr<v1::CacheInfo> refreshed = cache->Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 12000);
  EXPECT_EQ(TiledBytes(*two->client, cache->id(), seq), TiledBytes(*one->client, cache->id(), seq));
}

TEST_F(ClientRecoveryTest, RefreshIsDataLossWhenTheTailDoesNotReachBack) {
  std::unique_ptr<Server> memory = StartServer();
  std::unique_ptr<Server> disk = StartServer(TempDir());
  std::unique_ptr<Server> other = StartServer();
  const Sequence seq(2, 8, 8, 40, v1::DTYPE_FLOAT32, 3);

  // A server without --cache-dir: its answers carry no durable_length, so nothing is kept.
  absl::StatusOr<client::Cache> in_memory = client::Cache::Create(*memory->client, seq.Create());
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  ASSERT_TRUE(in_memory->Append(seq.Keys(0, 10), seq.Values(0, 10)).ok());
  ASSERT_TRUE(in_memory->Append(seq.Keys(10, 30), seq.Values(10, 30)).ok());
  EXPECT_EQ(in_memory->kept_from(), 30);
  ASSERT_TRUE(ImportPrefix(*other->client, in_memory->id(), seq, 10).ok());
  in_memory->Rebind(*other->client);
  const absl::StatusOr<v1::CacheInfo> lost = in_memory->Refresh();
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss) << lost.status();
  EXPECT_TRUE(absl::StrContains(lost.status().message(), "the server holds 10 tokens"))
      << lost.status();
  EXPECT_TRUE(absl::StrContains(lost.status().message(), "only from 30 on")) << lost.status();
  EXPECT_EQ(in_memory->length(), 30);                        // The Cache keeps its state...
  EXPECT_EQ(LengthOn(*other->client, in_memory->id()), 10);  // ...and sent nothing.

  // A persistent server said 30 were durable, so the tail starts there; a server holding 20
  // cannot be recovered.
  absl::StatusOr<client::Cache> on_disk = client::Cache::Create(*disk->client, seq.Create());
  ASSERT_TRUE(on_disk.ok()) << on_disk.status();
  ASSERT_TRUE(on_disk->Append(seq.Keys(0, 30), seq.Values(0, 30)).ok());
  ASSERT_TRUE(disk->service->caches().Flush().ok());
  ASSERT_TRUE(on_disk->Append(seq.Keys(30, 40), seq.Values(30, 40)).ok());
  EXPECT_EQ(on_disk->kept_from(), 30);
  ASSERT_TRUE(ImportPrefix(*other->client, on_disk->id(), seq, 20).ok());
  on_disk->Rebind(*other->client);
  const absl::StatusOr<v1::CacheInfo> dropped = on_disk->Refresh();
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kDataLoss) << dropped.status();
  EXPECT_TRUE(absl::StrContains(dropped.status().message(), "tokens [20, 30) are lost"))
      << dropped.status();
  EXPECT_EQ(on_disk->length(), 40);
  EXPECT_EQ(on_disk->kept_from(), 30);
}

TEST_F(ClientRecoveryTest, ACacheThatMovedIsFollowedOnceNotTwice) {
  std::unique_ptr<Server> one = StartServer(), two = StartServer();
  const Sequence seq(2, 8, 8, 40, v1::DTYPE_FLOAT32, 4);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  ASSERT_TRUE(cache.Append(seq.Keys(0, 20), seq.Values(0, 20)).ok());

  // Handed to server two as a drain does: copied (same id), then marked moved on server one.
  const absl::StatusOr<v1::CacheInfo> copied =
      client::CopyCache(*one->client, *two->client, cache.id(), false);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(copied->cache_id(), cache.id());
  one->service->caches().MarkMoved("", cache.id(), two->endpoint);
  const absl::StatusOr<v1::CacheInfo> gone = one->client->GetCacheInfo(cache.id());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client::MovedTo(gone.status()), two->endpoint) << gone.status();
  EXPECT_EQ(client::MovedTo(absl::NotFoundError("no cache")), std::nullopt);
  EXPECT_EQ(client::MovedTo(absl::UnavailableError("moved_to=x:1")), std::nullopt);

  // Append follows it to server two.
  const absl::StatusOr<v1::CacheInfo> appended = cache.Append(seq.Keys(20, 30), seq.Values(20, 30));
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->length(), 30);
  EXPECT_EQ(cache.client().target(), two->endpoint);
  EXPECT_EQ(LengthOn(*two->client, cache.id()), 30);

  // And back to server one: Decode follows it there.
  ASSERT_TRUE(client::CopyCache(*two->client, *one->client, cache.id(), false).ok());
  two->service->caches().MarkMoved("", cache.id(), one->endpoint);
  const v1::Tensor key = seq.Keys(30, 31), value = seq.Values(30, 31);
  const absl::StatusOr<v1::DecodeResponse> decoded = cache.Decode(Query(seq, 7), &key, &value);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(cache.length(), 31);
  EXPECT_EQ(cache.client().target(), one->endpoint);
  EXPECT_EQ(LengthOn(*one->client, cache.id()), 31);

  // Each server says the other has it: one hop, then the second moved_to is the answer.
  absl::StatusOr<client::Cache> looped = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(looped.ok()) << looped.status();
  ASSERT_TRUE(client::CopyCache(*one->client, *two->client, looped->id(), false).ok());
  one->service->caches().MarkMoved("", looped->id(), two->endpoint);
  two->service->caches().MarkMoved("", looped->id(), one->endpoint);
  const absl::StatusOr<v1::CacheInfo> refreshed = looped->Refresh();
  EXPECT_EQ(refreshed.status().code(), absl::StatusCode::kNotFound) << refreshed.status();
  EXPECT_EQ(client::MovedTo(refreshed.status()), one->endpoint) << refreshed.status();
  EXPECT_EQ(looped->client().target(), two->endpoint);
}

TEST_F(ClientRecoveryTest, MoveCacheStreamsChecksAndDeletesTheSource) {
  std::unique_ptr<Server> one = StartServer(), two = StartServer();
  // 6000 tokens of 2 × (64 + 64) fp32 = 6 144 000 bytes: two chunks of at most 4 MiB.
  const Sequence seq(2, 64, 64, 6000, v1::DTYPE_FLOAT32, 5);
  absl::StatusOr<client::Cache> cache = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Append(seq.Keys(0, 6000), seq.Values(0, 6000)).ok());
  const std::string id = cache->id();

  int64_t chunks = 0, tokens = 0;
  uint32_t crc = 0;
  std::optional<uint32_t> stated;
  ASSERT_TRUE(one->client
                  ->ExportCache(
                      id,
                      [&](const v1::CacheChunk& chunk) {
                        if (chunks++ == 0) {
                          EXPECT_EQ(chunk.info().length(), 6000);
                        }
                        EXPECT_EQ(chunk.start(), tokens);
                        tokens += chunk.key().shape(1);
                        crc = Crc32c(chunk.key().data().data(), chunk.key().data().size(), crc);
                        crc = Crc32c(chunk.value().data().data(), chunk.value().data().size(), crc);
                        if (chunk.has_crc32c()) stated = chunk.crc32c();
                        return true;
                      })
                  .ok());
  EXPECT_EQ(chunks, 2);
  EXPECT_EQ(tokens, 6000);
  EXPECT_EQ(stated, crc);
  const absl::Status stopped =
      one->client->ExportCache(id, [](const v1::CacheChunk&) { return false; });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled) << stopped;

  const std::string before = TiledBytes(*one->client, id, seq);
  const absl::StatusOr<v1::CacheInfo> moved = client::MoveCache(*one->client, *two->client, id,
                                                                /*new_id_if_taken=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->cache_id(), id);
  EXPECT_EQ(moved->length(), 6000);
  EXPECT_EQ(moved->crc32c(), crc);
  EXPECT_EQ(one->client->GetCacheInfo(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(TiledBytes(*two->client, id, seq), before);

  const absl::StatusOr<v1::CacheInfo> unknown =
      client::MoveCache(*two->client, *one->client, std::string(32, '0'), false);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_TRUE(absl::StartsWith(unknown.status().message(), "export from " + two->endpoint))
      << unknown.status();
}

// A server whose ImportCache takes every chunk and answers one token more than it got; it
// notes the caches it is asked to delete.
class WrongImportService final : public v1::AttentionService::CallbackService {
 public:
  grpc::ServerReadReactor<v1::CacheChunk>* ImportCache(grpc::CallbackServerContext* context,
                                                       v1::CacheInfo* response) override {
    class Reader final : public grpc::ServerReadReactor<v1::CacheChunk> {
     public:
      explicit Reader(v1::CacheInfo* response) : response_(response) { StartRead(&chunk_); }
      void OnReadDone(bool ok) override {
        if (ok) {
          if (chunk_.has_info()) *response_ = chunk_.info();
          if (chunk_.has_crc32c()) response_->set_crc32c(chunk_.crc32c());
          StartRead(&chunk_);
          return;
        }
        response_->set_length(response_->length() + 1);
        Finish(grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      v1::CacheInfo* response_;
      v1::CacheChunk chunk_;
    };
    return new Reader(response);
  }
  grpc::ServerUnaryReactor* DeleteCache(grpc::CallbackServerContext* context,
                                        const v1::DeleteCacheRequest* request,
                                        v1::DeleteCacheResponse* response) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      deleted_.push_back(request->cache_id());
    }
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  std::vector<std::string> deleted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return deleted_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> deleted_;
};

TEST_F(ClientRecoveryTest, MoveCacheRefusesATargetWhoseAnswerDiffers) {
  std::unique_ptr<Server> one = StartServer();
  WrongImportService wrong;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&wrong);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  client::Client target(absl::StrCat("127.0.0.1:", port), Options());

  const Sequence seq(2, 8, 8, 30, v1::DTYPE_FLOAT32, 6);
  absl::StatusOr<client::Cache> cache = client::Cache::Create(*one->client, seq.Create());
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Append(seq.Keys(0, 30), seq.Values(0, 30)).ok());

  const absl::StatusOr<v1::CacheInfo> moved = client::MoveCache(*one->client, target, cache->id(),
                                                                /*new_id_if_taken=*/false);
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kDataLoss) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "of 31 tokens")) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "held 30 tokens")) << moved.status();
  EXPECT_EQ(LengthOn(*one->client, cache->id()), 30);                 // The source stays.
  EXPECT_EQ(wrong.deleted(), std::vector<std::string>{cache->id()});  // The bad copy goes.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A server in front of `real` that forwards the cache calls a Cache makes, except that the next
// call of one RPC is lost: applied on `real` and its answer replaced by UNAVAILABLE, or failed
// UNAVAILABLE before it was forwarded. Counts the AppendCache calls it forwards. Synchronous: a
// forward blocks on `real`, which the sync server's own threads may do.
class LosingService final : public v1::AttentionService::Service {
 public:
  explicit LosingService(client::Client& real) : real_(real) {}

  void Lose(const std::string& rpc, bool applied) {
    std::lock_guard<std::mutex> lock(mutex_);
    lose_ = {rpc, applied};
  }
  int appends() {
    std::lock_guard<std::mutex> lock(mutex_);
    return appends_;
  }

  grpc::Status CreateCache(grpc::ServerContext*, const v1::CreateCacheRequest* request,
                           v1::CacheInfo* response) override {
    return Forward("CreateCache", response, [&] { return real_.CreateCache(*request); });
  }
  grpc::Status AppendCache(grpc::ServerContext*, const v1::AppendCacheRequest* request,
                           v1::CacheInfo* response) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++appends_;
    }
    return Forward("AppendCache", response, [&] { return real_.AppendCache(*request); });
  }
  grpc::Status GetCacheInfo(grpc::ServerContext*, const v1::GetCacheInfoRequest* request,
                            v1::CacheInfo* response) override {
    return Forward("GetCacheInfo", response,
                   [&] { return real_.GetCacheInfo(request->cache_id()); });
  }
  grpc::Status TruncateCache(grpc::ServerContext*, const v1::TruncateCacheRequest* request,
                             v1::CacheInfo* response) override {
    return Forward("TruncateCache", response, [&] { return real_.TruncateCache(*request); });
  }
  grpc::Status Decode(grpc::ServerContext*, const v1::DecodeRequest* request,
                      v1::DecodeResponse* response) override {
    return Forward("Decode", response, [&] { return real_.Decode(*request); });
  }

 private:
  template <typename Response, typename Call>
  grpc::Status Forward(const std::string& rpc, Response* response, const Call& call) {
    std::optional<bool> applied;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (lose_ && lose_->first == rpc) applied = lose_->second;
      if (applied) lose_.reset();
    }
    if (applied && !*applied) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "lost before it was sent (a test)");
    }
    absl::StatusOr<Response> answer = call();
    if (applied) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "answer lost (a test)");
    if (!answer.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(answer.status().code()),
                          std::string(answer.status().message()));
    }
    *response = *std::move(answer);
    return grpc::Status::OK;
  }

  client::Client& real_;
  std::mutex mutex_;
  std::optional<std::pair<std::string, bool>> lose_;
  int appends_ = 0;
};

// LosingService on a port of its own.
struct LosingServer {
  explicit LosingServer(client::Client& real) : service(real) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    EXPECT_NE(server, nullptr);
    client = std::make_unique<client::Client>(absl::StrCat("127.0.0.1:", port), Options());
  }
  ~LosingServer() {
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  LosingService service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<client::Client> client;
};

// Tiled's bytes over a new cache on `client` holding `key` and `value`, deleted after.
std::string TiledOfTokens(client::Client& client, const Sequence& layout, const v1::Tensor& key,
                          const v1::Tensor& value) {
  absl::StatusOr<client::Cache> clean = client::Cache::Create(client, layout.Create());
  EXPECT_TRUE(clean.ok()) << clean.status();
  if (!clean.ok()) return "";
  EXPECT_TRUE(clean->Append(key, value).ok());
  std::string bytes = TiledBytes(client, clean->id(), layout);
  EXPECT_TRUE(clean->Delete().ok());
  return bytes;
}

// Tokens of `a` then `b` ([kv_heads, n, dim] of one dtype) as one tensor.
v1::Tensor Joined(const v1::Tensor& a, const v1::Tensor& b) {
  const int64_t heads = a.shape(0), na = a.shape(1), nb = b.shape(1);
  const int64_t row = static_cast<int64_t>(a.data().size()) / (heads * na);
  v1::Tensor joined = a;
  joined.set_shape(1, na + nb);
  std::string* data = joined.mutable_data();
  data->clear();
  for (int64_t h = 0; h < heads; ++h) {
    data->append(a.data(), h * na * row, na * row);
    data->append(b.data(), h * nb * row, nb * row);
  }
  return joined;
}

// Rule 6 of the recovery protocol (docs/usage.md): a call carrying a cut that fails without a
// refusal may have been applied, so the Cache cuts its tail and the next Refresh sends nothing
// past the lowest such cut, taking the server's info when it holds at least that many tokens.
TEST_F(ClientRecoveryTest, ACutWhoseAnswerIsLostBoundsTheNextRefresh) {
  // A persistent server (answers carry durable_length, so the Cache keeps a tail), behind a
  // LosingServer.
  std::unique_ptr<Server> real = StartServer(TempDir());
  LosingServer losing(*real->client);
  const Sequence seq(1, 8, 8, 40, v1::DTYPE_FLOAT32, 11);
  const Sequence drafts(1, 8, 8, 40, v1::DTYPE_FLOAT32, 12);
  absl::StatusOr<client::Cache> created = client::Cache::Create(*losing.client, seq.Create());
  ASSERT_TRUE(created.ok()) << created.status();
  client::Cache& cache = *created;
  ASSERT_TRUE(cache.Append(seq.Keys(0, 10), seq.Values(0, 10)).ok());
  ASSERT_TRUE(cache.Append(seq.Keys(10, 16), seq.Values(10, 16)).ok());
  EXPECT_EQ(cache.kept_from(), 0);
  EXPECT_EQ(losing.service.appends(), 2);

  // TruncateCache applied, its answer lost: the Cache still believes 16, its tail is cut at 12,
  // and Refresh takes the server's 12 without sending anything.
  losing.service.Lose("TruncateCache", /*applied=*/true);
  const absl::StatusOr<v1::CacheInfo> truncated = cache.Truncate(12);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kUnavailable) << truncated.status();
  EXPECT_EQ(cache.length(), 16);
  EXPECT_EQ(cache.unsure_cut(), 12);
  EXPECT_EQ(LengthOn(*real->client, cache.id()), 12);
  absl::StatusOr<v1::CacheInfo> refreshed = cache.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 12);
  EXPECT_EQ(cache.length(), 12);
  EXPECT_EQ(cache.unsure_cut(), std::nullopt);
  EXPECT_EQ(cache.kept_from(), 0);  // The tail, cut at 12, still reaches back.
  EXPECT_EQ(losing.service.appends(), 2);
  EXPECT_EQ(TiledBytes(*real->client, cache.id(), seq),
            TiledOfTokens(*real->client, seq, seq.Keys(0, 12), seq.Values(0, 12)));

  // A Decode cutting to 5 and appending 3 drafts, applied, its answer lost: the same.
  const v1::Tensor key = drafts.Keys(0, 3), value = drafts.Values(0, 3);
  losing.service.Lose("Decode", /*applied=*/true);
  const absl::StatusOr<v1::DecodeResponse> decoded =
      cache.Decode(Query(seq, 1), &key, &value, {}, /*truncate_to=*/5);
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kUnavailable) << decoded.status();
  EXPECT_EQ(cache.length(), 12);
  EXPECT_EQ(cache.unsure_cut(), 5);
  refreshed = cache.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(cache.length(), 8);
  EXPECT_EQ(losing.service.appends(), 2);
  const v1::Tensor want_key = Joined(seq.Keys(0, 5), key);
  const v1::Tensor want_value = Joined(seq.Values(0, 5), value);
  const std::string want = TiledOfTokens(*real->client, seq, want_key, want_value);
  EXPECT_EQ(TiledBytes(*real->client, cache.id(), seq), want);

  // A cut that never reached the server: Refresh takes its 8 as they are, sending nothing.
  losing.service.Lose("TruncateCache", /*applied=*/false);
  EXPECT_EQ(cache.Truncate(3).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.unsure_cut(), 3);
  refreshed = cache.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(cache.length(), 8);
  EXPECT_EQ(losing.service.appends(), 2);
  EXPECT_EQ(TiledBytes(*real->client, cache.id(), seq), want);

  // Refusals applied nothing: the Cache is left as it was.
  EXPECT_EQ(cache.Truncate(9).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache.Decode(Query(seq, 2), nullptr, nullptr, {}, 9).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(cache.unsure_cut(), std::nullopt);
  EXPECT_EQ(cache.length(), 8);

  // A batched Decode: CallFailed applies the same rule to the item (and ignores a refusal).
  v1::DecodeRequest batch;
  *batch.add_items() = cache.Item(Query(seq, 3), nullptr, nullptr, /*truncate_to=*/6);
  cache.CallFailed(absl::OutOfRangeError("refused"), batch.items(0));
  EXPECT_EQ(cache.unsure_cut(), std::nullopt);
  losing.service.Lose("Decode", /*applied=*/true);
  const absl::StatusOr<v1::DecodeResponse> batched = losing.client->Decode(batch);
  EXPECT_EQ(batched.status().code(), absl::StatusCode::kUnavailable) << batched.status();
  cache.CallFailed(batched.status(), batch.items(0));
  EXPECT_EQ(cache.unsure_cut(), 6);
  refreshed = cache.Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(cache.length(), 6);
  EXPECT_EQ(losing.service.appends(), 2);

  // What a Refresh sends is bounded by the lowest unsure cut: three lost cuts (25, 27, and a
  // Decode's 28), none applied, then a server that holds only 18 tokens gets [18, 25) again.
  std::unique_ptr<Server> two = StartServer();
  absl::StatusOr<client::Cache> second = client::Cache::Create(*losing.client, seq.Create());
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(second->Append(seq.Keys(0, 10), seq.Values(0, 10)).ok());
  ASSERT_TRUE(second->Append(seq.Keys(10, 30), seq.Values(10, 30)).ok());
  losing.service.Lose("TruncateCache", /*applied=*/false);
  EXPECT_EQ(second->Truncate(25).status().code(), absl::StatusCode::kUnavailable);
  losing.service.Lose("TruncateCache", /*applied=*/false);
  EXPECT_EQ(second->Truncate(27).status().code(), absl::StatusCode::kUnavailable);
  losing.service.Lose("Decode", /*applied=*/false);
  EXPECT_EQ(second->Decode(Query(seq, 4), nullptr, nullptr, {}, 28).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(second->unsure_cut(), 25);
  EXPECT_EQ(second->length(), 30);
  EXPECT_EQ(second->kept_from(), 0);
  ASSERT_TRUE(ImportPrefix(*two->client, second->id(), seq, 18).ok());
  second->Rebind(*two->client);
  refreshed = second->Refresh();
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->length(), 25);
  EXPECT_EQ(second->length(), 25);
  EXPECT_EQ(LengthOn(*two->client, second->id()), 25);
  EXPECT_EQ(TiledBytes(*two->client, second->id(), seq),
            TiledOfTokens(*two->client, seq, seq.Keys(0, 25), seq.Values(0, 25)));
}

// A query [heads, rows, head_dim] of uniform values in [-1, 1) as an Array.
client::Array RandomQuery(int64_t heads, int64_t rows, int64_t head_dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  client::Array query;
  query.shape = {heads, rows, head_dim};
  query.values.resize(heads * rows * head_dim);
  for (float& x : query.values) x = uniform(rng);
  return query;
}

// Cache::Decode sends tree_parents (and Item carries them): each row of a token tree's output
// equals a plain causal Decode over a cache holding the prefix and that row's branch (another
// path through the kernels: within 1e-5 of the largest output); a count that does not fit is
// the server's INVALID_ARGUMENT naming items[0].tree_parents, the cache unchanged.
TEST_F(ClientRecoveryTest, DecodeSendsATokenTree) {
  std::unique_ptr<Server> server = StartServer();
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 1, 2, -1};
  const int64_t prefix = 21, n = 7, heads = 4;
  const Sequence seq(2, 16, 12, prefix + n, v1::DTYPE_FLOAT32, 21);
  absl::StatusOr<client::Cache> cache = client::Cache::Create(*server->client, seq.Create());
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Append(seq.Keys(0, prefix), seq.Values(0, prefix)).ok());
  v1::AttentionOptions options;
  options.set_causal(true);
  const client::Array query = RandomQuery(heads, n, 16, 22);
  const v1::Tensor key = seq.Keys(prefix, prefix + n), value = seq.Values(prefix, prefix + n);

  const v1::DecodeItem item =
      cache->Item(client::ToTensor(query), &key, &value, std::nullopt, parents);
  EXPECT_EQ(std::vector<int32_t>(item.tree_parents().begin(), item.tree_parents().end()), parents);
  const absl::StatusOr<v1::DecodeResponse> tree =
      cache->Decode(client::ToTensor(query), &key, &value, options, std::nullopt, parents);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(cache->length(), prefix + n);
  const absl::StatusOr<client::Array> output = client::FromTensor(tree->outputs(0));
  ASSERT_TRUE(output.ok()) << output.status();
  ASSERT_EQ(output->shape, (std::vector<int64_t>{heads, n, 12}));

  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<client::Cache> alone = client::Cache::Create(*server->client, seq.Create());
    ASSERT_TRUE(alone.ok()) << alone.status();
    ASSERT_TRUE(alone->Append(seq.Keys(0, prefix), seq.Values(0, prefix)).ok());
    std::vector<int64_t> branch;
    for (int64_t j = i; j >= 0; j = parents[j]) branch.insert(branch.begin(), j);
    for (const int64_t j : branch) {
      ASSERT_TRUE(
          alone
              ->Append(seq.Keys(prefix + j, prefix + j + 1), seq.Values(prefix + j, prefix + j + 1))
              .ok());
    }
    client::Array row;
    row.shape = {heads, 1, 16};
    for (int64_t h = 0; h < heads; ++h) {
      const auto first = query.values.begin() + (h * n + i) * 16;
      row.values.insert(row.values.end(), first, first + 16);
    }
    const absl::StatusOr<v1::DecodeResponse> plain =
        alone->Decode(client::ToTensor(row), nullptr, nullptr, options);
    ASSERT_TRUE(plain.ok()) << plain.status();
    const absl::StatusOr<client::Array> want = client::FromTensor(plain->outputs(0));
    ASSERT_TRUE(want.ok()) << want.status();
    float miss = 0.f, top = 0.f;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < 12; ++c) {
        const float got = output->values[(h * n + i) * 12 + c], expected = want->values[h * 12 + c];
        miss = std::max(miss, std::abs(got - expected));
        top = std::max(top, std::abs(expected));
      }
    }
    EXPECT_LE(miss, 1e-5f * top) << "row " << i;
    ASSERT_TRUE(alone->Delete().ok());
  }

  // Two parents for seven new tokens: the server's INVALID_ARGUMENT, nothing appended.
  const absl::StatusOr<v1::DecodeResponse> wrong =
      cache->Decode(client::ToTensor(query), &key, &value, options, std::nullopt, {-1, 0});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "items[0].tree_parents"))
      << wrong.status();
  EXPECT_EQ(cache->length(), prefix + n);
  EXPECT_EQ(LengthOn(*server->client, cache->id()), prefix + n);
}

}  // namespace
}  // namespace attn
