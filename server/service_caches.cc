// AttentionService (service.h), its KV-cache handlers: CreateCache, AppendCache, TruncateCache,
// ForkCache, GetCacheInfo, DeleteCache and ListCaches, Decode (a batch of one-step cuts, appends
// and attentions, each over its own cache, all or nothing), and ExportCache and ImportCache (a
// cache as a stream of chunks, cache_transfer.h). The request checks are request.h's, the caches'
// rules caches.h's: these handlers order them, and queue what reads every element or changes a
// cache.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/cache_transfer.h"
#include "server/compute_queue.h"
#include "server/response.h"
#include "server/security.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace attn {

namespace v1 = attention::v1;
using service_internal::Clock;
using service_internal::Failed;
using service_internal::FillStats;
using service_internal::Finished;
using service_internal::InflightBytes;
using service_internal::Interruption;
using service_internal::Timeline;

namespace {

// Counts one ExportCache or ImportCache stream among the open ones (a drain waits for them).
class TransferCount {
 public:
  explicit TransferCount(std::atomic<int64_t>& open) : open_(open) { open_.fetch_add(1); }
  ~TransferCount() { open_.fetch_sub(1); }
  TransferCount(const TransferCount&) = delete;
  TransferCount& operator=(const TransferCount&) = delete;

 private:
  std::atomic<int64_t>& open_;
};

// ExportCache's stream: one chunk per completed write (its flow control); each chunk's tokens
// are copied out once the write before it has completed, so one chunk is in memory at a time.
class ExportWriter final : public grpc::ServerWriteReactor<v1::CacheChunk> {
 public:
  ExportWriter(std::atomic<int64_t>& open, CacheExporter exporter)
      : count_(open), exporter_(std::move(exporter)) {
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "export stream closed by the client"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    RunGuarded(
        [this] {
          absl::StatusOr<bool> more = exporter_.Next(&chunk_);
          if (!more.ok()) {
            Finish(ToGrpcStatus(more.status()));
          } else if (*more) {
            StartWrite(&chunk_);
          } else {
            Finish(grpc::Status::OK);
          }
        },
        [this](const absl::Status& status) { Finish(ToGrpcStatus(status)); });
  }

  TransferCount count_;
  CacheExporter exporter_;
  v1::CacheChunk chunk_;
};

class FailedExport final : public grpc::ServerWriteReactor<v1::CacheChunk> {
 public:
  explicit FailedExport(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// ImportCache's stream: each chunk checked and added as it arrives; the cache appears when the
// client has sent them all (CacheImporter::Finish). A failure ends the call at once, and the
// tokens taken so far are given back.
class ImportReader final : public grpc::ServerReadReactor<v1::CacheChunk> {
 public:
  ImportReader(std::atomic<int64_t>& open, CacheRegistry& caches, std::string owner,
               grpc::CallbackServerContext* context, v1::CacheInfo* response)
      : count_(open), importer_(caches, std::move(owner)), context_(context), response_(response) {
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    RunGuarded(
        [this, ok] {
          if (!ok && context_->IsCancelled()) {  // The client gave up: nothing is imported.
            Finish(grpc::Status(grpc::StatusCode::CANCELLED, "import cancelled by the client"));
            return;
          }
          if (!ok) {  // The client has sent every chunk.
            absl::StatusOr<CacheDescription> cache = importer_.Finish();
            if (cache.ok()) EncodeCacheInfo(*cache, response_);
            Finish(cache.ok() ? grpc::Status::OK : ToGrpcStatus(cache.status()));
            return;
          }
          if (absl::Status added = importer_.Add(chunk_, chunks_++); !added.ok()) {
            Finish(ToGrpcStatus(added));
            return;
          }
          StartRead(&chunk_);
        },
        [this](const absl::Status& status) { Finish(ToGrpcStatus(status)); });
  }
  void OnDone() override { delete this; }

 private:
  TransferCount count_;
  CacheImporter importer_;
  grpc::CallbackServerContext* context_;
  v1::CacheInfo* response_;
  v1::CacheChunk chunk_;
  int64_t chunks_ = 0;
};

class FailedImport final : public grpc::ServerReadReactor<v1::CacheChunk> {
 public:
  explicit FailedImport(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// The lengths of a call that keeps a prefix of a cache (TruncateCache's, ForkCache's): its
// expected_length when given (the cache's length before the call), then `length` when given (the
// prefix kept), against the cache's length_now (−1 before it is known: the signs alone).
absl::Status CheckPrefixLengths(std::optional<int64_t> expected_length,
                                std::optional<int64_t> length, const std::string& cache_id,
                                int64_t length_now) {
  if (expected_length) {
    if (absl::Status expected = CheckExpectedLength("", *expected_length, cache_id, length_now);
        !expected.ok()) {
      return expected;
    }
  }
  if (length) return CheckCutLength("", "length", *length, length_now);
  return absl::OkStatus();
}

template <class Request>
std::optional<int64_t> ExpectedLengthOf(const Request& request) {
  return request.has_expected_length() ? std::optional<int64_t>(request.expected_length())
                                       : std::nullopt;
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::CreateCache(grpc::CallbackServerContext* context,
                                                        const v1::CreateCacheRequest* request,
                                                        v1::CacheInfo* response) {
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return Failed(context, accepting);
  if (absl::Status device = CheckDevice(); !device.ok()) return Failed(context, device);
  const absl::StatusOr<KvLayout> layout = ParseCreateCache(*request);
  if (!layout.ok()) return Failed(context, layout.status());
  const absl::StatusOr<CacheDescription> cache = caches_.Create(CallerIdentity(*context), *layout);
  if (!cache.ok()) return Failed(context, cache.status());
  EncodeCacheInfo(*cache, response);
  return Finished(context);
}

absl::StatusOr<KvLayout> AttentionService::AdmitCacheChange(const std::string& owner,
                                                            const std::string& id) {
  absl::StatusOr<KvLayout> layout = caches_.LayoutOf(owner, id, "cache_id");
  if (!layout.ok()) return layout.status();
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return accepting;
  if (absl::Status device = CheckDevice(); !device.ok()) return device;
  return layout;
}

grpc::ServerUnaryReactor* AttentionService::AppendCache(grpc::CallbackServerContext* context,
                                                        const v1::AppendCacheRequest* request,
                                                        v1::CacheInfo* response) {
  const std::string owner = CallerIdentity(*context);
  const absl::StatusOr<KvLayout> layout = AdmitCacheChange(owner, request->cache_id());
  if (!layout.ok()) return Failed(context, layout.status());
  std::shared_ptr<const v1::AppendCacheRequest> resolved;  // Its shared-memory tensors' bytes.
  if (absl::Status shared = ResolveSharedMemory(owner, request, resolved); !shared.ok()) {
    return Failed(context, shared);
  }
  const absl::StatusOr<NewTokens> tokens =
      ParseNewTokens("", TensorOrNull(request->has_key(), request->key()),
                     TensorOrNull(request->has_value(), request->value()), *layout, false);
  if (!tokens.ok()) return Failed(context, tokens.status());
  if (absl::Status length = CheckExpectedLength("", request->expected_length(), "", -1);
      !length.ok()) {
    return Failed(context, length);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  // The copy into the cache's pages (and the pass over the tokens) is compute-queue work.
  auto run = [this, context, request, resolved, response, owner, layout = *layout, tokens = *tokens,
              fail, reactor] {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    double max_key, max_value;
    if (absl::Status values = CheckNewTokenValues("", tokens, layout, &max_key, &max_value);
        !values.ok()) {
      fail(values);
      return;
    }
    absl::StatusOr<CacheRegistry::Lease> lease =
        caches_.Acquire(owner, request->cache_id(), "cache_id");
    if (!lease.ok()) {
      fail(lease.status());
      return;
    }
    if (absl::Status length = CheckExpectedLength("", request->expected_length(),
                                                  request->cache_id(), lease->length());
        !length.ok()) {
      fail(length);
      return;
    }
    if (absl::Status appended =
            lease->Append(tokens.key, tokens.value, tokens.n, max_key, max_value);
        !appended.ok()) {
      fail(appended);
      return;
    }
    EncodeCacheInfo(lease->Describe(), response);
    lease->Commit();
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit(
      {.request_bytes = InflightBytes(*request, 0), .work = std::move(run), .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::TruncateCache(grpc::CallbackServerContext* context,
                                                          const v1::TruncateCacheRequest* request,
                                                          v1::CacheInfo* response) {
  const std::string owner = CallerIdentity(*context);
  if (const absl::StatusOr<KvLayout> layout = AdmitCacheChange(owner, request->cache_id());
      !layout.ok()) {
    return Failed(context, layout.status());
  }
  if (absl::Status lengths =
          CheckPrefixLengths(ExpectedLengthOf(*request), request->length(), "", -1);
      !lengths.ok()) {
    return Failed(context, lengths);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  // Freeing pages and, with --cache-dir, an fsync: compute-queue work, off gRPC's threads.
  auto run = [this, context, request, response, owner, fail, reactor] {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    absl::StatusOr<CacheRegistry::Lease> lease =
        caches_.Acquire(owner, request->cache_id(), "cache_id");
    if (!lease.ok()) {
      fail(lease.status());
      return;
    }
    if (absl::Status lengths = CheckPrefixLengths(ExpectedLengthOf(*request), request->length(),
                                                  request->cache_id(), lease->length());
        !lengths.ok()) {
      fail(lengths);
      return;
    }
    if (absl::Status cut = lease->Truncate(request->length()); !cut.ok()) {
      fail(cut);
      return;
    }
    lease->Commit();
    EncodeCacheInfo(lease->Describe(), response);
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit(
      {.request_bytes = InflightBytes(*request, 0), .work = std::move(run), .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::ForkCache(grpc::CallbackServerContext* context,
                                                      const v1::ForkCacheRequest* request,
                                                      v1::CacheInfo* response) {
  const std::string owner = CallerIdentity(*context);
  if (const absl::StatusOr<KvLayout> layout = AdmitCacheChange(owner, request->cache_id());
      !layout.ok()) {
    return Failed(context, layout.status());
  }
  const std::optional<int64_t> length =
      request->has_length() ? std::optional<int64_t>(request->length()) : std::nullopt;
  if (absl::Status lengths = CheckPrefixLengths(ExpectedLengthOf(*request), length, "", -1);
      !lengths.ok()) {
    return Failed(context, lengths);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); };
  // With --cache-dir the fork's file is written and fsynced: compute-queue work.
  auto run = [this, context, request, response, owner, length, fail, reactor] {
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    absl::StatusOr<CacheRegistry::Lease> source =
        caches_.Acquire(owner, request->cache_id(), "cache_id");
    if (!source.ok()) {
      fail(source.status());
      return;
    }
    if (absl::Status lengths = CheckPrefixLengths(ExpectedLengthOf(*request), length,
                                                  request->cache_id(), source->length());
        !lengths.ok()) {
      fail(lengths);
      return;
    }
    const absl::StatusOr<CacheDescription> fork =
        caches_.Fork(*source, length.value_or(source->length()));
    if (!fork.ok()) {
      fail(fork.status());
      return;
    }
    EncodeCacheInfo(*fork, response);
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit(
      {.request_bytes = InflightBytes(*request, 0), .work = std::move(run), .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::GetCacheInfo(grpc::CallbackServerContext* context,
                                                         const v1::GetCacheInfoRequest* request,
                                                         v1::CacheInfo* response) {
  const absl::StatusOr<CacheDescription> cache =
      caches_.Describe(CallerIdentity(*context), request->cache_id());
  if (!cache.ok()) return Failed(context, cache.status());
  EncodeCacheInfo(*cache, response);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::DeleteCache(grpc::CallbackServerContext* context,
                                                        const v1::DeleteCacheRequest* request,
                                                        v1::DeleteCacheResponse* /*response*/) {
  const absl::Status deleted = caches_.Delete(CallerIdentity(*context), request->cache_id());
  if (!deleted.ok()) return Failed(context, deleted);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::ListCaches(grpc::CallbackServerContext* context,
                                                       const v1::ListCachesRequest* /*request*/,
                                                       v1::ListCachesResponse* response) {
  for (const CacheDescription& cache : caches_.List(CallerIdentity(*context))) {
    EncodeCacheInfo(cache, response->add_caches());
  }
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::Decode(grpc::CallbackServerContext* context,
                                                   const v1::DecodeRequest* request,
                                                   v1::DecodeResponse* response) {
  Timeline timeline;
  if (absl::Status count = CheckDecodeItemCount(*request); !count.ok()) {
    return Failed(context, count);
  }
  const std::string owner = CallerIdentity(*context);
  std::shared_ptr<const v1::DecodeRequest> resolved;  // Its shared-memory tensors' bytes.
  if (absl::Status shared = ResolveSharedMemory(owner, request, resolved); !shared.ok()) {
    return Failed(context, shared);
  }
  // The caches first: one a draining server handed over answers where it went (moved_to).
  absl::StatusOr<DecodeBatch> batch = ParseDecodeRequest(
      *request,
      [&](const std::string& id, const std::string& field) {
        return caches_.LayoutOf(owner, id, field);
      },
      backend_.default_block_k(), config_.max_message_bytes);
  if (!batch.ok()) return Failed(context, batch.status());
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) return Failed(context, accepting);
  if (absl::Status device = CheckDevice(); !device.ok()) return Failed(context, device);
  const int64_t reply_bytes = batch->reply_bytes;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor, response](const absl::Status& status) {
    response->Clear();
    reactor->Finish(ToGrpcStatus(status));
  };
  timeline.handed_off = Clock::now();
  auto run = [this, context, request, resolved, response, owner, items = std::move(batch->items),
              timeline, fail, reactor]() mutable {
    timeline.started = Clock::now();
    if (absl::Status interrupted = Interruption(context); !interrupted.ok()) {
      fail(interrupted);
      return;
    }
    // Every input's elements before any cache is held or changed.
    std::vector<std::pair<double, double>> maxima(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      if (absl::Status values =
              CheckNewTokenValues(items[i].prefix, items[i].tokens, items[i].layout,
                                  &maxima[i].first, &maxima[i].second);
          !values.ok()) {
        fail(values);
        return;
      }
    }
    std::vector<std::string> ids, fields;
    for (size_t i = 0; i < items.size(); ++i) {
      ids.push_back(request->items(i).cache_id());
      fields.push_back(absl::StrCat(items[i].prefix, "cache_id"));
    }
    absl::StatusOr<CacheRegistry::LeaseGroup> acquired = caches_.AcquireAll(owner, ids, fields);
    if (!acquired.ok()) {
      fail(acquired.status());
      return;
    }
    CacheRegistry::LeaseGroup& leases = *acquired;
    for (size_t i = 0; i < items.size(); ++i) {
      if (absl::Status length =
              CheckExpectedLength(items[i].prefix, request->items(i).expected_length(),
                                  request->items(i).cache_id(), leases[i].length());
          !length.ok()) {
        fail(length);
        return;
      }
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].truncate_to.has_value()) continue;
      if (absl::Status cut = CheckDecodeCut(items[i].prefix, *items[i].truncate_to,
                                            leases[i].length(), items[i].layout);
          !cut.ok()) {
        fail(cut);
        return;
      }
    }
    // From here on a failure takes back every item's cut and tokens: all items or none.
    auto undo = [&](const absl::Status& status) {
      leases.Rollback();
      fail(status);
    };
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].truncate_to.has_value()) continue;
      if (absl::Status cut = leases[i].TruncateTentatively(*items[i].truncate_to); !cut.ok()) {
        undo(cut);
        return;
      }
    }
    for (size_t i = 0; i < items.size(); ++i) {
      const NewTokens& tokens = items[i].tokens;
      if (tokens.n == 0) continue;
      if (absl::Status appended = leases[i].Append(tokens.key, tokens.value, tokens.n,
                                                   maxima[i].first, maxima[i].second);
          !appended.ok()) {
        undo(appended);
        return;
      }
    }
    std::vector<Problem> problems;
    std::vector<Outputs> outputs;
    for (size_t i = 0; i < items.size(); ++i) {
      DecodeItemProblem& item = items[i];
      const CacheRegistry::Lease& lease = leases[i];
      if (absl::Status bound = BindCache(item.prefix, lease.pages(), lease.length(),
                                         lease.max_abs_key(), lease.max_abs_value(), &item.problem);
          !bound.ok()) {
        undo(bound);
        return;
      }
      if (!item.tree.empty()) item.problem.tree_ancestors = item.tree.data();
      problems.push_back(item.problem);
      Outputs out = PrepareOutputs(item.problem, request->items(i).query(), response->add_outputs(),
                                   item.problem.return_lse ? response->add_lse() : nullptr);
      out.interrupt = [context] { return Interruption(context); };
      outputs.push_back(std::move(out));
    }
    timeline.computing = Clock::now();
    absl::StatusOr<Stats> stats = backend_.Decode(problems, outputs);
    timeline.computed = Clock::now();
    if (!stats.ok()) {
      undo(stats.status());
      return;
    }
    std::vector<SharedMemoryRegistry::OutputWrite> writes;
    for (int i = 0; i < request->items_size(); ++i) {
      if (!request->items(i).has_output_to()) continue;
      writes.push_back({&request->items(i).output_to(), absl::StrCat("items[", i, "].output_to"),
                        response->mutable_outputs(i)});
    }
    if (!writes.empty()) {
      if (absl::Status written = shared_memory_.WriteOutputs(owner, writes); !written.ok()) {
        undo(written);
        return;
      }
    }
    for (size_t i = 0; i < leases.size(); ++i) {
      if (absl::Status persisted = leases[i].PersistCut(); !persisted.ok()) {
        undo(persisted);
        return;
      }
    }
    leases.Commit();
    for (size_t i = 0; i < leases.size(); ++i) {
      EncodeCacheInfo(leases[i].Describe(), response->add_caches());
    }
    FillStats(backend_, *stats, timeline, response->mutable_stats());
    reactor->Finish(grpc::Status::OK);
  };
  absl::Status accepted = queue_.Submit({.request_bytes = InflightBytes(*request, reply_bytes),
                                         .work = std::move(run),
                                         .refuse = fail});
  if (!accepted.ok()) fail(accepted);
  return reactor;
}

grpc::ServerWriteReactor<v1::CacheChunk>* AttentionService::ExportCache(
    grpc::CallbackServerContext* context, const v1::ExportCacheRequest* request) {
  absl::StatusOr<CacheExporter> exporter =
      CacheExporter::Start(caches_, CallerIdentity(*context), request->cache_id(), "cache_id");
  if (!exporter.ok()) return new FailedExport(exporter.status());
  return new ExportWriter(open_transfers_, *std::move(exporter));
}

grpc::ServerReadReactor<v1::CacheChunk>* AttentionService::ImportCache(
    grpc::CallbackServerContext* context, v1::CacheInfo* response) {
  if (absl::Status accepting = CheckAccepting(); !accepting.ok()) {
    return new FailedImport(accepting);
  }
  if (absl::Status device = CheckDevice(); !device.ok()) return new FailedImport(device);
  return new ImportReader(open_transfers_, caches_, CallerIdentity(*context), context, response);
}

}  // namespace attn
