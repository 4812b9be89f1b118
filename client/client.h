// attn client library: a thin, typed wrapper over the attention.v1 stub.
//
// Converts between host arrays (fp32 values with a shape) and wire Tensors, raises gRPC's
// message limits to the server's default, and reports every failure as an absl::Status whose
// code is the RPC's and whose message is the server's. A Client is thread-safe (the channel
// and stub are); each call may carry a deadline.
//
// Server-resident KV caches: Client has one method per cache RPC (CreateCache, AppendCache,
// TruncateCache, ForkCache, GetCacheInfo, DeleteCache, ListCaches, Decode, ExportCache,
// ImportCache); Naive, Tiled and Trace attend over a cache when their request names one
// (AttentionRequest.cache_id, see CacheRequest). `Cache` keeps a cache's id and the length the
// client believes it has, sending it as expected_length on every append, cut and decode and
// taking the server's answer as the new length (and on a fork, whose answer is a new Cache);
// it also keeps the tokens the server has not yet made durable and sends them again when a
// restarted server lost them, and follows a cache that a draining server moved (moved_to).
// CopyCache and MoveCache stream a cache from one server to another; the export file helpers
// keep one in a file (`attn cache export`).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"

namespace attn::client {

// A dense host tensor: row-major fp32 values and their shape.
struct Array {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Encodes an array as a wire Tensor in `dtype` (fp16/bf16 rounded to nearest even; an
// unspecified or unknown dtype encodes as fp32).
attention::v1::Tensor ToTensor(const Array& array,
                               attention::v1::DType dtype = attention::v1::DTYPE_FLOAT32);

// Decodes a wire Tensor to fp32. INVALID_ARGUMENT when its dtype is unknown or its data
// length does not match its shape.
absl::StatusOr<Array> FromTensor(const attention::v1::Tensor& tensor);

// gRPC's load-balancing policy for a channel with several addresses: pick_first sends every call
// to one server (the first that connects), round_robin spreads calls over all ready servers.
enum class LoadBalancing { kPickFirst, kRoundRobin };

// "pick_first" / "round_robin" (also "pick-first", "round-robin"); INVALID_ARGUMENT otherwise.
absl::StatusOr<LoadBalancing> ParseLoadBalancing(absl::string_view name);

// Splits a target into its endpoints: "h1:p1,h2:p2" gives both; one address or a URI
// ("dns:///name:port", "ipv4:...") gives itself. Empty parts are dropped.
std::vector<std::string> SplitEndpoints(const std::string& target);

// The gRPC channel target for `target`: a single address or URI as is; a comma-separated list of
// numeric endpoints as "ipv4:h1:p1,h2:p2" (or "ipv6:[h1]:p1,..."; "localhost" counts as
// 127.0.0.1). INVALID_ARGUMENT for a list with a host name in it (use dns:/// for names).
absl::StatusOr<std::string> ChannelTarget(const std::string& target);

struct ClientOptions {
  int max_message_bytes = 1 << 30;  // Matches attnd's default --max-message-bytes.
  // Applied through the channel's service config; matters when the target names several servers
  // (a list, or a dns:/// name with several addresses, e.g. a Kubernetes headless Service).
  LoadBalancing load_balancing = LoadBalancing::kPickFirst;
  std::optional<std::chrono::milliseconds> timeout;  // Per-call deadline; none by default.
  // TLS, with PEM *contents* (not paths): tls_ca, the CA bundle the server's certificate must
  // chain to (empty = plaintext); tls_cert and tls_key, both or neither, a client certificate
  // for servers that require one (attnd --tls-client-ca).
  std::string tls_ca{};
  std::string tls_cert{};
  std::string tls_key{};
  // Sent as "authorization: Bearer <token>" on every call (empty = none); attnd started with
  // --auth-token-file requires it on every call but Health. Over plaintext anyone on the path
  // can read it: use TLS beyond loopback.
  std::string token{};
};

class ExportStream;

class Client {
 public:
  // Connects lazily: the first call dials `target` (e.g. "127.0.0.1:50051", a list
  // "127.0.0.1:50051,127.0.0.1:50052" or "dns:///attnd-headless:50051"; see ChannelTarget: a
  // list it refuses is dialled as given, and calls then fail UNAVAILABLE).
  explicit Client(const std::string& target, ClientOptions options = {});

  absl::StatusOr<attention::v1::AttentionResponse> Naive(
      const attention::v1::AttentionRequest& request);
  absl::StatusOr<attention::v1::AttentionResponse> Tiled(
      const attention::v1::AttentionRequest& request);
  absl::StatusOr<attention::v1::ServerInfo> Info();

  // Streams a trace, calling on_event for each event in order; on_event returning false
  // cancels the stream (the call then returns OK). Returns the stream's final status.
  absl::Status Trace(const attention::v1::TraceRequest& request,
                     const std::function<bool(const attention::v1::TraceEvent&)>& on_event);

  // grpc.health.v1 Check for `service` ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  // KV caches (attention.proto documents each RPC's errors: NOT_FOUND for an unknown, deleted
  // or expired cache, FAILED_PRECONDITION for a stale expected_length, RESOURCE_EXHAUSTED over
  // the server's --cache-bytes).
  absl::StatusOr<attention::v1::CacheInfo> CreateCache(
      const attention::v1::CreateCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> AppendCache(
      const attention::v1::AppendCacheRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> GetCacheInfo(const std::string& cache_id);
  absl::Status DeleteCache(const std::string& cache_id);
  absl::StatusOr<attention::v1::ListCachesResponse> ListCaches();
  absl::StatusOr<attention::v1::DecodeResponse> Decode(const attention::v1::DecodeRequest& request);
  absl::StatusOr<attention::v1::CacheInfo> TruncateCache(
      const attention::v1::TruncateCacheRequest& request);
  // A new cache holding the first `length` tokens (absent: all) of request.cache_id's, sharing
  // its pages; the answer is the fork's info (OUT_OF_RANGE naming length past the source's,
  // RESOURCE_EXHAUSTED at --max-caches).
  absl::StatusOr<attention::v1::CacheInfo> ForkCache(
      const attention::v1::ForkCacheRequest& request);

  // Shared memory (attnd --allow-shared-memory; attention.proto): a byte range of a file in
  // /dev/shm registered under a name, which a Tensor then names instead of carrying its bytes
  // (SharedTensor below) and an output_to names to receive an output. For a caller on the
  // server's machine, over loopback or a Unix socket ("unix:/path").
  absl::StatusOr<attention::v1::SharedMemoryRegion> RegisterSharedMemory(
      const attention::v1::RegisterSharedMemoryRequest& request);
  // Empty name: every region of this caller. The names unregistered.
  absl::StatusOr<std::vector<std::string>> UnregisterSharedMemory(const std::string& name = "");
  absl::StatusOr<attention::v1::SharedMemoryStatusResponse> SharedMemoryStatus(
      const std::string& name = "");

  // ExportCache's stream, calling on_chunk for each chunk in order (attention.proto: the first
  // carries info, the last crc32c). on_chunk returning false cancels the stream; the call then
  // returns CANCELLED. Otherwise returns the stream's status.
  absl::Status ExportCache(const std::string& cache_id,
                           const std::function<bool(const attention::v1::CacheChunk&)>& on_chunk);
  // The same stream read one chunk at a time (OpenExport(id)->Next(&chunk)), for a caller that
  // pulls, e.g. an ImportCache on another server. The Client must outlive it.
  std::unique_ptr<ExportStream> OpenExport(const std::string& cache_id);
  // ImportCache: calls next for each chunk to send (it fills the cleared chunk and returns true,
  // or false when none is left) and returns the server's answer. An error from next cancels the
  // call, so nothing is imported, and is returned as is.
  absl::StatusOr<attention::v1::CacheInfo> ImportCache(
      const std::function<absl::StatusOr<bool>(attention::v1::CacheChunk*)>& next);

  // What this client was made with: a client for another server of the same deployment (a
  // cache's moved_to) is made with them.
  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }

 private:
  friend class ExportStream;
  void Prepare(grpc::ClientContext* context) const;
  // One unary call of `method` on `stub`, prepared as above (deadline, token).
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Unary(Stub& stub,
                                 grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                              Response*),
                                 const Request& request) const;

  std::string target_;
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<attention::v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// One ExportCache stream, read by the caller (Client::OpenExport). Cancels the stream when
// destroyed before its end. Not thread-safe.
class ExportStream {
 public:
  ~ExportStream();
  ExportStream(const ExportStream&) = delete;
  ExportStream& operator=(const ExportStream&) = delete;

  // The next chunk into *chunk; false after the last one (the stream ended OK); the stream's
  // error otherwise (then and after the end, every later call answers the same).
  absl::StatusOr<bool> Next(attention::v1::CacheChunk* chunk);

 private:
  friend class Client;
  ExportStream(Client& client, const std::string& cache_id);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<attention::v1::CacheChunk>> reader_;
  std::optional<absl::Status> finished_;  // Set once the stream has ended.
};

// The server a NOT_FOUND names when the cache was moved there by a draining server: the
// message's "moved_to=HOST:PORT" (attention.proto); nullopt for any other status.
std::optional<std::string> MovedTo(const absl::Status& status);

// Copies cache `id` from `from` to `to`, streaming the export's chunks straight into the
// import (one chunk at a time, never the whole cache in memory), then checks the target's answer:
// its length must be the export's info.length and its crc32c the export's (the CRC32C of the
// chunks' key and value data, computed here too and compared with the export's last chunk). The
// target keeps the id when it is free there, else ALREADY_EXISTS, or a new id with new_id_if_taken.
// DATA_LOSS on any mismatch (the target's copy is then deleted). Returns the target's answer.
// Errors name the side ("export from T: ...", "import into T: ...") and keep the server's message.
absl::StatusOr<attention::v1::CacheInfo> CopyCache(Client& from, Client& to, const std::string& id,
                                                   bool new_id_if_taken);
// CopyCache, then DeleteCache on `from`: the source is deleted only once the copy checked out.
absl::StatusOr<attention::v1::CacheInfo> MoveCache(Client& from, Client& to, const std::string& id,
                                                   bool new_id_if_taken);

// The file `attn cache export` writes: kExportFileMagic, then for each CacheChunk of the
// export, in order, its serialized size as a little-endian u32 and the serialized message.
inline constexpr absl::string_view kExportFileMagic = "ATTNEXP1";

// Writes an export file chunk by chunk. Not thread-safe.
class ExportFileWriter {
 public:
  // Creates (or truncates) `path` and writes the magic.
  static absl::StatusOr<ExportFileWriter> Create(const std::string& path);
  ExportFileWriter(ExportFileWriter&& other) noexcept;
  ExportFileWriter& operator=(ExportFileWriter&&) = delete;
  ~ExportFileWriter();  // Closes the file if Close was not called (errors then go unreported).

  absl::Status Write(const attention::v1::CacheChunk& chunk);
  // Flushes and closes the file; the first error of any write or of the close.
  absl::Status Close();

 private:
  ExportFileWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
};

// Reads an export file chunk by chunk and checks it as it goes: DATA_LOSS naming the file for a
// wrong magic, a record cut short or that does not parse, a file that ends before the chunk
// carrying crc32c (cut at a record boundary) or goes on after it, and tokens whose CRC32C is
// not the one the last chunk states. Not thread-safe.
class ExportFileReader {
 public:
  // Opens `path` and checks the magic.
  static absl::StatusOr<ExportFileReader> Open(const std::string& path);
  ExportFileReader(ExportFileReader&& other) noexcept;
  ExportFileReader& operator=(ExportFileReader&&) = delete;
  ~ExportFileReader();

  // The next chunk into *chunk (cleared first); false after the last.
  absl::StatusOr<bool> Next(attention::v1::CacheChunk* chunk);

 private:
  ExportFileReader(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
  int64_t records_ = 0;  // Records read.
  int64_t offset_ = 8;   // Of the next record, in bytes.
  uint32_t crc_ = 0;     // Of the tokens read so far.
  bool ended_ = false;   // The chunk carrying crc32c has been read.
};

// The export of cache `id` from `client` into the file `path` (removed again on any failure).
// Returns the first chunk's info with crc32c set to the export's.
absl::StatusOr<attention::v1::CacheInfo> ExportCacheToFile(Client& client, const std::string& id,
                                                           const std::string& path);
// A cache on `client` from the export file `path` (new_id_if_taken as for CopyCache), its
// answer checked as CopyCache checks one. Returns the server's answer.
absl::StatusOr<attention::v1::CacheInfo> ImportCacheFromFile(Client& client,
                                                             const std::string& path,
                                                             bool new_id_if_taken);

// The standard ALiBi slopes for `heads` query heads (Press et al.; BLOOM's): for a power of two
// n, head h's slope is 2^(−8(h+1)/n); otherwise the n = 2^⌊log₂ heads⌋ slopes, then every other
// one of the 2n slopes (2^(−4(2i+1)/n), i = 0, 1, …) for the heads past n.
std::vector<float> StandardAlibiSlopes(int64_t heads);

// A Naive/Tiled request (or a TraceRequest's attention) over a cache's keys: `query`
// [heads, query_len, head_dim] (rank 2 or 3), no inline key or value.
attention::v1::AttentionRequest CacheRequest(const std::string& cache_id,
                                             const attention::v1::Tensor& query,
                                             const attention::v1::AttentionOptions& options = {});

// One cache as this client sees it: its id and the length it believes the cache has. Append and
// Decode send that length as expected_length and take the length of the server's answer, so a
// retried call is refused (FAILED_PRECONDITION) rather than storing tokens twice; after such a
// refusal, Refresh() re-reads the length.
//
// A latent cache (CreateCacheRequest.values_from_keys: MLA, as DeepSeek-V3 decodes) stores keys
// only, each token's value being the first value_dim columns of its key: Append(key) and
// Decode(query, &key) send the key alone, and a value given for one is refused before any RPC
// (INVALID_ARGUMENT naming "value"); its replay tail keeps keys only. values_from_keys() says
// which kind this Cache is (the server's CacheInfo).
//
// Recovery (the protocol the Python and Node clients follow too):
// - Replay tail. Every token sent through Append, Decode or Update(info, item) is kept, as sent,
//   until the server says it is durable: each answer drops the kept appends that end at or
//   before its durable_length, and an answer without durable_length (a server without
//   --cache-dir) drops them all. So the tail holds about the last --cache-sync-seconds of
//   appends.
// - Refresh() after a restart: when the server holds L tokens, fewer than length(), and the tail
//   reaches back to L, it sends tokens [L, length()) again (the kept append that straddles L
//   sliced along its token axis) in appends of at most kReplayAppendBytes, and returns the
//   answer; when the tail does not reach back, DATA_LOSS (the sequence must be prefilled again)
//   and the Cache is left as it was.
// - moved_to: when Append, Decode, Refresh or Delete fails NOT_FOUND naming moved_to=HOST:PORT
//   (MovedTo), the Cache makes a Client for HOST:PORT with the first one's options, keeps it,
//   and retries the call there once (a second moved_to in a row is returned as the error).
// - Cuts (Truncate, Decode's truncate_to, Update(info, item)) cut the kept tail too: the kept
//   appends at or past the cut are dropped and the one that straddles it is sliced, so a Refresh
//   never sends a cut token back. A call carrying a cut that fails without the server refusing
//   it (any code but IsRefusal's: UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, CANCELLED, ...; the
//   cut may have been applied, its answer lost) cuts the tail all the same and keeps length():
//   the next Refresh sends tokens only up to the lowest such cut C, i.e. when the server holds
//   at least C tokens it takes the server's info as it is (nothing sent), and when it holds L < C
//   it sends [L, C) again. A refusal applied nothing and leaves the Cache as it was. For a
//   batched Client::Decode that failed, CallFailed(status, item) applies the same rule.
//
// Not thread-safe (one sequence, one writer). The Client it was made with must outlive it (a
// Client it made for a moved_to lives as long as the last copy). Copies are cheap: they share
// the Clients and the kept tokens (immutable), and go their own ways from then on.
class Cache {
 public:
  // Bytes of key and value data a Refresh re-sends per AppendCache, at most (one token at
  // least): well under attnd's default --max-message-bytes (1 GiB).
  static constexpr int64_t kReplayAppendBytes = int64_t{8} << 20;

  // A new, empty cache on `client`.
  static absl::StatusOr<Cache> Create(Client& client,
                                      const attention::v1::CreateCacheRequest& request);
  // An existing cache (e.g. from ListCaches or GetCacheInfo), believed to have info.length();
  // no tokens kept.
  Cache(Client& client, attention::v1::CacheInfo info) : client_(&client), info_(std::move(info)) {}

  const std::string& id() const { return info_.cache_id(); }
  int64_t length() const { return info_.length(); }
  // The last CacheInfo the server sent for this cache.
  const attention::v1::CacheInfo& info() const { return info_; }
  // A latent cache: values are the first value_dim columns of the keys (CacheInfo).
  bool values_from_keys() const { return info_.values_from_keys(); }
  // The Client this Cache calls now (another than the first after following a moved_to).
  Client& client() const { return *client_; }
  // The first token of the kept tail: a Refresh can recover a server that holds at least this
  // many tokens. length() when nothing is kept.
  int64_t kept_from() const;

  // Appends key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] at length().
  // INVALID_ARGUMENT naming "value", before any RPC, for a latent cache (values_from_keys).
  absl::StatusOr<attention::v1::CacheInfo> Append(const attention::v1::Tensor& key,
                                                  const attention::v1::Tensor& value);
  // A latent cache's append: key [kv_heads, n, head_dim] alone at length(), each token's value
  // being the first value_dim columns of its key. INVALID_ARGUMENT naming "value", before any
  // RPC, for a cache that stores values (not values_from_keys).
  absl::StatusOr<attention::v1::CacheInfo> Append(const attention::v1::Tensor& key);
  // Cuts the cache to its first `length` tokens (TruncateCache, expected_length = length()): the
  // kept tail loses what lies past the cut, so a Refresh never sends cut tokens again. A failure
  // that is not a refusal (IsRefusal) cuts the tail too and bounds the next Refresh (above).
  absl::StatusOr<attention::v1::CacheInfo> Truncate(int64_t length);
  // Forks the cache (ForkCache, expected_length = length()): a new cache on the same server
  // whose tokens are this one's first `length` (nullopt: all), sharing its pages (parallel
  // sampling, beam search, a shared prompt); afterwards each changes alone. Returns a Cache for
  // the fork that calls the Client this one calls now and keeps nothing to replay: with
  // --cache-dir the server made all the fork's tokens durable before it answered
  // (durable_length = length). This Cache is left as it was (but for following a moved_to).
  // Refusals are the RPC's, and create nothing: FAILED_PRECONDITION when length() is stale (a
  // restart lost tokens: Refresh first), OUT_OF_RANGE naming length past length(),
  // INVALID_ARGUMENT naming a negative one, RESOURCE_EXHAUSTED at --max-caches. A fork whose
  // answer was lost (a failure that is not IsRefusal's) may exist all the same: ListCaches
  // shows it.
  absl::StatusOr<Cache> Fork(std::optional<int64_t> length = std::nullopt);
  // One Decode of this cache alone: cuts it to truncate_to first when given (speculative
  // decoding's rejected drafts; a failure that is not a refusal as for Truncate), appends
  // key/value when given (nullptr: none), then attends `query` [heads, nq, head_dim] over the
  // whole cache. A latent cache takes the key alone: a value given for it is INVALID_ARGUMENT
  // naming "value", before any RPC. tree_parents (empty: none) makes the new tokens a token tree
  // (EAGLE, Medusa; attention.proto, DecodeItem.tree_parents): entry i is new token i's parent
  // among the new tokens (−1: a child of the cached prefix; else earlier, 0 ≤ parent < i);
  // `query` then has one row per new token, and row i sees the cached prefix, token i's
  // ancestors and itself. Sent as given: the server names items[0].tree_parents,
  // items[0].tree_parents[j] or items[0].query (INVALID_ARGUMENT) when it does not fit.
  // E.g. t0 → {a, b}, a → {c}: Decode(query, &key, &value, options, std::nullopt, {-1, 0, 0, 1}).
  absl::StatusOr<attention::v1::DecodeResponse> Decode(
      const attention::v1::Tensor& query, const attention::v1::Tensor* key = nullptr,
      const attention::v1::Tensor* value = nullptr,
      const attention::v1::AttentionOptions& options = {},
      std::optional<int64_t> truncate_to = std::nullopt,
      absl::Span<const int32_t> tree_parents = {});
  // The DecodeItem for this cache in a batched Client::Decode, with expected_length = length(),
  // truncate_to and tree_parents as for Decode, key and value as given (a value for a latent
  // cache is the server's to refuse: INVALID_ARGUMENT naming items[i].value). After the call
  // succeeds, pass Update the response's caches[i] for this item and the item; after it fails,
  // pass CallFailed the status and the item.
  attention::v1::DecodeItem Item(const attention::v1::Tensor& query,
                                 const attention::v1::Tensor* key = nullptr,
                                 const attention::v1::Tensor* value = nullptr,
                                 std::optional<int64_t> truncate_to = std::nullopt,
                                 absl::Span<const int32_t> tree_parents = {}) const;
  // Takes `info` (the server's answer naming this cache) as what the cache now holds. With the
  // `item` that produced it, its cut (truncate_to) applies to the kept tail and its key and
  // value join it; without, a length that moved drops the tail (its tokens are not known here).
  void Update(const attention::v1::CacheInfo& info);
  void Update(const attention::v1::CacheInfo& info, const attention::v1::DecodeItem& item);
  // A batched Client::Decode carrying this Cache's `item` failed with `status`: when the item
  // has a cut and the status is not a refusal (IsRefusal), the cut may have been applied, so the
  // kept tail is cut and the next Refresh bounded by it (above); otherwise nothing changes.
  void CallFailed(const absl::Status& status, const attention::v1::DecodeItem& item);
  // Whether a failed call's `status` is the server refusing it, nothing of it applied:
  // INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE, NOT_FOUND, ALREADY_EXISTS,
  // PERMISSION_DENIED, UNAUTHENTICATED, UNIMPLEMENTED. Any other failure may have been applied.
  static bool IsRefusal(const absl::Status& status);
  // The lowest cut a failed call may have applied (a Refresh sends nothing past it); nullopt
  // when none is pending (every answer from the server clears it).
  std::optional<int64_t> unsure_cut() const { return unsure_cut_; }
  // Re-reads the cache's info from the server, re-sending the tokens it lost (above).
  absl::StatusOr<attention::v1::CacheInfo> Refresh();
  // Deletes the cache on the server.
  absl::Status Delete();
  // Calls `client` from now on, keeping the id, length and kept tokens: e.g. the server came
  // back at another address, or from a copy of its --cache-dir. The Client must outlive this.
  void Rebind(Client& client);

 private:
  // One append as sent: tokens [start, start + tokens); a latent cache's has no value.
  struct Sent {
    int64_t start;
    int64_t tokens;
    attention::v1::Tensor key;
    attention::v1::Tensor value;
  };
  // Takes the server's answer `info` to a call that appended key and value (key null: none;
  // value null: a latent cache's keys alone) at length(): keeps them unless durable, keeps the
  // tail contiguous up to the new length, and drops what info says is durable.
  void Adopt(const attention::v1::CacheInfo& info, const attention::v1::Tensor* key,
             const attention::v1::Tensor* value);
  // A cut to `length` tokens that the server made: the kept tail loses what lies past it (the
  // append that straddles it sliced), and length() becomes `length`.
  void Cut(int64_t length);
  // The kept tail's part of Cut, length() unchanged.
  void CutTail(int64_t length);
  // A call cutting to `length` failed with `status` (see CallFailed).
  void CutFailed(int64_t length, const absl::Status& status);
  // Tokens [begin, end) of the kept tail's keys (or values) as one [kv_heads, n, dim] tensor
  // in the dtype they were sent in (one dtype: end ≤ SameDTypeEnd(begin)); an empty Tensor for
  // a latent cache's values (none kept).
  attention::v1::Tensor Gather(bool keys, int64_t begin, int64_t end) const;
  // The end of the kept tokens from `begin` on that were sent in the dtype token `begin` was:
  // an fp8 cache takes tokens of any dtype, so its tail may hold several.
  int64_t SameDTypeEnd(int64_t begin) const;
  // OK, or INVALID_ARGUMENT naming "value" when a value is given (`has_value`) for a latent
  // cache or none for one that stores values.
  absl::Status CheckValue(bool has_value) const;
  // call(client()), and once more on the moved_to server's Client when it fails naming one.
  template <typename Call>
  auto FollowingMoves(const Call& call) -> decltype(call(std::declval<Client&>()));

  Client* client_;
  std::shared_ptr<Client> moved_client_;  // The Client made for a moved_to, when one was.
  attention::v1::CacheInfo info_;
  // Contiguous, ending at length(); or, while a cut is unsure, at or before it.
  std::deque<std::shared_ptr<const Sent>> tail_;
  std::optional<int64_t> unsure_cut_;  // See unsure_cut().
};

}  // namespace attn::client
