#include "client/client.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
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

// `status` with `context` before its message, its code kept.
absl::Status Annotated(const absl::Status& status, absl::string_view context) {
  return absl::Status(status.code(), absl::StrCat(context, status.message()));
}

int64_t ElementBytes(v1::DType dtype) {
  return ElementSize(FromProtoDType(dtype).value_or(DType::kFloat32));
}

std::string Hex(uint32_t crc) { return absl::StrFormat("0x%08x", crc); }

// The CRC32C of an export (CacheChunk.crc32c) extended by one chunk: its key data, then its
// value data.
uint32_t ChunkCrc(const v1::CacheChunk& chunk, uint32_t crc) {
  const std::string& key = chunk.key().data();
  const std::string& value = chunk.value().data();
  return Crc32c(value.data(), value.size(), Crc32c(key.data(), key.size(), crc));
}

// What an export stream says about itself, taken in as its chunks go by: the first chunk's
// info, the CRC32C of the tokens computed here, the crc32c its last chunk states.
class ExportTally {
 public:
  void Add(const v1::CacheChunk& chunk) {
    if (chunks_++ == 0) info_ = chunk.info();
    crc_ = ChunkCrc(chunk, crc_);
    if (chunk.has_crc32c()) stated_ = chunk.crc32c();
  }
  int64_t chunks() const { return chunks_; }
  // The first chunk's info, with crc32c set to the tokens'.
  v1::CacheInfo Info() const {
    v1::CacheInfo info = info_;
    info.set_crc32c(crc_);
    return info;
  }
  // DATA_LOSS unless the stream ended with its last chunk, whose crc32c is the tokens'.
  absl::Status CheckWhole() const {
    if (chunks_ == 0) return absl::DataLossError("the export stream held no chunk");
    if (!stated_) {
      return absl::DataLossError(absl::StrCat("the export stream of cache ", info_.cache_id(),
                                              " ended without its last chunk (crc32c)"));
    }
    if (*stated_ != crc_) {
      return absl::DataLossError(absl::StrCat("the export of cache ", info_.cache_id(),
                                              " states CRC32C ", Hex(*stated_), ", its tokens' is ",
                                              Hex(crc_)));
    }
    return absl::OkStatus();
  }
  // DATA_LOSS unless `answer`, an import's, holds the export's tokens: its length and crc32c.
  absl::Status CheckAnswer(const v1::CacheInfo& answer) const {
    if (answer.length() == info_.length() && answer.has_crc32c() && answer.crc32c() == crc_ &&
        stated_ == crc_) {
      return absl::OkStatus();
    }
    return absl::DataLossError(
        absl::StrCat("the import answered cache ", answer.cache_id(), " of ", answer.length(),
                     " tokens with CRC32C ", answer.has_crc32c() ? Hex(answer.crc32c()) : "(none)",
                     "; the export of cache ", info_.cache_id(), " held ", info_.length(),
                     " tokens with CRC32C ", Hex(crc_), " (its last chunk states ",
                     stated_ ? Hex(*stated_) : "none", ")"));
  }

 private:
  int64_t chunks_ = 0;
  v1::CacheInfo info_;
  uint32_t crc_ = 0;
  std::optional<uint32_t> stated_;
};

// An ImportCache on `to` of the chunks of an export that `next` gives (the first one asking for
// a new id when new_id_if_taken), its answer checked against them (ExportTally). A failed check
// deletes the import again. `next`'s errors are returned as they are, the server's after
// "import into TARGET: ".
absl::StatusOr<v1::CacheInfo> ImportChecked(
    Client& to, bool new_id_if_taken,
    const std::function<absl::StatusOr<bool>(v1::CacheChunk*)>& next) {
  ExportTally tally;
  absl::Status source_status;
  absl::StatusOr<v1::CacheInfo> imported =
      to.ImportCache([&](v1::CacheChunk* chunk) -> absl::StatusOr<bool> {
        absl::StatusOr<bool> more = next(chunk);
        if (more.ok() && !*more) source_status = tally.CheckWhole();
        if (!more.ok()) source_status = more.status();
        if (!source_status.ok()) return source_status;
        if (!*more) return false;
        if (tally.chunks() == 0) chunk->set_new_id_if_taken(new_id_if_taken);
        tally.Add(*chunk);
        return true;
      });
  if (!source_status.ok()) return source_status;
  const std::string into = absl::StrCat("import into ", to.target(), ": ");
  if (!imported.ok()) return Annotated(imported.status(), into);
  if (absl::Status checked = tally.CheckAnswer(*imported); !checked.ok()) {
    const absl::Status deleted = to.DeleteCache(imported->cache_id());
    return Annotated(
        checked,
        absl::StrCat(into,
                     deleted.ok() ? "deleted the copy again: " : "could not delete the copy (",
                     deleted.ok() ? "" : deleted.ToString(), deleted.ok() ? "" : "): "));
  }
  return imported;
}

// [heads, tokens, width] of a key or value tensor: rank 3, or rank 2 for one head.
struct TokenShape {
  int64_t heads = 0, tokens = 0, width = 0;
};

TokenShape ShapeOf(const v1::Tensor& tensor) {
  if (tensor.shape_size() == 3) return {tensor.shape(0), tensor.shape(1), tensor.shape(2)};
  if (tensor.shape_size() == 2) return {1, tensor.shape(0), tensor.shape(1)};
  return {};
}

// The AppendCache of tokens (key, value) after the first expected_length; value null: a latent
// cache's keys alone.
v1::AppendCacheRequest AppendRequest(const std::string& cache_id, const v1::Tensor& key,
                                     const v1::Tensor* value, int64_t expected_length) {
  v1::AppendCacheRequest request;
  request.set_cache_id(cache_id);
  *request.mutable_key() = key;
  if (value != nullptr) *request.mutable_value() = *value;
  request.set_expected_length(expected_length);
  return request;
}

const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
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

Client::Client(const std::string& target, ClientOptions options)
    : target_(target), options_(std::move(options)) {
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

absl::StatusOr<v1::CacheInfo> Client::TruncateCache(const v1::TruncateCacheRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::TruncateCache, request);
}

absl::StatusOr<v1::CacheInfo> Client::ForkCache(const v1::ForkCacheRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::ForkCache, request);
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

absl::StatusOr<v1::SharedMemoryRegion> Client::RegisterSharedMemory(
    const v1::RegisterSharedMemoryRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::RegisterSharedMemory, request);
}

absl::StatusOr<std::vector<std::string>> Client::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  absl::StatusOr<v1::UnregisterSharedMemoryResponse> response =
      Unary(*stub_, &v1::AttentionService::Stub::UnregisterSharedMemory, request);
  if (!response.ok()) return response.status();
  return std::vector<std::string>(response->names().begin(), response->names().end());
}

absl::StatusOr<v1::SharedMemoryStatusResponse> Client::SharedMemoryStatus(const std::string& name) {
  v1::SharedMemoryStatusRequest request;
  request.set_name(name);
  return Unary(*stub_, &v1::AttentionService::Stub::SharedMemoryStatus, request);
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(const v1::DecodeRequest& request) {
  return Unary(*stub_, &v1::AttentionService::Stub::Decode, request);
}

absl::Status Client::ExportCache(const std::string& cache_id,
                                 const std::function<bool(const v1::CacheChunk&)>& on_chunk) {
  std::unique_ptr<ExportStream> stream = OpenExport(cache_id);
  v1::CacheChunk chunk;
  for (int64_t chunks = 1;; ++chunks) {
    absl::StatusOr<bool> more = stream->Next(&chunk);
    if (!more.ok()) return more.status();
    if (!*more) return absl::OkStatus();
    if (!on_chunk(chunk)) {
      return absl::CancelledError(absl::StrCat("the export of cache ", cache_id,
                                               " was stopped by its reader after ", chunks,
                                               " chunks"));
    }
  }
}

std::unique_ptr<ExportStream> Client::OpenExport(const std::string& cache_id) {
  return std::unique_ptr<ExportStream>(new ExportStream(*this, cache_id));
}

absl::StatusOr<v1::CacheInfo> Client::ImportCache(
    const std::function<absl::StatusOr<bool>(v1::CacheChunk*)>& next) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::CacheInfo response;
  std::unique_ptr<grpc::ClientWriter<v1::CacheChunk>> writer =
      stub_->ImportCache(&context, &response);
  v1::CacheChunk chunk;
  while (true) {
    chunk.Clear();
    absl::StatusOr<bool> more = next(&chunk);
    if (!more.ok()) {
      context.TryCancel();
      (void)writer->Finish();
      return more.status();
    }
    if (!*more) break;
    if (!writer->Write(chunk)) break;  // The server ended the call: Finish says why.
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return ToAbsl(status);
  return response;
}

ExportStream::ExportStream(Client& client, const std::string& cache_id) {
  client.Prepare(&context_);
  v1::ExportCacheRequest request;
  request.set_cache_id(cache_id);
  reader_ = client.stub_->ExportCache(&context_, request);
}

ExportStream::~ExportStream() {
  if (finished_) return;
  context_.TryCancel();
  (void)reader_->Finish();
}

absl::StatusOr<bool> ExportStream::Next(v1::CacheChunk* chunk) {
  if (!finished_) {
    chunk->Clear();
    if (reader_->Read(chunk)) return true;
    finished_ = ToAbsl(reader_->Finish());
  }
  if (!finished_->ok()) return *finished_;
  return false;
}

std::optional<std::string> MovedTo(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kNotFound) return std::nullopt;
  constexpr absl::string_view kMark = "moved_to=";
  const absl::string_view message = status.message();
  const size_t at = message.rfind(kMark);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view target = absl::StripLeadingAsciiWhitespace(message.substr(at + kMark.size()));
  target = target.substr(0, target.find_first_of(" \t\r\n"));
  if (target.empty()) return std::nullopt;
  return std::string(target);
}

absl::StatusOr<v1::CacheInfo> CopyCache(Client& from, Client& to, const std::string& id,
                                        bool new_id_if_taken) {
  std::unique_ptr<ExportStream> source = from.OpenExport(id);
  const std::string export_from = absl::StrCat("export from ", from.target(), ": ");
  return ImportChecked(to, new_id_if_taken, [&](v1::CacheChunk* chunk) -> absl::StatusOr<bool> {
    absl::StatusOr<bool> more = source->Next(chunk);
    if (!more.ok()) return Annotated(more.status(), export_from);
    return more;
  });
}

absl::StatusOr<v1::CacheInfo> MoveCache(Client& from, Client& to, const std::string& id,
                                        bool new_id_if_taken) {
  absl::StatusOr<v1::CacheInfo> moved = CopyCache(from, to, id, new_id_if_taken);
  if (!moved.ok()) return moved;
  if (absl::Status deleted = from.DeleteCache(id); !deleted.ok()) {
    return Annotated(
        deleted, absl::StrCat("cache ", id, " was copied to ", to.target(), " as ",
                              moved->cache_id(), " but not deleted from ", from.target(), ": "));
  }
  return moved;
}

namespace {

// Records longer than this are not chunks of an export (theirs stay under 4 MiB).
constexpr uint32_t kMaxRecordBytes = uint32_t{1} << 30;

// The error of a failed file call, from errno (which a short fread or fwrite may leave 0: then
// UNKNOWN, never OK).
absl::Status FileError(absl::string_view what, const std::string& path) {
  const int error = errno;
  if (error == 0) return absl::UnknownError(absl::StrCat(what, " ", path));
  return absl::ErrnoToStatus(error, absl::StrCat(what, " ", path));
}

}  // namespace

absl::StatusOr<ExportFileWriter> ExportFileWriter::Create(const std::string& path) {
  errno = 0;
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return FileError("cannot create", path);
  ExportFileWriter writer(path, file);
  if (std::fwrite(kExportFileMagic.data(), 1, kExportFileMagic.size(), file) !=
      kExportFileMagic.size()) {
    return FileError("cannot write", path);
  }
  return writer;
}

ExportFileWriter::ExportFileWriter(ExportFileWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)) {}

ExportFileWriter::~ExportFileWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::Status ExportFileWriter::Write(const v1::CacheChunk& chunk) {
  if (file_ == nullptr) return absl::FailedPreconditionError(path_ + " is closed");
  std::string bytes;
  if (!chunk.SerializeToString(&bytes) || bytes.size() > kMaxRecordBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a chunk of ", chunk.ByteSizeLong(), " bytes does not fit ", path_));
  }
  const uint32_t size = static_cast<uint32_t>(bytes.size());
  errno = 0;
  const unsigned char prefix[4] = {
      static_cast<unsigned char>(size), static_cast<unsigned char>(size >> 8),
      static_cast<unsigned char>(size >> 16), static_cast<unsigned char>(size >> 24)};
  if (std::fwrite(prefix, 1, 4, file_) != 4 ||
      std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) {
    return FileError("cannot write", path_);
  }
  return absl::OkStatus();
}

absl::Status ExportFileWriter::Close() {
  if (file_ == nullptr) return absl::OkStatus();
  errno = 0;
  absl::Status status;
  if (std::fflush(file_) != 0) status = FileError("cannot write", path_);
  if (std::fclose(file_) != 0 && status.ok()) status = FileError("cannot write", path_);
  file_ = nullptr;
  return status;
}

absl::StatusOr<ExportFileReader> ExportFileReader::Open(const std::string& path) {
  errno = 0;
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return FileError("cannot open", path);
  ExportFileReader reader(path, file);
  char magic[8];
  const size_t got = std::fread(magic, 1, sizeof magic, file);
  if (std::ferror(file)) return FileError("cannot read", path);
  if (got != kExportFileMagic.size() || absl::string_view(magic, got) != kExportFileMagic) {
    return absl::DataLossError(absl::StrCat(path, ": not an attn cache export (its first ",
                                            kExportFileMagic.size(), " bytes are not \"",
                                            kExportFileMagic, "\")"));
  }
  return reader;
}

ExportFileReader::ExportFileReader(ExportFileReader&& other) noexcept
    : path_(std::move(other.path_)),
      file_(std::exchange(other.file_, nullptr)),
      records_(other.records_),
      offset_(other.offset_),
      crc_(other.crc_),
      ended_(other.ended_) {}

ExportFileReader::~ExportFileReader() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::StatusOr<bool> ExportFileReader::Next(v1::CacheChunk* chunk) {
  chunk->Clear();
  if (ended_) return false;
  if (file_ == nullptr) return absl::FailedPreconditionError(path_ + " is closed");
  const std::string record = absl::StrCat(path_, ": record ", records_, " (at byte ", offset_, ")");
  unsigned char prefix[4];
  errno = 0;
  size_t got = std::fread(prefix, 1, 4, file_);
  if (std::ferror(file_)) return FileError("cannot read", path_);
  if (got == 0) {
    return absl::DataLossError(
        absl::StrCat(path_, ": ends after ", records_,
                     " chunks, before the one carrying crc32c (the last): the file was cut short"));
  }
  if (got < 4) {
    return absl::DataLossError(
        absl::StrCat(record, " is cut short: its length has ", got, " of 4 bytes"));
  }
  const uint32_t size = uint32_t{prefix[0]} | uint32_t{prefix[1]} << 8 | uint32_t{prefix[2]} << 16 |
                        uint32_t{prefix[3]} << 24;
  if (size > kMaxRecordBytes) {
    return absl::DataLossError(
        absl::StrCat(record, " says it holds ", size, " bytes, more than any chunk"));
  }
  std::string bytes(size, '\0');
  got = std::fread(bytes.data(), 1, size, file_);
  if (std::ferror(file_)) return FileError("cannot read", path_);
  if (got < size) {
    return absl::DataLossError(
        absl::StrCat(record, " is cut short: ", got, " of its ", size, " bytes"));
  }
  if (!chunk->ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrCat(record, " does not parse as a CacheChunk"));
  }
  crc_ = ChunkCrc(*chunk, crc_);
  offset_ += 4 + int64_t{size};
  ++records_;
  if (chunk->has_crc32c()) {  // The last chunk: its CRC32C checked, and nothing after it.
    ended_ = true;
    if (chunk->crc32c() != crc_) {
      return absl::DataLossError(absl::StrCat(path_, ": its tokens' CRC32C is ", Hex(crc_),
                                              ", its last chunk states ", Hex(chunk->crc32c()),
                                              ": the file is damaged"));
    }
    if (std::fgetc(file_) != EOF) {
      return absl::DataLossError(absl::StrCat(path_, ": goes on after its last chunk (record ",
                                              records_ - 1, ", ending at byte ", offset_, ")"));
    }
  }
  return true;
}

absl::StatusOr<v1::CacheInfo> ExportCacheToFile(Client& client, const std::string& id,
                                                const std::string& path) {
  absl::StatusOr<ExportFileWriter> writer = ExportFileWriter::Create(path);
  if (!writer.ok()) return writer.status();
  ExportTally tally;
  absl::Status written;
  absl::Status status = client.ExportCache(id, [&](const v1::CacheChunk& chunk) {
    tally.Add(chunk);
    written = writer->Write(chunk);
    return written.ok();
  });
  if (!written.ok()) status = written;
  if (status.ok()) status = tally.CheckWhole();
  if (status.ok()) status = writer->Close();
  if (!status.ok()) {
    (void)writer->Close();
    std::remove(path.c_str());
    return status;
  }
  return tally.Info();
}

absl::StatusOr<v1::CacheInfo> ImportCacheFromFile(Client& client, const std::string& path,
                                                  bool new_id_if_taken) {
  absl::StatusOr<ExportFileReader> reader = ExportFileReader::Open(path);
  if (!reader.ok()) return reader.status();
  return ImportChecked(client, new_id_if_taken,
                       [&](v1::CacheChunk* chunk) { return reader->Next(chunk); });
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

int64_t Cache::kept_from() const { return tail_.empty() ? length() : tail_.front()->start; }

template <typename Call>
auto Cache::FollowingMoves(const Call& call) -> decltype(call(std::declval<Client&>())) {
  auto result = call(*client_);
  const std::optional<std::string> target = MovedTo(StatusOf(result));
  if (!target) return result;
  moved_client_ = std::make_shared<Client>(*target, client_->options());
  client_ = moved_client_.get();
  return call(*client_);
}

void Cache::Adopt(const v1::CacheInfo& info, const v1::Tensor* key, const v1::Tensor* value) {
  const int64_t before = length();
  info_ = info;
  unsure_cut_.reset();               // The server said what it holds.
  if (!info.has_durable_length()) {  // The server does not persist: nothing to send again.
    tail_.clear();
    return;
  }
  const auto tail_end = [&] { return tail_.back()->start + tail_.back()->tokens; };
  // The server took the append: a value with the key, or the key alone (a latent cache).
  const int64_t sent = key != nullptr ? ShapeOf(*key).tokens : 0;
  if (sent > 0 && info.length() == before + sent && info.length() > info.durable_length()) {
    // After a cut it was unsure of, the tail may end short of `before`: it would have a gap.
    if (!tail_.empty() && tail_end() != before) tail_.clear();
    tail_.push_back(std::make_shared<const Sent>(
        Sent{before, sent, *key, value != nullptr ? *value : v1::Tensor()}));
  }
  // Tokens this Cache has not seen (a length that moved), or a cut it was unsure of that the
  // server did not make: the tail would have a gap.
  if (!tail_.empty() && tail_end() != info.length()) tail_.clear();
  while (!tail_.empty() && tail_.front()->start + tail_.front()->tokens <= info.durable_length()) {
    tail_.pop_front();
  }
}

void Cache::Cut(int64_t length) {
  CutTail(length);
  info_.set_length(length);
}

void Cache::CutTail(int64_t length) {
  while (!tail_.empty() && tail_.back()->start >= length) tail_.pop_back();
  if (!tail_.empty() && tail_.back()->start + tail_.back()->tokens > length) {
    const int64_t start = tail_.back()->start;
    auto sliced = std::make_shared<const Sent>(
        Sent{start, length - start, Gather(true, start, length), Gather(false, start, length)});
    tail_.back() = std::move(sliced);
  }
}

bool Cache::IsRefusal(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

void Cache::CutFailed(int64_t length, const absl::Status& status) {
  if (status.ok() || IsRefusal(status) || length < 0) return;
  CutTail(length);
  if (!unsure_cut_ || length < *unsure_cut_) unsure_cut_ = length;
}

void Cache::CallFailed(const absl::Status& status, const v1::DecodeItem& item) {
  if (item.has_truncate_to() && item.expected_length() == length()) {
    CutFailed(item.truncate_to(), status);
  }
}

int64_t Cache::SameDTypeEnd(int64_t begin) const {
  int64_t end = begin;
  std::optional<v1::DType> dtype;
  for (const std::shared_ptr<const Sent>& sent : tail_) {
    if (sent->start + sent->tokens <= begin) continue;
    if (dtype && sent->key.dtype() != *dtype) break;
    dtype = sent->key.dtype();
    end = sent->start + sent->tokens;
  }
  return end;
}

v1::Tensor Cache::Gather(bool keys, int64_t begin, int64_t end) const {
  if (!keys && values_from_keys()) return v1::Tensor();  // Its values are within its keys.
  // Every kept tensor of the cache has its heads and width (the server took them), and those
  // of [begin, end) the dtype of the one holding `begin`.
  const Sent* first = tail_.front().get();
  for (const std::shared_ptr<const Sent>& sent : tail_) {
    if (sent->start <= begin && begin < sent->start + sent->tokens) first = sent.get();
  }
  const v1::Tensor& model = keys ? first->key : first->value;
  const TokenShape shape = ShapeOf(model);
  const int64_t row = shape.width * ElementBytes(model.dtype());
  v1::Tensor gathered;
  std::string* data = gathered.mutable_data();
  data->reserve(shape.heads * (end - begin) * row);
  for (int64_t h = 0; h < shape.heads; ++h) {
    for (const std::shared_ptr<const Sent>& sent : tail_) {
      const int64_t first = std::max(begin, sent->start);
      const int64_t last = std::min(end, sent->start + sent->tokens);
      if (first >= last) continue;
      const std::string& bytes = (keys ? sent->key : sent->value).data();
      data->append(bytes, (h * sent->tokens + first - sent->start) * row, (last - first) * row);
    }
  }
  for (const int64_t extent : {shape.heads, end - begin, shape.width}) gathered.add_shape(extent);
  gathered.set_dtype(model.dtype());
  return gathered;
}

absl::Status Cache::CheckValue(bool has_value) const {
  if (has_value && values_from_keys()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "value: cache ", id(),
        " is latent (values_from_keys): each token's value is the first value_dim columns of "
        "its key; send the key alone"));
  }
  if (!has_value && !values_from_keys()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "value: missing; cache ", id(),
        " stores values (it is not latent, values_from_keys): send a value with each key"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CacheInfo> Cache::Append(const v1::Tensor& key, const v1::Tensor& value) {
  if (absl::Status checked = CheckValue(true); !checked.ok()) return checked;
  const v1::AppendCacheRequest request = AppendRequest(id(), key, &value, length());
  absl::StatusOr<v1::CacheInfo> info =
      FollowingMoves([&](Client& client) { return client.AppendCache(request); });
  if (info.ok()) Adopt(*info, &key, &value);
  return info;
}

absl::StatusOr<v1::CacheInfo> Cache::Append(const v1::Tensor& key) {
  if (absl::Status checked = CheckValue(false); !checked.ok()) return checked;
  const v1::AppendCacheRequest request = AppendRequest(id(), key, nullptr, length());
  absl::StatusOr<v1::CacheInfo> info =
      FollowingMoves([&](Client& client) { return client.AppendCache(request); });
  if (info.ok()) Adopt(*info, &key, nullptr);
  return info;
}

absl::StatusOr<v1::CacheInfo> Cache::Truncate(int64_t length) {
  v1::TruncateCacheRequest request;
  request.set_cache_id(id());
  request.set_length(length);
  request.set_expected_length(this->length());
  absl::StatusOr<v1::CacheInfo> info =
      FollowingMoves([&](Client& client) { return client.TruncateCache(request); });
  if (info.ok()) {
    Cut(length);
    Adopt(*info, nullptr, nullptr);
  } else {
    CutFailed(length, info.status());
  }
  return info;
}

absl::StatusOr<Cache> Cache::Fork(std::optional<int64_t> length) {
  v1::ForkCacheRequest request;
  request.set_cache_id(id());
  if (length) request.set_length(*length);
  request.set_expected_length(this->length());
  absl::StatusOr<v1::CacheInfo> info =
      FollowingMoves([&](Client& client) { return client.ForkCache(request); });
  if (!info.ok()) return info.status();
  Cache fork(*client_, *std::move(info));
  fork.moved_client_ = moved_client_;  // The fork lives where this cache lives now.
  return fork;
}

v1::DecodeItem Cache::Item(const v1::Tensor& query, const v1::Tensor* key, const v1::Tensor* value,
                           std::optional<int64_t> truncate_to,
                           absl::Span<const int32_t> tree_parents) const {
  v1::DecodeItem item;
  item.set_cache_id(id());
  *item.mutable_query() = query;
  if (key != nullptr) *item.mutable_key() = *key;
  if (value != nullptr) *item.mutable_value() = *value;
  item.set_expected_length(length());
  if (truncate_to) item.set_truncate_to(*truncate_to);
  item.mutable_tree_parents()->Add(tree_parents.begin(), tree_parents.end());
  return item;
}

void Cache::Update(const v1::CacheInfo& info) { Adopt(info, nullptr, nullptr); }

void Cache::Update(const v1::CacheInfo& info, const v1::DecodeItem& item) {
  if (item.expected_length() != length()) {  // Not this Cache's item: its tokens are unknown.
    Adopt(info, nullptr, nullptr);
    return;
  }
  if (item.has_truncate_to()) Cut(item.truncate_to());
  // The server took the item's tokens: a key with its value, or alone for a latent cache.
  Adopt(info, item.has_key() ? &item.key() : nullptr,
        item.has_key() && item.has_value() ? &item.value() : nullptr);
}

absl::StatusOr<v1::DecodeResponse> Cache::Decode(const v1::Tensor& query, const v1::Tensor* key,
                                                 const v1::Tensor* value,
                                                 const v1::AttentionOptions& options,
                                                 std::optional<int64_t> truncate_to,
                                                 absl::Span<const int32_t> tree_parents) {
  if (key != nullptr || value != nullptr) {
    if (absl::Status checked = CheckValue(value != nullptr); !checked.ok()) return checked;
  }
  v1::DecodeRequest request;
  *request.add_items() = Item(query, key, value, truncate_to, tree_parents);
  *request.mutable_options() = options;
  absl::StatusOr<v1::DecodeResponse> response =
      FollowingMoves([&](Client& client) { return client.Decode(request); });
  if (!response.ok()) {
    CallFailed(response.status(), request.items(0));
    return response;
  }
  if (response->caches_size() != 1 || response->outputs_size() != 1) {
    return absl::InternalError(absl::StrCat("Decode of one item answered ",
                                            response->outputs_size(), " outputs and ",
                                            response->caches_size(), " cache infos"));
  }
  Update(response->caches(0), request.items(0));
  return response;
}

absl::StatusOr<v1::CacheInfo> Cache::Refresh() {
  absl::StatusOr<v1::CacheInfo> info =
      FollowingMoves([&](Client& client) { return client.GetCacheInfo(id()); });
  if (!info.ok()) return info;
  const int64_t held = info->length();
  // After a cut that may have been applied (CutFailed), nothing past it is sent again.
  const int64_t target = unsure_cut_ ? std::min(length(), *unsure_cut_) : length();
  if (held >= target) {
    if (target < length()) Cut(target);  // So Adopt keeps the tail when the server holds target.
    Adopt(*info, nullptr, nullptr);
    return info;
  }
  // The tail, when not empty, ends at target: at length(), or cut at the unsure cut.
  if (kept_from() > held) {
    return absl::DataLossError(
        absl::StrCat("cache ", id(), ": the server holds ", held, " tokens, this client sent ",
                     target, " and kept them only from ", kept_from(),
                     " on (the rest were durable, or the server does not persist caches): tokens [",
                     held, ", ", kept_from(), ") are lost; prefill the sequence again"));
  }
  // Tokens [held, target) again, from the tail, in appends of at most kReplayAppendBytes.
  const Sent& front = *tail_.front();
  const int64_t token_bytes =
      static_cast<int64_t>(front.key.data().size() + front.value.data().size()) /
      std::max<int64_t>(1, front.tokens);
  const int64_t per_append =
      std::max<int64_t>(1, kReplayAppendBytes / std::max<int64_t>(1, token_bytes));
  for (int64_t begin = held; begin < target;) {
    const int64_t end = std::min({target, begin + per_append, SameDTypeEnd(begin)});
    const v1::Tensor values = Gather(false, begin, end);  // Empty for a latent cache.
    info = client_->AppendCache(AppendRequest(id(), Gather(true, begin, end),
                                              values_from_keys() ? nullptr : &values, begin));
    if (!info.ok()) {
      return Annotated(info.status(),
                       absl::StrCat("cache ", id(), ": sending tokens [", begin, ", ", end,
                                    ") again after the server kept ", held, ": "));
    }
    begin = end;
  }
  Adopt(*info, nullptr, nullptr);
  return info;
}

absl::Status Cache::Delete() {
  return FollowingMoves([&](Client& client) { return client.DeleteCache(id()); });
}

void Cache::Rebind(Client& client) {
  client_ = &client;
  moved_client_.reset();
}

}  // namespace attn::client
