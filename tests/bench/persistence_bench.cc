// The persistence benchmark's client (tests/bench/persistence.sh runs it; not a test): what
// --cache-dir costs a decode step, and how fast a cache moves, beside the machine's copy
// bandwidth measured in the same run.
//
//   persistence_bench --plain HOST:PORT --persistent HOST:PORT [--tokens 32768] [--steps 200]
//                     [--fill-caches 0] --phase decode|fill
//
// --phase decode: one bf16 cache (32 query heads over 8 KV heads, head_dim 128) of --tokens
//   tokens on each server, then --steps decode steps of one new token each, alternating between
//   the two servers step by step (so both see the same machine state); prints the median and
//   p90 wall per step of each and their ratio. Then ExportCache of the persistent server's cache
//   into memory and ImportCache of those chunks into the plain server (new id), each timed, as
//   GB/s beside a memcpy of the same bytes (best of 5) in this process.
// --phase fill: --fill-caches more caches of --tokens tokens on the persistent server (for the
//   restore measurement, which persistence.sh reads from attnd's startup line).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, plain, "", "attnd without --cache-dir");
ABSL_FLAG(std::string, persistent, "", "attnd with --cache-dir");
ABSL_FLAG(int64_t, tokens, 32768, "tokens per cache");
ABSL_FLAG(int, steps, 200, "decode steps per server");
ABSL_FLAG(int, fill_caches, 0, "--phase fill: caches to add to the persistent server");
ABSL_FLAG(std::string, phase, "decode", "decode or fill");

namespace {

namespace v1 = attention::v1;
using Clock = std::chrono::steady_clock;

constexpr int64_t kKvHeads = 8, kHeads = 32, kDim = 128;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

[[noreturn]] void Die(const std::string& what, const grpc::Status& status) {
  std::fprintf(stderr, "persistence_bench: %s: %s\n", what.c_str(), status.error_message().c_str());
  std::exit(1);
}

std::unique_ptr<v1::AttentionService::Stub> Connect(const std::string& target) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  return v1::AttentionService::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments));
}

// Random bf16 bits of n elements (finite: exponent below all ones).
std::string RandomBf16(int64_t n, std::mt19937& rng) {
  std::string data(n * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = static_cast<uint16_t>((rng() & 0x807F) | 0x3C00);  // |x| in [2^-7, 2).
    std::memcpy(&data[i * 2], &bits, 2);
  }
  return data;
}

v1::Tensor Bf16(int64_t heads, int64_t n, int64_t dim, std::mt19937& rng) {
  v1::Tensor tensor;
  tensor.add_shape(heads);
  tensor.add_shape(n);
  tensor.add_shape(dim);
  tensor.set_dtype(v1::DTYPE_BFLOAT16);
  tensor.set_data(RandomBf16(heads * n * dim, rng));
  return tensor;
}

// A cache of `tokens` random tokens, appended 2048 at a time.
v1::CacheInfo MakeCache(v1::AttentionService::Stub& stub, int64_t tokens, std::mt19937& rng) {
  v1::CreateCacheRequest create;
  create.set_kv_heads(kKvHeads);
  create.set_head_dim(kDim);
  create.set_dtype(v1::DTYPE_BFLOAT16);
  v1::CacheInfo info;
  grpc::ClientContext context;
  if (grpc::Status s = stub.CreateCache(&context, create, &info); !s.ok()) Die("CreateCache", s);
  for (int64_t at = 0; at < tokens; at += 2048) {
    const int64_t n = std::min<int64_t>(2048, tokens - at);
    v1::AppendCacheRequest append;
    append.set_cache_id(info.cache_id());
    *append.mutable_key() = Bf16(kKvHeads, n, kDim, rng);
    *append.mutable_value() = Bf16(kKvHeads, n, kDim, rng);
    append.set_expected_length(at);
    grpc::ClientContext ctx;
    if (grpc::Status s = stub.AppendCache(&ctx, append, &info); !s.ok()) Die("AppendCache", s);
  }
  return info;
}

// One decode step (a new token and 32 query heads); its wall.
double Step(v1::AttentionService::Stub& stub, v1::CacheInfo& info, std::mt19937& rng) {
  v1::DecodeRequest request;
  v1::DecodeItem* item = request.add_items();
  item->set_cache_id(info.cache_id());
  *item->mutable_query() = Bf16(kHeads, 1, kDim, rng);
  *item->mutable_key() = Bf16(kKvHeads, 1, kDim, rng);
  *item->mutable_value() = Bf16(kKvHeads, 1, kDim, rng);
  item->set_expected_length(info.length());
  v1::DecodeResponse response;
  grpc::ClientContext context;
  const Clock::time_point start = Clock::now();
  if (grpc::Status s = stub.Decode(&context, request, &response); !s.ok()) Die("Decode", s);
  const double wall = Seconds(Clock::now() - start);
  info = response.caches(0);
  return wall;
}

double Quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1))];
}

// The copy ceiling: GB/s of one memcpy of `bytes` into another buffer, best of 5.
double CopyGBs(int64_t bytes) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point start = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    best = std::min(best, Seconds(Clock::now() - start));
  }
  if (to[bytes / 2] != 1) std::abort();
  return static_cast<double>(bytes) / best * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::mt19937 rng(29);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  auto persistent = Connect(absl::GetFlag(FLAGS_persistent));
  if (absl::GetFlag(FLAGS_phase) == "fill") {
    for (int i = 0; i < absl::GetFlag(FLAGS_fill_caches); ++i) MakeCache(*persistent, tokens, rng);
    return 0;
  }
  auto plain = Connect(absl::GetFlag(FLAGS_plain));
  v1::CacheInfo on_plain = MakeCache(*plain, tokens, rng);
  v1::CacheInfo on_persistent = MakeCache(*persistent, tokens, rng);
  for (int i = 0; i < 10; ++i) {  // Warm both.
    Step(*plain, on_plain, rng);
    Step(*persistent, on_persistent, rng);
  }
  std::vector<double> plain_walls, persistent_walls;
  for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    if (i % 2 == 0) {
      plain_walls.push_back(Step(*plain, on_plain, rng));
      persistent_walls.push_back(Step(*persistent, on_persistent, rng));
    } else {
      persistent_walls.push_back(Step(*persistent, on_persistent, rng));
      plain_walls.push_back(Step(*plain, on_plain, rng));
    }
  }
  const double p50_plain = Quantile(plain_walls, 0.5),
               p50_persistent = Quantile(persistent_walls, 0.5);
  std::printf("decode step, bf16, %lld tokens, 32/8 heads, d 128 (%d steps each, interleaved):\n",
              static_cast<long long>(on_plain.length()), absl::GetFlag(FLAGS_steps));
  std::printf("  without --cache-dir  p50 %.3f ms  p90 %.3f ms\n", p50_plain * 1e3,
              Quantile(plain_walls, 0.9) * 1e3);
  std::printf("  with --cache-dir     p50 %.3f ms  p90 %.3f ms\n", p50_persistent * 1e3,
              Quantile(persistent_walls, 0.9) * 1e3);
  std::printf("  ratio (p50)          %.3fx   (target <= 1.05x)\n", p50_persistent / p50_plain);

  // Export into memory, then import those chunks.
  std::vector<v1::CacheChunk> chunks;
  int64_t bytes = 0;
  {
    v1::ExportCacheRequest request;
    request.set_cache_id(on_persistent.cache_id());
    grpc::ClientContext context;
    const Clock::time_point start = Clock::now();
    auto reader = persistent->ExportCache(&context, request);
    v1::CacheChunk chunk;
    while (reader->Read(&chunk)) {
      bytes += static_cast<int64_t>(chunk.key().data().size() + chunk.value().data().size());
      chunks.push_back(std::move(chunk));
    }
    if (grpc::Status s = reader->Finish(); !s.ok()) Die("ExportCache", s);
    const double seconds = Seconds(Clock::now() - start);
    std::printf("export: %lld bytes in %zu chunks, %.3f s: %.2f GB/s\n",
                static_cast<long long>(bytes), chunks.size(), seconds, bytes / seconds * 1e-9);
  }
  {
    chunks[0].set_new_id_if_taken(true);
    grpc::ClientContext context;
    v1::CacheInfo info;
    const Clock::time_point start = Clock::now();
    auto writer = plain->ImportCache(&context, &info);
    for (const v1::CacheChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    if (grpc::Status s = writer->Finish(); !s.ok()) Die("ImportCache", s);
    const double seconds = Seconds(Clock::now() - start);
    std::printf("import: %lld tokens, %.3f s: %.2f GB/s\n", static_cast<long long>(info.length()),
                seconds, bytes / seconds * 1e-9);
  }
  std::printf("copy ceiling: memcpy of %lld bytes in this process, best of 5: %.2f GB/s\n",
              static_cast<long long>(bytes), CopyGBs(bytes));
  return 0;
}
