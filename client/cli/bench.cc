#include "client/cli/bench.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/cli/inputs.h"
#include "client/cli/render.h"

namespace attn::cli {
namespace {

namespace v1 = attention::v1;

constexpr const char* kNaiveColor = "#d62728";
constexpr const char* kTiledColor = "#1f77b4";

std::string DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT16:
      return "f16";
    case v1::DTYPE_BFLOAT16:
      return "bf16";
    default:
      return "f32";
  }
}

std::string Title(const std::string& method) { return method == "naive" ? "Naive" : "Tiled"; }

// "812 µs", "1.23 ms", "12.3 s": three significant digits in the largest unit under the value.
std::string Duration(int64_t ns) {
  struct Unit {
    double scale;
    const char* name;
  };
  static const Unit kUnits[] = {{1e9, "s"}, {1e6, "ms"}, {1e3, "µs"}};
  for (const Unit& unit : kUnits) {
    const double value = static_cast<double>(ns) / unit.scale;
    if (value < 0.9995) continue;
    const int decimals = value < 9.995 ? 2 : value < 99.95 ? 1 : 0;
    return absl::StrFormat("%.*f %s", decimals, value, unit.name);
  }
  return absl::StrFormat("%d ns", ns);
}

// The explainer's accounting of Naive's score and weight traffic, 16·B·H·N².
int64_t ExplainerBytes(const BenchConfig& config, int64_t n) {
  return 16 * config.batch * config.heads * n * n;
}

// Median; the mean of the middle two for an even count.
int64_t Median(std::vector<int64_t> values) {
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

// Calls `method` `repeats` times with the same request and keeps the medians.
absl::StatusOr<BenchPoint> Measure(client::Client& client, const std::string& method, int64_t n,
                                   const v1::AttentionRequest& request, int repeats) {
  BenchPoint point;
  point.method = method;
  point.n = n;
  std::vector<int64_t> walls, computes, servers;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<v1::AttentionResponse> response =
        method == "naive" ? client.Naive(request) : client.Tiled(request);
    const int64_t wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now() - start)
                                .count();
    if (!response.ok()) {
      if (method == "naive" && absl::IsResourceExhausted(response.status())) {
        point.refused = true;
        point.message = std::string(response.status().message());
        point.refusal = absl::StrContains(point.message, "max-naive-bytes")
                            ? "over --max-naive-bytes"
                            : "out of memory (RESOURCE_EXHAUSTED)";
        return point;
      }
      return response.status();
    }
    const v1::ExecutionStats& stats = response->stats();
    walls.push_back(wall_ns);
    computes.push_back(stats.compute_ns());
    servers.push_back(stats.server_ns());
    point.flops = stats.flops();
    point.intermediate_bytes = stats.intermediate_bytes();
    point.scratch_bytes = stats.scratch_bytes();
    point.peak_memory_bytes = stats.peak_memory_bytes();
    point.block_k = stats.block_k();
  }
  point.wall_ns = Median(walls);
  point.compute_ns = Median(computes);
  point.server_ns = Median(servers);
  return point;
}

std::string ProblemLine(const BenchConfig& config) {
  std::string line = absl::StrCat("[batch ", config.batch, ", heads ", config.heads);
  if (config.kv_heads > 0 && config.kv_heads != config.heads) {
    absl::StrAppend(&line, " (kv ", config.kv_heads, ")");
  }
  absl::StrAppend(&line, ", N, dim ", config.dim, "] ", DTypeName(config.dtype),
                  config.options.causal() ? ", causal" : "");
  if (config.options.block_k() > 0) absl::StrAppend(&line, ", block_k ", config.options.block_k());
  absl::StrAppend(&line, "; median of ", config.repeats, config.repeats == 1 ? " call" : " calls");
  return line;
}

std::string CsvField(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  return absl::StrCat("\"", absl::StrReplaceAll(text, {{"\"", "\"\""}}), "\"");
}

std::string CsvSeconds(int64_t ns) {
  return absl::StrFormat("%.9f", static_cast<double>(ns) / 1e9);
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ParseNs(const std::string& spec) {
  std::vector<int64_t> ns;
  for (const absl::string_view part : absl::StrSplit(spec, ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ns expects positive integers separated by commas (256,512,1024), got \"", spec, "\""));
    }
    ns.push_back(n);
  }
  std::sort(ns.begin(), ns.end());
  ns.erase(std::unique(ns.begin(), ns.end()), ns.end());
  return ns;
}

absl::StatusOr<std::vector<std::string>> ParseMethods(const std::string& spec) {
  std::vector<std::string> methods;
  for (const absl::string_view part : absl::StrSplit(spec, ',')) {
    const std::string method = absl::AsciiStrToLower(absl::StripAsciiWhitespace(part));
    if (method != "naive" && method != "tiled") {
      return absl::InvalidArgumentError(
          absl::StrCat("--methods expects naive, tiled or naive,tiled, got \"", spec, "\""));
    }
    if (std::find(methods.begin(), methods.end(), method) == methods.end()) {
      methods.push_back(method);
    }
  }
  return methods;
}

absl::StatusOr<BenchResult> RunSweep(client::Client& client, const BenchConfig& config,
                                     std::FILE* progress) {
  BenchResult result;
  result.config = config;
  absl::StatusOr<v1::ServerInfo> info = client.Info();
  if (!info.ok()) return info.status();
  result.server = *std::move(info);
  absl::FPrintF(progress, "attn bench: %s; %s on %s\n", ProblemLine(config),
                result.server.backend(), result.server.device());

  const size_t total = config.ns.size() * config.methods.size();
  size_t done = 0;
  for (const int64_t n : config.ns) {
    v1::AttentionRequest request;
    {
      absl::StatusOr<Inputs> inputs =
          RandomInputs(absl::StrCat(config.batch, ",", config.heads, ",", n, ",", config.dim),
                       config.kv_heads, config.seed, config.dtype);
      if (!inputs.ok()) return inputs.status();
      request = MakeRequest(*inputs, config.options);
    }
    for (const std::string& method : config.methods) {
      absl::FPrintF(progress, "[%d/%d] %s N=%d … ", ++done, total, method, n);
      std::fflush(progress);
      absl::StatusOr<BenchPoint> point = Measure(client, method, n, request, config.repeats);
      if (!point.ok()) {
        absl::FPrintF(progress, "failed\n");
        return absl::Status(point.status().code(),
                            absl::StrCat(method, " N=", n, ": ", point.status().message()));
      }
      if (point->refused) {
        absl::FPrintF(progress, "refused: %s\n", point->refusal);
      } else {
        absl::FPrintF(progress, "%s (compute %s, %.1f GFLOP/s)\n", Duration(point->wall_ns),
                      Duration(point->compute_ns), point->gflops());
      }
      std::fflush(progress);
      result.points.push_back(*std::move(point));
    }
  }
  return result;
}

void PrintTable(std::FILE* out, const BenchResult& result) {
  absl::FPrintF(out, "attn bench: %s\n", ProblemLine(result.config));
  absl::FPrintF(out, "server: attnd %s, %s on %s\n\n", result.server.version(),
                result.server.backend(), result.server.device());
  absl::FPrintF(out, "%-6s %7s %10s %10s %9s %13s %10s %10s %13s\n", "method", "N", "wall",
                "compute", "GFLOP/s", "RPC overhead", "scratch", "peak", "intermediate");
  for (const BenchPoint& point : result.points) {
    if (point.refused) {
      absl::FPrintF(out, "%-6s %7d   refused: %s", point.method, point.n, point.refusal);
      if (point.refusal == "over --max-naive-bytes") {
        // The server's check: fp32 scores and weights, 2 × 4·B·H·N² bytes.
        absl::FPrintF(out, " (scores + weights need %s, the limit is %s)",
                      Bytes(ExplainerBytes(result.config, point.n) / 2),
                      Bytes(result.server.max_naive_bytes()));
      }
      absl::FPrintF(out, "\n");
      continue;
    }
    // %s widths count bytes, and "µ" is two: pad by display width instead.
    auto cell = [](const std::string& text, int width) {
      int display = 0;
      for (const unsigned char c : text) display += (c & 0xC0) != 0x80;
      return std::string(std::max(0, width - display), ' ') + text;
    };
    absl::FPrintF(out, "%-6s %7d %s %s %9.2f %s %s %s %s\n", point.method, point.n,
                  cell(Duration(point.wall_ns), 10), cell(Duration(point.compute_ns), 10),
                  point.gflops(), cell(Duration(point.overhead_ns()), 13),
                  cell(Bytes(point.scratch_bytes), 10), cell(Bytes(point.peak_memory_bytes), 10),
                  cell(Bytes(point.intermediate_bytes), 13));
  }
  absl::FPrintF(out,
                "\nwall: round trip seen by attn; compute, FLOPs and memory: as the server "
                "reported them.\nRPC overhead = wall − compute (transfer, (de)serialization, "
                "checks, queueing); GFLOP/s = FLOPs / compute.\n");
}

std::string ToCsv(const BenchResult& result) {
  const BenchConfig& config = result.config;
  std::string csv =
      "method,n,batch,heads,kv_heads,dim,dtype,causal,block_k,repeats,status,wall_s,compute_s,"
      "server_s,rpc_overhead_s,flops,gflops,intermediate_bytes,scratch_bytes,peak_memory_bytes,"
      "message\n";
  for (const BenchPoint& point : result.points) {
    absl::StrAppend(&csv, point.method, ",", point.n, ",", config.batch, ",", config.heads, ",",
                    config.kv_heads > 0 ? config.kv_heads : config.heads, ",", config.dim, ",",
                    DTypeName(config.dtype), ",", config.options.causal() ? 1 : 0, ",");
    if (point.refused) {
      absl::StrAppend(&csv, config.options.block_k(), ",", config.repeats, ",refused,,,,,,,,,,",
                      CsvField(point.message), "\n");
      continue;
    }
    absl::StrAppend(&csv, point.block_k, ",", config.repeats, ",ok,", CsvSeconds(point.wall_ns),
                    ",", CsvSeconds(point.compute_ns), ",", CsvSeconds(point.server_ns), ",",
                    CsvSeconds(point.overhead_ns()), ",", absl::StrFormat("%.0f", point.flops), ",",
                    absl::StrFormat("%.3f", point.gflops()), ",", point.intermediate_bytes, ",",
                    point.scratch_bytes, ",", point.peak_memory_bytes, ",\n");
  }
  return csv;
}

Chart MakeChart(const BenchResult& result) {
  const BenchConfig& config = result.config;
  Chart chart;
  std::vector<std::string> names;
  for (const std::string& method : config.methods) names.push_back(Title(method));
  chart.title =
      absl::StrCat("attn bench: ", absl::StrJoin(names, " and "), " attention through attnd");
  chart.subtitle = absl::StrCat(ProblemLine(config), " · attnd ", result.server.version(), ", ",
                                result.server.backend(), " on ", result.server.device());

  Panel time;
  time.title = "Time per call";
  time.x_title = "N (queries = keys per head)";
  time.y_title = "time (s)";
  time.y_unit = AxisUnit::kSeconds;
  Panel memory;
  memory.title = "Memory the server reported";
  memory.x_title = time.x_title;
  memory.y_title = "bytes";
  memory.y_unit = AxisUnit::kBytes;

  int64_t first_refused = 0;
  for (const std::string& method : config.methods) {
    const std::string name = Title(method);
    const std::string color = method == "naive" ? kNaiveColor : kTiledColor;
    Series wall{name + " round trip (wall)", color, LineStyle::kSolid, true, {}};
    Series compute{name + " compute (server)", color, LineStyle::kDotted, true, {}};
    Series scratch{name + " scratch", color, LineStyle::kSolid, true, {}};
    Series peak{name + " peak (scratch + output)", color, LineStyle::kDotted, true, {}};
    Series explainer{"Naive 16·B·H·N² (explainer's traffic)", color, LineStyle::kDashed, false, {}};
    for (const BenchPoint& point : result.points) {
      if (point.method != method) continue;
      const double n = static_cast<double>(point.n);
      explainer.points.emplace_back(n, static_cast<double>(ExplainerBytes(config, point.n)));
      if (point.refused) {
        if (first_refused == 0) first_refused = point.n;
        // No measurement: the line stops here (a non-positive y breaks it).
        for (Series* series : {&wall, &compute, &scratch, &peak}) series->points.emplace_back(n, 0);
        continue;
      }
      wall.points.emplace_back(n, static_cast<double>(point.wall_ns) / 1e9);
      compute.points.emplace_back(n, static_cast<double>(point.compute_ns) / 1e9);
      scratch.points.emplace_back(n, static_cast<double>(point.scratch_bytes));
      peak.points.emplace_back(n, static_cast<double>(point.peak_memory_bytes));
    }
    time.series.push_back(std::move(wall));
    time.series.push_back(std::move(compute));
    memory.series.push_back(std::move(scratch));
    memory.series.push_back(std::move(peak));
    if (method == "naive") memory.series.push_back(std::move(explainer));
  }
  time.notes.push_back("The gap between a method's two lines is the RPC overhead:");
  time.notes.push_back("transfer, (de)serialization, checks and queueing.");
  memory.notes.push_back("scratch: working memory beyond inputs and outputs.");
  if (first_refused > 0) {
    memory.rules.push_back({static_cast<double>(result.server.max_naive_bytes()),
                            absl::StrCat("server's --max-naive-bytes (",
                                         Bytes(result.server.max_naive_bytes()), ")")});
    const std::string refused =
        absl::StrCat("Naive refused from N = ", first_refused, " (over --max-naive-bytes).");
    time.notes.push_back(refused);
    memory.notes.push_back(refused);
  }
  chart.panels.push_back(std::move(time));
  chart.panels.push_back(std::move(memory));
  return chart;
}

absl::Status WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (file) file.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (file) file.close();
  if (!file) {
    const int error = errno;
    return absl::ErrnoToStatus(error, absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace attn::cli
