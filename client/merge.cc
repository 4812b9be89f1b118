#include "client/merge.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "kernels/online_softmax.h"

namespace attn::client {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Elements of `shape`; -1 when a dimension is negative or the count passes 2^62.
int64_t Elements(const std::vector<int64_t>& shape) {
  constexpr int64_t kMax = int64_t{1} << 62;
  int64_t elements = 1;
  for (int64_t dim : shape) {
    if (dim < 0 || (dim > 0 && elements > kMax / dim)) return -1;
    elements *= dim;
  }
  return elements;
}

// OK when `state` is a state: output of rank ≥ 1 filled by its values, lse of the output's shape
// without its last dimension and filled too. `name` names it in the message.
absl::Status CheckState(const AttentionState& state, absl::string_view name) {
  const std::vector<int64_t>& shape = state.output.shape;
  if (shape.empty() || Elements(shape) < 0 ||
      Elements(shape) != static_cast<int64_t>(state.output.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".output has shape ", ShapeString(shape),
                                                   " and ", state.output.values.size(), " values"));
  }
  const std::vector<int64_t> rows(shape.begin(), shape.end() - 1);
  if (state.lse.shape != rows || Elements(rows) != static_cast<int64_t>(state.lse.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".lse has shape ", ShapeString(state.lse.shape), " and ", state.lse.values.size(),
        " values; its output ", ShapeString(shape), " needs ", ShapeString(rows)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionState> MergeStates(const std::vector<AttentionState>& parts) {
  if (parts.empty()) return absl::InvalidArgumentError("MergeStates: no parts to merge");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (absl::Status state = CheckState(parts[i], absl::StrCat("parts[", i, "]")); !state.ok()) {
      return state;
    }
    if (parts[i].output.shape != parts[0].output.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parts[", i, "].output has shape ", ShapeString(parts[i].output.shape), ", parts[0]'s ",
          ShapeString(parts[0].output.shape), ": merged parts hold the same rows"));
    }
  }
  AttentionState merged;
  merged.output.shape = parts[0].output.shape;
  merged.output.values.assign(parts[0].output.values.size(), 0.f);
  merged.lse.shape = parts[0].lse.shape;
  merged.lse.values.assign(parts[0].lse.values.size(), -INFINITY);
  const int64_t rows = static_cast<int64_t>(merged.lse.values.size());
  const int64_t width = merged.output.shape.back();
  for (int64_t r = 0; r < rows; ++r) {
    float* accumulator = merged.output.values.data() + r * width;  // Zeros: the empty state's.
    OnlineSoftmaxRow row;                                          // max −inf, denominator 0.
    for (const AttentionState& part : parts) {
      // The finished row (O, lse): Σ exp(s − lse) = 1, Σ … · v = O. A part whose slice this row
      // cannot see (lse −inf) adds nothing, and its output is not read (MergeInto).
      const OnlineSoftmaxRow other{.max = part.lse.values[r], .denominator = 1.f};
      row.MergeInto(other, part.output.values.data() + r * width, accumulator, width);
    }
    for (int64_t c = 0; c < width; ++c) accumulator[c] = row.Normalize(accumulator[c]);
    merged.lse.values[r] = row.LogSumExp();
  }
  return merged;
}

absl::StatusOr<AttentionState> StateOf(const attention::v1::AttentionResponse& response) {
  if (!response.has_lse()) {
    return absl::InvalidArgumentError(
        "response has no lse: ask for it with options.return_lse to merge the response");
  }
  AttentionState state;
  for (const auto& [name, tensor, array] : {std::tuple{"output", &response.output(), &state.output},
                                            std::tuple{"lse", &response.lse(), &state.lse}}) {
    absl::StatusOr<Array> decoded = FromTensor(*tensor);
    if (!decoded.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("response.", name, ": ", decoded.status().message()));
    }
    *array = *std::move(decoded);
  }
  if (absl::Status shapes = CheckState(state, "response"); !shapes.ok()) return shapes;
  return state;
}

}  // namespace attn::client
