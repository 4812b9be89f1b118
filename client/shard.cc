#include "client/shard.h"

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/merge.h"
#include "kernels/dtype.h"
#include "kernels/geometry.h"
#include "proto/dtype_mapping.h"
#include "proto/tensor_shape.h"

namespace attn::client {
namespace {

namespace v1 = attention::v1;

// A request's shapes normalized to rank 4: query [B, H, N, D], key [B, K, M, D],
// value [B, K, M, Dv].
struct Dims {
  int64_t batch, heads, kv_heads, query_len, key_len, head_dim, value_dim;
};

// Bytes of a tensor's data per element; nullopt for an unknown dtype.
std::optional<int64_t> ElementBytes(const v1::Tensor& tensor) {
  const std::optional<DType> dtype = FromProtoDType(tensor.dtype());
  if (!dtype) return std::nullopt;
  return ElementSize(*dtype);
}

// Elements of a tensor's shape; nullopt when a dimension is < 1 or the count passes 2^48.
std::optional<int64_t> Elements(const v1::Tensor& tensor) {
  constexpr int64_t kMax = int64_t{1} << 48;
  int64_t elements = 1;
  for (int64_t dim : tensor.shape()) {
    if (dim < 1 || dim > kMax || elements > kMax / dim) return std::nullopt;
    elements *= dim;
  }
  return elements;
}

// The dims of a request the server would accept as to shape, or nullopt.
std::optional<Dims> ReadDims(const v1::AttentionRequest& request) {
  const v1::Tensor& q = request.query();
  const v1::Tensor& k = request.key();
  const v1::Tensor& v = request.value();
  const int rank = q.shape_size();
  if (k.shape_size() != rank || v.shape_size() != rank) return std::nullopt;
  const std::optional<TensorDims> query = NormalizedShape(q);
  const std::optional<TensorDims> key = NormalizedShape(k);
  const std::optional<TensorDims> value = NormalizedShape(v);
  if (!query || !key || !value) return std::nullopt;
  for (const v1::Tensor* tensor : {&q, &k, &v}) {
    const std::optional<int64_t> elements = Elements(*tensor);
    const std::optional<int64_t> bytes = ElementBytes(*tensor);
    if (!elements || !bytes || static_cast<int64_t>(tensor->data().size()) != *elements * *bytes) {
      return std::nullopt;
    }
  }
  if (key->batch != query->batch || value->batch != query->batch || value->heads != key->heads ||
      value->len != key->len || key->dim != query->dim || query->heads % key->heads != 0) {
    return std::nullopt;
  }
  return Dims{query->batch, query->heads, key->heads, query->len, key->len, query->dim, value->dim};
}

// Elements [o·stride + first, o·stride + first + count) of `tensor` for each o < outer, in order,
// as a tensor of `shape`: byte slices of its data, never re-encoded. A head part is one run
// (outer 1); a key slice is one run per (batch, kv head).
v1::Tensor Slice(const v1::Tensor& tensor, int64_t outer, int64_t stride, int64_t first,
                 int64_t count, const std::vector<int64_t>& shape) {
  const int64_t bytes = *ElementBytes(tensor);
  v1::Tensor slice;
  slice.mutable_shape()->Assign(shape.begin(), shape.end());
  slice.set_dtype(tensor.dtype());
  std::string& data = *slice.mutable_data();
  data.reserve(outer * count * bytes);
  for (int64_t o = 0; o < outer; ++o) {
    data.append(tensor.data(), (o * stride + first) * bytes, count * bytes);
  }
  return slice;
}

}  // namespace

void AddPartStats(v1::ExecutionStats& stats, const v1::ExecutionStats& part, bool first) {
  if (first) {
    stats = part;
    return;
  }
  stats.set_block_k(std::max(stats.block_k(), part.block_k()));
  stats.set_compute_ns(std::max(stats.compute_ns(), part.compute_ns()));
  stats.set_server_ns(std::max(stats.server_ns(), part.server_ns()));
  stats.set_flops(stats.flops() + part.flops());
  stats.set_intermediate_bytes(stats.intermediate_bytes() + part.intermediate_bytes());
  stats.set_scratch_bytes(stats.scratch_bytes() + part.scratch_bytes());
  stats.set_peak_memory_bytes(stats.peak_memory_bytes() + part.peak_memory_bytes());
}

std::vector<ShardPart> SplitRequest(const v1::AttentionRequest& request, int max_parts) {
  const std::optional<Dims> dims = ReadDims(request);
  const int64_t units = dims ? dims->batch * dims->kv_heads : 1;
  const int64_t parts = std::clamp<int64_t>(max_parts, 1, units);
  // Values per query head (ALiBi slopes, sinks): each part takes its heads'.
  const v1::AttentionOptions& options = request.options();
  const int slope_count = options.alibi_slopes_size(), sink_count = options.sinks_size();
  const auto wrong_count = [&](int count) { return count != 0 && count != dims->heads; };
  if (!dims || parts == 1 || wrong_count(slope_count) || wrong_count(sink_count)) {
    return {ShardPart{.first_unit = 0,
                      .units = units,
                      .key_begin = 0,
                      .key_end = dims ? dims->key_len : 0,
                      .key_slice = false,
                      .request = request}};
  }
  const int64_t group = dims->heads / dims->kv_heads;
  const int64_t query_per_unit = group * dims->query_len * dims->head_dim;
  const int64_t key_per_unit = dims->key_len * dims->head_dim;
  const int64_t value_per_unit = dims->key_len * dims->value_dim;
  // ALiBi slopes and sinks belong to query heads, so a part that carries them holds kv heads of
  // one batch entry, sent as [1, u·G, N, D] × [1, u, M, D] with their heads' values (the same
  // elements). A ragged batch (batch 1) is sent so too, every part with the whole cu_seqlens.
  const bool per_head = slope_count > 0 || sink_count > 0;
  const bool one_entry = per_head || !request.cu_seqlens_q().empty();
  std::vector<ShardPart> out;
  out.reserve(parts);
  auto add = [&](int64_t first, int64_t count) {
    ShardPart& part = out.emplace_back();
    part.first_unit = first;
    part.units = count;
    part.key_end = dims->key_len;
    const int64_t batch = one_entry ? 1 : count, heads = one_entry ? count : 1;
    *part.request.mutable_query() =
        Slice(request.query(), 1, 0, first * query_per_unit, count * query_per_unit,
              {batch, heads * group, dims->query_len, dims->head_dim});
    *part.request.mutable_key() =
        Slice(request.key(), 1, 0, first * key_per_unit, count * key_per_unit,
              {batch, heads, dims->key_len, dims->head_dim});
    *part.request.mutable_value() =
        Slice(request.value(), 1, 0, first * value_per_unit, count * value_per_unit,
              {batch, heads, dims->key_len, dims->value_dim});
    if (request.has_options()) *part.request.mutable_options() = request.options();
    *part.request.mutable_cu_seqlens_q() = request.cu_seqlens_q();
    *part.request.mutable_cu_seqlens_k() = request.cu_seqlens_k();
    const int64_t head = first % dims->kv_heads * group;  // The part's first query head.
    for (const auto& [all, own] :
         {std::pair{&options.alibi_slopes(),
                    part.request.mutable_options()->mutable_alibi_slopes()},
          std::pair{&options.sinks(), part.request.mutable_options()->mutable_sinks()}}) {
      if (!all->empty()) own->Assign(all->begin() + head, all->begin() + head + count * group);
    }
  };
  for (int64_t p = 0; p < parts; ++p) {
    int64_t first = units * p / parts;
    const int64_t end = units * (p + 1) / parts;
    while (first < end) {  // With per-head values, cut at each batch entry's end.
      const int64_t stop =
          one_entry ? std::min(end, (first / dims->kv_heads + 1) * dims->kv_heads) : end;
      add(first, stop - first);
      first = stop;
    }
  }
  return out;
}

absl::StatusOr<v1::AttentionResponse> MergeResponses(
    const v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<v1::AttentionResponse>& responses) {
  if (parts.size() != responses.size() || parts.empty()) {
    return absl::InternalError("shard: a response per part is needed");
  }
  if (parts.size() == 1) return responses[0];
  const Dims dims = *ReadDims(request);
  const int64_t group = dims.heads / dims.kv_heads;
  std::vector<int64_t> output_shape(request.query().shape().begin(), request.query().shape().end());
  std::vector<int64_t> lse_shape(output_shape.begin(), output_shape.end() - 1);
  output_shape.back() = dims.value_dim;

  v1::AttentionResponse merged;
  v1::Tensor& output = *merged.mutable_output();
  output.mutable_shape()->Assign(output_shape.begin(), output_shape.end());
  output.set_dtype(responses[0].output().dtype());
  const bool lse = responses[0].has_lse();
  if (lse) {
    merged.mutable_lse()->mutable_shape()->Assign(lse_shape.begin(), lse_shape.end());
    merged.mutable_lse()->set_dtype(responses[0].lse().dtype());
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const v1::AttentionResponse& response = responses[i];
    const int64_t rows = parts[i].units * group * dims.query_len;
    for (const auto& [name, part_tensor, whole, per_row] :
         {std::tuple{"output", &response.output(), &output, dims.value_dim},
          std::tuple{"lse", &response.lse(), lse ? merged.mutable_lse() : nullptr, int64_t{1}}}) {
      if (whole == nullptr) continue;
      const std::optional<int64_t> bytes = ElementBytes(*part_tensor);
      if (part_tensor->dtype() != whole->dtype() || !bytes ||
          static_cast<int64_t>(part_tensor->data().size()) != rows * per_row * *bytes) {
        return absl::InternalError(absl::StrCat("shard: part ", i, "'s ", name, " has ",
                                                part_tensor->data().size(), " bytes of dtype ",
                                                part_tensor->dtype(), ", expected ", rows * per_row,
                                                " elements of dtype ", whole->dtype()));
      }
      whole->mutable_data()->append(part_tensor->data());
    }
    AddPartStats(*merged.mutable_stats(), response.stats(), i == 0);
  }
  return merged;
}

std::vector<ShardPart> SplitKeys(const v1::AttentionRequest& request, int max_parts) {
  const std::optional<Dims> dims = ReadDims(request);
  ShardPart whole{.first_unit = 0,
                  .units = dims ? dims->batch * dims->kv_heads : 1,
                  .key_begin = 0,
                  .key_end = dims ? dims->key_len : 0,
                  .key_slice = false,
                  .request = request};
  const v1::AttentionOptions& options = request.options();
  const auto in_range = [](int64_t position) { return position >= 0 && position <= kMaxPosition; };
  // Not split: a cache (on one server), a ragged batch (its sequences' positions are their own,
  // which a slice's key_position cannot give), positions the server would refuse.
  if (!dims || max_parts < 2 || dims->key_len < 2 || !request.cache_id().empty() ||
      !request.cu_seqlens_q().empty() || !request.cu_seqlens_k().empty() ||
      !in_range(options.key_position()) ||
      (options.has_query_position() && !in_range(options.query_position())) ||
      (options.has_window_left() && !in_range(options.window_left())) ||
      (options.has_window_right() && !in_range(options.window_right()))) {
    return {std::move(whole)};
  }
  const int64_t query_len = dims->query_len;
  Geometry geometry =
      Geometry::BottomRight(query_len, dims->key_len, options.causal(), options.key_position());
  if (options.has_query_position()) geometry.query_position = options.query_position();
  if (options.has_window_left()) geometry.window_left = options.window_left();
  if (options.has_window_right()) geometry.window_right = options.window_right();
  // Row i sees keys Visible(i) in every (batch, head), a range whose ends never decrease with i
  // (kernels/geometry.h), so the keys some row sees are [first, seen).
  const int64_t first = geometry.Visible(0).begin;
  const int64_t seen = geometry.Visible(query_len - 1).end;
  // Positions may only be shifted together: a negative default query_position moves both up.
  const int64_t shift = geometry.query_position < 0 ? -geometry.query_position : 0;
  if (seen <= first || options.key_position() > kMaxPosition - shift - (seen - 1)) {
    return {std::move(whole)};
  }
  // Prefix sums over rows r < i of the sizes and the first keys of the rows' ranges.
  std::vector<int64_t> sizes(query_len + 1, 0), begins(query_len + 1, 0);
  for (int64_t i = 0; i < query_len; ++i) {
    const KeyRange visible = geometry.Visible(i);
    sizes[i + 1] = sizes[i] + visible.size();
    begins[i + 1] = begins[i] + visible.begin;
  }
  // The first row for which `past` holds (it holds for every later row: the ends only grow).
  const auto first_row = [&](auto past) {
    int64_t low = 0, high = query_len;
    while (low < high) {
      const int64_t mid = low + (high - low) / 2;
      if (past(geometry.Visible(mid))) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    return low;
  };
  // Visible pairs among keys [0, x): rows [0, a) end at or before x and have all their pairs
  // there; rows [a, b) straddle x and have x − begin; rows [b, query_len) begin at or after x.
  const auto work = [&](int64_t x) {
    const int64_t b = first_row([x](KeyRange r) { return r.begin >= x; });
    const int64_t a = std::min(b, first_row([x](KeyRange r) { return r.end > x; }));
    return sizes[a] + (b - a) * x - (begins[b] - begins[a]);
  };

  const int64_t parts = std::min<int64_t>(max_parts, seen - first);
  const int64_t total = work(seen);
  std::vector<int64_t> bounds{first};
  for (int64_t s = 1; s < parts; ++s) {
    const int64_t target =
        static_cast<int64_t>((static_cast<__int128>(total) * s + parts - 1) / parts);
    int64_t low = bounds.back(), high = seen;  // The smallest x with work(x) ≥ target.
    while (low < high) {
      const int64_t mid = low + (high - low) / 2;
      if (work(mid) >= target) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    bounds.push_back(low);
  }
  bounds.push_back(seen);

  const int64_t units = dims->batch * dims->kv_heads;
  const int64_t len_axis = request.key().shape_size() - 2;  // Of key and value: [.., len, dim].
  std::vector<ShardPart> out;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    const int64_t begin = bounds[s], end = bounds[s + 1];
    if (begin == end) continue;  // An empty slice: not sent.
    ShardPart& part = out.emplace_back();
    part.units = units;
    part.key_begin = begin;
    part.key_end = end;
    part.key_slice = true;
    *part.request.mutable_query() = request.query();
    for (const auto& [whole_tensor, slice, width] :
         {std::tuple{&request.key(), part.request.mutable_key(), dims->head_dim},
          std::tuple{&request.value(), part.request.mutable_value(), dims->value_dim}}) {
      std::vector<int64_t> shape(whole_tensor->shape().begin(), whole_tensor->shape().end());
      shape[len_axis] = end - begin;
      *slice = Slice(*whole_tensor, units, dims->key_len * width, begin * width,
                     (end - begin) * width, shape);
    }
    v1::AttentionOptions& slice_options = *part.request.mutable_options();
    slice_options = options;
    slice_options.set_key_position(options.key_position() + shift + begin);
    slice_options.set_query_position(geometry.query_position + shift);
    slice_options.set_return_lse(true);
    slice_options.set_output_dtype(v1::DTYPE_FLOAT32);
    // A row's sink counts once: the first slice carries the sinks, the others none.
    if (out.size() > 1) slice_options.clear_sinks();
  }
  return out;
}

absl::StatusOr<v1::AttentionResponse> MergeKeySlices(
    const v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<v1::AttentionResponse>& responses) {
  if (parts.size() != responses.size() || parts.empty()) {
    return absl::InternalError("shard: a response per key slice is needed");
  }
  if (parts.size() == 1 && !parts[0].key_slice) return responses[0];
  const Dims dims = *ReadDims(request);
  v1::AttentionResponse merged;
  std::vector<AttentionState> states;
  states.reserve(parts.size());
  const auto name = [&](size_t i) {
    return absl::StrCat("shard: key slice ", i + 1, " of ", parts.size(), " (keys [",
                        parts[i].key_begin, ", ", parts[i].key_end, ")): ");
  };
  for (size_t i = 0; i < parts.size(); ++i) {
    absl::StatusOr<AttentionState> state = StateOf(responses[i]);
    if (!state.ok()) return absl::InternalError(absl::StrCat(name(i), state.status().message()));
    states.push_back(*std::move(state));
    AddPartStats(*merged.mutable_stats(), responses[i].stats(), i == 0);
  }
  absl::StatusOr<AttentionState> state = MergeStates(states);
  if (!state.ok()) return absl::InternalError(absl::StrCat("shard: ", state.status().message()));
  std::vector<int64_t> output_shape(request.query().shape().begin(), request.query().shape().end());
  output_shape.back() = dims.value_dim;
  if (state->output.shape != output_shape) {
    return absl::InternalError(absl::StrCat(
        "shard: the key slices' output has shape [", absl::StrJoin(state->output.shape, ", "),
        "], the request's is [", absl::StrJoin(output_shape, ", "), "]"));
  }
  const v1::DType dtype = request.options().output_dtype() != v1::DTYPE_UNSPECIFIED
                              ? request.options().output_dtype()
                              : request.query().dtype();
  *merged.mutable_output() = ToTensor(state->output, dtype);
  if (request.options().return_lse()) {
    *merged.mutable_lse() = ToTensor(state->lse, v1::DTYPE_FLOAT32);
  }
  return merged;
}

}  // namespace attn::client
