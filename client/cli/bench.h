// attn bench: an end-to-end sweep over sequence length N through the server, for Naive and
// Tiled. For each N it builds one random problem [batch, heads, N, dim], calls each method
// `repeats` times and keeps the median call; the results become a table, a CSV file and an SVG
// chart of time and memory against N.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/cli/chart.h"
#include "client/client.h"

namespace attn::cli {

struct BenchConfig {
  std::vector<int64_t> ns;           // Sequence lengths (queries = keys), increasing.
  std::vector<std::string> methods;  // "naive" and/or "tiled", in sweep order.
  int64_t batch = 1;
  int64_t heads = 8;
  int64_t kv_heads = 0;  // 0 = heads.
  int64_t dim = 64;      // head_dim = value_dim.
  attention::v1::DType dtype = attention::v1::DTYPE_FLOAT32;
  attention::v1::AttentionOptions options;  // causal, block_k, …
  int repeats = 3;
  uint64_t seed = 1;
};

// One (method, N) point: the median of `repeats` calls, or a refusal.
struct BenchPoint {
  std::string method;  // "naive" or "tiled".
  int64_t n = 0;
  bool refused = false;    // RESOURCE_EXHAUSTED from Naive: the point has no measurements.
  std::string refusal;     // Short reason for the table, e.g. "over --max-naive-bytes".
  std::string message;     // The server's full message, for the CSV.
  int64_t wall_ns = 0;     // Median round trip seen by the client.
  int64_t compute_ns = 0;  // Median server-reported compute time.
  int64_t server_ns = 0;   // Median server-reported handler time.
  double flops = 0;
  int64_t intermediate_bytes = 0;
  int64_t scratch_bytes = 0;
  int64_t peak_memory_bytes = 0;
  int32_t block_k = 0;

  // Median wall − median compute: time outside the backend (transfer, (de)serialization,
  // validation, queueing). Never negative: each call's wall time covers its compute time.
  int64_t overhead_ns() const { return wall_ns - compute_ns; }
  double gflops() const { return compute_ns > 0 ? flops / static_cast<double>(compute_ns) : 0; }
};

struct BenchResult {
  BenchConfig config;
  attention::v1::ServerInfo server;
  std::vector<BenchPoint> points;  // In sweep order: each N, then each method.
};

// "256,512,…": positive integers, returned sorted without duplicates.
absl::StatusOr<std::vector<int64_t>> ParseNs(const std::string& spec);
// "naive,tiled" (either or both).
absl::StatusOr<std::vector<std::string>> ParseMethods(const std::string& spec);

// Runs the sweep. Asks the server for its info first, then writes one progress line per point
// to `progress` as it completes. A Naive call refused with RESOURCE_EXHAUSTED becomes a refused
// point and the sweep goes on; any other failure stops it and is returned, naming the point.
absl::StatusOr<BenchResult> RunSweep(client::Client& client, const BenchConfig& config,
                                     std::FILE* progress);

// The results as an aligned text table with a header naming the problem and the server.
void PrintTable(std::FILE* out, const BenchResult& result);

// The results as CSV: a header line, then one line per point.
std::string ToCsv(const BenchResult& result);

// The two-panel chart: time against N, and server-reported memory against N.
Chart MakeChart(const BenchResult& result);

// Writes `contents` to `path`, replacing it.
absl::Status WriteFile(const std::string& path, const std::string& contents);

}  // namespace attn::cli
