#include "client/sharded_cache.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/merge.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"

namespace attn::client {
namespace {

namespace v1 = attention::v1;

// Codes after which a call's effect on the server is unknown: it may have been applied before
// the answer was lost.
bool OutcomeUnknown(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
      return true;
    default:
      return false;
  }
}

std::string Describe(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

// The shape of a [kv_heads, n, width] token tensor in the cache's layout, or INVALID_ARGUMENT.
absl::StatusOr<int64_t> TokenCount(const v1::Tensor& tensor, const char* name,
                                   const v1::CacheInfo& cache, int64_t width) {
  if (tensor.shape_size() != 3 || tensor.shape(0) != cache.kv_heads() || tensor.shape(1) < 1 ||
      tensor.shape(2) != width) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be [kv_heads ", cache.kv_heads(),
                                                   ", n ≥ 1, ", width, "], got [",
                                                   absl::StrJoin(tensor.shape(), ", "), "]"));
  }
  const std::optional<DType> dtype = FromProtoDType(tensor.dtype());
  if (!dtype) return absl::InvalidArgumentError(absl::StrCat(name, ": unknown dtype"));
  const int64_t elements = tensor.shape(0) * tensor.shape(1) * tensor.shape(2);
  if (static_cast<int64_t>(tensor.data().size()) != elements * ElementSize(*dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", tensor.data().size(),
                                                   " bytes of data for ", elements, " elements"));
  }
  return tensor.shape(1);
}

// Tokens [begin, end) of a well-formed [heads, n, width] tensor, as [heads, end − begin, width]
// (byte slices, no re-encoding).
v1::Tensor Slice(const v1::Tensor& tensor, int64_t begin, int64_t end) {
  const int64_t heads = tensor.shape(0), n = tensor.shape(1), width = tensor.shape(2);
  if (begin == 0 && end == n) return tensor;
  const int64_t element = ElementSize(*FromProtoDType(tensor.dtype()));
  const int64_t row = width * element;
  v1::Tensor slice;
  slice.add_shape(heads);
  slice.add_shape(end - begin);
  slice.add_shape(width);
  slice.set_dtype(tensor.dtype());
  std::string* data = slice.mutable_data();
  data->reserve(heads * (end - begin) * row);
  for (int64_t h = 0; h < heads; ++h) {
    data->append(tensor.data(), (h * n + begin) * row, (end - begin) * row);
  }
  return slice;
}

// Tokens to give each part so the shortest are raised to one level (water-filling): the k
// shortest reach T or T + 1 (the extra to the lower indices), where k is the fewest parts whose
// raising to the next part's length would take all n.
std::vector<int64_t> WaterFill(const std::vector<int64_t>& lengths, int64_t n) {
  const size_t parts = lengths.size();
  std::vector<size_t> order(parts);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return lengths[a] < lengths[b]; });
  size_t k = 1;
  int64_t below = lengths[order[0]];  // Σ of the k shortest lengths.
  for (; k < parts; ++k) {
    const int64_t next = lengths[order[k]];
    // Raising the k shortest to `next` takes k·next − below tokens.
    if (static_cast<int64_t>(k) * next - below >= n) break;
    below += next;
  }
  const int64_t total = below + n;
  const int64_t level = total / static_cast<int64_t>(k);
  int64_t extra = total % static_cast<int64_t>(k);
  std::vector<size_t> chosen(order.begin(), order.begin() + k);
  std::sort(chosen.begin(), chosen.end());
  std::vector<int64_t> shares(parts, 0);
  for (size_t part : chosen) {
    shares[part] = level - lengths[part] + (extra > 0 ? 1 : 0);
    if (extra > 0) --extra;
  }
  return shares;
}

// Adds tokens [global_start, global_start + n) at local `local_start` to `segments`, joining the
// last segment when they continue it in both numberings.
void AddSegment(std::vector<CacheSegment>& segments, int64_t global_start, int64_t local_start,
                int64_t n) {
  if (!segments.empty()) {
    CacheSegment& last = segments.back();
    if (last.global_start + last.length == global_start &&
        last.local_start + last.length == local_start) {
      last.length += n;
      return;
    }
  }
  segments.push_back({.global_start = global_start, .local_start = local_start, .length = n});
}

void AddStats(v1::ExecutionStats& total, const v1::ExecutionStats& part, bool first) {
  if (first) {
    total.set_backend(part.backend());
    total.set_device(part.device());
    total.set_block_k(part.block_k());
  }
  total.set_compute_ns(std::max(total.compute_ns(), part.compute_ns()));
  total.set_server_ns(std::max(total.server_ns(), part.server_ns()));
  total.set_flops(total.flops() + part.flops());
  total.set_intermediate_bytes(total.intermediate_bytes() + part.intermediate_bytes());
  total.set_scratch_bytes(total.scratch_bytes() + part.scratch_bytes());
  total.set_peak_memory_bytes(total.peak_memory_bytes() + part.peak_memory_bytes());
}

}  // namespace

ShardedCache::ShardedCache(std::vector<Part> parts) : parts_(std::move(parts)) {
  shape_ = parts_.front().info;
  shape_.clear_cache_id();
  shape_.set_length(0);
  shape_.set_bytes(0);
}

absl::StatusOr<ShardedCache> ShardedCache::Create(std::vector<CacheEndpoint> endpoints,
                                                  const v1::CreateCacheRequest& request) {
  if (endpoints.empty()) return absl::InvalidArgumentError("sharded cache: no endpoints");
  std::vector<Part> parts;
  for (size_t i = 0; i < endpoints.size(); ++i) {
    absl::StatusOr<v1::CacheInfo> info = endpoints[i].client->CreateCache(request);
    if (!info.ok()) {
      for (Part& made : parts) (void)made.client->DeleteCache(made.info.cache_id());
      return absl::Status(
          info.status().code(),
          absl::StrCat("sharded cache: creating part ", i + 1, " of ", endpoints.size(), " on ",
                       endpoints[i].name, ": ", info.status().message()));
    }
    parts.push_back(Part{.endpoint = endpoints[i].name,
                         .client = endpoints[i].client,
                         .info = *info,
                         .segments = {},
                         .deleted = false});
  }
  return ShardedCache(std::move(parts));
}

absl::StatusOr<ShardedCache> ShardedCache::Create(MultiServerClient& client,
                                                  const v1::CreateCacheRequest& request) {
  const size_t count = client.endpoints().size();
  if (count == 0) return absl::InvalidArgumentError("sharded cache: no endpoints");
  std::vector<Part> parts;
  auto fail = [&](size_t i, const absl::Status& status) {
    for (Part& made : parts) (void)made.client->DeleteCache(made.info.cache_id());
    return absl::Status(status.code(), absl::StrCat("sharded cache: creating part ", i + 1, " of ",
                                                    count, ": ", status.message()));
  };
  for (size_t i = 0; i < count; ++i) {
    absl::StatusOr<v1::CacheInfo> info = client.CreateCache(request);
    if (!info.ok()) return fail(i, info.status());
    absl::StatusOr<std::string> endpoint = client.EndpointOf(info->cache_id());
    absl::StatusOr<Client*> owner = client.ClientFor(info->cache_id());
    if (!endpoint.ok() || !owner.ok()) {
      (void)client.DeleteCache(info->cache_id());
      return fail(i, endpoint.ok() ? owner.status() : endpoint.status());
    }
    parts.push_back(Part{
        .endpoint = *endpoint, .client = *owner, .info = *info, .segments = {}, .deleted = false});
  }
  return ShardedCache(std::move(parts));
}

int64_t ShardedCache::length() const {
  int64_t total = 0;
  for (const Part& part : parts_) total += part.info.length();
  return total;
}

ShardedCacheInfo ShardedCache::Info() const {
  ShardedCacheInfo info;
  info.length = length();
  for (const Part& part : parts_) {
    info.parts.push_back({.endpoint = part.endpoint,
                          .cache_id = part.info.cache_id(),
                          .length = part.info.length(),
                          .bytes = part.info.bytes(),
                          .segments = part.segments});
  }
  return info;
}

std::string ShardedCache::Name(size_t part) const {
  return absl::StrCat("part ", part + 1, " of ", parts_.size(), " (cache ",
                      parts_[part].info.cache_id(), " on ", parts_[part].endpoint, ")");
}

void ShardedCache::Record(size_t part, int64_t global_start, int64_t n, const v1::CacheInfo& info) {
  Part& p = parts_[part];
  AddSegment(p.segments, global_start, p.info.length(), n);
  p.info = info;
}

absl::Status ShardedCache::CheckNoPending() const {
  if (!pending_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("sharded cache: whether ", Name(pending_->part), " stored global tokens [",
                   pending_->global_start, ", ", pending_->global_start + pending_->length,
                   ") is unknown after a failed call; call Refresh() first"));
}

absl::StatusOr<int64_t> ShardedCache::NewTokens(const v1::Tensor& key,
                                                const v1::Tensor* value) const {
  if (shape_.values_from_keys() && value != nullptr) {
    return absl::InvalidArgumentError(
        "value: this sharded cache is latent (values_from_keys): each token's value is the "
        "first value_dim columns of its key; send the key alone");
  }
  if (!shape_.values_from_keys() && value == nullptr) {
    return absl::InvalidArgumentError(
        "value: missing; this sharded cache stores values (it is not latent, values_from_keys)");
  }
  absl::StatusOr<int64_t> n = TokenCount(key, "key", shape_, shape_.head_dim());
  if (!n.ok() || value == nullptr) return n;
  absl::StatusOr<int64_t> value_n = TokenCount(*value, "value", shape_, shape_.value_dim());
  if (!value_n.ok()) return value_n.status();
  if (*value_n != *n) {
    return absl::InvalidArgumentError(
        absl::StrCat("key has ", *n, " tokens but value has ", *value_n));
  }
  return n;
}

absl::Status ShardedCache::Append(const v1::Tensor& key, const v1::Tensor& value) {
  if (absl::Status pending = CheckNoPending(); !pending.ok()) return pending;
  absl::StatusOr<int64_t> n = NewTokens(key, &value);
  if (!n.ok()) return n.status();
  return AppendTokens(key, &value, *n);
}

absl::Status ShardedCache::Append(const v1::Tensor& key) {
  if (absl::Status pending = CheckNoPending(); !pending.ok()) return pending;
  absl::StatusOr<int64_t> n = NewTokens(key, nullptr);
  if (!n.ok()) return n.status();
  return AppendTokens(key, nullptr, *n);
}

absl::Status ShardedCache::AppendTokens(const v1::Tensor& key, const v1::Tensor* value, int64_t n) {
  std::vector<int64_t> lengths;
  for (const Part& part : parts_) lengths.push_back(part.info.length());
  const std::vector<int64_t> shares = WaterFill(lengths, n);
  const int64_t start = length();
  int64_t done = 0;
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (shares[i] == 0) continue;
    Part& part = parts_[i];
    v1::AppendCacheRequest request;
    request.set_cache_id(part.info.cache_id());
    *request.mutable_key() = Slice(key, done, done + shares[i]);
    if (value != nullptr) *request.mutable_value() = Slice(*value, done, done + shares[i]);
    request.set_expected_length(part.info.length());
    absl::StatusOr<v1::CacheInfo> info = part.client->AppendCache(request);
    if (!info.ok()) {
      const bool unknown = OutcomeUnknown(info.status());
      if (unknown) {
        pending_ = Pending{.part = i, .global_start = start + done, .length = shares[i]};
      }
      return absl::Status(
          info.status().code(),
          absl::StrCat("sharded cache: appending tokens [", done, ", ", done + shares[i], ") of ",
                       n, " to ", Name(i), ": ", info.status().message(), "; tokens [0, ", done,
                       ") of this append were kept (global [", start, ", ", start + done, "))",
                       unknown ? "; whether the failed part stored its chunk is unknown: call "
                                 "Refresh() before the next append"
                               : ""));
    }
    Record(i, start + done, shares[i], *info);
    done += shares[i];
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardedDecodeResult> ShardedCache::Decode(const v1::Tensor& query,
                                                         const v1::Tensor* key,
                                                         const v1::Tensor* value,
                                                         const v1::AttentionOptions& options) {
  if (absl::Status pending = CheckNoPending(); !pending.ok()) return pending;
  if (options.key_position() != 0 || options.has_query_position()) {
    return absl::InvalidArgumentError(
        "sharded cache: options.key_position and query_position must be unset (the positions "
        "are the sequence's)");
  }
  if (key == nullptr && value != nullptr) {
    return absl::InvalidArgumentError(
        shape_.values_from_keys()
            ? "value: this sharded cache is latent (values_from_keys): send the key alone"
            : "sharded cache: give both key and value, or neither");
  }
  int64_t fresh = 0;  // New tokens of this step.
  if (key != nullptr) {
    absl::StatusOr<int64_t> n = NewTokens(*key, value);
    if (!n.ok()) return n.status();
    fresh = *n;
  }
  const int rank = query.shape_size();
  if (rank < 2 || rank > 4 || (rank == 4 && query.shape(0) != 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("query must be [heads, nq, head_dim] (rank 2 or 3, or rank 4 with batch 1), "
                     "got [",
                     absl::StrJoin(query.shape(), ", "), "]"));
  }
  const int64_t nq = query.shape(rank - 2);
  const std::optional<DType> query_dtype = FromProtoDType(query.dtype());
  if (!query_dtype) return absl::InvalidArgumentError("query: unknown dtype");

  // The receiving part (the shortest, lowest index on a tie) and each part's segments after it.
  const size_t count = parts_.size();
  size_t receiver = 0;
  for (size_t i = 1; i < count; ++i) {
    if (parts_[i].info.length() < parts_[receiver].info.length()) receiver = i;
  }
  const int64_t before = length();
  const int64_t total = before + fresh;  // G.
  std::vector<CacheSegment> receiver_segments = parts_[receiver].segments;
  if (fresh > 0) AddSegment(receiver_segments, before, parts_[receiver].info.length(), fresh);

  struct Ask {
    size_t part;
    v1::DecodeRequest request;
    absl::StatusOr<v1::DecodeResponse> response = absl::UnknownError("not sent");
  };
  std::vector<Ask> asks;
  v1::AttentionOptions part_options = options;
  part_options.set_return_lse(true);
  part_options.set_output_dtype(v1::DTYPE_FLOAT32);
  for (size_t i = 0; i < count; ++i) {
    const bool receives = fresh > 0 && i == receiver;
    const int64_t after = parts_[i].info.length() + (receives ? fresh : 0);
    if (after == 0 && !(total == 0 && i == 0))
      continue;  // Nothing to see; an empty
                 // sequence asks part 1 alone.
    Ask& ask = asks.emplace_back();
    ask.part = i;
    v1::DecodeItem& item = *ask.request.add_items();
    item.set_cache_id(parts_[i].info.cache_id());
    *item.mutable_query() = query;
    if (receives) {
      *item.mutable_key() = *key;
      if (value != nullptr) *item.mutable_value() = *value;
    }
    item.set_expected_length(parts_[i].info.length());
    if (options.causal() && after > 0) {
      const std::vector<CacheSegment>& segments =
          i == receiver ? receiver_segments : parts_[i].segments;
      const CacheSegment& last = segments.back();
      const int64_t first_query = total - nq;
      if (segments.size() > 1 && last.global_start - 1 > first_query) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sharded cache: a causal Decode of ", nq, " query rows (global positions ", first_query,
            " … ", total - 1, ") with ", fresh, " new token", fresh == 1 ? "" : "s",
            " cannot be split exactly: ", Name(i), " holds keys before global position ",
            last.global_start,
            " that some of those rows must not see (its keys are not one "
            "run of positions); send at least nq − 1 new tokens with the query, or nq = 1"));
      }
      const int64_t shift = std::max<int64_t>(0, -first_query);
      item.set_key_position(last.global_start - last.local_start + shift);
      item.set_query_position(first_query + shift);
    }
    *ask.request.mutable_options() = part_options;
    // A row's sink counts once: only the first ask carries the sinks.
    if (asks.size() > 1) ask.request.mutable_options()->clear_sinks();
  }

  ShardedDecodeResult result;
  for (const Ask& ask : asks) result.request_bytes += ask.request.ByteSizeLong();
  auto send = [this](Ask& ask) { ask.response = parts_[ask.part].client->Decode(ask.request); };
  if (asks.size() == 1) {
    send(asks[0]);
  } else {
    std::vector<std::thread> threads;
    threads.reserve(asks.size());
    for (Ask& ask : asks) threads.emplace_back(send, std::ref(ask));
    for (std::thread& thread : threads) thread.join();
  }

  // Take every answer's lengths first, so they stay the servers' whatever fails.
  std::vector<std::string> failures;
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string fresh_note;
  for (Ask& ask : asks) {
    const bool receives = fresh > 0 && ask.part == receiver;
    if (ask.response.ok() && (ask.response->caches_size() != 1 ||
                              ask.response->outputs_size() != 1 || ask.response->lse_size() != 1)) {
      ask.response = absl::InternalError(absl::StrCat(
          "answered ", ask.response->outputs_size(), " outputs, ", ask.response->lse_size(),
          " lse and ", ask.response->caches_size(), " caches for one item"));
    }
    if (ask.response.ok()) {
      if (receives) {
        Record(ask.part, before, fresh, ask.response->caches(0));
        fresh_note =
            absl::StrCat("; the ", fresh, " new token", fresh == 1 ? " was" : "s were", " kept on ",
                         Name(ask.part), " as global [", before, ", ", total, "): retry without ",
                         shape_.values_from_keys() ? "the key" : "key and value");
      } else {
        parts_[ask.part].info = ask.response->caches(0);
      }
      continue;
    }
    if (code == absl::StatusCode::kOk) code = ask.response.status().code();
    failures.push_back(absl::StrCat(Name(ask.part), ": ", Describe(ask.response.status())));
    if (receives) {
      if (OutcomeUnknown(ask.response.status())) {
        pending_ = Pending{.part = ask.part, .global_start = before, .length = fresh};
        fresh_note =
            absl::StrCat("; whether ", Name(ask.part), " stored the ", fresh, " new token",
                         fresh == 1 ? "" : "s", " is unknown: call Refresh() before retrying");
      } else {
        fresh_note = absl::StrCat("; the new token", fresh == 1 ? " was" : "s were",
                                  " not stored: the Decode may be retried whole");
      }
    }
  }
  if (!failures.empty()) {
    return absl::Status(
        code, absl::StrCat("sharded cache: Decode failed on ", failures.size(), " of ", asks.size(),
                           " parts asked (", absl::StrJoin(failures, "; "), ")", fresh_note));
  }

  std::vector<AttentionState> states;
  for (Ask& ask : asks) {
    absl::StatusOr<Array> output = FromTensor(ask.response->outputs(0));
    absl::StatusOr<Array> lse = FromTensor(ask.response->lse(0));
    if (!output.ok() || !lse.ok()) {
      return absl::InternalError(
          absl::StrCat("sharded cache: ", Name(ask.part), " answered ",
                       Describe(output.ok() ? lse.status() : output.status())));
    }
    states.push_back({.output = *std::move(output), .lse = *std::move(lse)});
    AddStats(result.stats, ask.response->stats(), result.part_stats.empty());
    result.part_stats.push_back(ask.response->stats());
  }
  absl::StatusOr<AttentionState> merged = MergeStates(states);
  if (!merged.ok()) {
    return absl::Status(
        merged.status().code(),
        absl::StrCat("sharded cache: merging the parts' answers: ", merged.status().message()));
  }
  const v1::DType output_dtype =
      options.output_dtype() == v1::DTYPE_UNSPECIFIED ? query.dtype() : options.output_dtype();
  result.output = ToTensor(merged->output, output_dtype);
  if (options.return_lse()) result.lse = ToTensor(merged->lse, v1::DTYPE_FLOAT32);
  return result;
}

absl::Status ShardedCache::Refresh() {
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& part = parts_[i];
    absl::StatusOr<v1::CacheInfo> info = part.client->GetCacheInfo(part.info.cache_id());
    if (!info.ok()) {
      return absl::Status(info.status().code(), absl::StrCat("sharded cache: reading ", Name(i),
                                                             ": ", info.status().message()));
    }
    const int64_t believed = part.info.length();
    if (pending_ && pending_->part == i) {
      if (info->length() == believed + pending_->length) {
        Record(i, pending_->global_start, pending_->length, *info);
        pending_.reset();
        continue;
      }
      if (info->length() == believed) {
        part.info = *info;
        pending_.reset();
        continue;
      }
    }
    if (info->length() != believed) {
      return absl::FailedPreconditionError(
          absl::StrCat("sharded cache: ", Name(i), " holds ", info->length(),
                       " tokens, but this cache put ", believed,
                       pending_ && pending_->part == i
                           ? absl::StrCat(" (or ", believed + pending_->length, ") there")
                           : std::string(" there"),
                       ": someone else wrote to it"));
    }
    part.info = *info;
  }
  return absl::OkStatus();
}

absl::Status ShardedCache::Delete() {
  absl::Status first;
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part& part = parts_[i];
    if (part.deleted) continue;
    const absl::Status status = part.client->DeleteCache(part.info.cache_id());
    if (status.ok() || absl::IsNotFound(status)) {
      part.deleted = true;
    } else if (first.ok()) {
      first = absl::Status(
          status.code(), absl::StrCat("sharded cache: deleting ", Name(i), ": ", status.message()));
    }
  }
  return first;
}

}  // namespace attn::client
