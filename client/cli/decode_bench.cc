#include "client/cli/decode_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/cache.h"
#include "client/cli/render.h"
#include "client/shared_memory.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"

namespace attn::cli {
namespace {

namespace v1 = attention::v1;

// The issue 13 targets' thresholds.
constexpr double kMaxSentShare = 0.001;        // (a) sent / stateless bytes.
constexpr double kMinBandwidthShare = 0.5;     // (b) cache read / memory read bandwidth.
constexpr int64_t kMaxOverheadNs = 2'000'000;  // (c) wall − compute.
// Issue 32's edge targets: wall − compute for 1 × 4096 and 16 × 4096.
constexpr int64_t kMaxEdgeOneNs = 120'000;
constexpr int64_t kMaxEdgeBatchNs = 250'000;
// GetServerInfo calls timed for the bare round trip (the floor of any call on this channel).
constexpr int kFloorCalls = 200;
// The memory-read ceiling: this buffer, summed by every hardware thread, best of kReadRepeats.
constexpr int64_t kReadBufferBytes = int64_t{1} << 30;
constexpr int kReadRepeats = 6;

using Clock = std::chrono::steady_clock;

int64_t Since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

// splitmix64: fast enough to make gigabytes of random tokens without dominating the fill.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1), 24 random bits.
  float Uniform() { return static_cast<float>(Next() >> 40) * 0x1p-23f - 1.f; }

 private:
  uint64_t state_;
};

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (const int64_t extent : shape) elements *= extent;
  return elements;
}

// The dtype of the tensors sent for a cache of `dtype` (TokenDTypeFor: bf16 for an fp8 cache).
DType HostDType(v1::DType dtype) {
  return FromProtoDType(TokenDTypeFor(dtype)).value_or(DType::kFloat32);
}

// A tensor of uniform(−1, 1) values stored in `dtype`.
v1::Tensor RandomTensor(Random& random, const std::vector<int64_t>& shape, v1::DType dtype) {
  v1::Tensor tensor;
  for (const int64_t extent : shape) tensor.add_shape(extent);
  tensor.set_dtype(dtype);
  const DType host = HostDType(dtype);
  const int64_t elements = Elements(shape);
  std::string* data = tensor.mutable_data();
  data->resize(elements * ElementSize(host));
  for (int64_t i = 0; i < elements; ++i) StoreElement(data->data(), host, i, random.Uniform());
  return tensor;
}

// Bytes of a serialized length-delimited field (tag < 16) holding `payload` bytes.
int64_t FieldBytes(int64_t payload) {
  return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(payload) + payload;
}

// Stateless shapes: rank 3 for one sequence (as a decode item's query is), rank 4 for a batch.
std::vector<int64_t> StatelessShape(int64_t batch, int64_t heads, int64_t n, int64_t dim) {
  if (batch == 1) return {heads, n, dim};
  return {batch, heads, n, dim};
}

// The serialized size of the stateless Tiled request of one step: q [batch, heads, 1, head_dim]
// and every sequence's whole K and V (`length` tokens each) inline, with the run's options.
// Exact: the tensors' shape and dtype fields are serialized, their data fields added by size.
int64_t StatelessBytes(const DecodeBenchConfig& config, int64_t batch, int64_t length) {
  const int64_t element = ElementSize(HostDType(config.dtype));
  v1::AttentionRequest request;
  *request.mutable_options() = config.options;
  request.mutable_options()->set_return_lse(false);
  int64_t bytes = static_cast<int64_t>(request.ByteSizeLong());
  const struct {
    int64_t heads, n, dim;
  } tensors[] = {{config.heads, 1, config.head_dim},
                 {config.kv_heads, length, config.head_dim},
                 {config.kv_heads, length, config.value_dim}};
  for (const auto& t : tensors) {
    v1::Tensor tensor;  // Shape and dtype; the data field is added by size.
    const std::vector<int64_t> shape = StatelessShape(batch, t.heads, t.n, t.dim);
    for (const int64_t extent : shape) tensor.add_shape(extent);
    tensor.set_dtype(TokenDTypeFor(config.dtype));
    const int64_t data = Elements(shape) * element;
    bytes += FieldBytes(static_cast<int64_t>(tensor.ByteSizeLong()) + FieldBytes(data));
  }
  return bytes;
}

// The cache bytes one step's compute reads: every item's whole K and V.
int64_t CacheReadBytes(const DecodeBenchConfig& config, int64_t tokens) {
  const DType stored = FromProtoCacheDType(config.dtype).value_or(DType::kFloat32);
  return tokens * config.kv_heads *
         (StoredRowBytes(stored, config.head_dim) + StoredRowBytes(stored, config.value_dim));
}

uint64_t SumWords(const uint64_t* words, int64_t count) {
  // Four independent sums: a loop the compiler vectorizes, limited by memory, not by adds.
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    a += words[i];
    b += words[i + 1];
    c += words[i + 2];
    d += words[i + 3];
  }
  for (; i < count; ++i) a += words[i];
  return (a + b) + (c + d);
}

struct MemoryRead {
  double gb_per_s = 0;                          // The ceiling: the better of the two below.
  double begin_gb_per_s = 0, end_gb_per_s = 0;  // Measured before the first row, after the last.
  int threads = 0;
};

// Reads a kReadBufferBytes buffer (written first, so its pages exist) split evenly over every
// hardware thread; the best of kReadRepeats passes.
MemoryRead MeasureMemoryRead() {
  MemoryRead result;
  result.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t count = kReadBufferBytes / 8;
  std::vector<uint64_t> buffer(count);
  for (int64_t i = 0; i < count; ++i) buffer[i] = static_cast<uint64_t>(i);
  std::vector<uint64_t> sums(result.threads);
  int64_t best_ns = INT64_MAX;
  for (int repeat = 0; repeat < kReadRepeats; ++repeat) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < result.threads; ++t) {
      workers.emplace_back([&, t] {
        const int64_t begin = count * t / result.threads;
        const int64_t end = count * (t + 1) / result.threads;
        sums[t] = SumWords(buffer.data() + begin, end - begin);
      });
    }
    for (std::thread& worker : workers) worker.join();
    best_ns = std::min(best_ns, Since(start));
  }
  uint64_t total = 0;
  for (const uint64_t sum : sums) total += sum;
  // Σ i for i < count: the reads happened and were right.
  const uint64_t expected = static_cast<uint64_t>(count) * (static_cast<uint64_t>(count) - 1) / 2;
  result.gb_per_s = total == expected ? static_cast<double>(kReadBufferBytes) / best_ns : 0;
  return result;
}

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (!absl::StartsWith(line, "model name")) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
  }
  return "unknown CPU (no model name in /proc/cpuinfo)";
}

bool IsLoopback(const std::string& target) {
  for (const char* prefix : {"127.", "localhost", "[::1]", "ipv4:127.", "ipv6:[::1]", "::1"}) {
    if (absl::StartsWith(target, prefix)) return true;
  }
  return false;
}

int64_t Median(std::vector<int64_t> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

std::string Millis(int64_t ns) { return absl::StrFormat("%.2f ms", static_cast<double>(ns) / 1e6); }

std::string Micros(int64_t ns) { return absl::StrFormat("%.0f µs", static_cast<double>(ns) / 1e3); }

std::string Seconds(int64_t ns) { return absl::StrFormat("%.1f s", static_cast<double>(ns) / 1e9); }

std::string Percent(double share) {
  const double percent = 100 * share;
  return absl::StrFormat(percent < 0.1 ? "%.4f %%" : percent < 10 ? "%.2f %%" : "%.1f %%", percent);
}

// %s widths count bytes, and "−" or "µ" are more than one: pad by display width instead.
std::string Cell(const std::string& text, int width) {
  int display = 0;
  for (const unsigned char c : text) display += (c & 0xC0) != 0x80;
  return std::string(std::max(0, width - display), ' ') + text;
}

struct Row {
  int64_t batch = 0;
  int64_t length = 0;      // Tokens cached before the first step.
  int64_t wall_ns = 0;     // p50 over the steps.
  int64_t compute_ns = 0;  // p50 of the server's compute_ns.
  int64_t server_ns = 0;   // p50 of the server's server_ns (handler time, compute included).
  // p50s of the server's stages (ExecutionStats.stages) and of this client's own codec work
  // (serializing the request, parsing the answer, timed apart from the call).
  int64_t handler_ns = 0, queue_ns = 0, prepare_ns = 0, finish_ns = 0, codec_ns = 0;
  int64_t outside_ns = 0;       // p50 of wall − server_ns.
  int64_t sent_bytes = 0;       // p50 of the serialized DecodeRequest.
  int64_t stateless_bytes = 0;  // p50 of the same steps as stateless Tiled requests.
  double cache_gb_per_s = 0;    // p50 over the steps of cache bytes / compute.
  int64_t fill_ns = 0;
  int64_t stateless_wall_ns = -1;  // p50 of the timed stateless calls; −1: not timed.
  int64_t stateless_compute_ns = 0;
  std::string stateless_note;  // Why not timed.

  int64_t overhead_ns() const { return wall_ns - compute_ns; }
  // Of that, the part inside the server's handler (decode, append, checks, encode).
  int64_t in_server_ns() const { return server_ns - compute_ns; }
  double sent_share() const { return double(sent_bytes) / double(stateless_bytes); }
};

std::string RowName(int64_t batch, int64_t length) { return absl::StrCat(batch, " × ", length); }

// Appends `tokens` random tokens to `cache` in appends of at most kFillChunkBytes.
absl::Status Fill(client::Cache& cache, const DecodeBenchConfig& config, int64_t tokens,
                  Random& random) {
  const int64_t token_bytes = CacheReadBytes(config, 1);
  const int64_t chunk = std::max<int64_t>(1, kFillChunkBytes / token_bytes);
  for (int64_t done = 0; done < tokens;) {
    const int64_t n = std::min(chunk, tokens - done);
    const v1::Tensor key =
        RandomTensor(random, {config.kv_heads, n, config.head_dim}, TokenDTypeFor(config.dtype));
    const v1::Tensor value =
        RandomTensor(random, {config.kv_heads, n, config.value_dim}, TokenDTypeFor(config.dtype));
    if (absl::StatusOr<v1::CacheInfo> appended = cache.Append(key, value); !appended.ok()) {
      return absl::Status(appended.status().code(),
                          absl::StrCat("appending tokens [", done, ", ", done + n, ") to cache ",
                                       cache.id(), ": ", appended.status().message()));
    }
    done += n;
  }
  return absl::OkStatus();
}

// --shm: the run's shared-memory file, registered as region kShmRegion: item i's q, k and v at
// i × input_bytes(), back to back, then every item's output back to back after all the inputs
// (so the server reads the inputs and writes the outputs in one system call each).
constexpr char kShmRegion[] = "attn-bench-decode";
struct ShmIo {
  client::SharedMemoryFile* file = nullptr;
  int64_t query_bytes = 0, key_bytes = 0, value_bytes = 0, output_bytes = 0;
  int64_t batch = 0;  // Items the file has room for.
  int64_t input_bytes() const { return query_bytes + key_bytes + value_bytes; }
  int64_t output_offset(int64_t item) const { return batch * input_bytes() + item * output_bytes; }
};

// The tensor's bytes moved into the file at `offset`: the tensor then names them there.
v1::Tensor IntoShm(const v1::Tensor& tensor, const ShmIo& io, int64_t offset) {
  std::memcpy(io.file->data() + offset, tensor.data().data(), tensor.data().size());
  return client::SharedTensor({tensor.shape().begin(), tensor.shape().end()}, tensor.dtype(),
                              kShmRegion, offset);
}

// Each timed step's figures.
struct Samples {
  std::vector<int64_t> wall, compute, server, sent, stateless;
  std::vector<int64_t> handler, queue, prepare, finish, codec, outside;
  std::vector<double> rate;  // Cache bytes read per ns of compute (= GB/s).
};

// One decode step over every cache: all items in one Decode call. Adds the step's figures to
// `samples` when given (null: the warm-up).
absl::Status Step(client::Client& client, std::vector<client::Cache>& caches,
                  const DecodeBenchConfig& config, const ShmIo* io, Random& random,
                  Samples* samples) {
  v1::DecodeRequest request;
  for (size_t i = 0; i < caches.size(); ++i) {
    v1::Tensor query =
        RandomTensor(random, {config.heads, 1, config.head_dim}, TokenDTypeFor(config.dtype));
    v1::Tensor key =
        RandomTensor(random, {config.kv_heads, 1, config.head_dim}, TokenDTypeFor(config.dtype));
    v1::Tensor value =
        RandomTensor(random, {config.kv_heads, 1, config.value_dim}, TokenDTypeFor(config.dtype));
    if (io != nullptr) {  // The bytes go into the file, the request names them.
      const int64_t base = static_cast<int64_t>(i) * io->input_bytes();
      query = IntoShm(query, *io, base);
      key = IntoShm(key, *io, base + io->query_bytes);
      value = IntoShm(value, *io, base + io->query_bytes + io->key_bytes);
    }
    v1::DecodeItem* item = request.add_items();
    *item = caches[i].Item(query, &key, &value);
    if (io != nullptr) {
      *item->mutable_output_to() = client::SharedRange(
          kShmRegion, io->output_offset(static_cast<int64_t>(i)), io->output_bytes);
    }
  }
  *request.mutable_options() = config.options;
  const int64_t request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  const Clock::time_point start = Clock::now();
  absl::StatusOr<v1::DecodeResponse> response = client.Decode(request);
  const int64_t wall_ns = Since(start);
  if (!response.ok()) return response.status();
  if (response->caches_size() != static_cast<int>(caches.size()) ||
      response->outputs_size() != static_cast<int>(caches.size())) {
    return absl::InternalError(absl::StrCat("Decode answered ", response->outputs_size(),
                                            " outputs for ", caches.size(), " items"));
  }
  int64_t tokens = 0;
  for (size_t i = 0; i < caches.size(); ++i) {
    // Tokens sent through shared memory are not in the request: the Cache takes the info alone.
    if (io != nullptr) {
      caches[i].Update(response->caches(static_cast<int>(i)));
    } else {
      caches[i].Update(response->caches(static_cast<int>(i)), request.items(static_cast<int>(i)));
    }
    tokens += caches[i].length();
  }
  if (samples == nullptr) return absl::OkStatus();
  // This client's share of the codec work, timed apart: the request serialized, the answer parsed.
  const Clock::time_point codec_start = Clock::now();
  std::string bytes;
  request.SerializeToString(&bytes);
  int64_t codec_ns = Since(codec_start);
  bytes = response->SerializeAsString();
  const Clock::time_point parse_start = Clock::now();
  v1::DecodeResponse parsed;
  if (!parsed.ParseFromString(bytes)) return absl::InternalError("the answer does not parse");
  codec_ns += Since(parse_start);
  const v1::ExecutionStats& stats = response->stats();
  const int64_t compute_ns = stats.compute_ns();
  const int64_t read = CacheReadBytes(config, tokens);
  samples->wall.push_back(wall_ns);
  samples->compute.push_back(compute_ns);
  samples->server.push_back(stats.server_ns());
  samples->handler.push_back(stats.stages().handler_ns());
  samples->queue.push_back(stats.stages().queue_ns());
  samples->prepare.push_back(stats.stages().prepare_ns());
  samples->finish.push_back(stats.stages().finish_ns());
  samples->codec.push_back(codec_ns);
  samples->outside.push_back(wall_ns - stats.server_ns());
  samples->sent.push_back(request_bytes);
  // Every item has the same length: the stateless call carries that many tokens per sequence.
  samples->stateless.push_back(
      StatelessBytes(config, static_cast<int64_t>(caches.size()), caches[0].length()));
  samples->rate.push_back(compute_ns > 0 ? double(read) / double(compute_ns) : 0);
  return absl::OkStatus();
}

// Times the step as stateless Tiled calls over `length` tokens per sequence, when it fits.
absl::Status TimeStateless(client::Client& client, const DecodeBenchConfig& config,
                           const v1::ServerInfo& server, Random& random, Row& row) {
  const int64_t length = row.length + 1;  // The first step's keys: the cache plus its new token.
  const int64_t bytes = StatelessBytes(config, row.batch, length);
  const int64_t limit =
      std::min<int64_t>(server.max_message_bytes(), client::ClientOptions{}.max_message_bytes);
  if (config.stateless_repeats < 1) {
    row.stateless_note = "not timed (--repeats 0)";
    return absl::OkStatus();
  }
  if (bytes > limit) {
    row.stateless_note = absl::StrCat("over max message ", Bytes(limit));
    return absl::OkStatus();
  }
  v1::AttentionRequest request;
  *request.mutable_query() =
      RandomTensor(random, StatelessShape(row.batch, config.heads, 1, config.head_dim),
                   TokenDTypeFor(config.dtype));
  *request.mutable_key() =
      RandomTensor(random, StatelessShape(row.batch, config.kv_heads, length, config.head_dim),
                   TokenDTypeFor(config.dtype));
  *request.mutable_value() =
      RandomTensor(random, StatelessShape(row.batch, config.kv_heads, length, config.value_dim),
                   TokenDTypeFor(config.dtype));
  *request.mutable_options() = config.options;
  request.mutable_options()->set_return_lse(false);
  if (static_cast<int64_t>(request.ByteSizeLong()) != bytes) {
    return absl::InternalError(absl::StrCat("stateless request is ", request.ByteSizeLong(),
                                            " bytes, the shapes say ", bytes));
  }
  std::vector<int64_t> walls, computes;
  for (int r = 0; r < config.stateless_repeats; ++r) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<v1::AttentionResponse> response = client.Tiled(request);
    const int64_t wall_ns = Since(start);
    if (!response.ok()) {
      return absl::Status(response.status().code(),
                          absl::StrCat("stateless Tiled: ", response.status().message()));
    }
    walls.push_back(wall_ns);
    computes.push_back(response->stats().compute_ns());
  }
  row.stateless_wall_ns = Median(walls);
  row.stateless_compute_ns = Median(computes);
  return absl::OkStatus();
}

absl::StatusOr<Row> RunRow(client::Client& client, const DecodeBenchConfig& config, const ShmIo* io,
                           const v1::ServerInfo& server, int64_t batch, int64_t length,
                           Random& random) {
  Row row;
  row.batch = batch;
  row.length = length;
  v1::CreateCacheRequest create;
  create.set_kv_heads(config.kv_heads);
  create.set_head_dim(config.head_dim);
  create.set_value_dim(config.value_dim);
  create.set_dtype(config.dtype);
  std::vector<client::Cache> caches;
  // Everything after the first create deletes the caches made so far, also on failure.
  absl::Status status = [&]() -> absl::Status {
    for (int64_t i = 0; i < batch; ++i) {
      absl::StatusOr<client::Cache> cache = client::Cache::Create(client, create);
      if (!cache.ok()) return cache.status();
      caches.push_back(*std::move(cache));
    }
    const Clock::time_point fill_start = Clock::now();
    for (client::Cache& cache : caches) {
      if (absl::Status filled = Fill(cache, config, length, random); !filled.ok()) return filled;
    }
    row.fill_ns = Since(fill_start);
    if (absl::Status warm = Step(client, caches, config, io, random, nullptr); !warm.ok()) {
      return warm;
    }
    Samples samples;
    for (int64_t step = 0; step < config.steps; ++step) {
      if (absl::Status stepped = Step(client, caches, config, io, random, &samples);
          !stepped.ok()) {
        return absl::Status(stepped.code(),
                            absl::StrCat("step ", step + 1, ": ", stepped.message()));
      }
    }
    row.wall_ns = Median(samples.wall);
    row.compute_ns = Median(samples.compute);
    row.server_ns = Median(samples.server);
    row.handler_ns = Median(samples.handler);
    row.queue_ns = Median(samples.queue);
    row.prepare_ns = Median(samples.prepare);
    row.finish_ns = Median(samples.finish);
    row.codec_ns = Median(samples.codec);
    row.outside_ns = Median(samples.outside);
    row.sent_bytes = Median(samples.sent);
    row.stateless_bytes = Median(samples.stateless);
    row.cache_gb_per_s = Median(samples.rate);
    return absl::OkStatus();
  }();
  for (client::Cache& cache : caches) {
    if (absl::Status deleted = cache.Delete(); !deleted.ok() && status.ok()) status = deleted;
  }
  caches.clear();
  // The caches are gone: the stateless calls have the server's memory to themselves.
  if (status.ok()) status = TimeStateless(client, config, server, random, row);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(RowName(batch, length), ": ", status.message()));
  }
  return row;
}

bool IssueShapes(const DecodeBenchConfig& config) {
  return config.heads == 32 && config.kv_heads == 8 && config.head_dim == 128 &&
         config.value_dim == 128 && config.dtype == v1::DTYPE_BFLOAT16;
}

const Row* Find(const std::vector<Row>& rows, int64_t batch, int64_t length) {
  for (const Row& row : rows) {
    if (row.batch == batch && row.length == length) return &row;
  }
  return nullptr;
}

const char* Verdict(bool met) { return met ? "met" : "MISSED"; }

void PrintTargets(std::FILE* out, const DecodeBenchConfig& config, const std::vector<Row>& rows,
                  const MemoryRead& memory) {
  absl::FPrintF(out, "\ntargets (issue 13: CPU backend, 2 threads, loopback):\n");
  if (!IssueShapes(config)) {
    absl::FPrintF(out,
                  "  NOTE: this run's shapes are not the targets' (32 heads over 8 kv heads, d = "
                  "128, bf16)\n");
  }
  const auto missing = [&](const char* label, int64_t batch, int64_t length) {
    absl::FPrintF(out, "  %s %s: not measured (run with --batches %d and --lengths %d)\n", label,
                  RowName(batch, length), batch, length);
  };
  if (const Row* row = Find(rows, 1, 32768); row != nullptr) {
    absl::FPrintF(out,
                  "  (a) bytes sent, %s: %s per step = %s of the stateless call's %s "
                  "(target < %s): %s\n",
                  RowName(1, 32768), Bytes(row->sent_bytes), Percent(row->sent_share()),
                  Bytes(row->stateless_bytes), Percent(kMaxSentShare),
                  Verdict(row->sent_share() < kMaxSentShare));
  } else {
    missing("(a) bytes sent,", 1, 32768);
  }
  for (const auto& [batch, length] : {std::pair<int64_t, int64_t>{1, 32768}, {16, 4096}}) {
    const Row* row = Find(rows, batch, length);
    if (row == nullptr) {
      missing("(b) cache read,", batch, length);
      continue;
    }
    const double share = memory.gb_per_s > 0 ? row->cache_gb_per_s / memory.gb_per_s : 0;
    absl::FPrintF(out,
                  "  (b) cache read, %s: %.2f GB/s = %s of the %.2f GB/s memory read "
                  "(target ≥ %s): %s\n",
                  RowName(batch, length), row->cache_gb_per_s, Percent(share), memory.gb_per_s,
                  Percent(kMinBandwidthShare), Verdict(share >= kMinBandwidthShare));
  }
  std::vector<std::string> missed;
  const Row* worst = nullptr;
  for (const Row& row : rows) {
    if (worst == nullptr || row.overhead_ns() > worst->overhead_ns()) worst = &row;
    if (row.overhead_ns() > kMaxOverheadNs) {
      missed.push_back(
          absl::StrCat(RowName(row.batch, row.length), " (", Millis(row.overhead_ns()), ")"));
    }
  }
  if (worst != nullptr) {
    absl::FPrintF(
        out, "  (c) wall ≤ compute + 2 ms, every row: worst wall − compute %s (%s): %s%s\n",
        Millis(worst->overhead_ns()), RowName(worst->batch, worst->length), Verdict(missed.empty()),
        missed.empty() ? "" : absl::StrCat(" at ", absl::StrJoin(missed, ", ")));
  }
  absl::FPrintF(out, "targets (issue 32: the edge, C++ client, loopback, p50):\n");
  for (const auto& [batch, limit] :
       {std::pair<int64_t, int64_t>{1, kMaxEdgeOneNs}, {16, kMaxEdgeBatchNs}}) {
    const Row* row = Find(rows, batch, 4096);
    if (row == nullptr) {
      missing("wall ≤ compute + edge,", batch, 4096);
      continue;
    }
    absl::FPrintF(out, "  wall ≤ compute + %s, %s: wall − compute %s: %s\n", Micros(limit),
                  RowName(batch, 4096), Micros(row->overhead_ns()),
                  Verdict(row->overhead_ns() <= limit));
  }
}

// Where each row's wall − compute goes: the server's stages, the rest outside its handler, and
// the floor under any call (a GetServerInfo round trip on the same channel, measured in this run).
void PrintStages(std::FILE* out, const std::vector<Row>& rows, int64_t floor_ns) {
  absl::FPrintF(
      out, "\nwhere wall − compute goes (p50 of each part; the parts' p50s need not add up):\n");
  const struct {
    const char* title;
    int width;
  } columns[] = {{"B", 3},          {"cached", 7},  {"wall", 9},  {"compute", 9},
                 {"wall−comp", 10}, {"handler", 8}, {"queue", 7}, {"prepare", 8},
                 {"finish", 7},     {"outside", 8}, {"floor", 7}, {"codec", 7}};
  std::vector<std::string> header;
  for (const auto& column : columns) header.push_back(Cell(column.title, column.width));
  absl::FPrintF(out, "%s\n", absl::StrJoin(header, " "));
  for (const Row& row : rows) {
    const std::string cells[] = {
        absl::StrCat(row.batch), absl::StrCat(row.length),  Micros(row.wall_ns),
        Micros(row.compute_ns),  Micros(row.overhead_ns()), Micros(row.handler_ns),
        Micros(row.queue_ns),    Micros(row.prepare_ns),    Micros(row.finish_ns),
        Micros(row.outside_ns),  Micros(floor_ns),          Micros(row.codec_ns)};
    std::vector<std::string> line;
    for (size_t i = 0; i < std::size(cells); ++i) line.push_back(Cell(cells[i], columns[i].width));
    absl::FPrintF(out, "%s\n", absl::StrJoin(line, " "));
  }
  absl::FPrintF(
      out,
      "handler: on gRPC's thread until the hand-off; queue: waiting for a compute worker; prepare: "
      "value\nscans, caches held, tokens appended, outputs allocated; finish: commit, cache info, "
      "stats (the\nserver's ExecutionStats.stages). outside: wall − server_ns (transport, gRPC, "
      "(de)serialization,\nthis client); floor: a GetServerInfo round trip; codec: this client "
      "serializing the request\nand parsing the answer, timed apart.\n");
}

void PrintTable(std::FILE* out, const DecodeBenchConfig& config, const v1::ServerInfo& server,
                const std::string& target, const MemoryRead& memory, const std::vector<Row>& rows,
                int64_t floor_ns) {
  absl::FPrintF(out,
                "attn bench --decode: %d query heads over %d kv heads, head_dim %d, value_dim %d, "
                "cache %s, tensors %s; 1 new token per step (q, k, v)\n",
                config.heads, config.kv_heads, config.head_dim, config.value_dim,
                DTypeName(FromProtoCacheDType(config.dtype).value_or(DType::kFloat32)),
                DTypeName(HostDType(config.dtype)));
  absl::FPrintF(out, "client CPU: %s (%d hardware threads)\n", CpuModel(), memory.threads);
  absl::FPrintF(out, "server: attnd %s, %s on %s, at %s\n", server.version(), server.backend(),
                server.device(), target);
  if (config.shm) {
    absl::FPrintF(out,
                  "transport: each step's q, k, v and outputs in a /dev/shm region registered "
                  "with the server (--shm); the messages carry shapes and references\n");
  }
  absl::FPrintF(out,
                "memory read: %.2f GB/s, 1 GiB summed by %d threads in this process (best of %d "
                "passes; %.2f before the rows, %.2f after)\n",
                memory.gb_per_s, memory.threads, kReadRepeats, memory.begin_gb_per_s,
                memory.end_gb_per_s);
  absl::FPrintF(
      out, "%s\n",
      IsLoopback(target)
          ? "  the server runs on this machine over loopback: same CPUs, same memory"
          : "  NOTE: the target is not loopback, so this need not be the server's memory");
  absl::FPrintF(out,
                "per row: p50 of %d decode steps (after 1 warm-up), each one Decode call for "
                "every sequence; stateless: p50 of %d Tiled calls\n\n",
                config.steps, config.stateless_repeats);
  const struct {
    const char* title;
    int width;
  } columns[] = {{"B", 3},
                 {"cached", 7},
                 {"wall p50", 10},
                 {"compute", 10},
                 {"wall−compute", 13},
                 {"in server", 10},
                 {"sent/step", 11},
                 {"stateless", 11},
                 {"sent %", 10},
                 {"stateless wall", 15},
                 {"cache read", 12},
                 {"of memory", 10}};
  std::vector<std::string> header;
  for (const auto& column : columns) header.push_back(Cell(column.title, column.width));
  absl::FPrintF(out, "%s\n", absl::StrJoin(header, " "));
  for (const Row& row : rows) {
    const double share = memory.gb_per_s > 0 ? row.cache_gb_per_s / memory.gb_per_s : 0;
    const std::string stateless_wall =
        row.stateless_wall_ns >= 0 ? Millis(row.stateless_wall_ns) : "—";
    const std::string cells[] = {absl::StrCat(row.batch),
                                 absl::StrCat(row.length),
                                 Millis(row.wall_ns),
                                 Millis(row.compute_ns),
                                 Millis(row.overhead_ns()),
                                 Millis(row.in_server_ns()),
                                 Bytes(row.sent_bytes),
                                 Bytes(row.stateless_bytes),
                                 Percent(row.sent_share()),
                                 stateless_wall,
                                 absl::StrFormat("%.2f GB/s", row.cache_gb_per_s),
                                 Percent(share)};
    std::vector<std::string> line;
    for (size_t i = 0; i < std::size(cells); ++i) line.push_back(Cell(cells[i], columns[i].width));
    absl::FPrintF(out, "%s\n", absl::StrJoin(line, " "));
  }
  std::vector<std::string> untimed;
  for (const Row& row : rows) {
    if (row.stateless_wall_ns < 0) {
      untimed.push_back(absl::StrCat(RowName(row.batch, row.length), ": ", row.stateless_note));
    }
  }
  absl::FPrintF(
      out,
      "\nwall: the Decode round trip seen here; compute: the server's compute_ns for the whole "
      "batch;\nin server: the part of wall − compute inside the server's handler (server_ns − "
      "compute_ns).\nsent: the serialized DecodeRequest; stateless: the same step as one Tiled "
      "request (q plus every\nsequence's whole K and V), exact from the shapes. cache read: every "
      "sequence's K and V per second\nof compute; of memory: that / the memory read above.\n");
  if (!untimed.empty()) {
    absl::FPrintF(out, "stateless calls not timed: %s.\n", absl::StrJoin(untimed, "; "));
  }
  PrintStages(out, rows, floor_ns);
  PrintTargets(out, config, rows, memory);
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ParseCounts(const std::string& flag, const std::string& spec) {
  std::vector<int64_t> counts;
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int64_t multiplier = 1;
    if (!part.empty() && (part.back() == 'k' || part.back() == 'K')) {
      multiplier = 1024;
      part.remove_suffix(1);
    }
    int64_t count = 0;
    if (!absl::SimpleAtoi(part, &count) || count < 1 || count > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag,
                       " expects positive integers separated by commas (a k suffix: × 1024), "
                       "got \"",
                       spec, "\""));
    }
    counts.push_back(count * multiplier);
  }
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

absl::Status RunDecodeBench(client::Client& client, const DecodeBenchConfig& config, std::FILE* out,
                            std::FILE* progress) {
  if (config.heads < 1 || config.kv_heads < 1 || config.heads % config.kv_heads != 0 ||
      config.head_dim < 1 || config.value_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bench --decode: --heads, --head-dim and --value-dim must be positive and --kv-heads "
        "must divide --heads (",
        config.heads, " heads, ", config.kv_heads, " kv heads)"));
  }
  if (config.steps < 1) return absl::InvalidArgumentError("bench --decode: --steps must be ≥ 1");
  absl::StatusOr<v1::ServerInfo> server = client.Info();
  if (!server.ok()) return server.status();
  absl::FPrintF(progress, "attn bench --decode: %s on %s; measuring memory read … ",
                server->backend(), server->device());
  std::fflush(progress);
  MemoryRead memory = MeasureMemoryRead();
  if (memory.gb_per_s <= 0) return absl::InternalError("the memory-read pass summed wrong");
  memory.begin_gb_per_s = memory.gb_per_s;
  absl::FPrintF(progress, "%.2f GB/s (%d threads)\n", memory.gb_per_s, memory.threads);
  std::vector<int64_t> floors;
  for (int call = 0; call < kFloorCalls; ++call) {
    const Clock::time_point start = Clock::now();
    if (absl::StatusOr<v1::ServerInfo> info = client.Info(); !info.ok()) return info.status();
    floors.push_back(Since(start));
  }
  const int64_t floor_ns = Median(floors);
  // --shm: one file for the largest batch, registered for the run and unregistered after it.
  ShmIo io;
  std::unique_ptr<client::SharedMemoryFile> shm_file;
  if (config.shm) {
    const int64_t element = ElementSize(HostDType(config.dtype));
    io.query_bytes = config.heads * config.head_dim * element;
    io.key_bytes = config.kv_heads * config.head_dim * element;
    io.value_bytes = config.kv_heads * config.value_dim * element;
    io.output_bytes = config.heads * config.value_dim *
                      ElementSize(HostDType(config.options.output_dtype() != v1::DTYPE_UNSPECIFIED
                                                ? config.options.output_dtype()
                                                : config.dtype));
    io.batch = *std::max_element(config.batches.begin(), config.batches.end());
    absl::StatusOr<std::unique_ptr<client::SharedMemoryFile>> file =
        client::SharedMemoryFile::Create(absl::StrCat("attn-bench-", getpid()),
                                         io.output_offset(io.batch));
    if (!file.ok()) return file.status();
    shm_file = *std::move(file);
    io.file = shm_file.get();
    v1::RegisterSharedMemoryRequest registration;
    registration.set_name(kShmRegion);
    registration.set_key(shm_file->key());
    registration.set_byte_size(shm_file->size());
    if (absl::StatusOr<v1::SharedMemoryRegion> region = client.RegisterSharedMemory(registration);
        !region.ok()) {
      return absl::Status(region.status().code(),
                          absl::StrCat("--shm: RegisterSharedMemory: ", region.status().message()));
    }
  }
  struct Unregister {
    client::Client& client;
    bool registered;
    ~Unregister() {
      if (registered) (void)client.UnregisterSharedMemory(kShmRegion);
    }
  } unregister{client, config.shm};

  Random random(config.seed);
  std::vector<Row> rows;
  const size_t total = config.batches.size() * config.lengths.size();
  for (const int64_t batch : config.batches) {
    for (const int64_t length : config.lengths) {
      absl::FPrintF(progress, "[%d/%d] %s: fill %s … ", rows.size() + 1, total,
                    RowName(batch, length), Bytes(batch * CacheReadBytes(config, length)));
      std::fflush(progress);
      const Clock::time_point start = Clock::now();
      absl::StatusOr<Row> row = RunRow(client, config, io.file != nullptr ? &io : nullptr, *server,
                                       batch, length, random);
      if (!row.ok()) {
        absl::FPrintF(progress, "failed\n");
        return row.status();
      }
      absl::FPrintF(
          progress, "%s; step wall %s, compute %s, %.2f GB/s; stateless %s (%s)\n",
          Seconds(row->fill_ns), Millis(row->wall_ns), Millis(row->compute_ns), row->cache_gb_per_s,
          row->stateless_wall_ns >= 0 ? absl::StrCat(Millis(row->stateless_wall_ns), ", compute ",
                                                     Millis(row->stateless_compute_ns))
                                      : row->stateless_note,
          Seconds(Since(start)));
      std::fflush(progress);
      rows.push_back(*std::move(row));
    }
  }
  absl::FPrintF(progress, "measuring memory read again … ");
  std::fflush(progress);
  memory.end_gb_per_s = MeasureMemoryRead().gb_per_s;
  if (memory.end_gb_per_s <= 0) return absl::InternalError("the memory-read pass summed wrong");
  memory.gb_per_s = std::max(memory.begin_gb_per_s, memory.end_gb_per_s);
  absl::FPrintF(progress, "%.2f GB/s\n", memory.end_gb_per_s);
  PrintTable(out, config, *server, config.target, memory, rows, floor_ns);
  return absl::OkStatus();
}

}  // namespace attn::cli
