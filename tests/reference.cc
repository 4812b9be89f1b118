#include "tests/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>

namespace attn::testing {
namespace {

std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * ElementSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) StoreElement(bytes.data(), dtype, i, values[i]);
  return bytes;
}

float Round(float value, DType dtype) {
  uint8_t bytes[4];
  StoreElement(bytes, dtype, 0, value);
  return LoadElement(bytes, dtype, 0);
}

void SetInputs(HostProblem& p, std::vector<float> q, std::vector<float> k, std::vector<float> v) {
  for (auto* values : {&q, &k, &v}) {
    for (float& x : *values) x = Round(x, p.dtype);
  }
  p.query_bytes = Encode(q, p.dtype);
  p.key_bytes = Encode(k, p.dtype);
  p.value_bytes = Encode(v, p.dtype);
  p.query = std::move(q);
  p.key = std::move(k);
  p.value = std::move(v);
}

}  // namespace

Shape MakeShape(int64_t batch, int64_t heads, int64_t kv_heads, int64_t query_len, int64_t key_len,
                int64_t head_dim, int64_t value_dim) {
  return Shape{.batch = batch,
               .heads = heads,
               .kv_heads = kv_heads,
               .query_len = query_len,
               .key_len = key_len,
               .head_dim = head_dim,
               .value_dim = value_dim};
}

void HostProblem::SetValuesFromKeys() {
  values_from_keys = true;
  const Shape& s = shape;
  std::vector<float> v(s.batch * s.kv_heads * s.key_len * s.value_dim);
  for (int64_t row = 0; row < s.batch * s.kv_heads * s.key_len; ++row) {
    for (int64_t c = 0; c < s.value_dim; ++c) v[row * s.value_dim + c] = key[row * s.head_dim + c];
  }
  value_bytes = Encode(v, dtype);
  value = std::move(v);
}

Problem HostProblem::View() const {
  Problem problem;
  problem.shape = shape;
  problem.query = TensorView{query_bytes.data(), dtype};
  problem.key = TensorView{key_bytes.data(), dtype};
  problem.value = TensorView{value_bytes.data(), dtype};
  problem.scale = scale;
  problem.softcap = softcap;
  problem.alibi_slopes = alibi_slopes.empty() ? nullptr : alibi_slopes.data();
  problem.sinks = sinks.empty() ? nullptr : sinks.data();
  problem.causal = causal;
  problem.key_position = key_position;
  problem.query_position = query_position;
  problem.window_left = window_left.value_or(kUnbounded);
  problem.window_right = window_right.value_or(kUnbounded);
  if (!cu_seqlens_q.empty()) {
    problem.cu_seqlens_q = cu_seqlens_q.data();
    problem.cu_seqlens_k = cu_seqlens_k.data();
    problem.sequences = static_cast<int64_t>(cu_seqlens_q.size()) - 1;
  }
  if (!tree_parents.empty()) {
    problem.tree_count = static_cast<int64_t>(tree_parents.size());
    problem.tree_first = shape.key_len - problem.tree_count;
    problem.tree_ancestors = tree_ancestors.data();
  }
  problem.block_k = static_cast<int>(std::min<int64_t>(block_k, shape.key_len));
  problem.return_lse = return_lse;
  problem.output_dtype = output_dtype;
  return problem;
}

void HostProblem::SetTree(std::vector<int32_t> parents) {
  tree_parents = std::move(parents);
  const int64_t n = static_cast<int64_t>(tree_parents.size());
  const int64_t words = (n + 63) / 64;
  tree_ancestors.assign(n * words, 0);
  for (int64_t i = 0; i < n; ++i) {  // Walking each token's chain up to the prefix.
    for (int64_t a = i; a >= 0; a = tree_parents[a]) {
      tree_ancestors[i * words + a / 64] |= uint64_t{1} << (a % 64);
    }
  }
}

std::vector<int64_t> CumulativeLengths(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> sums = {0};
  for (int64_t length : lengths) sums.push_back(sums.back() + length);
  return sums;
}

HostProblem RandomProblem(const Shape& shape, DType dtype, bool causal, int block_k,
                          uint64_t seed) {
  HostProblem p;
  p.shape = shape;
  p.dtype = dtype;
  p.output_dtype = dtype;
  p.causal = causal;
  p.block_k = block_k;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  auto fill = [&](int64_t n) {
    std::vector<float> values(n);
    for (float& x : values) {
      do x = uniform(rng);
      while (x == 0.f);
    }
    return values;
  };
  const Shape& s = shape;
  std::vector<float> q = fill(s.batch * s.heads * s.query_len * s.head_dim);
  std::vector<float> k = fill(s.batch * s.kv_heads * s.key_len * s.head_dim);
  std::vector<float> v = fill(s.batch * s.kv_heads * s.key_len * s.value_dim);
  SetInputs(p, std::move(q), std::move(k), std::move(v));
  return p;
}

HostProblem SeedExample(float query_multiplier, int block_k) {
  constexpr int n = 8, d = 4;
  HostProblem p;
  p.shape = Shape{.batch = 1,
                  .heads = 1,
                  .kv_heads = 1,
                  .query_len = n,
                  .key_len = n,
                  .head_dim = d,
                  .value_dim = d};
  p.scale = 0.5f;  // 1/sqrt(4)
  p.block_k = block_k;
  std::vector<float> q(n * d), k(n * d), v(n * d);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < d; ++j) {
      q[i * d + j] = static_cast<float>((i + j) % 5 - 2) * query_multiplier;
      k[i * d + j] = static_cast<float>((2 * i + j) % 7 - 3) / 2.f;
      v[i * d + j] = static_cast<float>((i + j) % 9 - 4);
    }
  }
  SetInputs(p, std::move(q), std::move(k), std::move(v));
  return p;
}

HostProblem KeyPrefix(const HostProblem& full, int64_t length) {
  HostProblem p = full;
  const Shape& s = full.shape;
  p.shape.key_len = length;
  const int64_t element = ElementSize(full.dtype);
  auto cut = [&](const auto& values, int64_t width, int64_t scale) {
    std::decay_t<decltype(values)> out;
    for (int64_t h = 0; h < s.batch * s.kv_heads; ++h) {
      const auto first = values.begin() + h * s.key_len * width * scale;
      out.insert(out.end(), first, first + length * width * scale);
    }
    return out;
  };
  p.key_bytes = cut(full.key_bytes, s.head_dim, element);
  p.value_bytes = cut(full.value_bytes, s.value_dim, element);
  p.key = cut(full.key, s.head_dim, 1);
  p.value = cut(full.value, s.value_dim, 1);
  return p;
}

namespace {

// Row i's sequence of a ragged batch, found by scanning: its first row and key, its lengths.
struct ReferenceSequence {
  int64_t first_row = 0, first_key = 0, query_len = 0, key_len = 0;
};

ReferenceSequence SequenceOfRow(const HostProblem& p, int64_t i) {
  if (p.cu_seqlens_q.empty()) return {0, 0, p.shape.query_len, p.shape.key_len};
  for (size_t s = 0; s + 1 < p.cu_seqlens_q.size(); ++s) {
    if (p.cu_seqlens_q[s] <= i && i < p.cu_seqlens_q[s + 1]) {
      return {p.cu_seqlens_q[s], p.cu_seqlens_k[s], p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s],
              p.cu_seqlens_k[s + 1] - p.cu_seqlens_k[s]};
    }
  }
  return {};
}

}  // namespace

int64_t ReferenceDistance(const HostProblem& p, int64_t i, int64_t j) {
  const ReferenceSequence q = SequenceOfRow(p, i);
  i -= q.first_row;
  j -= q.first_key;
  const int64_t query = p.query_position.value_or(p.key_position + q.key_len - q.query_len) + i;
  return query - (p.key_position + j);
}

double ReferenceBias(const HostProblem& p, int64_t h, int64_t i, int64_t j) {
  if (p.alibi_slopes.empty()) return 0;
  return -double(p.alibi_slopes[h]) * std::abs(double(ReferenceDistance(p, i, j)));
}

bool ReferenceSees(const HostProblem& p, int64_t i, int64_t j) {
  const ReferenceSequence q = SequenceOfRow(p, i);
  if (j < q.first_key || j >= q.first_key + q.key_len) return false;
  const int64_t distance = ReferenceDistance(p, i, j);  // p − t
  if (p.causal && distance < 0) return false;
  if (p.window_left && distance > *p.window_left) return false;
  if (p.window_right && -distance > *p.window_right) return false;
  // A token tree: of the new tokens (the last query_len keys), row i sees its own chain only.
  const int64_t first_new = p.shape.key_len - p.shape.query_len;
  if (!p.tree_parents.empty() && j >= first_new) {
    for (int64_t a = i; a >= 0; a = p.tree_parents[a]) {
      if (first_new + a == j) return true;
    }
    return false;
  }
  return true;
}

std::pair<int64_t, int64_t> ReferenceTiles(const HostProblem& p, int64_t i, int64_t block_k) {
  int64_t first = -1, last = -1;
  for (int64_t j = 0; j < p.shape.key_len; ++j) {
    if (!ReferenceSees(p, i, j)) continue;
    if (first < 0) first = j;
    last = j;
  }
  if (first < 0) return {0, 0};
  return {first / block_k, last / block_k + 1};
}

namespace {

// The keys row i sees, ascending (ReferenceSees).
std::vector<int64_t> SeenKeys(const HostProblem& p, int64_t i) {
  std::vector<int64_t> seen;
  for (int64_t j = 0; j < p.shape.key_len; ++j) {
    if (ReferenceSees(p, i, j)) seen.push_back(j);
  }
  return seen;
}

}  // namespace

Reference ReferenceAttention(const HostProblem& p) {
  const Problem view = p.View();
  const Shape& s = p.shape;
  Reference ref;
  ref.output.assign(view.OutputElements(), 0.0);
  ref.lse.assign(view.LseElements(), -std::numeric_limits<double>::infinity());
  std::vector<double> scores(s.key_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kvh = view.KvHead(h);
      // The sink: one more term e^sink of the row's sum, with no value.
      const bool has_sink = !p.sinks.empty();
      const double sink = has_sink ? double(p.sinks[h]) : 0.0;
      for (int64_t i = 0; i < s.query_len; ++i) {
        const std::vector<int64_t> seen = SeenKeys(p, i);
        if (seen.empty()) {
          if (has_sink) ref.lse[view.LseOffset(b, h, i)] = sink;
          continue;
        }
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j : seen) {
          double dot = 0;
          for (int64_t c = 0; c < s.head_dim; ++c) {
            dot += double(p.query[view.QueryOffset(b, h, i) + c]) *
                   double(p.key[view.KeyOffset(b, kvh, j) + c]);
          }
          scores[j] = double(p.scale) * dot;
          if (p.softcap > 0) scores[j] = p.softcap * std::tanh(scores[j] / p.softcap);
          scores[j] += ReferenceBias(p, h, i, j);
          max = std::max(max, scores[j]);
        }
        if (has_sink) max = std::max(max, sink);
        double sum = has_sink ? std::exp(sink - max) : 0.0;
        for (int64_t j : seen) sum += std::exp(scores[j] - max);
        double* out = &ref.output[view.OutputOffset(b, h, i)];
        for (int64_t j : seen) {
          const double w = std::exp(scores[j] - max) / sum;
          for (int64_t c = 0; c < s.value_dim; ++c) {
            // A latent cache's value: its key's first value_dim columns.
            const double v = p.values_from_keys ? double(p.key[view.KeyOffset(b, kvh, j) + c])
                                                : double(p.value[view.ValueOffset(b, kvh, j) + c]);
            out[c] += w * v;
          }
        }
        ref.lse[view.LseOffset(b, h, i)] = max + std::log(sum);
      }
    }
  }
  return ref;
}

std::vector<float> LowPrecisionBaseline(const HostProblem& p, DType dtype) {
  const Problem view = p.View();
  const Shape& s = p.shape;
  std::vector<float> output(view.OutputElements(), 0.f);
  std::vector<float> scores(s.key_len);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kvh = view.KvHead(h);
      for (int64_t i = 0; i < s.query_len; ++i) {
        const std::vector<int64_t> seen = SeenKeys(p, i);
        if (seen.empty()) continue;
        // The sink: one more logit in the row's max and sum, with no value.
        const float sink = p.sinks.empty() ? -INFINITY : p.sinks[h];
        float max = sink;
        for (int64_t j : seen) {
          float dot = 0;
          for (int64_t c = 0; c < s.head_dim; ++c) {
            dot += p.query[view.QueryOffset(b, h, i) + c] * p.key[view.KeyOffset(b, kvh, j) + c];
          }
          scores[j] = Round(p.scale * dot, dtype);
          if (p.softcap > 0) scores[j] = Round(p.softcap * std::tanh(scores[j] / p.softcap), dtype);
          scores[j] = Round(scores[j] + static_cast<float>(ReferenceBias(p, h, i, j)), dtype);
          max = std::max(max, scores[j]);
        }
        float sum = p.sinks.empty() ? 0.f : std::exp(sink - max);
        for (int64_t j : seen) sum += std::exp(scores[j] - max);
        float* out = &output[view.OutputOffset(b, h, i)];
        for (int64_t c = 0; c < s.value_dim; ++c) {
          float acc = 0;
          for (int64_t j : seen) {
            const float w = Round(std::exp(scores[j] - max) / sum, dtype);
            acc += w * p.value[view.ValueOffset(b, kvh, j) + c];
          }
          out[c] = Round(acc, dtype);
        }
      }
    }
  }
  return output;
}

PoisonedOutputs::PoisonedOutputs(const HostProblem& problem)
    : dtype(problem.output_dtype),
      output_bytes(problem.View().OutputElements() * ElementSize(problem.output_dtype)),
      lse(problem.View().LseElements(), std::numeric_limits<float>::quiet_NaN()) {
  for (int64_t i = 0; i < problem.View().OutputElements(); ++i) {
    StoreElement(output_bytes.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
  }
}

Outputs PoisonedOutputs::outputs() {
  Outputs outputs;
  outputs.output = MutableTensorView{output_bytes.data(), dtype};
  outputs.lse = lse.data();
  return outputs;
}

std::vector<float> PoisonedOutputs::Output() const {
  return Decode(output_bytes.data(), dtype,
                static_cast<int64_t>(output_bytes.size()) / ElementSize(dtype));
}

std::vector<float> Decode(const void* data, DType dtype, int64_t count) {
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) values[i] = LoadElement(data, dtype, i);
  return values;
}

double MaxAbsError(const std::vector<float>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double error = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double diff = std::abs(double(actual[i]) - expected[i]);
    if (std::isnan(diff)) return std::numeric_limits<double>::infinity();
    error = std::max(error, diff);
  }
  return error;
}

double MaxAbs(const std::vector<double>& values) {
  double m = 0;
  for (double x : values) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace attn::testing
