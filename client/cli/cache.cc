#include "client/cli/cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/render.h"
#include "client/client.h"
#include "client/sharded_cache.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"

namespace attn::cli {
namespace {

namespace v1 = attention::v1;

// Random tensor data as sent and, beside it, the values the server stores (rounded to dtype).
struct Tokens {
  v1::Tensor tensor;
  std::vector<float> stored;
};

Tokens RandomTokens(std::mt19937_64& rng, std::vector<int64_t> shape, v1::DType dtype) {
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  client::Array array;
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  array.shape = std::move(shape);
  array.values.resize(elements);
  for (float& x : array.values) x = uniform(rng);
  Tokens tokens;
  tokens.tensor = client::ToTensor(array, dtype);
  tokens.stored = client::FromTensor(tokens.tensor)->values;  // Well-formed: made just above.
  return tokens;
}

int64_t ElementBytes(v1::DType dtype) {
  return ElementSize(FromProtoDType(dtype).value_or(DType::kFloat32));
}

std::string Millis(int64_t ns) { return absl::StrFormat("%.3f ms", static_cast<double>(ns) / 1e6); }

std::string Json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

void PrintInfo(std::FILE* out, const v1::CacheInfo& info, bool json) {
  if (json) {
    absl::FPrintF(out, "%s\n", Json(info));
    return;
  }
  absl::FPrintF(out, "cache %s\n", info.cache_id());
  absl::FPrintF(
      out, "  kv_heads %d, head_dim %d, value_dim %d, %s%s\n", info.kv_heads(), info.head_dim(),
      info.value_dim(), v1::DType_Name(info.dtype()),
      info.values_from_keys() ? ", latent: values from keys (the first value_dim columns)" : "");
  absl::FPrintF(out, "  length %d tokens, %s in pages of %d tokens\n", info.length(),
                Bytes(info.bytes()), info.page_tokens());
  if (info.shared_bytes() > 0) {
    absl::FPrintF(out,
                  "  shared %s of them with other caches (counted once against --cache-bytes)\n",
                  Bytes(info.shared_bytes()));
  }
  if (info.has_durable_length()) {
    absl::FPrintF(out, "  durable %d tokens (on the server's disk)\n", info.durable_length());
  }
  if (info.has_crc32c()) absl::FPrintF(out, "  CRC32C 0x%08x\n", info.crc32c());
}

// Appends `count` random tokens [kv_heads, ·, head_dim | value_dim] in `dtype` through `append`
// (which returns the length after its append), in appends of at most kFillChunkBytes;
// `stored_keys` and `stored_values` (one vector per kv head, null = not kept) receive them as
// stored. A latent cache (`shape.values_from_keys()`) gets keys alone (value null), and each
// stored value is the first value_dim columns of its key.
using AppendFunction =
    std::function<absl::StatusOr<int64_t>(const v1::Tensor& key, const v1::Tensor* value)>;

// The values a cache of `shape` holds for tokens `key` [kv_heads, n, head_dim] and `value`
// [kv_heads, n, value_dim], as stored: a latent cache's are its keys' first value_dim columns.
std::vector<float> StoredValues(const v1::CacheInfo& shape, const Tokens& key,
                                const Tokens& value) {
  if (!shape.values_from_keys()) return value.stored;
  const int64_t rows = static_cast<int64_t>(key.stored.size()) / shape.head_dim();
  std::vector<float> values;
  values.reserve(rows * shape.value_dim());
  for (int64_t row = 0; row < rows; ++row) {
    const auto first = key.stored.begin() + row * shape.head_dim();
    values.insert(values.end(), first, first + shape.value_dim());
  }
  return values;
}

absl::Status Fill(const AppendFunction& append, const v1::CacheInfo& shape, int64_t length,
                  int64_t count, std::mt19937_64& rng, std::vector<std::vector<float>>* stored_keys,
                  std::vector<std::vector<float>>* stored_values, int* appends) {
  const int64_t kv_heads = shape.kv_heads(), head_dim = shape.head_dim(),
                value_dim = shape.value_dim();
  const bool latent = shape.values_from_keys();
  const v1::DType dtype = TokenDTypeFor(shape.dtype());  // What the tokens travel in.
  const int64_t token_bytes =
      kv_heads * (head_dim + (latent ? 0 : value_dim)) * ElementBytes(dtype);
  const int64_t chunk = std::max<int64_t>(1, kFillChunkBytes / std::max<int64_t>(1, token_bytes));
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(chunk, count - done);
    Tokens key = RandomTokens(rng, {kv_heads, n, head_dim}, dtype);
    Tokens value = latent ? Tokens() : RandomTokens(rng, {kv_heads, n, value_dim}, dtype);
    const absl::StatusOr<int64_t> appended = append(key.tensor, latent ? nullptr : &value.tensor);
    if (!appended.ok()) {
      return absl::Status(appended.status().code(),
                          absl::StrCat("appending tokens [", done, ", ", done + n, ") at length ",
                                       length, ": ", appended.status().message()));
    }
    length = *appended;
    const std::vector<float> values =
        stored_values != nullptr ? StoredValues(shape, key, value) : std::vector<float>();
    for (int64_t h = 0; stored_keys != nullptr && h < kv_heads; ++h) {
      (*stored_keys)[h].insert((*stored_keys)[h].end(), key.stored.begin() + h * n * head_dim,
                               key.stored.begin() + (h + 1) * n * head_dim);
      (*stored_values)[h].insert((*stored_values)[h].end(), values.begin() + h * n * value_dim,
                                 values.begin() + (h + 1) * n * value_dim);
    }
    done += n;
    if (appends != nullptr) ++*appends;
  }
  return absl::OkStatus();
}

// Appends to one cache, as Fill does.
AppendFunction AppendTo(client::Cache& cache) {
  return [&cache](const v1::Tensor& key, const v1::Tensor* value) -> absl::StatusOr<int64_t> {
    absl::StatusOr<v1::CacheInfo> appended =
        value != nullptr ? cache.Append(key, *value) : cache.Append(key);
    if (!appended.ok()) return appended.status();
    return appended->length();
  };
}

// Fill for one cache.
absl::Status Fill(client::Cache& cache, int64_t count, std::mt19937_64& rng,
                  std::vector<std::vector<float>>* stored_keys,
                  std::vector<std::vector<float>>* stored_values, int* appends) {
  return Fill(AppendTo(cache), cache.info(), cache.length(), count, rng, stored_keys, stored_values,
              appends);
}

// The cache `id` on the server holding it; with expected_length ≥ 0 it is believed to hold that
// many tokens (what the next call sends as expected_length), else what the server says.
absl::StatusOr<client::Cache> OpenCache(client::MultiServerClient& client, const std::string& id,
                                        int64_t expected_length = -1) {
  absl::StatusOr<v1::CacheInfo> info = client.GetCacheInfo(id);
  if (!info.ok()) return info.status();
  absl::StatusOr<client::Client*> owner = client.ClientFor(id);
  if (!owner.ok()) return owner.status();
  if (expected_length >= 0) info->set_length(expected_length);
  return client::Cache(**owner, *std::move(info));
}

// Bytes of a serialized length-delimited field (tag < 16) holding `payload` bytes.
int64_t FieldBytes(int64_t payload) {
  return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(payload) + payload;
}

// The size of the stateless AttentionRequest of one decode step: `query` and options, with the
// whole cache (`length` tokens) inline as key [kv_heads, length, head_dim] and value (a latent
// cache's too: a stateless call sends its values).
int64_t StatelessRequestBytes(const v1::Tensor& query, const v1::AttentionOptions& options,
                              const v1::CacheInfo& info, int64_t length) {
  v1::AttentionRequest request;
  *request.mutable_query() = query;
  *request.mutable_options() = options;
  int64_t bytes = static_cast<int64_t>(request.ByteSizeLong());
  for (const int64_t dim : {info.head_dim(), info.value_dim()}) {
    v1::Tensor tensor;  // Shape and dtype; the data's field is added by size.
    for (const int64_t extent : {info.kv_heads(), length, dim}) tensor.add_shape(extent);
    tensor.set_dtype(TokenDTypeFor(info.dtype()));
    const int64_t data = info.kv_heads() * length * dim * ElementBytes(TokenDTypeFor(info.dtype()));
    bytes += FieldBytes(static_cast<int64_t>(tensor.ByteSizeLong()) + FieldBytes(data));
  }
  return bytes;
}

// max |out − ref| / max |ref| for one decode step: softmax(scale · q Kᵀ) V in float64, over the
// stored keys and values, for query [heads, 1, head_dim] (the keys the window leaves the last
// row: all of them without one), each score capped and biased as the options say (softcap ·
// tanh(s / softcap), then −slope · |p − t|), and the head's sink one more term of the softmax
// with no value (attention.proto, AttentionOptions).
double StepError(const std::vector<float>& query, const std::vector<float>& output,
                 const std::vector<std::vector<float>>& keys,
                 const std::vector<std::vector<float>>& values, int64_t heads, int64_t head_dim,
                 int64_t value_dim, double scale, const v1::AttentionOptions& options) {
  const int64_t kv_heads = static_cast<int64_t>(keys.size());
  const int64_t group = heads / kv_heads;
  double worst = 0, largest = 0;
  std::vector<double> scores, row(value_dim);
  for (int64_t h = 0; h < heads; ++h) {
    const std::vector<float>& k = keys[h / group];
    const std::vector<float>& v = values[h / group];
    const int64_t length = static_cast<int64_t>(k.size()) / head_dim;
    // The new token sits at the last position: a left window of L leaves it keys length − 1 − L
    // on (a right window or the causal mask hides nothing, there being no later key).
    const int64_t first =
        options.has_window_left() ? std::max<int64_t>(0, length - 1 - options.window_left()) : 0;
    scores.assign(length, 0);
    double max = -INFINITY;
    for (int64_t j = first; j < length; ++j) {
      double s = 0;
      for (int64_t c = 0; c < head_dim; ++c)
        s += double(query[h * head_dim + c]) * k[j * head_dim + c];
      s *= scale;
      if (options.softcap() > 0) s = options.softcap() * std::tanh(s / options.softcap());
      // The new token, at the last position, is length − 1 − j positions after key j.
      if (options.alibi_slopes_size() > 0) s -= options.alibi_slopes(h) * double(length - 1 - j);
      scores[j] = s;
      max = std::max(max, scores[j]);
    }
    const double sink = options.sinks_size() > 0 ? options.sinks(h) : -INFINITY;
    max = std::max(max, sink);
    double sum = options.sinks_size() > 0 ? std::exp(sink - max) : 0;
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t j = first; j < length; ++j) {
      const double w = std::exp(scores[j] - max);
      sum += w;
      for (int64_t c = 0; c < value_dim; ++c) row[c] += w * v[j * value_dim + c];
    }
    for (int64_t c = 0; c < value_dim; ++c) {
      const double ref = row[c] / sum;
      largest = std::max(largest, std::abs(ref));
      const double out = output[h * value_dim + c];
      worst = std::isnan(out) ? INFINITY : std::max(worst, std::abs(out - ref));
    }
  }
  return largest > 0 ? worst / largest : worst;
}

// ", latent (values from keys)" for a latent cache's request, else "".
const char* LatentNote(const v1::CreateCacheRequest& create) {
  return create.values_from_keys() ? ", latent (values from keys)" : "";
}

int64_t Median(std::vector<int64_t> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

absl::Status NeedId(const std::vector<std::string>& args, const char* command) {
  if (args.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("usage: attn cache ", command, " CACHE_ID"));
  }
  return absl::OkStatus();
}

// The caches' per-part lengths: "1234 + 1233 + 1233".
std::string PartLengths(const client::ShardedCacheInfo& info) {
  std::string text;
  for (const client::ShardedCacheInfo::Part& part : info.parts) {
    absl::StrAppend(&text, text.empty() ? "" : " + ", part.length);
  }
  return text;
}

// The cache a decode demo runs on — one server's (client::Cache) or one spread over every
// endpoint (client::ShardedCache) — as the demo's loop uses it.
struct DemoCache {
  AppendFunction append;  // Fill's.
  // One step: append the token (key, value; value null for a latent cache), attend `query`
  // over the cache. Sets the output, the step's stats and the bytes the step's request(s) took.
  std::function<absl::Status(const v1::Tensor& query, const v1::Tensor& key,
                             const v1::Tensor* value, v1::Tensor* output, v1::ExecutionStats* stats,
                             int64_t* sent)>
      step;
  std::function<int64_t()> length;
  std::function<int64_t()> page_bytes;  // Memory the cache's pages take.
  v1::CacheInfo shape;                  // kv_heads, head_dim, value_dim, dtype, values_from_keys.
  const char* compute_note = "";        // After the median compute: "" or " (slowest part)".
  const char* sent_note = "";           // After the bytes sent: "" or " (all parts)".
};

// attn decode's loop over `cache`: fill, then flags.steps steps, each checked against a float64
// reference over every token sent; prints as RunDecodeDemo says.
absl::Status DecodeLoop(const DemoCache& cache, const CacheFlags& flags, int64_t heads,
                        std::FILE* out) {
  const int64_t kv_heads = cache.shape.kv_heads(), head_dim = cache.shape.head_dim(),
                value_dim = cache.shape.value_dim();
  std::mt19937_64 rng(flags.seed);
  std::vector<std::vector<float>> keys(kv_heads), values(kv_heads);
  int appends = 0;
  const auto fill_start = std::chrono::steady_clock::now();
  const bool latent = cache.shape.values_from_keys();
  if (absl::Status filled = Fill(cache.append, cache.shape, cache.length(), flags.tokens, rng,
                                 &keys, &values, &appends);
      !filled.ok()) {
    return filled;
  }
  const int64_t fill_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - fill_start)
                              .count();
  absl::FPrintF(out, "filled with %d random tokens in %d append%s (%s of pages, %s)\n\n",
                cache.length(), appends, appends == 1 ? "" : "s", Bytes(cache.page_bytes()),
                Millis(fill_ns));
  absl::FPrintF(out, "%5s  %8s  %11s  %11s  %10s  %10s  %8s  %11s\n", "step", "length", "wall",
                "compute", "sent", "stateless", "ratio", "max rel err");
  const double scale =
      flags.options.has_scale() ? flags.options.scale() : 1.0 / std::sqrt(double(head_dim));
  std::vector<int64_t> walls, computes;
  int64_t sent_total = 0, stateless_total = 0;
  double worst = 0;
  for (int64_t step = 1; step <= flags.steps; ++step) {
    // Tensors in the cache's dtype (bf16 for an fp8 cache, whose error below then includes its
    // quantization's: the reference is on the tokens as sent).
    const v1::DType sent_dtype = TokenDTypeFor(flags.dtype);
    const Tokens query = RandomTokens(rng, {heads, 1, head_dim}, sent_dtype);
    const Tokens key = RandomTokens(rng, {kv_heads, 1, head_dim}, sent_dtype);
    const Tokens value =
        latent ? Tokens() : RandomTokens(rng, {kv_heads, 1, value_dim}, sent_dtype);
    v1::Tensor output_tensor;
    v1::ExecutionStats stats;
    int64_t sent = 0;
    const auto start = std::chrono::steady_clock::now();
    const absl::Status stepped = cache.step(
        query.tensor, key.tensor, latent ? nullptr : &value.tensor, &output_tensor, &stats, &sent);
    const int64_t wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - start)
                                .count();
    if (!stepped.ok()) {
      return absl::Status(stepped.code(), absl::StrCat("decode step ", step, " at length ",
                                                       cache.length(), ": ", stepped.message()));
    }
    const std::vector<float> stored_values = StoredValues(cache.shape, key, value);
    for (int64_t h = 0; h < kv_heads; ++h) {
      keys[h].insert(keys[h].end(), key.stored.begin() + h * head_dim,
                     key.stored.begin() + (h + 1) * head_dim);
      values[h].insert(values[h].end(), stored_values.begin() + h * value_dim,
                       stored_values.begin() + (h + 1) * value_dim);
    }
    absl::StatusOr<client::Array> output = client::FromTensor(output_tensor);
    if (!output.ok()) return output.status();
    if (static_cast<int64_t>(output->values.size()) != heads * value_dim) {
      return absl::InternalError(absl::StrCat("decode step ", step, ": output has ",
                                              output->values.size(), " values, expected ",
                                              heads * value_dim));
    }
    const double error = StepError(query.stored, output->values, keys, values, heads, head_dim,
                                   value_dim, scale, flags.options);
    worst = std::max(worst, error);
    const int64_t stateless =
        StatelessRequestBytes(query.tensor, flags.options, cache.shape, cache.length());
    walls.push_back(wall_ns);
    computes.push_back(stats.compute_ns());
    sent_total += sent;
    stateless_total += stateless;
    absl::FPrintF(out, "%5d  %8d  %11s  %11s  %10s  %10s  %7.3f%%  %11.3g\n", step, cache.length(),
                  Millis(wall_ns), Millis(stats.compute_ns()), Bytes(sent), Bytes(stateless),
                  100.0 * double(sent) / double(stateless), error);
  }
  const int64_t steps = flags.steps;
  absl::FPrintF(out,
                "\nper step (median of %d): wall %s, compute %s%s; sent %s%s vs %s for stateless "
                "Tiled (%.3f%%)\n",
                steps, Millis(Median(walls)), Millis(Median(computes)), cache.compute_note,
                Bytes(sent_total / steps), cache.sent_note, Bytes(stateless_total / steps),
                100.0 * double(sent_total) / double(stateless_total));
  absl::FPrintF(out, "max |decode - float64 reference| / max |reference| = %.3g over %d steps\n",
                worst, steps);
  return absl::OkStatus();
}

// attn decode --shard-keys: the demo over a ShardedCache with a part on every endpoint.
absl::Status ShardedDecodeDemo(client::MultiServerClient& client, const CacheFlags& flags,
                               const v1::CreateCacheRequest& create, int64_t heads,
                               std::FILE* out) {
  absl::StatusOr<client::ShardedCache> created = client::ShardedCache::Create(client, create);
  if (!created.ok()) return created.status();
  client::ShardedCache& cache = *created;
  absl::FPrintF(out,
                "decode: %d heads over %d kv heads, head_dim %d, value_dim %d, %s%s; keys sharded "
                "over %d parts\n",
                heads, create.kv_heads(), create.head_dim(), create.value_dim(),
                v1::DType_Name(flags.dtype), LatentNote(create), cache.parts());
  const client::ShardedCacheInfo parts = cache.Info();
  for (size_t i = 0; i < parts.parts.size(); ++i) {
    const client::ShardedCacheInfo::Part& part = parts.parts[i];
    absl::FPrintF(out, "part %d: cache %s on %s\n", i + 1, part.cache_id, part.endpoint);
  }
  DemoCache demo;
  demo.append = [&cache](const v1::Tensor& key,
                         const v1::Tensor* value) -> absl::StatusOr<int64_t> {
    if (absl::Status appended = value != nullptr ? cache.Append(key, *value) : cache.Append(key);
        !appended.ok()) {
      return appended;
    }
    return cache.length();
  };
  demo.step = [&](const v1::Tensor& query, const v1::Tensor& key, const v1::Tensor* value,
                  v1::Tensor* output, v1::ExecutionStats* stats, int64_t* sent) -> absl::Status {
    absl::StatusOr<client::ShardedDecodeResult> result =
        cache.Decode(query, &key, value, flags.options);
    if (!result.ok()) return result.status();
    *output = std::move(result->output);
    *stats = result->stats;
    *sent = result->request_bytes;
    return absl::OkStatus();
  };
  demo.length = [&cache] { return cache.length(); };
  demo.page_bytes = [&cache] {
    int64_t bytes = 0;
    for (const client::ShardedCacheInfo::Part& part : cache.Info().parts) bytes += part.bytes;
    return bytes;
  };
  demo.shape = cache.shape();
  demo.compute_note = " (slowest part)";
  demo.sent_note = " (all parts)";
  // Everything after the create deletes the parts, also on failure.
  absl::Status status = DecodeLoop(demo, flags, heads, out);
  if (status.ok()) {
    const client::ShardedCacheInfo info = cache.Info();
    absl::FPrintF(out, "parts hold %s = %d tokens\n", PartLengths(info), info.length);
    for (size_t i = 0; i < info.parts.size(); ++i) {
      absl::FPrintF(out, "  part %d on %s: %d tokens in %d segment%s\n", i + 1,
                    info.parts[i].endpoint, info.parts[i].length, info.parts[i].segments.size(),
                    info.parts[i].segments.size() == 1 ? "" : "s");
    }
  }
  const absl::Status deleted = cache.Delete();
  if (!status.ok()) return status;
  if (!deleted.ok()) return deleted;
  absl::FPrintF(out, "deleted the %d parts\n", cache.parts());
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCacheCommand(client::MultiServerClient& client,
                             const std::vector<std::string>& args, const CacheFlags& flags,
                             std::FILE* out) {
  if (args.empty()) {
    return absl::InvalidArgumentError(
        "give a cache command: create, append, truncate, fork, info, list, delete, export, import "
        "or move (attn --help)");
  }
  const std::string& command = args[0];
  if (command == "create") {
    if (args.size() != 1) return absl::InvalidArgumentError("usage: attn cache create [flags]");
    v1::CreateCacheRequest request;
    request.set_kv_heads(flags.kv_heads > 0 ? flags.kv_heads : flags.heads);
    request.set_head_dim(flags.head_dim);
    request.set_value_dim(flags.value_dim > 0 ? flags.value_dim : flags.head_dim);
    request.set_dtype(flags.dtype);
    request.set_values_from_keys(flags.values_from_keys);
    absl::StatusOr<v1::CacheInfo> info = client.CreateCache(request);
    if (!info.ok()) return info.status();
    PrintInfo(out, *info, flags.json);
    return absl::OkStatus();
  }
  if (command == "append") {
    if (absl::Status usage = NeedId(args, "append ... --tokens N"); !usage.ok()) return usage;
    if (flags.tokens < 1) return absl::InvalidArgumentError("--tokens must be positive");
    absl::StatusOr<client::Cache> cache = OpenCache(client, args[1], flags.expected_length);
    if (!cache.ok()) return cache.status();
    std::mt19937_64 rng(flags.seed);
    if (absl::Status filled = Fill(*cache, flags.tokens, rng, nullptr, nullptr, nullptr);
        !filled.ok()) {
      return filled;
    }
    PrintInfo(out, cache->info(), flags.json);
    return absl::OkStatus();
  }
  if (command == "truncate") {
    if (absl::Status usage = NeedId(args, "truncate ... --keep N"); !usage.ok()) return usage;
    if (flags.keep < 0) return absl::InvalidArgumentError("--keep N: the tokens to keep (≥ 0)");
    absl::StatusOr<client::Cache> cache = OpenCache(client, args[1], flags.expected_length);
    if (!cache.ok()) return cache.status();
    absl::StatusOr<v1::CacheInfo> info = cache->Truncate(flags.keep);
    if (!info.ok()) return info.status();
    PrintInfo(out, *info, flags.json);
    return absl::OkStatus();
  }
  if (command == "fork") {
    if (args.size() != 2) {
      return absl::InvalidArgumentError(
          "usage: attn cache fork CACHE_ID [--length N] [--expected-length L]");
    }
    absl::StatusOr<client::Cache> cache = OpenCache(client, args[1], flags.expected_length);
    if (!cache.ok()) return cache.status();
    absl::StatusOr<client::Cache> fork = cache->Fork(flags.length);
    if (!fork.ok()) return fork.status();
    PrintInfo(out, fork->info(), flags.json);
    return absl::OkStatus();
  }
  if (command == "info") {
    if (absl::Status usage = NeedId(args, "info"); !usage.ok()) return usage;
    absl::StatusOr<v1::CacheInfo> info = client.GetCacheInfo(args[1]);
    if (!info.ok()) return info.status();
    PrintInfo(out, *info, flags.json);
    return absl::OkStatus();
  }
  if (command == "list") {
    if (args.size() != 1) return absl::InvalidArgumentError("usage: attn cache list");
    absl::StatusOr<v1::ListCachesResponse> list = client.ListCaches();
    if (!list.ok()) return list.status();
    if (flags.json) {
      absl::FPrintF(out, "%s\n", Json(*list));
      return absl::OkStatus();
    }
    if (list->caches().empty()) {
      absl::FPrintF(out, "no caches\n");
      return absl::OkStatus();
    }
    absl::FPrintF(out, "%-32s  %8s  %8s  %9s  %-14s  %8s  %10s  %10s  %s\n", "cache_id", "kv_heads",
                  "head_dim", "value_dim", "dtype", "length", "bytes", "shared", "values");
    for (const v1::CacheInfo& info : list->caches()) {
      absl::FPrintF(out, "%-32s  %8d  %8d  %9d  %-14s  %8d  %10s  %10s  %s\n", info.cache_id(),
                    info.kv_heads(), info.head_dim(), info.value_dim(),
                    v1::DType_Name(info.dtype()), info.length(), Bytes(info.bytes()),
                    Bytes(info.shared_bytes()), info.values_from_keys() ? "from keys" : "stored");
    }
    return absl::OkStatus();
  }
  if (command == "delete") {
    if (absl::Status usage = NeedId(args, "delete"); !usage.ok()) return usage;
    if (absl::Status deleted = client.DeleteCache(args[1]); !deleted.ok()) return deleted;
    absl::FPrintF(out, "deleted cache %s\n", args[1]);
    return absl::OkStatus();
  }
  if (command == "export") {
    if (args.size() != 2 || flags.to.empty()) {
      return absl::InvalidArgumentError("usage: attn cache export CACHE_ID --to FILE");
    }
    absl::StatusOr<client::Client*> owner = client.ClientFor(args[1]);
    if (!owner.ok()) return owner.status();
    absl::StatusOr<v1::CacheInfo> exported = client::ExportCacheToFile(**owner, args[1], flags.to);
    if (!exported.ok()) return exported.status();
    if (flags.json) {
      absl::FPrintF(out, "%s\n", Json(*exported));
      return absl::OkStatus();
    }
    std::error_code error;
    const uintmax_t bytes = std::filesystem::file_size(flags.to, error);
    absl::FPrintF(out, "exported cache %s to %s: %d tokens, CRC32C 0x%08x, %s\n", args[1], flags.to,
                  exported->length(), exported->crc32c(),
                  error ? "?" : Bytes(static_cast<int64_t>(bytes)));
    return absl::OkStatus();
  }
  if (command == "import") {
    if (args.size() != 2) {
      return absl::InvalidArgumentError("usage: attn cache import FILE [--new-id]");
    }
    if (client.endpoints().size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attn cache import puts the cache on one server: give --target one address, not ",
          client.endpoints().size()));
    }
    client::Client server(client.endpoints()[0], flags.client_options);
    absl::StatusOr<v1::CacheInfo> imported =
        client::ImportCacheFromFile(server, args[1], flags.new_id);
    if (!imported.ok()) return imported.status();
    PrintInfo(out, *imported, flags.json);
    return absl::OkStatus();
  }
  if (command == "move") {
    if (args.size() != 2 || flags.from.empty() || flags.to.empty()) {
      return absl::InvalidArgumentError(
          "usage: attn cache move CACHE_ID --from HOST:PORT --to HOST:PORT [--new-id]");
    }
    client::Client from(flags.from, flags.client_options);
    client::Client to(flags.to, flags.client_options);
    absl::StatusOr<v1::CacheInfo> moved = client::MoveCache(from, to, args[1], flags.new_id);
    if (!moved.ok()) return moved.status();
    PrintInfo(out, *moved, flags.json);
    if (!flags.json) {
      absl::FPrintF(out, "moved %s from %s to %s: %d tokens, CRC32C 0x%08x%s\n", args[1],
                    flags.from, flags.to, moved->length(), moved->crc32c(),
                    moved->cache_id() == args[1]
                        ? ""
                        : absl::StrCat("; its id there is ", moved->cache_id()));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown cache command \"", command,
                   "\": use create, append, truncate, fork, info, list, delete, export, "
                   "import or move"));
}

absl::Status RunDecodeDemo(client::MultiServerClient& client, const CacheFlags& flags,
                           std::FILE* out) {
  const int64_t heads = flags.heads;
  const int64_t kv_heads = flags.kv_heads > 0 ? flags.kv_heads : heads;
  const int64_t head_dim = flags.head_dim;
  const int64_t value_dim = flags.value_dim > 0 ? flags.value_dim : head_dim;
  if (heads < 1 || head_dim < 1 || heads % kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: --heads and --head-dim must be positive and --kv-heads must divide --heads (",
        heads, " heads, ", kv_heads, " kv heads, head_dim ", head_dim, ")"));
  }
  if (flags.tokens < 0 || flags.steps < 1) {
    return absl::InvalidArgumentError("decode: --tokens must be ≥ 0 and --steps positive");
  }
  v1::CreateCacheRequest create;
  create.set_kv_heads(kv_heads);
  create.set_head_dim(head_dim);
  create.set_value_dim(value_dim);
  create.set_dtype(flags.dtype);
  create.set_values_from_keys(flags.values_from_keys);
  if (flags.shard_keys) return ShardedDecodeDemo(client, flags, create, heads, out);
  absl::StatusOr<v1::CacheInfo> created = client.CreateCache(create);
  if (!created.ok()) return created.status();
  const std::string id = created->cache_id();
  absl::StatusOr<client::Client*> owner = client.ClientFor(id);
  if (!owner.ok()) return owner.status();
  client::Cache cache(**owner, *created);
  absl::StatusOr<std::string> endpoint = client.EndpointOf(id);
  absl::FPrintF(out, "decode: %d heads over %d kv heads, head_dim %d, value_dim %d, %s%s\n", heads,
                kv_heads, head_dim, value_dim, v1::DType_Name(flags.dtype), LatentNote(create));
  absl::FPrintF(out, "cache %s on %s\n", id, endpoint.ok() ? *endpoint : "?");
  DemoCache demo;
  demo.append = AppendTo(cache);
  demo.step = [&](const v1::Tensor& query, const v1::Tensor& key, const v1::Tensor* value,
                  v1::Tensor* output, v1::ExecutionStats* stats, int64_t* sent) -> absl::Status {
    v1::DecodeRequest request;
    *request.add_items() = cache.Item(query, &key, value);
    *request.mutable_options() = flags.options;
    *sent = static_cast<int64_t>(request.ByteSizeLong());
    absl::StatusOr<v1::DecodeResponse> response = (*owner)->Decode(request);
    if (!response.ok()) return response.status();
    if (response->outputs_size() != 1 || response->caches_size() != 1) {
      return absl::InternalError(absl::StrCat(response->outputs_size(), " outputs for 1 item"));
    }
    cache.Update(response->caches(0), request.items(0));
    *output = response->outputs(0);
    *stats = response->stats();
    return absl::OkStatus();
  };
  demo.length = [&cache] { return cache.length(); };
  demo.page_bytes = [&cache] { return cache.info().bytes(); };
  demo.shape = cache.info();
  // Everything after the create deletes the cache, also on failure.
  const absl::Status status = DecodeLoop(demo, flags, heads, out);
  const absl::Status deleted = client.DeleteCache(id);
  if (!status.ok()) return status;
  if (!deleted.ok()) return deleted;
  absl::FPrintF(out, "deleted cache %s\n", id);
  return absl::OkStatus();
}

}  // namespace attn::cli
