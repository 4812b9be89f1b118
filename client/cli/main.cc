// attn: command-line client for attnd.
//
//   attn info | health
//   attn naive|tiled  (--example seed [--query-multiplier X] | --random B,H,N,D [--seed S]
//                      [--dtype f32|f16|bf16] [--kv-heads K]) [--causal] [--block-k K] [--lse]
//                     [--query-len Q] [--shard-heads] [--shard-keys] [--output-file PATH]
//   (any command)     [--target h1:p1,h2:p2,... | dns:///name:port] [--lb round_robin]
//   attn naive|tiled|trace --cache ID (--random 1,H,N,D | --example seed)   over a cache's keys
//   attn trace        (same inputs) [--rows b:h:r,...] [--follow [--follow-ms MS] | --json]
//                     [--shard-keys]   each endpoint traces its slice of the keys, then the merge
//                     (client/cli/merge_trace.h)
//   attn naive|tiled|trace ... [--key-position P] [--query-position Q]   positions (geometry.h)
//   attn naive|tiled|trace --random 1,H,N,D --seqlens Q1,…[/K1,…]   a ragged batch (geometry.h)
//   attn naive|tiled|trace|decode|bench ... [--window L,R] [--softcap C] [--alibi standard|s,…]
//                     [--sinks s|s,…]
//                     a sliding window (geometry.h), a softcap, ALiBi biases (score_transform.h)
//   attn bench        [--ns 256,512,...] [--batch B] [--heads H] [--dim D] [--methods naive,tiled]
//                     [--repeats R] [--csv PATH] [--svg PATH] [--dtype ...] [--causal]
//   attn bench --decode [--lengths 1k,...,32k] [--batches 1,16] [--steps M] [--repeats R]
//                     [--heads H --kv-heads K --head-dim D --value-dim V --dtype T]
//                     (client/cli/decode_bench.h)
//   attn cache create --kv-heads K --head-dim D [--value-dim V] [--dtype f32|f16|bf16|fp8]
//                     [--json]
//                     [--values-from-keys]   a latent cache (MLA): keys only, values their first
//                     V columns
//   attn cache append ID --tokens N [--expected-length L] [--seed S]   (random tokens)
//   attn cache truncate ID --keep N [--expected-length L]   (drops the tokens from N on)
//   attn cache fork ID [--length N] [--expected-length L]   (a new cache of ID's first N tokens,
//                     all without --length, sharing its pages)
//   attn cache info ID | attn cache list | attn cache delete ID
//   attn cache export ID --to FILE | attn cache import FILE [--new-id]
//   attn cache move ID --from HOST:PORT --to HOST:PORT [--new-id]
//   attn decode       [--heads H] [--kv-heads K] [--head-dim D] [--value-dim V] [--dtype ...]
//                     [--tokens N] [--steps M] [--block-k K] [--shard-keys] [--values-from-keys]
//                     (client/cli/cache.h)
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/cli/bench.h"
#include "client/cli/cache.h"
#include "client/cli/decode_bench.h"
#include "client/cli/inputs.h"
#include "client/cli/merge_trace.h"
#include "client/cli/render.h"
#include "client/client.h"
#include "client/multi_server_client.h"
#include "common/dashed_flags.h"
#include "google/protobuf/util/json_util.h"
#include "proto/credential_files.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "attnd address (host:port), a comma-separated list of them (numeric addresses), or a "
          "gRPC URI such as dns:///name:port.");
ABSL_FLAG(std::string, lb, "pick_first",
          "Load balancing over the target's addresses: pick_first (one server) or round_robin "
          "(calls spread over all ready servers).");
ABSL_FLAG(bool, shard_heads, false,
          "naive/tiled: split the request by (batch, kv-head group) across the --target list's "
          "endpoints, send the parts concurrently and reassemble the answer; a failed part is "
          "retried once on another endpoint.");
ABSL_FLAG(bool, shard_keys, false,
          "naive/tiled: split the keys and values along the sequence across the --target list's "
          "endpoints, one slice each, balanced by the (query, key) pairs the causal mask lets "
          "through; each slice returns its (output, lse) and the client merges them exactly "
          "(client/merge.h). A failed part is retried once on another endpoint. With "
          "--shard-heads: a grid of parts (heads × keys).");
ABSL_FLAG(std::string, output_file, "",
          "naive/tiled: write the output tensor's raw bytes (then the lse's, with --lse) to this "
          "file, e.g. to compare answers bit for bit.");
ABSL_FLAG(std::string, example, "", "Use a built-in example: seed (the explainer's 8×4 problem).");
ABSL_FLAG(float, query_multiplier, 1.f, "Multiplies the seed example's queries (and scores).");
ABSL_FLAG(std::string, random, "", "Random inputs of shape B,H,N,D (uniform in [-1, 1)).");
ABSL_FLAG(uint64_t, seed, 1, "Seed for --random.");
ABSL_FLAG(int64_t, query_len, 0,
          "--random B,H,N,D: give the query this many rows instead of N (the keys and values keep "
          "N), drawn with their own seed; 0 = N.");
ABSL_FLAG(std::string, seqlens, "",
          "--random 1,H,N,D as a ragged batch (AttentionRequest.cu_seqlens_q/k) of sequences of "
          "these lengths, e.g. 5,1,40 (keys as long as queries) or 5,1,40/7,1,33 (query lengths / "
          "key lengths): the query gets sum(Q) rows and the keys sum(K) instead of N; each "
          "sequence attends only within itself, at its own positions (naive/tiled/trace).");
ABSL_FLAG(int64_t, kv_heads, 0,
          "Key/value heads for --random, bench, cache create and decode (divides H; 0 = H, "
          "--heads for cache create and decode).");
ABSL_FLAG(std::string, dtype, "f32",
          "Input dtype: f32, f16 or bf16; for a cache (attn cache create, attn decode, attn bench "
          "--decode) also fp8, whose tokens are sent as bf16 and quantized by the server.");
ABSL_FLAG(bool, causal, false,
          "Apply the causal mask: a query sees the keys at its position and before (bottom-right "
          "aligned unless --key-position/--query-position say otherwise).");
ABSL_FLAG(int64_t, key_position, 0,
          "naive/tiled/trace: the position of the first key (AttentionOptions.key_position).");
ABSL_FLAG(int64_t, query_position, -1,
          "naive/tiled/trace: the position of the first query row; -1 = bottom-right "
          "(key position + key_len − query_len).");
ABSL_FLAG(std::string, window, "",
          "Sliding window L,R: a query at position p sees only the keys at p − L … p + R (and "
          "none after p with --causal); a side empty or -1 is unbounded, e.g. --window 256, "
          "(AttentionOptions.window_left/right; naive/tiled/trace/decode/bench).");
ABSL_FLAG(std::string, alibi, "",
          "ALiBi biases: \"standard\" (the geometric slopes 2^(-8(h+1)/H) for the request's H "
          "query heads) or one slope per query head, comma-separated; query head h adds "
          "-slope_h * |p - t| to its scores (AttentionOptions.alibi_slopes; "
          "naive/tiled/trace/decode/bench).");
ABSL_FLAG(std::string, sinks, "",
          "Attention sinks (gpt-oss): one logit for every query head, or one per head, "
          "comma-separated; each row's softmax takes e^sink more weight with no value "
          "(AttentionOptions.sinks; naive/tiled/trace/decode/bench).");
ABSL_FLAG(double, softcap, 0,
          "Softcap C: each scaled score s becomes C · tanh(s / C) before the mask (Gemma 2, "
          "Grok; AttentionOptions.softcap); 0 = off.");
ABSL_FLAG(int32_t, block_k, 0, "Keys per tile for tiled/trace; 0 = the server's default.");
ABSL_FLAG(bool, lse, false, "Also return the log-sum-exp of each row.");
ABSL_FLAG(std::string, rows, "", "trace: rows to follow as batch:head:row,... (default 0:0:0).");
ABSL_FLAG(bool, follow, false,
          "trace: animate the steps in the terminal as they arrive (--follow-ms between steps).");
ABSL_FLAG(int32_t, follow_ms, 250, "trace --follow: pause between steps, milliseconds.");
ABSL_FLAG(bool, json, false,
          "trace: print each event as one line of JSON (protobuf's JSON mapping), for scripts; "
          "cache create|append|truncate|fork|info|list|export|import|move: the CacheInfo "
          "(ListCachesResponse) as JSON.");
ABSL_FLAG(int32_t, print_rows, 4, "naive/tiled: output rows to print.");
ABSL_FLAG(int64_t, timeout_ms, 0, "Per-call deadline in milliseconds; 0 = none.");
ABSL_FLAG(std::string, tls_ca, "",
          "Connect with TLS, trusting this PEM CA bundle for the server's certificate.");
ABSL_FLAG(std::string, tls_cert, "", "Mutual TLS: PEM client certificate (with --tls-key).");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: PEM private key of --tls-cert.");
ABSL_FLAG(std::string, token_file, "",
          "File holding the bearer token to send (attnd --auth-token-file); trailing whitespace "
          "is ignored.");
ABSL_FLAG(int64_t, head_dim, 64, "cache create, decode, bench --decode: the key width.");
ABSL_FLAG(int64_t, value_dim, 0,
          "cache create, decode, bench --decode: the value width (0 = --head-dim).");
ABSL_FLAG(bool, values_from_keys, false,
          "cache create, decode: a latent cache (MLA, as DeepSeek-V3 decodes; "
          "CreateCacheRequest.values_from_keys): it stores keys only, a token's value being the "
          "first --value-dim columns of its key (--value-dim ≤ --head-dim), so appends and decode "
          "steps send keys alone.");
ABSL_FLAG(int64_t, tokens, 4096,
          "cache append: random tokens to append; decode: random tokens to fill the cache with.");
ABSL_FLAG(int64_t, steps, 16,
          "decode: decode steps, each sending one new token's q, k and v; bench --decode: timed "
          "steps per row (20 when not given).");
ABSL_FLAG(int64_t, keep, -1, "cache truncate: the tokens to keep; the ones after are dropped.");
ABSL_FLAG(int64_t, length, -1,
          "cache fork: the source's tokens the fork starts with (its first N); not given = all of "
          "them. Past the source's length: OUT_OF_RANGE.");
ABSL_FLAG(int64_t, expected_length, -1,
          "cache append, truncate, fork: the cache length to send as expected_length (-1 = the "
          "cache's current length, read first); a wrong one is refused with FAILED_PRECONDITION.");
ABSL_FLAG(std::string, ns, "256,512,1024,2048,4096", "bench: sequence lengths N to sweep.");
ABSL_FLAG(int64_t, batch, 1, "bench: batch size B.");
ABSL_FLAG(int64_t, heads, 8, "bench, decode: query heads H (--kv-heads sets key/value heads).");
ABSL_FLAG(int64_t, dim, 64, "bench: head_dim D (= value_dim).");
ABSL_FLAG(std::string, methods, "naive,tiled", "bench: methods to sweep: naive, tiled or both.");
ABSL_FLAG(int32_t, repeats, 3,
          "bench: calls per point, the median reported; bench --decode: stateless Tiled calls "
          "per row (0 = none).");
ABSL_FLAG(std::string, csv, "bench.csv", "bench: CSV output file (\"\" = none).");
ABSL_FLAG(std::string, svg, "bench.svg",
          "bench: SVG chart of time and memory against N (\"\" = none).");
ABSL_FLAG(
    bool, decode, false,
    "bench: the decode benchmark instead: per-step wall and compute of Decode over "
    "server-resident caches (--lengths, --batches, --steps), bytes sent beside stateless "
    "Tiled calls (--repeats of them), cache read bandwidth against this machine's memory "
    "read. Its defaults where those flags are not given: --heads 32 --kv-heads 8 --head-dim 128 "
    "--dtype bf16 --steps 20.");
ABSL_FLAG(std::string, lengths, "1k,2k,4k,8k,16k,32k",
          "bench --decode: cache lengths (tokens cached before the timed steps; k = ×1024).");
ABSL_FLAG(bool, shm, false,
          "bench --decode: send each step's q, k, v and take its outputs through a /dev/shm "
          "region registered with the server (attnd --allow-shared-memory, on this machine; "
          "e.g. --target unix:/run/attnd.sock) instead of in the messages.");
ABSL_FLAG(std::string, batches, "1,16",
          "bench --decode: sequences per Decode call (one cache each).");
ABSL_FLAG(std::string, to, "",
          "cache export: the file to write the export to; cache move: the server (host:port) to "
          "move the cache to.");
ABSL_FLAG(std::string, from, "", "cache move: the server (host:port) holding the cache.");
ABSL_FLAG(bool, new_id, false,
          "cache import, cache move: give the cache a new id when its own is taken on the target "
          "server (otherwise ALREADY_EXISTS).");
ABSL_FLAG(std::string, cache, "",
          "naive/tiled/trace: attend over this KV cache's keys and values (attn cache create) "
          "instead of inline ones; only the query of --random 1,H,N,D or --example is sent.");

namespace {

namespace v1 = attention::v1;
using attn::cli::Inputs;

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attn: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

absl::StatusOr<Inputs> ReadInputs() {
  const std::string example = absl::GetFlag(FLAGS_example);
  const std::string random = absl::GetFlag(FLAGS_random);
  absl::StatusOr<v1::DType> dtype = attn::cli::ParseTensorDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  if (!example.empty() && !random.empty()) {
    return absl::InvalidArgumentError("give --example or --random, not both");
  }
  if (example == "seed") {
    Inputs inputs = attn::cli::SeedExample(absl::GetFlag(FLAGS_query_multiplier));
    inputs.dtype = *dtype;
    return inputs;
  }
  if (!example.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --example \"", example, "\"; the built-in example is: seed"));
  }
  if (random.empty()) {
    return absl::InvalidArgumentError("give inputs: --example seed or --random B,H,N,D");
  }
  int64_t query_len = absl::GetFlag(FLAGS_query_len);
  std::string spec = random;
  std::vector<int64_t> cu_q, cu_k;
  if (const std::string seqlens = absl::GetFlag(FLAGS_seqlens); !seqlens.empty()) {
    // A ragged batch: keys and values of sum(K) rows, a query of sum(Q) (as --query-len's).
    if (query_len != 0) {
      return absl::InvalidArgumentError("give --seqlens or --query-len, not both");
    }
    if (absl::Status parsed = attn::cli::ParseSeqlens(seqlens, &cu_q, &cu_k); !parsed.ok()) {
      return parsed;
    }
    std::vector<std::string> dims = absl::StrSplit(random, ',');  // B,H,N,D (RandomInputs checks)
    int64_t batch = 0;
    if (dims.size() == 4 && absl::SimpleAtoi(dims[0], &batch) && batch != 1) {
      return absl::InvalidArgumentError(
          "--seqlens packs its sequences into one batch entry: give --random 1,H,N,D (N is then "
          "replaced by the lengths' sums)");
    }
    if (dims.size() == 4) dims[2] = absl::StrCat(cu_k.back());
    spec = absl::StrJoin(dims, ",");
    query_len = cu_q.back();
  }
  absl::StatusOr<Inputs> inputs = attn::cli::RandomInputs(spec, absl::GetFlag(FLAGS_kv_heads),
                                                          absl::GetFlag(FLAGS_seed), *dtype);
  if (inputs.ok() && !cu_q.empty()) {
    inputs->cu_seqlens_q = std::move(cu_q);
    inputs->cu_seqlens_k = std::move(cu_k);
  }
  if (!inputs.ok() || query_len == 0) return inputs;
  if (query_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--query-len must be ≥ 1, got ", query_len));
  }
  // Queries of their own shape, from another seed (the keys' stream is left as it was).
  const std::vector<int64_t>& shape = inputs->query.shape;  // [B, H, N, D]
  absl::StatusOr<Inputs> queries = attn::cli::RandomInputs(
      absl::StrCat(shape[0], ",", shape[1], ",", query_len, ",", shape[3]),
      absl::GetFlag(FLAGS_kv_heads), absl::GetFlag(FLAGS_seed) ^ 0x9e3779b97f4a7c15, *dtype);
  if (!queries.ok()) return queries.status();
  inputs->query = std::move(queries->query);
  return inputs;
}

// The options the flags give, for a request of `heads` query heads (--alibi's slopes, --sinks).
absl::StatusOr<v1::AttentionOptions> ReadOptions(int64_t heads) {
  v1::AttentionOptions options;
  if (absl::Status window = attn::cli::ParseWindow(absl::GetFlag(FLAGS_window), &options);
      !window.ok()) {
    return window;
  }
  if (absl::Status alibi = attn::cli::ParseAlibi(absl::GetFlag(FLAGS_alibi), heads, &options);
      !alibi.ok()) {
    return alibi;
  }
  if (absl::Status sinks = attn::cli::ParseSinks(absl::GetFlag(FLAGS_sinks), heads, &options);
      !sinks.ok()) {
    return sinks;
  }
  options.set_causal(absl::GetFlag(FLAGS_causal));
  options.set_softcap(static_cast<float>(absl::GetFlag(FLAGS_softcap)));
  options.set_block_k(absl::GetFlag(FLAGS_block_k));
  options.set_return_lse(absl::GetFlag(FLAGS_lse));
  options.set_key_position(absl::GetFlag(FLAGS_key_position));
  if (absl::GetFlag(FLAGS_query_position) != -1) {
    options.set_query_position(absl::GetFlag(FLAGS_query_position));
  }
  return options;
}

// The naive/tiled/trace request: the inputs inline or, with --cache, their query alone over
// that cache's keys and values.
absl::StatusOr<v1::AttentionRequest> ReadRequest() {
  absl::StatusOr<Inputs> inputs = ReadInputs();
  if (!inputs.ok()) return inputs.status();
  const std::string cache_id = absl::GetFlag(FLAGS_cache);
  const std::vector<int64_t>& shape = inputs->query.shape;  // [heads,] query_len, head_dim
  absl::StatusOr<v1::AttentionOptions> options =
      ReadOptions(shape.size() >= 3 ? shape[shape.size() - 3] : 1);
  if (!options.ok()) return options.status();
  if (cache_id.empty()) return attn::cli::MakeRequest(*inputs, *options);
  return attn::client::CacheRequest(cache_id, attn::client::ToTensor(inputs->query, inputs->dtype),
                                    *options);
}

// The server to call: `client`, or with --cache the --target endpoint holding that cache (a
// list's endpoints are asked in turn, as attn cache does); `servers` keeps that endpoint's
// Client alive.
absl::StatusOr<attn::client::Client*> ServerFor(
    attn::client::Client& client, const attn::client::ClientOptions& options,
    std::optional<attn::client::MultiServerClient>& servers) {
  const std::string cache_id = absl::GetFlag(FLAGS_cache);
  if (cache_id.empty()) return &client;
  servers.emplace(attn::client::SplitEndpoints(absl::GetFlag(FLAGS_target)), options);
  return servers->ClientFor(cache_id);
}

absl::StatusOr<std::vector<v1::RowRef>> ReadRows() {
  std::vector<v1::RowRef> rows;
  const std::string spec = absl::GetFlag(FLAGS_rows);
  if (spec.empty()) return rows;
  for (const absl::string_view part : absl::StrSplit(spec, ',')) {
    const std::vector<absl::string_view> fields = absl::StrSplit(part, ':');
    int64_t values[3];
    if (fields.size() != 3 || !absl::SimpleAtoi(fields[0], &values[0]) ||
        !absl::SimpleAtoi(fields[1], &values[1]) || !absl::SimpleAtoi(fields[2], &values[2])) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rows expects batch:head:row,..., got \"", part, "\""));
    }
    v1::RowRef& row = rows.emplace_back();
    row.set_batch(values[0]);
    row.set_head(values[1]);
    row.set_row(values[2]);
  }
  return rows;
}

int RunCompute(attn::client::Client& default_client, const std::string& method,
               const attn::client::ClientOptions& options) {
  absl::StatusOr<v1::AttentionRequest> read = ReadRequest();
  if (!read.ok()) return Fail(read.status());
  const v1::AttentionRequest& request = *read;
  std::optional<attn::client::MultiServerClient> cache_endpoints;
  absl::StatusOr<attn::client::Client*> server =
      ServerFor(default_client, options, cache_endpoints);
  if (!server.ok()) return Fail(server.status());
  attn::client::Client& client = **server;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::AttentionResponse> response;
  const bool shard_heads = absl::GetFlag(FLAGS_shard_heads);
  const bool shard_keys = absl::GetFlag(FLAGS_shard_keys);
  if (shard_heads || shard_keys) {
    const attn::client::Sharding sharding = !shard_keys   ? attn::client::Sharding::kHeads
                                            : shard_heads ? attn::client::Sharding::kHeadsAndKeys
                                                          : attn::client::Sharding::kKeys;
    attn::client::MultiServerClient servers(
        attn::client::SplitEndpoints(absl::GetFlag(FLAGS_target)), options);
    attn::client::ShardReport report;
    response = method == "naive" ? servers.Naive(request, &report, sharding)
                                 : servers.Tiled(request, &report, sharding);
    for (size_t i = 0; i < report.parts.size(); ++i) {
      const attn::client::ShardReport::Part& part = report.parts[i];
      if (part.retried) {
        std::fprintf(stderr, "shard: part %zu retried after %s\n", i + 1, part.first_error.c_str());
      }
      const std::string keys =
          part.key_slice ? absl::StrCat(" keys [", part.key_begin, ", ", part.key_end, ")") : "";
      std::fprintf(stderr, "shard: part %zu/%zu units [%lld, %lld)%s -> %s\n", i + 1,
                   report.parts.size(), static_cast<long long>(part.first_unit),
                   static_cast<long long>(part.first_unit + part.units), keys.c_str(),
                   part.endpoint.c_str());
    }
  } else {
    response = method == "naive" ? client.Naive(request) : client.Tiled(request);
  }
  const int64_t round_trip_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  if (!response.ok()) return Fail(response.status());
  absl::StatusOr<attn::client::Array> output = attn::client::FromTensor(response->output());
  if (!output.ok()) return Fail(output.status());
  if (const std::string path = absl::GetFlag(FLAGS_output_file); !path.empty()) {
    const absl::Status written =
        attn::cli::WriteFile(path, response->output().data() + response->lse().data());
    if (!written.ok()) return Fail(written);
  }
  attn::cli::PrintResult(stdout, method == "naive" ? "Naive" : "Tiled", *response, *output,
                         round_trip_ns, absl::GetFlag(FLAGS_print_rows));
  return 0;
}

int RunTrace(attn::client::Client& default_client, const attn::client::ClientOptions& options) {
  absl::StatusOr<v1::AttentionRequest> attention = ReadRequest();
  if (!attention.ok()) return Fail(attention.status());
  absl::StatusOr<std::vector<v1::RowRef>> rows = ReadRows();
  if (!rows.ok()) return Fail(rows.status());
  v1::TraceRequest request;
  *request.mutable_attention() = *std::move(attention);
  for (const v1::RowRef& row : *rows) *request.add_rows() = row;
  if (absl::GetFlag(FLAGS_follow) && absl::GetFlag(FLAGS_json)) {
    return Fail(absl::InvalidArgumentError("--follow and --json: choose one"));
  }
  if (absl::GetFlag(FLAGS_shard_keys)) {  // Each endpoint traces its slice; then the merge.
    if (absl::GetFlag(FLAGS_follow)) {
      return Fail(absl::InvalidArgumentError("--follow and --shard-keys: choose one"));
    }
    const absl::Status status =
        attn::cli::RunShardedTrace(attn::client::SplitEndpoints(absl::GetFlag(FLAGS_target)),
                                   options, request, absl::GetFlag(FLAGS_json), stdout);
    return status.ok() ? 0 : Fail(status);
  }
  std::optional<attn::client::MultiServerClient> cache_endpoints;
  absl::StatusOr<attn::client::Client*> server =
      ServerFor(default_client, options, cache_endpoints);
  if (!server.ok()) return Fail(server.status());
  attn::client::Client& client = **server;
  if (absl::GetFlag(FLAGS_follow_ms) < 0) {
    return Fail(absl::InvalidArgumentError("--follow-ms must be ≥ 0"));
  }
  std::function<void(const v1::TraceEvent&)> show;
  attn::cli::TraceRenderer renderer(stdout);
  attn::cli::TraceFollower follower(stdout, absl::GetFlag(FLAGS_follow_ms), isatty(1) != 0);
  if (absl::GetFlag(FLAGS_json)) {
    show = [](const v1::TraceEvent& event) {
      std::string line;
      google::protobuf::util::JsonPrintOptions options;
      options.add_whitespace = false;
      (void)google::protobuf::util::MessageToJsonString(event, &line, options);
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    };
  } else if (absl::GetFlag(FLAGS_follow)) {
    show = [&](const v1::TraceEvent& event) { follower.OnEvent(event); };
  } else {
    show = [&](const v1::TraceEvent& event) { renderer.OnEvent(event); };
  }
  const absl::Status status = client.Trace(request, [&](const v1::TraceEvent& event) {
    show(event);
    return true;
  });
  return status.ok() ? 0 : Fail(status);
}

// Names of the flags given on the command line (underscored, as Abseil spells them): bench
// --decode's shape flags have defaults of their own when absent.
std::set<std::string>& GivenFlags() {
  static std::set<std::string> given;
  return given;
}

void NoteGivenFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    const std::string name = arg.substr(arg.find_first_not_of('-'));
    GivenFlags().insert(name.substr(0, name.find('=')));
  }
}

// The flag's value when given on the command line, else `fallback`.
template <typename T>
T FlagOr(const absl::Flag<T>& flag, const char* name, T fallback) {
  return GivenFlags().count(name) > 0 ? absl::GetFlag(flag) : fallback;
}

int RunDecodeBench(attn::client::Client& client) {
  attn::cli::DecodeBenchConfig config;
  absl::StatusOr<std::vector<int64_t>> lengths =
      attn::cli::ParseCounts("lengths", absl::GetFlag(FLAGS_lengths));
  if (!lengths.ok()) return Fail(lengths.status());
  absl::StatusOr<std::vector<int64_t>> batches =
      attn::cli::ParseCounts("batches", absl::GetFlag(FLAGS_batches));
  if (!batches.ok()) return Fail(batches.status());
  absl::StatusOr<v1::DType> dtype =
      attn::cli::ParseDType(FlagOr(FLAGS_dtype, "dtype", std::string("bf16")));
  if (!dtype.ok()) return Fail(dtype.status());
  config.lengths = *std::move(lengths);
  config.batches = *std::move(batches);
  config.dtype = *dtype;
  config.heads = FlagOr(FLAGS_heads, "heads", int64_t{32});
  config.kv_heads = FlagOr(FLAGS_kv_heads, "kv_heads", int64_t{8});
  if (config.kv_heads == 0) config.kv_heads = config.heads;
  config.head_dim = FlagOr(FLAGS_head_dim, "head_dim", FlagOr(FLAGS_dim, "dim", int64_t{128}));
  config.value_dim =
      absl::GetFlag(FLAGS_value_dim) > 0 ? absl::GetFlag(FLAGS_value_dim) : config.head_dim;
  config.steps = FlagOr(FLAGS_steps, "steps", int64_t{20});
  config.stateless_repeats = absl::GetFlag(FLAGS_repeats);
  config.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<v1::AttentionOptions> options = ReadOptions(config.heads);
  if (!options.ok()) return Fail(options.status());
  config.options = *std::move(options);
  config.options.set_return_lse(false);
  config.target = absl::GetFlag(FLAGS_target);
  config.shm = absl::GetFlag(FLAGS_shm);
  const absl::Status status = attn::cli::RunDecodeBench(client, config, stdout, stderr);
  return status.ok() ? 0 : Fail(status);
}

int RunBench(attn::client::Client& client) {
  if (absl::GetFlag(FLAGS_decode)) return RunDecodeBench(client);
  if (!absl::GetFlag(FLAGS_example).empty() || !absl::GetFlag(FLAGS_random).empty()) {
    return Fail(absl::InvalidArgumentError(
        "bench makes its own inputs: set them with --ns, --batch, --heads and --dim"));
  }
  attn::cli::BenchConfig config;
  absl::StatusOr<std::vector<int64_t>> ns = attn::cli::ParseNs(absl::GetFlag(FLAGS_ns));
  if (!ns.ok()) return Fail(ns.status());
  absl::StatusOr<std::vector<std::string>> methods =
      attn::cli::ParseMethods(absl::GetFlag(FLAGS_methods));
  if (!methods.ok()) return Fail(methods.status());
  absl::StatusOr<v1::DType> dtype = attn::cli::ParseTensorDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status());
  config.ns = *std::move(ns);
  config.methods = *std::move(methods);
  config.dtype = *dtype;
  config.batch = absl::GetFlag(FLAGS_batch);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  config.dim = absl::GetFlag(FLAGS_dim);
  config.repeats = absl::GetFlag(FLAGS_repeats);
  config.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<v1::AttentionOptions> options = ReadOptions(config.heads);
  if (!options.ok()) return Fail(options.status());
  config.options = *std::move(options);
  config.options.set_return_lse(false);
  if (config.batch < 1 || config.heads < 1 || config.dim < 1) {
    return Fail(absl::InvalidArgumentError("--batch, --heads and --dim must be positive"));
  }
  if (config.repeats < 1) return Fail(absl::InvalidArgumentError("--repeats must be positive"));

  absl::StatusOr<attn::cli::BenchResult> result = attn::cli::RunSweep(client, config, stderr);
  if (!result.ok()) return Fail(result.status());
  attn::cli::PrintTable(stdout, *result);
  std::fflush(stdout);
  for (const auto& [path, contents] :
       {std::pair{absl::GetFlag(FLAGS_csv), attn::cli::ToCsv(*result)},
        std::pair{absl::GetFlag(FLAGS_svg), attn::cli::RenderSvg(attn::cli::MakeChart(*result))}}) {
    if (path.empty()) continue;
    const absl::Status written = attn::cli::WriteFile(path, contents);
    if (!written.ok()) return Fail(written);
    std::fprintf(stderr, "wrote %s\n", path.c_str());
  }
  return 0;
}

int RunInfo(attn::client::Client& client) {
  absl::StatusOr<v1::ServerInfo> info = client.Info();
  if (!info.ok()) return Fail(info.status());
  std::printf("attnd %s\n  backend             %s\n  device              %s\n",
              info->version().c_str(), info->backend().c_str(), info->device().c_str());
  std::printf("  device memory       %lld bytes\n  max message         %lld bytes\n",
              static_cast<long long>(info->device_memory_bytes()),
              static_cast<long long>(info->max_message_bytes()));
  std::printf("  max naive storage   %lld bytes\n  default block_k     %d\n  dtypes             ",
              static_cast<long long>(info->max_naive_bytes()), info->default_block_k());
  for (int dtype : info->dtypes()) std::printf(" %s", v1::DType_Name(dtype).c_str());
  std::printf("\n  cache budget        %lld bytes, pages of %lld tokens\n",
              static_cast<long long>(info->cache_bytes()),
              static_cast<long long>(info->cache_page_tokens()));
  std::printf("  cache idle expiry   %s\n",
              info->cache_idle_seconds() > 0
                  ? absl::StrCat(info->cache_idle_seconds(), " s").c_str()
                  : "never");
  std::printf("  max caches          %lld\n  max in-flight bytes %lld\n  trace idle limit    %s\n",
              static_cast<long long>(info->max_caches()),
              static_cast<long long>(info->max_inflight_bytes()),
              info->trace_idle_seconds() > 0
                  ? absl::StrCat(info->trace_idle_seconds(), " s").c_str()
                  : "never");
  return 0;
}

int RunHealth(attn::client::Client& client) {
  auto status = client.Health();
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int RunCaches(const std::vector<std::string>& words, const attn::client::ClientOptions& options) {
  if (options.load_balancing == attn::client::LoadBalancing::kRoundRobin) {
    return Fail(absl::InvalidArgumentError(
        "a cache lives on one server: --lb round_robin would spread its calls over several; give "
        "the servers as a --target list instead (each cache stays where it was created)"));
  }
  absl::StatusOr<v1::DType> dtype = attn::cli::ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status());
  attn::cli::CacheFlags flags;
  flags.heads = absl::GetFlag(FLAGS_heads);
  flags.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  flags.head_dim = absl::GetFlag(FLAGS_head_dim);
  flags.value_dim = absl::GetFlag(FLAGS_value_dim);
  flags.dtype = *dtype;
  flags.values_from_keys = absl::GetFlag(FLAGS_values_from_keys);
  flags.tokens = absl::GetFlag(FLAGS_tokens);
  flags.steps = absl::GetFlag(FLAGS_steps);
  flags.expected_length = absl::GetFlag(FLAGS_expected_length);
  flags.keep = absl::GetFlag(FLAGS_keep);
  if (GivenFlags().count("length") > 0) flags.length = absl::GetFlag(FLAGS_length);
  flags.seed = absl::GetFlag(FLAGS_seed);
  flags.json = absl::GetFlag(FLAGS_json);
  flags.shard_keys = absl::GetFlag(FLAGS_shard_keys);
  flags.to = absl::GetFlag(FLAGS_to);
  flags.from = absl::GetFlag(FLAGS_from);
  flags.new_id = absl::GetFlag(FLAGS_new_id);
  flags.client_options = options;
  absl::StatusOr<v1::AttentionOptions> attention_options = ReadOptions(flags.heads);
  if (!attention_options.ok()) return Fail(attention_options.status());
  flags.options = *std::move(attention_options);
  attn::client::MultiServerClient client(attn::client::SplitEndpoints(absl::GetFlag(FLAGS_target)),
                                         options);
  const absl::Status status =
      words[0] == "decode"
          ? attn::cli::RunDecodeDemo(client, flags, stdout)
          : attn::cli::RunCacheCommand(client, {words.begin() + 1, words.end()}, flags, stdout);
  return status.ok() ? 0 : Fail(status);
}

// Fills the TLS and token fields of `options` from --tls-ca, --tls-cert, --tls-key and
// --token-file. INVALID_ARGUMENT names the flag whose file is unreadable or unusable.
absl::Status ReadSecurityFlags(attn::client::ClientOptions& options) {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together: give both or neither");
  }
  if (!cert.empty() && ca.empty()) {
    return absl::InvalidArgumentError("--tls-cert needs TLS: give --tls-ca too");
  }
  for (const auto& [flag, path, field] : {std::tuple{"--tls-ca", ca, &options.tls_ca},
                                          std::tuple{"--tls-cert", cert, &options.tls_cert},
                                          std::tuple{"--tls-key", key, &options.tls_key}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> pem = attn::ReadPemFile(flag, path);
    if (!pem.ok()) return pem.status();
    *field = *std::move(pem);
  }
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = attn::ReadTokenFile("--token-file", token_file);
    if (!token.ok()) return token.status();
    options.token = *std::move(token);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // As in attnd (server/main.cc): no lock-order detection on every gRPC lock of every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "attn <info|health|naive|tiled|trace|bench|cache ...|decode> [flags]: call an attnd "
      "server.\n"
      "  attn tiled --example seed            the explainer's 8×4 example\n"
      "  attn naive --random 1,8,2048,64      a random problem [batch, heads, seq, dim]\n"
      "  attn tiled --random 1,8,4096,64 --causal --target h1:p1,h2:p2 --shard-keys   the keys "
      "split over two servers, merged\n"
      "  attn trace --example seed --block-k 2   every online-softmax step of row 0\n"
      "  attn bench --ns 256,512,1024,2048,4096   Naive vs Tiled against N: table, CSV, SVG\n"
      "  attn bench --decode                  decode steps over server-resident caches vs "
      "stateless calls\n"
      "  attn cache create --kv-heads 8 --head-dim 128 --dtype bf16   a server-resident KV cache\n"
      "  attn cache create --kv-heads 1 --head-dim 576 --value-dim 512 --dtype bf16 "
      "--values-from-keys   a latent (MLA) cache: keys only\n"
      "  attn cache append ID --tokens 1000   1000 random tokens; also: cache info|delete ID, "
      "cache list\n"
      "  attn cache truncate ID --keep 900    drops the tokens from 900 on (rejected drafts)\n"
      "  attn cache fork ID [--length 900]    a new cache of its first 900 tokens (all without "
      "--length), sharing its pages\n"
      "  attn cache export ID --to FILE       the cache's tokens into a file; attn cache import "
      "FILE [--new-id] puts it back\n"
      "  attn cache move ID --from HOST:PORT --to HOST:PORT [--new-id]   streamed to another "
      "server, checked (length, CRC32C), then deleted on the first\n"
      "  attn decode --heads 32 --kv-heads 8 --head-dim 128 --tokens 4096 --steps 16   a decode "
      "loop:\n"
      "      per-step latency and bytes sent, beside a stateless Tiled call's\n"
      "  attn tiled --cache ID --random 1,32,1,128   attend over a cache's keys (also naive, "
      "trace)\n"
      "  attn tiled --random 1,8,1,64 --seqlens 5,1,40/7,1,33 --causal   a ragged batch of three "
      "sequences");
  attn::DashedFlags flags(argc, argv);
  NoteGivenFlags(flags.argc(), flags.argv());
  const std::vector<char*> args = absl::ParseCommandLine(flags.argc(), flags.argv());
  const std::vector<std::string> words(args.begin() + 1, args.end());
  if (words.empty() || (words.size() != 1 && words[0] != "cache")) {
    std::fprintf(stderr,
                 "attn: give one command: info, health, naive, tiled, trace, bench, cache "
                 "create|append|truncate|fork|info|list|delete|export|import|move or decode "
                 "(--help)\n");
    return 2;
  }
  const std::string command = words[0];
  attn::client::ClientOptions options;
  if (absl::GetFlag(FLAGS_timeout_ms) > 0) {
    options.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  }
  if (const absl::Status security = ReadSecurityFlags(options); !security.ok()) {
    return Fail(security);
  }
  absl::StatusOr<attn::client::LoadBalancing> lb =
      attn::client::ParseLoadBalancing(absl::GetFlag(FLAGS_lb));
  if (!lb.ok()) return Fail(lb.status());
  options.load_balancing = *lb;
  // --shard-heads, --shard-keys, --cache, cache and decode dial each endpoint on its own
  // channel, so their list may hold host names.
  const bool per_endpoint = absl::GetFlag(FLAGS_shard_heads) || absl::GetFlag(FLAGS_shard_keys) ||
                            !absl::GetFlag(FLAGS_cache).empty() || command == "cache" ||
                            command == "decode";
  if (const absl::StatusOr<std::string> target =
          attn::client::ChannelTarget(absl::GetFlag(FLAGS_target));
      !target.ok() && !per_endpoint) {
    return Fail(target.status());
  }
  if (absl::GetFlag(FLAGS_shard_heads) && command != "naive" && command != "tiled") {
    return Fail(absl::InvalidArgumentError("--shard-heads applies to naive and tiled"));
  }
  if (absl::GetFlag(FLAGS_shard_keys) && command != "naive" && command != "tiled" &&
      command != "trace" && command != "decode") {
    return Fail(
        absl::InvalidArgumentError("--shard-keys applies to naive, tiled, trace and decode"));
  }
  if ((absl::GetFlag(FLAGS_key_position) != 0 || absl::GetFlag(FLAGS_query_position) != -1) &&
      command != "naive" && command != "tiled" && command != "trace") {
    return Fail(absl::InvalidArgumentError(
        "--key-position and --query-position apply to naive, tiled and trace (attn decode places "
        "its queries after the cache's tokens)"));
  }
  if (!absl::GetFlag(FLAGS_cache).empty() &&
      (absl::GetFlag(FLAGS_shard_heads) || absl::GetFlag(FLAGS_shard_keys) ||
       (command != "naive" && command != "tiled" && command != "trace"))) {
    return Fail(absl::InvalidArgumentError(
        "--cache applies to naive, tiled and trace, without --shard-heads or --shard-keys (a "
        "cache lives on one server)"));
  }
  if (absl::GetFlag(FLAGS_query_len) != 0 && absl::GetFlag(FLAGS_random).empty()) {
    return Fail(absl::InvalidArgumentError("--query-len applies to --random inputs"));
  }
  if (!absl::GetFlag(FLAGS_seqlens).empty() &&
      (absl::GetFlag(FLAGS_random).empty() || !absl::GetFlag(FLAGS_cache).empty() ||
       (command != "naive" && command != "tiled" && command != "trace"))) {
    return Fail(absl::InvalidArgumentError(
        "--seqlens applies to naive, tiled and trace over --random 1,H,N,D inputs (not --cache: "
        "a cache is one sequence)"));
  }
  if (absl::GetFlag(FLAGS_values_from_keys) && command != "decode" &&
      !(command == "cache" && words.size() > 1 && words[1] == "create")) {
    return Fail(absl::InvalidArgumentError(
        "--values-from-keys applies to cache create and decode (a cache's other commands read "
        "whether it is latent from the server)"));
  }
  if (absl::GetFlag(FLAGS_shm) && !(command == "bench" && absl::GetFlag(FLAGS_decode))) {
    return Fail(absl::InvalidArgumentError("--shm applies to bench --decode"));
  }
  if (GivenFlags().count("length") > 0 &&
      !(command == "cache" && words.size() > 1 && words[1] == "fork")) {
    return Fail(absl::InvalidArgumentError(
        "--length applies to cache fork (cache truncate takes --keep, bench --decode --lengths)"));
  }
  if (command == "cache" || command == "decode") return RunCaches(words, options);
  attn::client::Client client(absl::GetFlag(FLAGS_target), options);
  if (command == "naive" || command == "tiled") return RunCompute(client, command, options);
  if (command == "trace") return RunTrace(client, options);
  if (command == "bench") return RunBench(client);
  if (command == "info") return RunInfo(client);
  if (command == "health") return RunHealth(client);
  std::fprintf(stderr,
               "attn: unknown command \"%s\": use info, health, naive, tiled, trace, bench, cache "
               "or decode\n",
               command.c_str());
  return 2;
}
