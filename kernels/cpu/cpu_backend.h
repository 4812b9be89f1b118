// CpuBackend: serves Naive, Tiled, Trace and Decode from the CPU kernels in this directory, and
// keeps KV caches in host memory (CpuKvStore).
//
// Thread-safe. Each Naive, Tiled or Decode call spreads its work over the backend's pool of
// `threads` workers (calls take turns on it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/naive.h"
#include "kernels/cpu/thread_pool.h"

namespace attn {

class CpuBackend final : public Backend {
 public:
  static constexpr int64_t kDefaultMaxPackedHeadBytes = 16 << 20;  // docs/perf.md
  // Tokens per KV cache page: 256 tokens of 8 kv heads × 128 × bf16 keys are 512 KiB a block,
  // so page-table walks are rare and a cache wastes at most one page per sequence.
  static constexpr int64_t kDefaultKvPageTokens = 256;

  // threads: workers per call (0 = hardware concurrency). max_naive_bytes: Naive's budget for
  // score and weight storage (0 = a quarter of physical memory). max_packed_head_bytes: the
  // packed key tiles each Tiled worker keeps per head (TiledAttention in tiled.h; tests lower it
  // to reach the path that packs again for every block). kv_page_tokens: tokens per page of the
  // KV caches it creates (tests use small odd ones).
  CpuBackend(int threads, int64_t max_naive_bytes,
             int64_t max_packed_head_bytes = kDefaultMaxPackedHeadBytes,
             int64_t kv_page_tokens = kDefaultKvPageTokens);

  const char* name() const override { return "cpu"; }
  std::string device() const override { return device_; }
  int64_t memory_bytes() const override { return memory_bytes_; }
  int default_block_k() const override { return kDefaultBlockK; }
  int64_t max_naive_bytes() const override { return max_naive_bytes_; }
  NaiveStorage naive_storage_;  // Naive's matrices, kept from one call for the next.
  // Up to kInlineFlops and kInlineInputBytes: such a call runs on its caller's thread alone.
  bool RunsInline(const Problem& problem) const override;

  absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) override;
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                     std::vector<RowRef> rows) override;

  absl::StatusOr<std::unique_ptr<KvStore>> CreateKvStore(const KvLayout& layout) override;
  int64_t kv_page_tokens() const override { return kv_page_tokens_; }
  bool keeps_fp8_caches() const override { return true; }
  // Decode-shaped problems (DecodeRowsOf ≤ kDecodeGemmMaxRows, decode.h) through the decode kernel,
  // all in one pool run; any others through Tiled.
  absl::StatusOr<Stats> Decode(const std::vector<Problem>& problems,
                               const std::vector<Outputs>& outputs) override;

 private:
  // Keys per tile when a request asks for 0 (measured: docs/perf.md).
  static constexpr int kDefaultBlockK = 256;
  // A call this small takes microseconds on one core (about 4 MFLOP and 256 KiB of inputs, at
  // tens of GFLOP/s and several GB/s): less than handing it to a worker thread and back costs.
  static constexpr double kInlineFlops = 1 << 22;
  static constexpr int64_t kInlineInputBytes = 256 << 10;

  ThreadPool& PoolFor(const Problem& problem);  // caller_only_ for RunsInline calls.

  ThreadPool pool_;
  ThreadPool caller_only_{1};  // For RunsInline calls: no helpers, so never waits on pool_.
  int64_t memory_bytes_;
  int64_t max_naive_bytes_;
  int64_t max_packed_head_bytes_;
  int64_t kv_page_tokens_;
  std::string device_;
};

}  // namespace attn
