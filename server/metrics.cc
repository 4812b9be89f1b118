#include "server/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "server/service.h"

namespace attn {
namespace {

[[maybe_unused]] bool ValidName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// A sample value as Prometheus parses it: integers as integers, other values in the shortest
// decimal that reads back exactly (%g style: 0.0005, 1.5e-07), "+Inf", "-Inf", "NaN".
std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::trunc(value) && std::fabs(value) < 0x1p53) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buffer[64];
  const std::to_chars_result result =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::general);
  return std::string(buffer, result.ptr);
}

// HELP text escapes backslash and newline; label values also escape the double quote.
std::string Escape(absl::string_view text, bool quote) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}`, with `extra` (an already formatted `le="…"`) last; empty without labels.
std::string LabelText(const std::vector<std::string>& names, const std::vector<std::string>& values,
                      absl::string_view extra = "") {
  if (names.empty() && extra.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i > 0 ? "," : "", names[i], "=\"", Escape(values[i], true), "\"");
  }
  absl::StrAppend(&out, !names.empty() && !extra.empty() ? "," : "", extra, "}");
  return out;
}

}  // namespace

// --- Histogram --------------------------------------------------------------------------------

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  assert(std::is_sorted(bounds_.begin(), bounds_.end()) &&
         std::adjacent_find(bounds_.begin(), bounds_.end()) == bounds_.end());
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // The first bound ≥ value: its bucket counts value (le = "less than or equal").
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[bucket];
  sum_ += value;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot snapshot;
  snapshot.bounds = bounds_;
  snapshot.cumulative.reserve(bounds_.size());
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t running = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    running += counts_[i];
    snapshot.cumulative.push_back(running);
  }
  snapshot.count = running + counts_.back();
  snapshot.sum = sum_;
  return snapshot;
}

std::vector<double> LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,    1,     2.5,    5,     10,   30,    60,   120};
}

// --- Family -----------------------------------------------------------------------------------

template <typename Metric>
Family<Metric>::Family(std::vector<std::string> label_names,
                       std::function<std::unique_ptr<Metric>()> make)
    : label_names_(std::move(label_names)), make_(std::move(make)) {
  for ([[maybe_unused]] const std::string& name : label_names_) {
    assert(ValidName(name) && name.find(':') == std::string::npos && name != "le");
  }
  if (label_names_.empty()) children_.emplace(std::vector<std::string>{}, make_());
}

template <typename Metric>
Metric& Family<Metric>::WithLabels(const std::vector<std::string>& values) {
  assert(values.size() == label_names_.size());
  std::lock_guard<std::mutex> lock(mutex_);
  std::unique_ptr<Metric>& child = children_[values];
  if (child == nullptr) child = make_();
  return *child;
}

template <typename Metric>
void Family<Metric>::ForEach(
    const std::function<void(const std::vector<std::string>&, const Metric&)>& visit) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [values, child] : children_) visit(values, *child);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// --- MetricsRegistry --------------------------------------------------------------------------

struct MetricsRegistry::Entry {
  std::string name;
  std::string help;
  std::vector<std::string> label_names;
  std::variant<std::unique_ptr<Family<Counter>>, std::unique_ptr<Family<Gauge>>,
               std::unique_ptr<Family<Histogram>>, std::function<double()>>
      metric;
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

void MetricsRegistry::Add(std::unique_ptr<Entry> entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  assert(ValidName(entry->name));
  assert(std::none_of(entries_.begin(), entries_.end(),
                      [&](const std::unique_ptr<Entry>& e) { return e->name == entry->name; }));
  entries_.push_back(std::move(entry));
}

template <typename Metric>
Family<Metric>& MetricsRegistry::AddFamily(std::string name, std::string help,
                                           std::vector<std::string> label_names,
                                           std::function<std::unique_ptr<Metric>()> make) {
  auto entry = std::make_unique<Entry>();
  entry->name = std::move(name);
  entry->help = std::move(help);
  entry->label_names = label_names;
  auto family = std::make_unique<Family<Metric>>(std::move(label_names), std::move(make));
  Family<Metric>& result = *family;
  entry->metric = std::move(family);
  Add(std::move(entry));
  return result;
}

Family<Counter>& MetricsRegistry::AddCounter(std::string name, std::string help,
                                             std::vector<std::string> label_names) {
  return AddFamily<Counter>(std::move(name), std::move(help), std::move(label_names),
                            [] { return std::make_unique<Counter>(); });
}

Family<Gauge>& MetricsRegistry::AddGauge(std::string name, std::string help,
                                         std::vector<std::string> label_names) {
  return AddFamily<Gauge>(std::move(name), std::move(help), std::move(label_names),
                          [] { return std::make_unique<Gauge>(); });
}

Family<Histogram>& MetricsRegistry::AddHistogram(std::string name, std::string help,
                                                 std::vector<double> bounds,
                                                 std::vector<std::string> label_names) {
  return AddFamily<Histogram>(std::move(name), std::move(help), std::move(label_names),
                              [bounds] { return std::make_unique<Histogram>(bounds); });
}

void MetricsRegistry::AddGaugeCallback(std::string name, std::string help,
                                       std::function<double()> read) {
  auto entry = std::make_unique<Entry>();
  entry->name = std::move(name);
  entry->help = std::move(help);
  entry->metric = std::move(read);
  Add(std::move(entry));
}

std::string MetricsRegistry::Render() const {
  std::string out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const std::unique_ptr<Entry>& entry : entries_) {
    const std::string& name = entry->name;
    const std::vector<std::string>& labels = entry->label_names;
    const char* type =
        std::holds_alternative<std::unique_ptr<Family<Counter>>>(entry->metric)     ? "counter"
        : std::holds_alternative<std::unique_ptr<Family<Histogram>>>(entry->metric) ? "histogram"
                                                                                    : "gauge";
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(entry->help, false), "\n", "# TYPE ", name,
                    " ", type, "\n");
    if (const auto* counters = std::get_if<std::unique_ptr<Family<Counter>>>(&entry->metric)) {
      (*counters)->ForEach([&](const std::vector<std::string>& values, const Counter& counter) {
        absl::StrAppend(&out, name, LabelText(labels, values), " ", counter.value(), "\n");
      });
    } else if (const auto* gauges = std::get_if<std::unique_ptr<Family<Gauge>>>(&entry->metric)) {
      (*gauges)->ForEach([&](const std::vector<std::string>& values, const Gauge& gauge) {
        absl::StrAppend(&out, name, LabelText(labels, values), " ", FormatValue(gauge.value()),
                        "\n");
      });
    } else if (const auto* histograms =
                   std::get_if<std::unique_ptr<Family<Histogram>>>(&entry->metric)) {
      (*histograms)
          ->ForEach([&](const std::vector<std::string>& values, const Histogram& histogram) {
            const Histogram::Snapshot snapshot = histogram.snapshot();
            for (size_t i = 0; i < snapshot.bounds.size(); ++i) {
              absl::StrAppend(
                  &out, name, "_bucket",
                  LabelText(labels, values,
                            absl::StrCat("le=\"", FormatValue(snapshot.bounds[i]), "\"")),
                  " ", snapshot.cumulative[i], "\n");
            }
            absl::StrAppend(&out, name, "_bucket", LabelText(labels, values, "le=\"+Inf\""), " ",
                            snapshot.count, "\n");
            absl::StrAppend(&out, name, "_sum", LabelText(labels, values), " ",
                            FormatValue(snapshot.sum), "\n");
            absl::StrAppend(&out, name, "_count", LabelText(labels, values), " ", snapshot.count,
                            "\n");
          });
    } else if (const auto* read = std::get_if<std::function<double()>>(&entry->metric)) {
      absl::StrAppend(&out, name, " ", FormatValue((*read)()), "\n");
    }
  }
  return out;
}

// --- attnd's gauges ---------------------------------------------------------------------------

int64_t ProcessResidentBytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  long long size_pages = 0;
  long long resident_pages = 0;
  const int fields = std::fscanf(statm, "%lld %lld", &size_pages, &resident_pages);
  std::fclose(statm);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (fields != 2 || page_bytes <= 0) return -1;
  return static_cast<int64_t>(resident_pages) * page_bytes;
}

void AddServerGauges(MetricsRegistry& registry, const AttentionService& service,
                     const Backend& backend) {
  registry
      .AddGauge("attnd_build_info", "attnd's version, compute backend and device; always 1.",
                {"version", "backend", "device"})
      .WithLabels({ATTN_VERSION, backend.name(), backend.device()})
      .Set(1);
  registry.AddGaugeCallback("attnd_compute_inflight",
                            "Calls computing on a compute worker now (Naive, Tiled, Trace "
                            "openings, AppendCache, TruncateCache, Decode).",
                            [&service] { return static_cast<double>(service.computing()); });
  registry.AddGaugeCallback(
      "attnd_compute_queued",
      "Calls waiting for a compute worker (Naive, Tiled, Trace openings, AppendCache, "
      "TruncateCache, Decode).",
      [&service] { return static_cast<double>(service.queued()); });
  registry.AddGaugeCallback(
      "attnd_inflight_request_bytes",
      "Bytes of the requests and answers accepted and not yet answered (of --max-inflight-bytes).",
      [&service] { return static_cast<double>(service.inflight_bytes()); });
  registry.AddGaugeCallback(
      "attnd_trace_idle_cancelled",
      "Trace streams cancelled so far because their reader took nothing for --trace-idle-seconds.",
      [&service] { return static_cast<double>(service.idle_traces_cancelled()); });
  registry.AddGaugeCallback("attnd_caches", "Server-resident KV caches alive now.",
                            [&service] { return static_cast<double>(service.caches().caches()); });
  registry.AddGaugeCallback("attnd_cache_tokens", "Tokens held by all KV caches.",
                            [&service] { return static_cast<double>(service.caches().tokens()); });
  registry.AddGaugeCallback("attnd_cache_bytes",
                            "Memory the KV caches' pages take (of --cache-bytes), bytes.",
                            [&service] { return static_cast<double>(service.caches().bytes()); });
  if (service.caches().persistent()) {
    registry.AddGaugeCallback(
        "attnd_cache_disk_bytes", "Bytes the KV caches' files take in --cache-dir.",
        [&service] { return static_cast<double>(service.caches().disk_bytes()); });
    registry.AddGaugeCallback(
        "attnd_cache_disk_lag_seconds",
        "How long the oldest append not yet durable in --cache-dir has waited (0: none waits).",
        [&service] { return service.caches().disk_lag_seconds(); });
    registry.AddGaugeCallback(
        "attnd_cache_last_flush_seconds",
        "When the KV caches were last written and fsynced to --cache-dir, seconds since the epoch.",
        [&service] { return service.caches().last_flush_seconds(); });
  }
  registry.AddGaugeCallback("attnd_host_memory_rss_bytes",
                            "Resident memory of the attnd process (/proc/self/statm), bytes.",
                            [] { return static_cast<double>(ProcessResidentBytes()); });
  if (absl::string_view(backend.name()) != "cpu") {
    registry.AddGaugeCallback("attnd_device_memory_total_bytes",
                              "Memory of the compute device, bytes.",
                              [&backend] { return static_cast<double>(backend.memory_bytes()); });
  }
}

}  // namespace attn
