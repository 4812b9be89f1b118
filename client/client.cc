#include "client/client.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"

namespace attn::client {
namespace {

namespace v1 = attention::v1;

absl::Status ToAbsl(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// Splits "host:port" or "[v6]:port" into host and port; false when it is not that form.
bool SplitHostPort(absl::string_view endpoint, std::string* host, std::string* port) {
  size_t colon;
  if (absl::StartsWith(endpoint, "[")) {
    const size_t close = endpoint.find(']');
    if (close == absl::string_view::npos || close + 1 >= endpoint.size() ||
        endpoint[close + 1] != ':') {
      return false;
    }
    *host = std::string(endpoint.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = endpoint.rfind(':');
    if (colon == absl::string_view::npos) return false;
    *host = std::string(endpoint.substr(0, colon));
  }
  *port = std::string(endpoint.substr(colon + 1));
  int port_number;
  return !host->empty() && absl::SimpleAtoi(*port, &port_number) && port_number > 0 &&
         port_number < 65536;
}

}  // namespace

absl::StatusOr<LoadBalancing> ParseLoadBalancing(absl::string_view name) {
  if (name == "pick_first" || name == "pick-first") return LoadBalancing::kPickFirst;
  if (name == "round_robin" || name == "round-robin") return LoadBalancing::kRoundRobin;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown load-balancing policy \"", name, "\": use pick_first or round_robin"));
}

std::vector<std::string> SplitEndpoints(const std::string& target) {
  std::vector<std::string> endpoints;
  for (absl::string_view part : absl::StrSplit(target, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) endpoints.emplace_back(part);
  }
  return endpoints;
}

absl::StatusOr<std::string> ChannelTarget(const std::string& target) {
  const std::vector<std::string> endpoints = SplitEndpoints(target);
  if (endpoints.empty()) return absl::InvalidArgumentError("empty target");
  if (endpoints.size() == 1) return endpoints[0];
  // gRPC's ipv4:/ipv6: resolvers take a comma-separated list of numeric addresses.
  std::vector<std::string> v4, v6;
  for (const std::string& endpoint : endpoints) {
    std::string host, port;
    if (!SplitHostPort(endpoint, &host, &port)) {
      return absl::InvalidArgumentError(
          absl::StrCat("target list: \"", endpoint, "\" is not host:port"));
    }
    if (host == "localhost") host = "127.0.0.1";
    in_addr address4;
    in6_addr address6;
    if (inet_pton(AF_INET, host.c_str(), &address4) == 1) {
      v4.push_back(absl::StrCat(host, ":", port));
    } else if (inet_pton(AF_INET6, host.c_str(), &address6) == 1) {
      v6.push_back(absl::StrCat("[", host, "]:", port));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("target list: \"", host,
                       "\" is not an IP address (a list takes numeric addresses; use "
                       "dns:///name:port for a name with several addresses)"));
    }
  }
  if (!v4.empty() && !v6.empty()) {
    return absl::InvalidArgumentError("target list: mixes IPv4 and IPv6 addresses");
  }
  return v4.empty() ? absl::StrCat("ipv6:", absl::StrJoin(v6, ","))
                    : absl::StrCat("ipv4:", absl::StrJoin(v4, ","));
}

v1::Tensor ToTensor(const Array& array, v1::DType dtype) {
  const DType kernel_dtype = FromProtoDType(dtype).value_or(DType::kFloat32);
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(array.shape.begin(), array.shape.end());
  tensor.set_dtype(ToProtoDType(kernel_dtype));
  std::string* data = tensor.mutable_data();
  data->resize(array.values.size() * ElementSize(kernel_dtype));
  for (size_t i = 0; i < array.values.size(); ++i) {
    StoreElement(data->data(), kernel_dtype, static_cast<int64_t>(i), array.values[i]);
  }
  return tensor;
}

absl::StatusOr<Array> FromTensor(const v1::Tensor& tensor) {
  const std::optional<DType> dtype = FromProtoDType(tensor.dtype());
  if (!dtype) return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", tensor.dtype()));
  Array array;
  array.shape.assign(tensor.shape().begin(), tensor.shape().end());
  int64_t elements = 1;
  for (int64_t dim : array.shape) elements *= dim;
  if (static_cast<int64_t>(tensor.data().size()) != elements * ElementSize(*dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor data has ", tensor.data().size(),
                                                   " bytes, its shape needs ",
                                                   elements * ElementSize(*dtype)));
  }
  array.values.resize(elements);
  for (int64_t i = 0; i < elements; ++i) {
    array.values[i] = LoadElement(tensor.data().data(), *dtype, i);
  }
  return array;
}

Client::Client(const std::string& target, ClientOptions options) : options_(options) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options_.max_message_bytes);
  arguments.SetMaxSendMessageSize(options_.max_message_bytes);
  arguments.SetServiceConfigJSON(options_.load_balancing == LoadBalancing::kRoundRobin
                                     ? R"({"loadBalancingConfig": [{"round_robin": {}}]})"
                                     : R"({"loadBalancingConfig": [{"pick_first": {}}]})");
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options_.tls_ca.empty()) {
    credentials = grpc::SslCredentials({.pem_root_certs = options_.tls_ca,
                                        .pem_private_key = options_.tls_key,
                                        .pem_cert_chain = options_.tls_cert});
  }
  const absl::StatusOr<std::string> channel_target = ChannelTarget(target);
  channel_ = grpc::CreateCustomChannel(channel_target.ok() ? *channel_target : target, credentials,
                                       arguments);
  stub_ = v1::AttentionService::NewStub(channel_);
  health_ = grpc::health::v1::Health::NewStub(channel_);
}

void Client::Prepare(grpc::ClientContext* context) const {
  if (options_.timeout) context->set_deadline(std::chrono::system_clock::now() + *options_.timeout);
  // Plain metadata rather than call credentials: gRPC sends call credentials over TLS only, and
  // attnd accepts a token over plaintext on loopback.
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
}

template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> Client::Unary(Stub& stub,
                                       grpc::Status (Stub::*method)(grpc::ClientContext*,
                                                                    const Request&, Response*),
                                       const Request& request) const {
  grpc::ClientContext context;
  Prepare(&context);
  Response response;
  const grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return ToAbsl(status);
  return response;
}

absl::StatusOr<v1::AttentionResponse> Client::Naive(const v1::AttentionRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::Naive, request);
}

absl::StatusOr<v1::AttentionResponse> Client::Tiled(const v1::AttentionRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::Tiled, request);
}

absl::StatusOr<v1::ServerInfo> Client::Info() {
  return Unary(*stub_, &v1::AttentionService::Stub::GetServerInfo, v1::GetServerInfoRequest());
}

absl::Status Client::Trace(const v1::TraceRequest& request,
                           const std::function<bool(const v1::TraceEvent&)>& on_event) {
  grpc::ClientContext context;
  Prepare(&context);
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader = stub_->Trace(&context, request);
  v1::TraceEvent event;
  while (reader->Read(&event)) {
    if (!on_event(event)) {
      context.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return ToAbsl(reader->Finish());
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  const absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      Unary(*health_, &grpc::health::v1::Health::Stub::Check, request);
  if (!response.ok()) return response.status();
  return response->status();
}

std::vector<float> StandardAlibiSlopes(int64_t heads) {
  std::vector<float> slopes;
  if (heads < 1) return slopes;
  int64_t n = 1;
  while (n * 2 <= heads) n *= 2;
  for (int64_t h = 0; h < n; ++h) {
    slopes.push_back(static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / n)));
  }
  for (int64_t i = 0; n + i < heads; ++i) {  // The odd-numbered slopes of 2n heads.
    slopes.push_back(
        static_cast<float>(std::exp2(-8.0 * static_cast<double>(2 * i + 1) / (2 * n))));
  }
  return slopes;
}

absl::StatusOr<v1::CacheInfo> Client::CreateCache(const v1::CreateCacheRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::CreateCache, request);
}

absl::StatusOr<v1::CacheInfo> Client::AppendCache(const v1::AppendCacheRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::AppendCache, request);
}

absl::StatusOr<v1::CacheInfo> Client::GetCacheInfo(const std::string& cache_id) {
  v1::GetCacheInfoRequest request;
  request.set_cache_id(cache_id);
  return Unary(*stub_, &v1::AttentionService::Stub::GetCacheInfo, request);
}

absl::Status Client::DeleteCache(const std::string& cache_id) {
  v1::DeleteCacheRequest request;
  request.set_cache_id(cache_id);
  return Unary(*stub_, &v1::AttentionService::Stub::DeleteCache, request).status();
}

absl::StatusOr<v1::ListCachesResponse> Client::ListCaches() {
  return Unary(*stub_, &v1::AttentionService::Stub::ListCaches, v1::ListCachesRequest());
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(const v1::DecodeRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::Decode, request);
}

v1::AttentionRequest CacheRequest(const std::string& cache_id, const v1::Tensor& query,
                                  const v1::AttentionOptions& options) {
  v1::AttentionRequest request;
  request.set_cache_id(cache_id);
  *request.mutable_query() = query;
  *request.mutable_options() = options;
  return request;
}

absl::StatusOr<Cache> Cache::Create(Client& client, const v1::CreateCacheRequest& request) {
  absl::StatusOr<v1::CacheInfo> info = client.CreateCache(request);
  if (!info.ok()) return info.status();
  return Cache(client, *std::move(info));
}

absl::StatusOr<v1::CacheInfo> Cache::Append(const v1::Tensor& key, const v1::Tensor& value) {
  v1::AppendCacheRequest request;
  request.set_cache_id(id());
  *request.mutable_key() = key;
  *request.mutable_value() = value;
  request.set_expected_length(length());
  absl::StatusOr<v1::CacheInfo> info = client_->AppendCache(request);
  if (info.ok()) info_ = *info;
  return info;
}

v1::DecodeItem Cache::Item(const v1::Tensor& query, const v1::Tensor* key,
                           const v1::Tensor* value) const {
  v1::DecodeItem item;
  item.set_cache_id(id());
  *item.mutable_query() = query;
  if (key != nullptr) *item.mutable_key() = *key;
  if (value != nullptr) *item.mutable_value() = *value;
  item.set_expected_length(length());
  return item;
}

absl::StatusOr<v1::DecodeResponse> Cache::Decode(const v1::Tensor& query, const v1::Tensor* key,
                                                 const v1::Tensor* value,
                                                 const v1::AttentionOptions& options) {
  v1::DecodeRequest request;
  *request.add_items() = Item(query, key, value);
  *request.mutable_options() = options;
  absl::StatusOr<v1::DecodeResponse> response = client_->Decode(request);
  if (!response.ok()) return response;
  if (response->caches_size() != 1 || response->outputs_size() != 1) {
    return absl::InternalError(absl::StrCat("Decode of one item answered ",
                                            response->outputs_size(), " outputs and ",
                                            response->caches_size(), " cache infos"));
  }
  info_ = response->caches(0);
  return response;
}

absl::StatusOr<v1::CacheInfo> Cache::Refresh() {
  absl::StatusOr<v1::CacheInfo> info = client_->GetCacheInfo(id());
  if (info.ok()) info_ = *info;
  return info;
}

absl::Status Cache::Delete() { return client_->DeleteCache(id()); }

}  // namespace attn::client
