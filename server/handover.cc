#include "server/handover.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/cache_transfer.h"

namespace attn {

namespace v1 = attention::v1;

namespace {

// One cache to the peer: OK once the peer holds it whole.
absl::Status MoveOne(CacheRegistry& caches, v1::AttentionService::Stub& peer,
                     const std::string& owner, const std::string& id, const std::string& auth_token,
                     int seconds) {
  absl::StatusOr<CacheExporter> exporter = CacheExporter::Start(caches, owner, id, "cache_id");
  if (!exporter.ok()) return exporter.status();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  if (!auth_token.empty()) context.AddMetadata("authorization", "Bearer " + auth_token);
  v1::CacheInfo info;
  std::unique_ptr<grpc::ClientWriter<v1::CacheChunk>> writer = peer.ImportCache(&context, &info);
  v1::CacheChunk chunk;
  while (true) {
    absl::StatusOr<bool> more = exporter->Next(&chunk);
    if (!more.ok()) {
      context.TryCancel();
      writer->Finish();
      return more.status();
    }
    if (!*more || !writer->Write(chunk)) break;
  }
  writer->WritesDone();
  const grpc::Status finished = writer->Finish();
  if (!finished.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(finished.error_code()),
                        absl::StrCat("the peer refused it: ", finished.error_message()));
  }
  if (info.cache_id() != id || info.length() != exporter->length() ||
      info.crc32c() != exporter->crc32c()) {
    return absl::DataLossError(absl::StrCat(
        "the peer holds ", info.cache_id(), " with ", info.length(), " tokens and CRC32C ",
        info.crc32c(), ", not ", id, " with ", exporter->length(), " and ", exporter->crc32c()));
  }
  return absl::OkStatus();
}

}  // namespace

HandOverResult HandOverCaches(CacheRegistry& caches, const std::string& target,
                              const std::string& auth_token, int seconds_per_cache) {
  HandOverResult result;
  const auto start = std::chrono::steady_clock::now();
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  std::unique_ptr<v1::AttentionService::Stub> peer = v1::AttentionService::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments));
  int64_t tokens = 0;
  for (const auto& [owner, id] : caches.AllCaches()) {
    const absl::StatusOr<CacheDescription> description = caches.Describe(owner, id);
    const absl::Status moved = MoveOne(caches, *peer, owner, id, auth_token, seconds_per_cache);
    if (moved.ok()) {
      caches.MarkMoved(owner, id, target);
      ++result.moved;
      if (description.ok()) tokens += description->length;
    } else {
      ++result.kept;
      result.lines.push_back(absl::StrCat("cache ", id, " stays here (", moved.message(), ")"));
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.lines.insert(result.lines.begin(),
                      absl::StrFormat("moved %d caches (%d tokens) to %s in %.3f s; %d kept here",
                                      result.moved, tokens, target, seconds, result.kept));
  return result;
}

}  // namespace attn
