#include "client/multi_server_client.h"

#include <map>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attn::client {
namespace {

namespace v1 = attention::v1;

// The codes another server might not give (see the class comment): a part or a new cache that
// fails with one is sent once more, to the next endpoint.
bool Retryable(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace

MultiServerClient::MultiServerClient(std::vector<std::string> endpoints, ClientOptions options)
    : endpoints_(std::move(endpoints)), next_endpoint_(std::random_device()()) {
  for (const std::string& endpoint : endpoints_) {
    clients_.push_back(std::make_unique<Client>(endpoint, options));
  }
}

absl::StatusOr<v1::AttentionResponse> MultiServerClient::Naive(const v1::AttentionRequest& request,
                                                               ShardReport* report,
                                                               Sharding sharding) {
  return Call(/*naive=*/true, request, sharding, report);
}

absl::StatusOr<v1::AttentionResponse> MultiServerClient::Tiled(const v1::AttentionRequest& request,
                                                               ShardReport* report,
                                                               Sharding sharding) {
  return Call(/*naive=*/false, request, sharding, report);
}

std::vector<absl::StatusOr<v1::AttentionResponse>> MultiServerClient::Send(
    bool naive, const std::vector<const v1::AttentionRequest*>& requests,
    std::vector<ShardReport::Part>& parts) {
  const size_t endpoints = clients_.size();
  std::vector<absl::StatusOr<v1::AttentionResponse>> results(requests.size(),
                                                             absl::UnknownError("not sent"));
  auto run = [&](size_t i) {
    ShardReport::Part& part = parts[i];
    for (int attempt = 0; attempt < 2; ++attempt) {
      const size_t endpoint = (i + attempt) % endpoints;
      Client& client = *clients_[endpoint];
      part.endpoint = endpoints_[endpoint];
      results[i] = naive ? client.Naive(*requests[i]) : client.Tiled(*requests[i]);
      if (results[i].ok() || !Retryable(results[i].status())) return;
      if (attempt == 0) {
        part.retried = true;
        part.first_error = absl::StrCat(endpoints_[endpoint], ": ",
                                        absl::StatusCodeToString(results[i].status().code()), ": ",
                                        results[i].status().message());
      }
    }
  };
  if (requests.size() == 1) {
    run(0);
  } else {
    std::vector<std::thread> threads;
    threads.reserve(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) threads.emplace_back(run, i);
    for (std::thread& thread : threads) thread.join();
  }
  return results;
}

absl::StatusOr<v1::AttentionResponse> MultiServerClient::Call(bool naive,
                                                              const v1::AttentionRequest& request,
                                                              Sharding sharding,
                                                              ShardReport* report) {
  if (clients_.empty()) return absl::InvalidArgumentError("shard: no endpoints");
  if (!request.cache_id().empty()) {  // The cache's keys are on one server: the whole call too.
    absl::StatusOr<size_t> owner = Owner(request.cache_id());
    if (!owner.ok()) return owner.status();
    if (report != nullptr) {
      report->parts.assign(1, ShardReport::Part{.first_unit = 0,
                                                .units = 1,
                                                .key_begin = 0,
                                                .key_end = 0,
                                                .key_slice = false,
                                                .endpoint = endpoints_[*owner],
                                                .retried = false,
                                                .first_error = ""});
    }
    Client& client = *clients_[*owner];
    return naive ? client.Naive(request) : client.Tiled(request);
  }
  const int endpoints = static_cast<int>(clients_.size());
  // The head parts, then each one's key slices: the grid, numbered in (head part, slice) order.
  const std::vector<ShardPart> heads =
      SplitRequest(request, sharding == Sharding::kKeys ? 1 : endpoints);
  std::vector<std::vector<ShardPart>> grid;
  grid.reserve(heads.size());
  std::vector<const v1::AttentionRequest*> requests;
  ShardReport local;
  for (const ShardPart& head : heads) {
    std::vector<ShardPart>& slices =
        grid.emplace_back(sharding == Sharding::kHeads ? std::vector<ShardPart>{head}
                                                       : SplitKeys(head.request, endpoints));
    for (ShardPart& slice : slices) {
      slice.first_unit = head.first_unit;
      slice.units = head.units;
      requests.push_back(&slice.request);
      local.parts.push_back(ShardReport::Part{.first_unit = slice.first_unit,
                                              .units = slice.units,
                                              .key_begin = slice.key_begin,
                                              .key_end = slice.key_end,
                                              .key_slice = slice.key_slice,
                                              .endpoint = "",
                                              .retried = false,
                                              .first_error = ""});
    }
  }
  std::vector<absl::StatusOr<v1::AttentionResponse>> results = Send(naive, requests, local.parts);
  if (report != nullptr) *report = local;

  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].ok()) continue;
    if (results.size() == 1 && !local.parts[i].retried) return results[i].status();
    return absl::Status(
        results[i].status().code(),
        absl::StrCat("part ", i + 1, " of ", results.size(), " (", local.parts[i].endpoint,
                     local.parts[i].retried ? ", after a retry" : "",
                     "): ", results[i].status().message()));
  }
  std::vector<v1::AttentionResponse> head_responses;
  head_responses.reserve(heads.size());
  size_t next = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    std::vector<v1::AttentionResponse> responses;
    responses.reserve(grid[h].size());
    for (size_t s = 0; s < grid[h].size(); ++s) responses.push_back(*std::move(results[next++]));
    absl::StatusOr<v1::AttentionResponse> merged =
        MergeKeySlices(heads[h].request, grid[h], responses);
    if (!merged.ok()) return merged.status();
    head_responses.push_back(*std::move(merged));
  }
  return MergeResponses(request, heads, head_responses);
}

absl::Status MultiServerClient::Trace(const v1::TraceRequest& request,
                                      const std::function<bool(const v1::TraceEvent&)>& on_event) {
  if (clients_.empty()) return absl::InvalidArgumentError("shard: no endpoints");
  size_t endpoint = 0;
  if (const std::string& cache_id = request.attention().cache_id(); !cache_id.empty()) {
    absl::StatusOr<size_t> owner = Owner(cache_id);
    if (!owner.ok()) return owner.status();
    endpoint = *owner;
  }
  return clients_[endpoint]->Trace(request, on_event);
}

void MultiServerClient::Remember(const std::string& cache_id, size_t endpoint) {
  std::lock_guard<std::mutex> lock(mutex_);
  owners_[cache_id] = endpoint;
}

void MultiServerClient::Forget(const std::string& cache_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  owners_.erase(cache_id);
}

absl::StatusOr<size_t> MultiServerClient::Owner(const std::string& cache_id) {
  if (clients_.empty()) return absl::InvalidArgumentError("shard: no endpoints");
  if (clients_.size() == 1) return 0;  // The one server answers for itself.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const auto found = owners_.find(cache_id); found != owners_.end()) return found->second;
  }
  absl::Status failure;  // The first failure that is not NOT_FOUND.
  for (size_t i = 0; i < clients_.size(); ++i) {
    const absl::StatusOr<v1::CacheInfo> info = clients_[i]->GetCacheInfo(cache_id);
    if (info.ok()) {
      Remember(cache_id, i);
      return i;
    }
    if (!absl::IsNotFound(info.status()) && failure.ok()) {
      failure = absl::Status(info.status().code(),
                             absl::StrCat(endpoints_[i], ": ", info.status().message()));
    }
  }
  if (!failure.ok()) return failure;
  return absl::NotFoundError(
      absl::StrCat("cache \"", cache_id, "\" is on none of the ", clients_.size(), " endpoints"));
}

absl::StatusOr<std::string> MultiServerClient::EndpointOf(const std::string& cache_id) {
  absl::StatusOr<size_t> owner = Owner(cache_id);
  if (!owner.ok()) return owner.status();
  return endpoints_[*owner];
}

absl::StatusOr<Client*> MultiServerClient::ClientFor(const std::string& cache_id) {
  absl::StatusOr<size_t> owner = Owner(cache_id);
  if (!owner.ok()) return owner.status();
  return clients_[*owner].get();
}

absl::StatusOr<v1::CacheInfo> MultiServerClient::CreateCache(
    const v1::CreateCacheRequest& request) {
  if (clients_.empty()) return absl::InvalidArgumentError("shard: no endpoints");
  size_t first;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    first = next_endpoint_++ % clients_.size();
  }
  absl::StatusOr<v1::CacheInfo> info = absl::UnknownError("not sent");
  std::string first_error;
  const int attempts = clients_.size() > 1 ? 2 : 1;
  for (int attempt = 0; attempt < attempts; ++attempt) {
    const size_t endpoint = (first + attempt) % clients_.size();
    info = clients_[endpoint]->CreateCache(request);
    if (info.ok()) {
      Remember(info->cache_id(), endpoint);
      return info;
    }
    if (!Retryable(info.status())) break;
    if (attempt == 0) {
      first_error = absl::StrCat(endpoints_[endpoint], ": ", info.status().message());
    }
  }
  if (first_error.empty()) return info.status();
  return absl::Status(
      info.status().code(),
      absl::StrCat(info.status().message(), " (after a retry; first ", first_error, ")"));
}

absl::StatusOr<v1::CacheInfo> MultiServerClient::AppendCache(
    const v1::AppendCacheRequest& request) {
  absl::StatusOr<size_t> owner = Owner(request.cache_id());
  if (!owner.ok()) return owner.status();
  return clients_[*owner]->AppendCache(request);
}

absl::StatusOr<v1::CacheInfo> MultiServerClient::GetCacheInfo(const std::string& cache_id) {
  absl::StatusOr<size_t> owner = Owner(cache_id);
  if (!owner.ok()) return owner.status();
  absl::StatusOr<v1::CacheInfo> info = clients_[*owner]->GetCacheInfo(cache_id);
  if (absl::IsNotFound(info.status())) Forget(cache_id);  // Deleted or expired there.
  return info;
}

absl::Status MultiServerClient::DeleteCache(const std::string& cache_id) {
  absl::StatusOr<size_t> owner = Owner(cache_id);
  if (!owner.ok()) return owner.status();
  const absl::Status status = clients_[*owner]->DeleteCache(cache_id);
  if (status.ok() || absl::IsNotFound(status)) Forget(cache_id);
  return status;
}

absl::StatusOr<v1::ListCachesResponse> MultiServerClient::ListCaches() {
  v1::ListCachesResponse all;
  for (size_t i = 0; i < clients_.size(); ++i) {
    absl::StatusOr<v1::ListCachesResponse> list = clients_[i]->ListCaches();
    if (!list.ok()) {
      return absl::Status(list.status().code(),
                          absl::StrCat(endpoints_[i], ": ", list.status().message()));
    }
    for (const v1::CacheInfo& info : list->caches()) {
      if (clients_.size() > 1) Remember(info.cache_id(), i);
      *all.add_caches() = info;
    }
  }
  return all;
}

absl::StatusOr<v1::DecodeResponse> MultiServerClient::Decode(const v1::DecodeRequest& request) {
  if (clients_.empty()) return absl::InvalidArgumentError("shard: no endpoints");
  if (request.items_size() == 0) return clients_[0]->Decode(request);
  // Items by endpoint, each list in item order.
  std::map<size_t, std::vector<int>> groups;
  for (int i = 0; i < request.items_size(); ++i) {
    absl::StatusOr<size_t> owner = Owner(request.items(i).cache_id());
    if (!owner.ok()) {
      return absl::Status(owner.status().code(),
                          absl::StrCat("items[", i, "]: ", owner.status().message()));
    }
    groups[*owner].push_back(i);
  }
  if (groups.size() == 1) return clients_[groups.begin()->first]->Decode(request);

  struct Part {
    size_t endpoint;
    std::vector<int> items;
    v1::DecodeRequest request;
    absl::StatusOr<v1::DecodeResponse> response = absl::UnknownError("not sent");
  };
  std::vector<Part> parts;
  for (auto& [endpoint, items] : groups) {
    Part& part = parts.emplace_back();
    part.endpoint = endpoint;
    part.items = std::move(items);
    for (int i : part.items) *part.request.add_items() = request.items(i);
    if (request.has_options()) *part.request.mutable_options() = request.options();
  }
  std::vector<std::thread> threads;
  threads.reserve(parts.size());
  for (Part& part : parts) {
    threads.emplace_back(
        [this, &part] { part.response = clients_[part.endpoint]->Decode(part.request); });
  }
  for (std::thread& thread : threads) thread.join();

  const bool lse = request.options().return_lse();
  v1::DecodeResponse merged;
  std::vector<v1::Tensor> outputs(request.items_size()), lses(request.items_size());
  std::vector<v1::CacheInfo> caches(request.items_size());
  for (size_t p = 0; p < parts.size(); ++p) {
    Part& part = parts[p];
    if (!part.response.ok()) {
      return absl::Status(
          part.response.status().code(),
          absl::StrCat(endpoints_[part.endpoint], " (items ", absl::StrJoin(part.items, ", "),
                       " of ", request.items_size(), "): ", part.response.status().message()));
    }
    v1::DecodeResponse& response = *part.response;
    const int n = static_cast<int>(part.items.size());
    if (response.outputs_size() != n || response.caches_size() != n ||
        (lse && response.lse_size() != n)) {
      return absl::InternalError(absl::StrCat(endpoints_[part.endpoint], " answered ",
                                              response.outputs_size(), " outputs for ", n,
                                              " decode items"));
    }
    for (int j = 0; j < n; ++j) {
      outputs[part.items[j]] = std::move(*response.mutable_outputs(j));
      if (lse) lses[part.items[j]] = std::move(*response.mutable_lse(j));
      caches[part.items[j]] = std::move(*response.mutable_caches(j));
    }
    AddPartStats(*merged.mutable_stats(), response.stats(), p == 0);
  }
  for (int i = 0; i < request.items_size(); ++i) {
    *merged.add_outputs() = std::move(outputs[i]);
    if (lse) *merged.add_lse() = std::move(lses[i]);
    *merged.add_caches() = std::move(caches[i]);
  }
  return merged;
}

}  // namespace attn::client
