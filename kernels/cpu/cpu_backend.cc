#include "kernels/cpu/cpu_backend.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kernels/cpu/decode.h"
#include "kernels/cpu/kv_store.h"
#include "kernels/cpu/naive.h"
#include "kernels/cpu/tiled.h"
#include "kernels/cpu/trace.h"

namespace attn {
namespace {

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : 0;
}

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "model name")) {
      const size_t colon = rest.find(':');
      if (colon != std::string::npos)
        return std::string(absl::StripAsciiWhitespace(rest.substr(colon + 1)));
    }
  }
  return "unknown CPU";
}

// Runs a kernel, timing it and completing the stats every kernel shares.
template <class Kernel>
absl::StatusOr<Stats> Timed(const Problem& problem, Kernel&& kernel) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Stats> stats = kernel();
  if (!stats.ok()) return stats;
  stats->compute_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  stats->flops = problem.Flops();
  const int64_t output_bytes = problem.OutputElements() * ElementSize(problem.output_dtype);
  const int64_t lse_bytes = problem.return_lse ? problem.LseElements() * 4 : 0;
  stats->peak_memory_bytes = stats->scratch_bytes + output_bytes + lse_bytes;
  return stats;
}

int ThreadsOrAll(int threads) {
  return threads > 0 ? threads
                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

CpuBackend::CpuBackend(int threads, int64_t max_naive_bytes, int64_t max_packed_head_bytes,
                       int64_t kv_page_tokens)
    : pool_(ThreadsOrAll(threads)),
      memory_bytes_(PhysicalMemoryBytes()),
      max_naive_bytes_(max_naive_bytes > 0 ? max_naive_bytes : memory_bytes_ / 4),
      max_packed_head_bytes_(max_packed_head_bytes),
      kv_page_tokens_(std::max<int64_t>(kv_page_tokens, 1)),
      device_(absl::StrCat(CpuModel(), ", ", pool_.threads(), " threads")) {}

bool CpuBackend::RunsInline(const Problem& problem) const {
  const Shape& s = problem.shape;
  const int64_t query_bytes =
      s.batch * s.heads * s.query_len * s.head_dim * ElementSize(problem.query.dtype);
  const int64_t key_value_bytes = s.batch * s.kv_heads * s.key_len *
                                  (s.head_dim * ElementSize(problem.key_dtype()) +
                                   s.value_dim * ElementSize(problem.value_dtype()));
  return problem.Flops() <= kInlineFlops && query_bytes + key_value_bytes <= kInlineInputBytes;
}

ThreadPool& CpuBackend::PoolFor(const Problem& problem) {
  return RunsInline(problem) ? caller_only_ : pool_;
}

absl::StatusOr<Stats> CpuBackend::Naive(const Problem& problem, const Outputs& outputs) {
  return Timed(problem, [&] {
    return NaiveAttention(problem, outputs, PoolFor(problem), max_naive_bytes_, naive_storage_);
  });
}

absl::StatusOr<Stats> CpuBackend::Tiled(const Problem& problem, const Outputs& outputs) {
  return Timed(problem, [&]() -> absl::StatusOr<Stats> {
    absl::StatusOr<Stats> stats =
        TiledAttention(problem, outputs, PoolFor(problem), max_packed_head_bytes_);
    if (stats.ok()) stats->block_k = problem.block_k;
    return stats;
  });
}

absl::StatusOr<std::unique_ptr<TraceCursor>> CpuBackend::Trace(const Problem& problem,
                                                               std::vector<RowRef> rows) {
  return MakeCpuTraceCursor(problem, std::move(rows));
}

absl::StatusOr<std::unique_ptr<KvStore>> CpuBackend::CreateKvStore(const KvLayout& layout) {
  return std::make_unique<CpuKvStore>(layout, kv_page_tokens_);
}

absl::StatusOr<Stats> CpuBackend::Decode(const std::vector<Problem>& problems,
                                         const std::vector<Outputs>& outputs) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<const Problem*> decode_problems;
  std::vector<const Outputs*> decode_outputs;
  Stats total;
  for (size_t i = 0; i < problems.size(); ++i) {
    if (DecodeRowsOf(problems[i]) <= kDecodeGemmMaxRows) {
      decode_problems.push_back(&problems[i]);
      decode_outputs.push_back(&outputs[i]);
      continue;
    }
    absl::StatusOr<Stats> stats = Tiled(problems[i], outputs[i]);
    if (!stats.ok()) return stats.status();
    total.Add(*stats);
    total.block_k = stats->block_k;  // The decode kernel's tile, below, wins when both ran.
  }
  if (!decode_problems.empty()) {
    absl::StatusOr<Stats> stats = DecodeAttention(decode_problems, decode_outputs, pool_);
    if (!stats.ok()) return stats.status();
    total.Add(*stats);
    total.block_k = stats->block_k;
  }
  // The batch's own time and peak: every output is held until the call returns.
  int64_t output_bytes = 0;
  for (const Problem& problem : problems) {
    output_bytes += problem.OutputElements() * ElementSize(problem.output_dtype) +
                    (problem.return_lse ? problem.LseElements() * 4 : 0);
  }
  total.peak_memory_bytes = total.scratch_bytes + output_bytes;
  total.compute_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  return total;
}

}  // namespace attn
