#include "client/cli/inputs.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace attn::cli {

namespace v1 = attention::v1;

Inputs SeedExample(float query_multiplier) {
  constexpr int n = 8, d = 4;
  Inputs inputs;
  for (client::Array* array : {&inputs.query, &inputs.key, &inputs.value}) {
    array->shape = {n, d};
    array->values.resize(n * d);
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < d; ++j) {
      inputs.query.values[i * d + j] = static_cast<float>((i + j) % 5 - 2) * query_multiplier;
      inputs.key.values[i * d + j] = static_cast<float>((2 * i + j) % 7 - 3) / 2.f;
      inputs.value.values[i * d + j] = static_cast<float>((i + j) % 9 - 4);
    }
  }
  return inputs;
}

absl::StatusOr<Inputs> RandomInputs(const std::string& spec, int64_t kv_heads, uint64_t seed,
                                    v1::DType dtype) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ',');
  int64_t dims[4];
  if (parts.size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("--random expects B,H,N,D (four positive integers), got \"", spec, "\""));
  }
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleAtoi(parts[i], &dims[i]) || dims[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--random expects B,H,N,D (four positive integers), got \"", spec, "\""));
    }
  }
  const auto [batch, heads, n, d] = dims;
  if (kv_heads == 0) kv_heads = heads;
  if (kv_heads < 1 || heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-heads must divide the query heads (", heads, "), got ", kv_heads));
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  auto fill = [&](client::Array& array, std::vector<int64_t> shape) {
    int64_t elements = 1;
    for (int64_t dim : shape) elements *= dim;
    array.shape = std::move(shape);
    array.values.resize(elements);
    for (float& x : array.values) x = uniform(rng);
  };
  Inputs inputs;
  inputs.dtype = dtype;
  fill(inputs.query, {batch, heads, n, d});
  fill(inputs.key, {batch, kv_heads, n, d});
  fill(inputs.value, {batch, kv_heads, n, d});
  return inputs;
}

absl::Status ParseWindow(const std::string& spec, v1::AttentionOptions* options) {
  if (spec.empty()) return absl::OkStatus();
  const std::vector<absl::string_view> sides = absl::StrSplit(spec, ',');
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "--window expects L,R: the keys a query at p sees run from p − L to p + R, each side an "
        "integer ≥ 0, or empty or -1 for unbounded (e.g. 256,0 or 256,), got \"",
        spec, "\""));
  };
  if (sides.size() != 2) return bad();
  for (int side = 0; side < 2; ++side) {
    const absl::string_view text = absl::StripAsciiWhitespace(sides[side]);
    if (text.empty()) continue;
    int64_t value = 0;
    if (!absl::SimpleAtoi(text, &value) || value < -1) return bad();
    if (value == -1) continue;
    if (side == 0) {
      options->set_window_left(value);
    } else {
      options->set_window_right(value);
    }
  }
  return absl::OkStatus();
}

namespace {

// `spec`'s comma-separated finite floats; INVALID_ARGUMENT naming --flag and what it expects.
absl::StatusOr<std::vector<float>> ParseFloats(absl::string_view flag, const std::string& spec,
                                               absl::string_view expects) {
  std::vector<float> values;
  for (absl::string_view text : absl::StrSplit(spec, ',')) {
    float value = 0;
    if (!absl::SimpleAtof(absl::StripAsciiWhitespace(text), &value) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " expects ", expects, "; got \"", spec, "\""));
    }
    values.push_back(value);
  }
  return values;
}

}  // namespace

absl::Status ParseAlibi(const std::string& spec, int64_t heads, v1::AttentionOptions* options) {
  if (spec.empty()) return absl::OkStatus();
  std::vector<float> slopes;
  if (spec == "standard") {
    slopes = client::StandardAlibiSlopes(heads);
  } else {
    absl::StatusOr<std::vector<float>> parsed = ParseFloats(
        "alibi", spec, "\"standard\" or one finite slope per query head, comma-separated");
    if (!parsed.ok()) return parsed.status();
    slopes = *std::move(parsed);
  }
  if (static_cast<int64_t>(slopes.size()) != heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--alibi gives ", slopes.size(), " slopes for ", heads,
                     " query heads; give one per head or \"standard\""));
  }
  options->mutable_alibi_slopes()->Assign(slopes.begin(), slopes.end());
  return absl::OkStatus();
}

absl::Status ParseSinks(const std::string& spec, int64_t heads, v1::AttentionOptions* options) {
  if (spec.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<float>> sinks = ParseFloats(
      "sinks", spec, "one finite sink for every query head, or one per head, comma-separated");
  if (!sinks.ok()) return sinks.status();
  if (sinks->size() == 1) sinks->assign(heads, sinks->front());
  if (static_cast<int64_t>(sinks->size()) != heads) {
    return absl::InvalidArgumentError(absl::StrCat("--sinks gives ", sinks->size(), " sinks for ",
                                                   heads,
                                                   " query heads; give one, or one per head"));
  }
  options->mutable_sinks()->Assign(sinks->begin(), sinks->end());
  return absl::OkStatus();
}

absl::StatusOr<v1::DType> ParseDType(const std::string& name) {
  if (name == "f32") return v1::DTYPE_FLOAT32;
  if (name == "f16") return v1::DTYPE_FLOAT16;
  if (name == "bf16") return v1::DTYPE_BFLOAT16;
  if (name == "fp8") return v1::DTYPE_FLOAT8_E4M3;  // A cache's dtype (the server refuses tensors).
  return absl::InvalidArgumentError(absl::StrCat(
      "--dtype must be f32, f16, bf16 or fp8 (a cache's dtype only), got \"", name, "\""));
}

absl::StatusOr<v1::DType> ParseTensorDType(const std::string& name) {
  absl::StatusOr<v1::DType> dtype = ParseDType(name);
  if (dtype.ok() && *dtype == v1::DTYPE_FLOAT8_E4M3) {
    return absl::InvalidArgumentError(
        "--dtype fp8 is a KV cache's dtype only (attn cache create, attn decode, attn bench "
        "--decode); a query and inline keys and values are f32, f16 or bf16");
  }
  return dtype;
}

absl::Status ParseSeqlens(const std::string& spec, std::vector<int64_t>* cu_seqlens_q,
                          std::vector<int64_t>* cu_seqlens_k) {
  const auto invalid = [&spec](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seqlens expects Q1,Q2,… or Q1,Q2,…/K1,K2,… (sequence lengths: integers ≥ "
                     "0), got \"",
                     spec, "\": ", why));
  };
  const std::vector<std::string> sides = absl::StrSplit(spec, '/');
  if (sides.size() > 2) return invalid("more than one '/'");
  for (size_t side = 0; side < 2; ++side) {
    std::vector<int64_t>* cu = side == 0 ? cu_seqlens_q : cu_seqlens_k;
    cu->assign(1, 0);
    for (absl::string_view part : absl::StrSplit(sides[std::min(side, sides.size() - 1)], ',')) {
      int64_t length;
      if (!absl::SimpleAtoi(part, &length) || length < 0 || length > (int64_t{1} << 40)) {
        return invalid(absl::StrCat("\"", part, "\" is not a length"));
      }
      cu->push_back(cu->back() + length);
    }
    if (cu->back() < 1) return invalid(side == 0 ? "no query rows" : "no keys");
  }
  if (cu_seqlens_q->size() != cu_seqlens_k->size()) {
    return invalid(absl::StrCat(cu_seqlens_q->size() - 1, " query lengths but ",
                                cu_seqlens_k->size() - 1, " key lengths"));
  }
  return absl::OkStatus();
}

v1::AttentionRequest MakeRequest(const Inputs& inputs, const v1::AttentionOptions& options) {
  v1::AttentionRequest request;
  *request.mutable_query() = client::ToTensor(inputs.query, inputs.dtype);
  *request.mutable_key() = client::ToTensor(inputs.key, inputs.dtype);
  *request.mutable_value() = client::ToTensor(inputs.value, inputs.dtype);
  *request.mutable_options() = options;
  request.mutable_cu_seqlens_q()->Assign(inputs.cu_seqlens_q.begin(), inputs.cu_seqlens_q.end());
  request.mutable_cu_seqlens_k()->Assign(inputs.cu_seqlens_k.begin(), inputs.cu_seqlens_k.end());
  return request;
}

}  // namespace attn::cli
