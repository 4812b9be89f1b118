#include "tests/checks.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "gtest/gtest.h"
#include "kernels/cpu/fp32_rows.h"

namespace attn::testing {

const char* KernelName(Kernel kernel) { return kernel == Kernel::kNaive ? "Naive" : "Tiled"; }

// Runs one kernel on `problem` (a view of `host`, possibly adjusted) into poisoned outputs.
// Uses no gtest assertions, so threads may call it.
absl::StatusOr<KernelRun> TryKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                                    const Problem& problem) {
  PoisonedOutputs outputs(host);
  absl::StatusOr<Stats> stats = kernel == Kernel::kNaive
                                    ? backend.Naive(problem, outputs.outputs())
                                    : backend.Tiled(problem, outputs.outputs());
  if (!stats.ok()) return stats.status();
  KernelRun run;
  run.stats = *stats;
  run.output = outputs.Output();
  run.output_bytes = std::move(outputs.output_bytes);
  run.lse = std::move(outputs.lse);
  return run;
}

KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host,
                    const Problem& problem) {
  absl::StatusOr<KernelRun> run = TryKernel(backend, kernel, host, problem);
  EXPECT_TRUE(run.ok()) << KernelName(kernel) << ": " << run.status();
  if (run.ok()) return *std::move(run);
  // A failed run compares as all-NaN (the poison), so every later check fails too.
  const PoisonedOutputs poisoned(host);
  return KernelRun{poisoned.output_bytes, poisoned.Output(), poisoned.lse, Stats{}};
}

KernelRun RunKernel(Backend& backend, Kernel kernel, const HostProblem& host) {
  return RunKernel(backend, kernel, host, host.View());
}

// Output relative error max|out − ref| / max|ref| ≤ rtol. NaN never passes.
void ExpectOutputMatches(const KernelRun& run, const Reference& ref, double rtol) {
  const double error = MaxAbsError(run.output, ref.output);
  const double magnitude = MaxAbs(ref.output);
  ASSERT_GT(magnitude, 0.0);
  EXPECT_LE(error / magnitude, rtol) << "max abs error " << error << ", max |ref| " << magnitude;
}

// lse within rtol · max(1, |lse|), exactly −inf where the reference row saw no key.
void ExpectLseMatches(const KernelRun& run, const Reference& ref, double rtol) {
  ASSERT_EQ(run.lse.size(), ref.lse.size());
  int reported = 0;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    bool ok;
    if (std::isinf(ref.lse[i])) {
      ok = std::isinf(run.lse[i]) && run.lse[i] < 0;
    } else {
      ok = std::abs(double(run.lse[i]) - ref.lse[i]) <= rtol * std::max(1.0, std::abs(ref.lse[i]));
    }
    if (!ok && reported++ < 5) {
      ADD_FAILURE() << "lse[" << i << "] = " << run.lse[i] << ", reference " << ref.lse[i];
    }
  }
}

void ExpectMatchesReference(const KernelRun& run, const Reference& ref, double rtol) {
  ExpectOutputMatches(run, ref, rtol);
  ExpectLseMatches(run, ref, rtol);
}

// Output rows of query rows that see no key must be exactly zero (and their lse −inf, which
// ExpectLseMatches checks). Which rows see none is ReferenceSees's answer, so moved positions,
// windows and ragged batches are held to it too.
void ExpectUnseeingRowsZero(const KernelRun& run, const HostProblem& host) {
  const Shape& s = host.shape;
  std::vector<int64_t> unseeing_rows;
  for (int64_t i = 0; i < s.query_len; ++i) {
    bool sees = false;
    for (int64_t j = 0; j < s.key_len && !sees; ++j) sees = ReferenceSees(host, i, j);
    if (!sees) unseeing_rows.push_back(i);
  }
  int64_t checked = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i : unseeing_rows) {
        const int64_t offset = ((b * s.heads + h) * s.query_len + i) * s.value_dim;
        for (int64_t c = 0; c < s.value_dim; ++c) {
          EXPECT_EQ(run.output[offset + c], 0.f) << "b=" << b << " h=" << h << " row=" << i;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 0) << "the case was meant to have rows that see no key";
}

void ExpectMatchesInItsDtype(const KernelRun& run, const HostProblem& host, const Reference& ref) {
  if (host.dtype == DType::kFloat32) {
    ExpectMatchesReference(run, ref, 1e-5);
  } else {
    ExpectLowPrecisionMatches(run, host, ref);
  }
  ExpectLseMatches(run, ref, 1e-5);
}

KernelRun RunDecode(Backend& backend, const HostProblem& host) {
  std::optional<PagedCopy> paged;
  if (host.shape.batch == 1) {
    absl::StatusOr<PagedCopy> copy = MakePaged(backend, host, {host.shape.key_len / 2});
    EXPECT_TRUE(copy.ok()) << copy.status();
    if (!copy.ok()) return {};
    paged = *std::move(copy);
  }
  PoisonedOutputs poisoned(host);
  const absl::StatusOr<Stats> stats =
      backend.Decode({paged ? paged->problem : host.View()}, {poisoned.outputs()});
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return {};
  KernelRun run;
  run.output = poisoned.Output();
  run.output_bytes = poisoned.output_bytes;
  run.lse = poisoned.lse;
  run.stats = *stats;
  return run;
}

void ExpectNaiveTiledAndDecodeMatch(Backend& backend, const HostProblem& host) {
  const Reference ref = ReferenceAttention(host);
  for (Kernel kernel : {Kernel::kNaive, Kernel::kTiled}) {
    SCOPED_TRACE(KernelName(kernel));
    ExpectMatchesInItsDtype(RunKernel(backend, kernel, host), host, ref);
  }
  SCOPED_TRACE("Decode");
  const KernelRun decoded = RunDecode(backend, host);
  ASSERT_FALSE(decoded.output.empty());
  ExpectMatchesInItsDtype(decoded, host, ref);
}

double LargestOutputDifference(const Reference& a, const Reference& b) {
  double largest = 0;
  for (size_t i = 0; i < a.output.size() && i < b.output.size(); ++i) {
    largest = std::max(largest, std::abs(a.output[i] - b.output[i]));
  }
  return largest;
}

absl::StatusOr<PagedCopy> MakePaged(Backend& backend, const HostProblem& host,
                                    const std::vector<int64_t>& pieces, const DType* input_dtype,
                                    const DType* store_dtype) {
  const Shape& s = host.shape;
  if (s.batch != 1) return absl::InvalidArgumentError("a cache holds one sequence (batch 1)");
  absl::StatusOr<std::unique_ptr<KvStore>> store =
      backend.CreateKvStore(KvLayout{.kv_heads = s.kv_heads,
                                     .head_dim = s.head_dim,
                                     .value_dim = s.value_dim,
                                     .dtype = store_dtype != nullptr ? *store_dtype : host.dtype,
                                     .values_from_keys = host.values_from_keys});
  if (!store.ok()) return store.status();
  const DType dtype = input_dtype != nullptr ? *input_dtype : host.dtype;
  std::vector<int64_t> sizes;
  int64_t used = 0;
  for (int64_t piece : pieces) {
    if (used + piece > s.key_len) break;
    sizes.push_back(piece);
    used += piece;
  }
  if (used < s.key_len) sizes.push_back(s.key_len - used);
  int64_t begin = 0;
  for (int64_t n : sizes) {
    // Tokens [begin, begin + n) of every kv head, as dense [kv_heads, n, width] in `dtype`.
    auto slice = [&](const std::vector<float>& values, int64_t width) {
      std::vector<uint8_t> bytes(s.kv_heads * n * width * ElementSize(dtype));
      int64_t out = 0;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        for (int64_t i = (h * s.key_len + begin) * width; i < (h * s.key_len + begin + n) * width;
             ++i) {
          StoreElement(bytes.data(), dtype, out++, values[i]);
        }
      }
      return bytes;
    };
    const std::vector<uint8_t> key = slice(host.key, s.head_dim);
    // A latent store takes keys alone.
    const std::vector<uint8_t> value =
        host.values_from_keys ? std::vector<uint8_t>() : slice(host.value, s.value_dim);
    if (absl::Status status =
            (*store)->Append(TensorView{key.data(), dtype},
                             TensorView{host.values_from_keys ? nullptr : value.data(), dtype}, n);
        !status.ok()) {
      return status;
    }
    begin += n;
  }
  PagedCopy copy;
  copy.store = *std::move(store);
  copy.problem = host.View();
  copy.problem.key = TensorView{};
  copy.problem.value = TensorView{};
  copy.problem.pages = &copy.store->pages();
  return copy;
}

void ExpectLowPrecisionMatches(const KernelRun& run, const HostProblem& host,
                               const Reference& ref) {
  const double baseline_error =
      MaxAbsError(LowPrecisionBaseline(host, host.output_dtype), ref.output);
  ASSERT_TRUE(std::isfinite(baseline_error));
  // LowPrecisionAtol, and never more than a couple of output ulps at 1 (fp16 ulp at 1 is
  // 2^-10 ≈ 1e-3, bf16's 2^-7 ≈ 8e-3).
  const double atol =
      std::min(LowPrecisionAtol(host, ref), host.output_dtype == DType::kFloat16 ? 1e-3 : 1e-2);
  const double error = MaxAbsError(run.output, ref.output);
  EXPECT_LE(error, 2 * baseline_error + atol) << "baseline error " << baseline_error;
  ExpectLseMatches(run, ref, 1e-5);
}

double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return std::ldexp(1.0, -24);
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
    case DType::kFloat8E4M3:
      return std::ldexp(1.0, -4);
  }
  return 1;
}

double LowPrecisionAtol(const HostProblem& host, const Reference& ref) {
  return UnitRoundoff(host.output_dtype) * MaxAbs(ref.output) + 1e-5;
}

double ProbabilityRoundingBound(const HostProblem& host) {
  if (host.dtype == DType::kFloat32) return 0;
  double max_value = 0;
  for (float v : host.value) max_value = std::max(max_value, double(std::abs(v)));
  const double subnormal = host.dtype == DType::kFloat16
                               ? double(host.shape.key_len) * std::ldexp(1.0, -25) * max_value
                               : 0;
  return UnitRoundoff(host.dtype) * max_value + subnormal;
}

HostProblem DequantizedFrom(const KvStore& store, const HostProblem& host) {
  HostProblem out = host;
  const KvLayout& l = store.layout();
  const Shape& s = host.shape;
  const int64_t n = store.length();
  const int64_t key_row = KeyRowBytes(l), value_row = StoredRowBytes(l.dtype, l.value_dim);
  std::vector<uint8_t> key(KeyBytes(l, n)), value(l.kv_heads * n * value_row);
  const absl::Status copied = store.CopyOut(0, n, key.data(), value.data());
  EXPECT_TRUE(copied.ok()) << copied;
  for (int64_t h = 0; h < l.kv_heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      DequantizeFp8Row(key.data() + (h * n + t) * key_row, l.head_dim, key_row,
                       out.key.data() + (h * s.key_len + t) * s.head_dim);
      DequantizeFp8Row(value.data() + (h * n + t) * value_row, l.value_dim, value_row,
                       out.value.data() + (h * s.key_len + t) * s.value_dim);
    }
  }
  for (size_t i = 0; i < out.key.size(); ++i)
    StoreElement(out.key_bytes.data(), out.dtype, i, out.key[i]);
  for (size_t i = 0; i < out.value.size(); ++i) {
    StoreElement(out.value_bytes.data(), out.dtype, i, out.value[i]);
  }
  return out;
}

}  // namespace attn::testing
