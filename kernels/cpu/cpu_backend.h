// CpuBackend: serves Naive, Tiled and Trace from the CPU kernels in this directory.
//
// Thread-safe. Each Naive or Tiled call spreads its work over the backend's pool of `threads`
// workers (calls take turns on it); BLAS runs single-threaded inside each worker.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"

namespace attn {

class CpuBackend final : public Backend {
 public:
  // threads: workers per call (0 = hardware concurrency). max_naive_bytes: Naive's budget for
  // score and weight storage (0 = a quarter of physical memory).
  CpuBackend(int threads, int64_t max_naive_bytes);

  const char* name() const override { return "cpu"; }
  std::string device() const override { return device_; }
  int64_t memory_bytes() const override { return memory_bytes_; }
  int default_block_k() const override { return kDefaultBlockK; }
  int64_t max_naive_bytes() const override { return max_naive_bytes_; }
  int threads() const { return pool_.threads(); }

  absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                     std::vector<RowRef> rows) override;

 private:
  // Keys per tile when a request asks for 0 (measured: docs/perf.md).
  static constexpr int kDefaultBlockK = 256;

  ThreadPool pool_;
  int64_t memory_bytes_;
  int64_t max_naive_bytes_;
  std::string device_;
};

}  // namespace attn
