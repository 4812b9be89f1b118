// MetricsRegistry: counters, gauges and histograms with labels, rendered in the Prometheus text
// exposition format (version 0.0.4) for the HTTP port's /metrics (http_port.h).
//
// A family (one name, one help text, one type, fixed label names) is registered once; its
// children, one per combination of label values, are made at zero on first use and live as long
// as the registry, so a caller may keep a child's reference and update it without a lookup. A
// family without labels has its one child from the start, so it renders as 0 before any update.
// Updates are atomic (counters, gauges) or take the histogram's own mutex; registration, lookups
// and Render are thread-safe. Families render in registration order, children sorted by their
// label values, so the text is deterministic.
//
// Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and be unique within a registry, and WithLabels must
// get one value per label name: breaking either is a programming error (asserted in debug
// builds). Nothing here is global: attnd makes one registry in main and passes it in.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace attn {

class AttentionService;
class Backend;

// A count that only goes up (requests, bytes).
class Counter {
 public:
  void Increment(int64_t by = 1) { value_.fetch_add(by, std::memory_order_relaxed); }
  int64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> value_{0};
};

// A value that goes up and down (calls in flight).
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into buckets by upper bound (`le`, "less than or equal"), plus their sum
// and count. The bounds must be finite and strictly increasing; +Inf is implied. NaN
// observations are dropped.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);

  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<int64_t> cumulative;  // cumulative[i]: observations ≤ bounds[i].
    int64_t count = 0;                // All observations: the +Inf bucket.
    double sum = 0;
  };
  // A consistent copy: the buckets, sum and count of the same observations.
  Snapshot snapshot() const;

 private:
  const std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<int64_t> counts_;  // Per bucket, not cumulative; the last is (bounds_.back(), +Inf].
  double sum_ = 0;
};

// Latency buckets, seconds: 0.5 ms to 2 minutes.
std::vector<double> LatencyBuckets();

// One metric family: the children of one name, by label values.
template <typename Metric>
class Family {
 public:
  Family(std::vector<std::string> label_names, std::function<std::unique_ptr<Metric>()> make);

  // The child for these label values (one per label name), made at zero on first use.
  Metric& WithLabels(const std::vector<std::string>& values);

  const std::vector<std::string>& label_names() const { return label_names_; }
  // Calls visit(values, child) for every child, sorted by label values, under the family's lock.
  void ForEach(
      const std::function<void(const std::vector<std::string>&, const Metric&)>& visit) const;

 private:
  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<Metric>()> make_;
  mutable std::mutex mutex_;
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_;
};

class MetricsRegistry {
 public:
  // The Content-Type of Render's text.
  static constexpr absl::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  Family<Counter>& AddCounter(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(std::string name, std::string help,
                          std::vector<std::string> label_names = {});
  Family<Histogram>& AddHistogram(std::string name, std::string help, std::vector<double> bounds,
                                  std::vector<std::string> label_names = {});
  // A gauge without labels whose value `read` returns at each Render (on the scraping thread,
  // so it must be thread-safe and quick). Whatever it reads must outlive the registry's use.
  void AddGaugeCallback(std::string name, std::string help, std::function<double()> read);

  // Every family, in the text exposition format: "# HELP", "# TYPE", then one line per sample.
  std::string Render() const;

 private:
  struct Entry;
  void Add(std::unique_ptr<Entry> entry);
  template <typename Metric>
  Family<Metric>& AddFamily(std::string name, std::string help,
                            std::vector<std::string> label_names,
                            std::function<std::unique_ptr<Metric>()> make);

  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// This process's resident set size in bytes (/proc/self/statm), or -1 when it cannot be read.
int64_t ProcessResidentBytes();

// attnd's process and compute gauges, read at each scrape: attnd_compute_inflight,
// attnd_compute_queued, attnd_caches, attnd_cache_tokens, attnd_cache_bytes (service),
// attnd_host_memory_rss_bytes, attnd_device_memory_total_bytes
// (GPU backends only) and attnd_build_info. The service and backend must outlive every Render.
void AddServerGauges(MetricsRegistry& registry, const AttentionService& service,
                     const Backend& backend);

}  // namespace attn
