// Server-resident KV caches end to end (issue 13): an attnd service on loopback with the CPU
// backend, called through the raw attention.v1 stub. Every answer is checked against the
// float64 reference on the same (rounded) tokens; every refused call must leave its cache
// exactly as it was. The registry's ownership, idle expiry and budget accounting are checked on
// the registry itself.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "server/caches.h"
#include "server/request.h"
#include "server/service.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using testing::HostProblem;

v1::Tensor ToTensor(std::vector<int64_t> shape, const uint8_t* bytes, size_t size, DType dtype) {
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_dtype(ToProtoDType(dtype));
  tensor.set_data(bytes, size);
  return tensor;
}

// Tokens [begin, end) of a [heads, len, width] tensor in `dtype`, as a [heads, end − begin,
// width] tensor.
v1::Tensor Tokens(const std::vector<uint8_t>& bytes, DType dtype, int64_t heads, int64_t len,
                  int64_t width, int64_t begin, int64_t end) {
  const int64_t element = ElementSize(dtype);
  std::vector<uint8_t> slice;
  for (int64_t h = 0; h < heads; ++h) {
    const uint8_t* first = bytes.data() + (h * len + begin) * width * element;
    slice.insert(slice.end(), first, first + (end - begin) * width * element);
  }
  return ToTensor({heads, end - begin, width}, slice.data(), slice.size(), dtype);
}

// `full` with only its first `length` keys and values: the problem a cache of that length poses.
HostProblem Prefix(const HostProblem& full, int64_t length) {
  return testing::KeyPrefix(full, length);
}

std::vector<float> Floats(const v1::Tensor& tensor) {
  const std::optional<DType> dtype = FromProtoDType(tensor.dtype());
  EXPECT_TRUE(dtype.has_value());
  return testing::Decode(tensor.data().data(), *dtype,
                         static_cast<int64_t>(tensor.data().size()) / ElementSize(*dtype));
}

// fp32 outputs of (rounded) inputs: the fp32 bound, whatever the storage dtype.
void ExpectMatches(const v1::Tensor& output, const HostProblem& problem) {
  const testing::Reference ref = testing::ReferenceAttention(problem);
  EXPECT_LE(testing::MaxAbsError(Floats(output), ref.output),
            1e-5 * std::max(1.0, testing::MaxAbs(ref.output)));
}

class CacheServiceTest : public ::testing::Test {
 public:  // The bad-call table's lambdas call these.
  void StartServer(int64_t cache_bytes = int64_t{256} << 20, int64_t max_naive_bytes = 0,
                   int64_t page_tokens = CpuBackend::kDefaultKvPageTokens) {
    backend_ = std::make_unique<CpuBackend>(2, max_naive_bytes,
                                            CpuBackend::kDefaultMaxPackedHeadBytes, page_tokens);
    ServiceConfig config;
    config.caches = {.budget_bytes = cache_bytes, .idle_seconds = 0};
    service_ = std::make_unique<AttentionService>(*backend_, config);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(1 << 30);
    builder.SetMaxSendMessageSize(1 << 30);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                              grpc::InsecureChannelCredentials()));
  }
  void SetUp() override { StartServer(); }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  template <class Request, class Response>
  grpc::Status Call(grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return (stub_.get()->*method)(&context, request, response);
  }

  v1::CacheInfo Create(const Shape& s, DType dtype) {
    v1::CreateCacheRequest request;
    request.set_kv_heads(s.kv_heads);
    request.set_head_dim(s.head_dim);
    request.set_value_dim(s.value_dim);
    request.set_dtype(ToProtoDType(dtype));
    v1::CacheInfo info;
    const grpc::Status status = Call(&v1::AttentionService::Stub::CreateCache, request, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info;
  }

  // Appends tokens [begin, end) of p's keys and values.
  grpc::Status Append(const std::string& id, const HostProblem& p, int64_t begin, int64_t end,
                      int64_t expected_length, v1::CacheInfo* info) {
    const Shape& s = p.shape;
    v1::AppendCacheRequest request;
    request.set_cache_id(id);
    *request.mutable_key() =
        Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, begin, end);
    *request.mutable_value() =
        Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, begin, end);
    request.set_expected_length(expected_length);
    return Call(&v1::AttentionService::Stub::AppendCache, request, info);
  }

  // A cache holding all of p's keys, appended in two chunks.
  std::string Filled(const HostProblem& p) {
    const v1::CacheInfo created = Create(p.shape, p.dtype);
    v1::CacheInfo info;
    const int64_t half = p.shape.key_len / 2;
    EXPECT_TRUE(Append(created.cache_id(), p, 0, half, 0, &info).ok());
    EXPECT_TRUE(Append(created.cache_id(), p, half, p.shape.key_len, half, &info).ok());
    EXPECT_EQ(info.length(), p.shape.key_len);
    return created.cache_id();
  }

  // An attention request on p's query (rank 3, fp32 output) over cache `id`.
  v1::AttentionRequest OverCache(const HostProblem& p, const std::string& id) {
    const Shape& s = p.shape;
    v1::AttentionRequest request;
    *request.mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                        p.query_bytes.size(), p.dtype);
    request.mutable_options()->set_causal(p.causal);
    request.mutable_options()->set_block_k(p.block_k);
    request.mutable_options()->set_return_lse(true);
    request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
    request.mutable_options()->set_key_position(p.key_position);
    if (p.query_position) request.mutable_options()->set_query_position(*p.query_position);
    request.set_cache_id(id);
    return request;
  }

  // The RowDone output of a trace of one row (query head `head`, row `row`) of `request`; empty
  // when the stream gave none (and a failure when it ended with an error).
  std::vector<float> TracedRow(const v1::AttentionRequest& request, int64_t head, int64_t row) {
    v1::TraceRequest trace;
    *trace.mutable_attention() = request;
    trace.add_rows()->set_head(head);
    trace.mutable_rows(0)->set_row(row);
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader = stub_->Trace(&context, trace);
    v1::TraceEvent event;
    std::vector<float> traced;
    while (reader->Read(&event)) {
      if (event.has_row_done()) {
        traced.assign(event.row_done().output().begin(), event.row_done().output().end());
      }
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() ? traced : std::vector<float>();
  }

  int64_t LengthOf(const std::string& id) {
    v1::GetCacheInfoRequest request;
    request.set_cache_id(id);
    v1::CacheInfo info;
    const grpc::Status status = Call(&v1::AttentionService::Stub::GetCacheInfo, request, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.length();
  }

  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

HostProblem RandomCacheProblem(int64_t query_len, int64_t key_len, DType dtype, bool causal,
                               uint64_t seed) {
  return testing::RandomProblem(testing::MakeShape(1, 8, 2, query_len, key_len, 33, 17), dtype,
                                causal, 37, seed);
}

TEST_F(CacheServiceTest, NaiveTiledAndTraceOverACacheMatchTheReferenceAndStatelessTiled) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const HostProblem p = RandomCacheProblem(5, 601, dtype, /*causal=*/true, 41);
    const std::string id = Filled(p);
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;

    const v1::AttentionRequest request = OverCache(p, id);
    v1::AttentionResponse naive, tiled, stateless;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Naive, request, &naive).ok());
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, request, &tiled).ok());
    ExpectMatches(naive.output(), p);
    ExpectMatches(tiled.output(), p);
    EXPECT_EQ(tiled.output().shape_size(), 3);
    EXPECT_EQ(tiled.stats().block_k(), 37);

    // The same keys sent inline.
    v1::AttentionRequest inline_request = request;
    inline_request.clear_cache_id();
    const Shape& s = p.shape;
    *inline_request.mutable_key() =
        Tokens(p.key_bytes, dtype, s.kv_heads, s.key_len, s.head_dim, 0, s.key_len);
    *inline_request.mutable_value() =
        Tokens(p.value_bytes, dtype, s.kv_heads, s.key_len, s.value_dim, 0, s.key_len);
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, inline_request, &stateless).ok());
    const std::vector<float> over_cache = Floats(tiled.output()),
                             inline_out = Floats(stateless.output());
    ASSERT_EQ(over_cache.size(), inline_out.size());
    for (size_t i = 0; i < over_cache.size(); ++i) {
      EXPECT_NEAR(over_cache[i], inline_out[i], 1e-5 * std::max(1.f, std::abs(inline_out[i]))) << i;
    }

    // A trace of row 4 of head 7: its RowDone is the reference's row.
    v1::TraceRequest trace;
    *trace.mutable_attention() = request;
    v1::RowRef* row = trace.add_rows();
    row->set_head(7);
    row->set_row(4);
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader = stub_->Trace(&context, trace);
    v1::TraceEvent event;
    int steps = 0;
    std::vector<float> traced;
    while (reader->Read(&event)) {
      if (event.has_start()) {
        EXPECT_EQ(event.start().key_len(), s.key_len);
      }
      if (event.has_step()) ++steps;
      if (event.has_row_done()) {
        traced.assign(event.row_done().output().begin(), event.row_done().output().end());
      }
    }
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(steps, (s.key_len + 36) / 37);
    const std::vector<float> all = Floats(tiled.output());
    ASSERT_EQ(traced.size(), static_cast<size_t>(s.value_dim));
    for (int64_t c = 0; c < s.value_dim; ++c) {
      const float expected = all[(7 * s.query_len + 4) * s.value_dim + c];
      EXPECT_NEAR(traced[c], expected, 1e-5 * std::max(1.f, std::abs(expected)));
    }

    v1::DeleteCacheRequest del;
    del.set_cache_id(id);
    v1::DeleteCacheResponse deleted;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::DeleteCache, del, &deleted).ok());
    EXPECT_EQ(Call(&v1::AttentionService::Stub::Tiled, request, &tiled).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  v1::ListCachesResponse list;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::ListCaches, v1::ListCachesRequest(), &list).ok());
  EXPECT_EQ(list.caches_size(), 0);
  EXPECT_EQ(service_->caches().bytes(), 0) << "deleted caches still hold their pages";
}

// One Decode call for three sequences of different lengths and dtypes, each appending one new
// token (one of them with three causal query rows), against the reference after the append.
TEST_F(CacheServiceTest, ADecodeBatchAppendsEachItemsTokensThenAttends) {
  const struct {
    int64_t cached, query_len;
    DType dtype;
  } sequences[] = {{1, 1, DType::kFloat32}, {300, 3, DType::kBFloat16}, {517, 1, DType::kFloat16}};
  std::vector<HostProblem> problems;
  std::vector<std::string> ids;
  v1::DecodeRequest request;
  request.mutable_options()->set_causal(true);
  request.mutable_options()->set_return_lse(true);
  request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
  for (size_t i = 0; i < std::size(sequences); ++i) {
    const auto& seq = sequences[i];
    problems.push_back(RandomCacheProblem(seq.query_len, seq.cached + 1, seq.dtype, true, 50 + i));
    const HostProblem& p = problems.back();
    const Shape& s = p.shape;
    ids.push_back(Create(s, seq.dtype).cache_id());
    v1::CacheInfo info;
    ASSERT_TRUE(Append(ids.back(), p, 0, seq.cached, 0, &info).ok());
    v1::DecodeItem* item = request.add_items();
    item->set_cache_id(ids.back());
    *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                      p.query_bytes.size(), seq.dtype);
    *item->mutable_key() =
        Tokens(p.key_bytes, seq.dtype, s.kv_heads, s.key_len, s.head_dim, seq.cached, s.key_len);
    *item->mutable_value() =
        Tokens(p.value_bytes, seq.dtype, s.kv_heads, s.key_len, s.value_dim, seq.cached, s.key_len);
    item->set_expected_length(seq.cached);
  }
  v1::DecodeResponse response;
  const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.outputs_size(), 3);
  ASSERT_EQ(response.lse_size(), 3);
  ASSERT_EQ(response.caches_size(), 3);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    problems[i].block_k = 0;
    ExpectMatches(response.outputs(i), problems[i]);
    EXPECT_EQ(response.caches(i).length(), sequences[i].cached + 1);
    EXPECT_EQ(LengthOf(ids[i]), sequences[i].cached + 1);
    const testing::Reference ref = testing::ReferenceAttention(problems[i]);
    EXPECT_LE(testing::MaxAbsError(Floats(response.lse(i)), ref.lse), 1e-4);
  }
  // Where server_ns went (ExecutionStats.stages): each stage measured, together within it.
  const v1::ExecutionStats& stats = response.stats();
  const v1::ServerStages& stages = stats.stages();
  EXPECT_GT(stages.handler_ns(), 0);
  EXPECT_GE(stages.queue_ns(), 0);
  EXPECT_GT(stages.prepare_ns(), 0);  // Three appends at least.
  EXPECT_GT(stages.finish_ns(), 0);   // Three caches' info.
  EXPECT_LE(stages.handler_ns() + stages.queue_ns() + stages.prepare_ns() + stats.compute_ns() +
                stages.finish_ns(),
            stats.server_ns());
}

// An fp8 cache (DTYPE_FLOAT8_E4M3, issue 32): tokens sent in fp32 and in bf16 are quantized
// a row at a time; Decode, Tiled, Naive and Trace over it read the same stored values (agreeing
// to fp32's bound) and stay near the float64 reference on the unquantized tokens; an export
// imported elsewhere decodes to the same bits; CacheInfo says fp8 and counts its smaller pages;
// fp8 is refused naming the field wherever a tensor's dtype or an output's goes.
TEST_F(CacheServiceTest, AnFp8CacheQuantizesTokensOfAnyDtypeAndEveryMethodReadsTheSameValues) {
  const DType fp8 = DType::kFloat8E4M3;
  HostProblem p = RandomCacheProblem(3, 601, DType::kFloat32, /*causal=*/true, 77);
  HostProblem half = p;  // The second half of the tokens sent as bf16 (values rounded to it).
  half.dtype = DType::kBFloat16;
  half.key_bytes.assign(p.key.size() * 2, 0);
  half.value_bytes.assign(p.value.size() * 2, 0);
  for (auto [from, to, bytes] : {std::tuple{&p.key, &half.key, &half.key_bytes},
                                 std::tuple{&p.value, &half.value, &half.value_bytes}}) {
    for (size_t i = 0; i < from->size(); ++i) {
      StoreElement(bytes->data(), DType::kBFloat16, i, (*from)[i]);
      (*to)[i] = LoadElement(bytes->data(), DType::kBFloat16, i);
    }
  }
  const Shape& s = p.shape;
  const v1::CacheInfo created = Create(s, fp8);
  EXPECT_EQ(created.dtype(), v1::DTYPE_FLOAT8_E4M3);
  v1::CacheInfo info;
  ASSERT_TRUE(Append(created.cache_id(), p, 0, 300, 0, &info).ok());
  const grpc::Status second = Append(created.cache_id(), half, 300, s.key_len, 300, &info);
  ASSERT_TRUE(second.ok()) << second.error_message();
  ASSERT_EQ(info.length(), s.key_len);
  const v1::CacheInfo bf16 = Create(s, DType::kBFloat16);
  const KvLayout layout{
      .kv_heads = s.kv_heads, .head_dim = s.head_dim, .value_dim = s.value_dim, .dtype = fp8};
  EXPECT_EQ(info.bytes(), (s.key_len + info.page_tokens() - 1) / info.page_tokens() *
                              info.page_tokens() * TokenBytes(layout));
  // The float64 reference on what was sent: fp32 tokens, then the bf16-rounded ones.
  HostProblem sent = p;
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    for (int64_t t = 300; t < s.key_len; ++t) {
      for (int64_t c = 0; c < s.head_dim; ++c) {
        const int64_t i = (h * s.key_len + t) * s.head_dim + c;
        sent.key[i] = half.key[i];
      }
      for (int64_t c = 0; c < s.value_dim; ++c) {
        const int64_t i = (h * s.key_len + t) * s.value_dim + c;
        sent.value[i] = half.value[i];
      }
    }
  }
  const testing::Reference ref = testing::ReferenceAttention(sent);

  const v1::AttentionRequest request = OverCache(p, created.cache_id());
  v1::AttentionResponse naive, tiled;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Naive, request, &naive).ok());
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, request, &tiled).ok());
  v1::DecodeRequest decode;
  *decode.mutable_options() = request.options();
  v1::DecodeItem* item = decode.add_items();
  item->set_cache_id(created.cache_id());
  item->set_expected_length(s.key_len);
  *item->mutable_query() = request.query();
  v1::DecodeResponse decoded;
  const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, decode, &decoded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const std::vector<float> out = Floats(tiled.output());
  const double magnitude = testing::MaxAbs(ref.output);
  const double error = testing::MaxAbsError(out, ref.output) / magnitude;
  EXPECT_LE(error, 0.05);
  EXPECT_GT(error, 1e-5) << "the cache holds the tokens unquantized";
  const std::vector<double> tiled_out(out.begin(), out.end());
  EXPECT_LE(testing::MaxAbsError(Floats(naive.output()), tiled_out), 1e-5 * magnitude);
  EXPECT_LE(testing::MaxAbsError(Floats(decoded.outputs(0)), tiled_out), 1e-5 * magnitude);

  // Trace reads a copy of the rows dequantized (code · scale): its row is Tiled's, bit for bit.
  const std::vector<float> traced = TracedRow(request, 5, 2);
  ASSERT_EQ(traced.size(), static_cast<size_t>(s.value_dim));
  for (int64_t c = 0; c < s.value_dim; ++c) {
    EXPECT_EQ(traced[c], out[(5 * s.query_len + 2) * s.value_dim + c]) << c;
  }

  // Exported and imported (under a new id): the stored rows, so the same bits.
  std::vector<v1::CacheChunk> chunks;
  {
    grpc::ClientContext context;
    v1::ExportCacheRequest export_request;
    export_request.set_cache_id(created.cache_id());
    std::unique_ptr<grpc::ClientReader<v1::CacheChunk>> reader =
        stub_->ExportCache(&context, export_request);
    v1::CacheChunk chunk;
    while (reader->Read(&chunk)) chunks.push_back(chunk);
    ASSERT_TRUE(reader->Finish().ok());
  }
  ASSERT_FALSE(chunks.empty());
  EXPECT_EQ(chunks[0].info().dtype(), v1::DTYPE_FLOAT8_E4M3);
  EXPECT_EQ(chunks[0].key().dtype(), v1::DTYPE_FLOAT8_E4M3);
  EXPECT_EQ(static_cast<int64_t>(chunks[0].key().data().size()),
            s.kv_heads * chunks[0].key().shape(1) * StoredRowBytes(fp8, s.head_dim));
  v1::CacheInfo imported;
  {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientWriter<v1::CacheChunk>> writer =
        stub_->ImportCache(&context, &imported);
    chunks[0].set_new_id_if_taken(true);
    for (const v1::CacheChunk& chunk : chunks) ASSERT_TRUE(writer->Write(chunk));
    writer->WritesDone();
    const grpc::Status done = writer->Finish();
    ASSERT_TRUE(done.ok()) << done.error_message();
  }
  EXPECT_NE(imported.cache_id(), created.cache_id());
  EXPECT_EQ(imported.dtype(), v1::DTYPE_FLOAT8_E4M3);
  v1::AttentionResponse again;
  ASSERT_TRUE(
      Call(&v1::AttentionService::Stub::Tiled, OverCache(p, imported.cache_id()), &again).ok());
  EXPECT_EQ(again.output().data(), tiled.output().data());

  // A query whose dot product with an fp8 cache's codes could pass fp32 before the keys' scales
  // is refused (a bf16 cache's bound alone would let this one through), naming the query.
  v1::AttentionRequest huge = request;
  const float big = 1e37f;
  std::memcpy(huge.mutable_query()->mutable_data()->data(), &big, sizeof big);
  grpc::Status refused = Call(&v1::AttentionService::Stub::Tiled, huge, &naive);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("fp8 cache"), std::string::npos)
      << refused.error_message();

  // fp8 is a cache's dtype only.
  v1::AttentionRequest bad = request;
  bad.mutable_query()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
  refused = Call(&v1::AttentionService::Stub::Tiled, bad, &naive);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("query.dtype"), std::string::npos)
      << refused.error_message();
  bad = request;
  bad.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT8_E4M3);
  refused = Call(&v1::AttentionService::Stub::Tiled, bad, &naive);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("options.output_dtype"), std::string::npos)
      << refused.error_message();
  v1::AppendCacheRequest append;
  append.set_cache_id(bf16.cache_id());
  *append.mutable_key() =
      Tokens(half.key_bytes, DType::kBFloat16, s.kv_heads, s.key_len, s.head_dim, 0, 1);
  *append.mutable_value() =
      Tokens(half.value_bytes, DType::kBFloat16, s.kv_heads, s.key_len, s.value_dim, 0, 1);
  append.mutable_key()->set_dtype(v1::DTYPE_FLOAT8_E4M3);
  refused = Call(&v1::AttentionService::Stub::AppendCache, append, &info);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("key.dtype"), std::string::npos)
      << refused.error_message();
  v1::CreateCacheRequest unknown;
  unknown.set_kv_heads(1);
  unknown.set_head_dim(8);
  unknown.set_dtype(static_cast<v1::DType>(5));
  refused = Call(&v1::AttentionService::Stub::CreateCache, unknown, &info);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("DTYPE_FLOAT8_E4M3"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(LengthOf(bf16.cache_id()), 0);
}

// A latent cache (values_from_keys, MLA): keys only, each value its key's first value_dim
// columns. Appends and Decode items send keys alone; Naive, Tiled, Trace and Decode over it
// match the float64 reference, which reads each value from its key; it takes half the bytes of
// a cache storing both; a value sent to it, or a value_dim past head_dim, is refused naming the
// field and changes nothing.
TEST_F(CacheServiceTest, ALatentCacheStoresKeysOnlyAndEveryPathReadsItsValuesFromThem) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    // 80 query heads over one latent head (a GEMM group), head_dim 72, value_dim 40.
    HostProblem p =
        testing::RandomProblem(testing::MakeShape(1, 80, 1, 2, 389, 72, 40), dtype, true, 29, 61);
    p.SetValuesFromKeys();
    const Shape& s = p.shape;
    v1::CreateCacheRequest create;
    create.set_kv_heads(s.kv_heads);
    create.set_head_dim(s.head_dim);
    create.set_value_dim(s.value_dim);
    create.set_dtype(ToProtoDType(dtype));
    create.set_values_from_keys(true);
    v1::CacheInfo latent;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::CreateCache, create, &latent).ok());
    EXPECT_TRUE(latent.values_from_keys());
    const std::string id = latent.cache_id();
    auto keys = [&](int64_t begin, int64_t end) {
      return Tokens(p.key_bytes, dtype, s.kv_heads, s.key_len, s.head_dim, begin, end);
    };
    // Keys alone; a value is refused, naming it, and appends nothing.
    v1::AppendCacheRequest append;
    append.set_cache_id(id);
    *append.mutable_key() = keys(0, 200);
    *append.mutable_value() =
        Tokens(p.value_bytes, dtype, s.kv_heads, s.key_len, s.value_dim, 0, 200);
    v1::CacheInfo info;
    grpc::Status status = Call(&v1::AttentionService::Stub::AppendCache, append, &info);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("value"), std::string::npos) << status.error_message();
    EXPECT_NE(status.error_message().find("values_from_keys"), std::string::npos);
    EXPECT_EQ(LengthOf(id), 0);
    append.clear_value();
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::AppendCache, append, &info).ok());
    EXPECT_EQ(info.length(), 200);

    // The same tokens in a cache storing values too: twice the bytes.
    v1::CreateCacheRequest full_create = create;
    full_create.set_values_from_keys(false);
    full_create.set_value_dim(s.head_dim);
    v1::CacheInfo full;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::CreateCache, full_create, &full).ok());
    v1::AppendCacheRequest full_append;
    full_append.set_cache_id(full.cache_id());
    *full_append.mutable_key() = keys(0, 200);
    *full_append.mutable_value() = keys(0, 200);
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::AppendCache, full_append, &full).ok());
    EXPECT_EQ(2 * info.bytes(), full.bytes());

    // A Decode item with a value is refused, naming it; with keys alone it appends and attends.
    v1::DecodeRequest decode;
    decode.mutable_options()->set_causal(true);
    decode.mutable_options()->set_return_lse(true);
    decode.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
    v1::DecodeItem* item = decode.add_items();
    item->set_cache_id(id);
    *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                      p.query_bytes.size(), dtype);
    *item->mutable_key() = keys(200, s.key_len);
    *item->mutable_value() =
        Tokens(p.value_bytes, dtype, s.kv_heads, s.key_len, s.value_dim, 200, s.key_len);
    item->set_expected_length(200);
    v1::DecodeResponse decoded;
    status = Call(&v1::AttentionService::Stub::Decode, decode, &decoded);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("items[0].value"), std::string::npos)
        << status.error_message();
    EXPECT_EQ(LengthOf(id), 200);
    item->clear_value();
    status = Call(&v1::AttentionService::Stub::Decode, decode, &decoded);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(LengthOf(id), s.key_len);
    HostProblem unblocked = p;
    unblocked.block_k = 0;
    ExpectMatches(decoded.outputs(0), unblocked);
    const testing::Reference ref = testing::ReferenceAttention(p);
    EXPECT_LE(testing::MaxAbsError(Floats(decoded.lse(0)), ref.lse), 1e-4);

    // Naive, Tiled and a trace over it.
    const v1::AttentionRequest request = OverCache(p, id);
    v1::AttentionResponse naive, tiled;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Naive, request, &naive).ok());
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, request, &tiled).ok());
    ExpectMatches(naive.output(), p);
    ExpectMatches(tiled.output(), p);
    const std::vector<float> traced = TracedRow(request, 79, 1);
    ASSERT_EQ(traced.size(), static_cast<size_t>(s.value_dim));
    for (int64_t c = 0; c < s.value_dim; ++c) {
      const double expected = ref.output[(79 * s.query_len + 1) * s.value_dim + c];
      EXPECT_NEAR(traced[c], expected, dtype == DType::kFloat32 ? 1e-5 : 2e-2) << c;
    }
  }

  // value_dim past head_dim cannot come from the keys.
  v1::CreateCacheRequest wide;
  wide.set_kv_heads(1);
  wide.set_head_dim(64);
  wide.set_value_dim(65);
  wide.set_dtype(v1::DTYPE_BFLOAT16);
  wide.set_values_from_keys(true);
  v1::CacheInfo refused;
  const grpc::Status status = Call(&v1::AttentionService::Stub::CreateCache, wide, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message().rfind("value_dim", 0), 0u) << status.error_message();
}

// Speculative decoding: a cache cut back (TruncateCache, or a Decode item's truncate_to before
// its new tokens) is exactly one that never had the cut tokens — the same output and lse bits,
// and the float64 reference over the kept tokens; errors name the field and change nothing; a
// batch that fails after its cuts puts every cut token back.
TEST_F(CacheServiceTest, ACutCacheEqualsOneThatNeverHadTheCutTokens) {
  const HostProblem p = RandomCacheProblem(3, 153, DType::kBFloat16, true, 71);
  const HostProblem drafts = RandomCacheProblem(3, 153, DType::kBFloat16, true, 72);
  const Shape& s = p.shape;
  v1::CacheInfo info;
  // Never had them: p's first 153 tokens.
  const std::string clean = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(clean, p, 0, 153, 0, &info).ok());
  // Cut by TruncateCache: p's first 150, 30 rejected drafts, cut back to 150, then p's next 3.
  const std::string truncated = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(truncated, p, 0, 150, 0, &info).ok());
  const int64_t bytes_at_150 = info.bytes();
  ASSERT_TRUE(Append(truncated, drafts, 0, 30, 150, &info).ok());
  v1::TruncateCacheRequest cut;
  cut.set_cache_id(truncated);
  cut.set_length(150);
  cut.set_expected_length(180);
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::TruncateCache, cut, &info).ok());
  EXPECT_EQ(info.length(), 150);
  EXPECT_EQ(info.bytes(), bytes_at_150);  // The pages only the drafts used are freed.
  ASSERT_TRUE(Append(truncated, p, 150, 153, 150, &info).ok());
  // Cut by the Decode that appends the accepted tokens (truncate_to), in one call.
  const std::string decoded = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(decoded, p, 0, 150, 0, &info).ok());
  ASSERT_TRUE(Append(decoded, drafts, 0, 30, 150, &info).ok());

  auto decode = [&](const std::string& id, bool with_step, v1::DecodeResponse* response) {
    v1::DecodeRequest request;
    request.mutable_options()->set_causal(true);
    request.mutable_options()->set_return_lse(true);
    request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
    v1::DecodeItem* item = request.add_items();
    item->set_cache_id(id);
    *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                      p.query_bytes.size(), p.dtype);
    if (with_step) {
      item->set_expected_length(180);
      item->set_truncate_to(150);
      *item->mutable_key() =
          Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 150, 153);
      *item->mutable_value() =
          Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 150, 153);
    } else {
      item->set_expected_length(153);
    }
    return Call(&v1::AttentionService::Stub::Decode, request, response);
  };
  v1::DecodeResponse want, by_rpc, by_step;
  ASSERT_TRUE(decode(clean, false, &want).ok());
  ASSERT_TRUE(decode(truncated, false, &by_rpc).ok());
  const grpc::Status stepped = decode(decoded, true, &by_step);
  ASSERT_TRUE(stepped.ok()) << stepped.error_message();
  EXPECT_EQ(by_step.caches(0).length(), 153);
  for (const v1::DecodeResponse* got : {&by_rpc, &by_step}) {
    EXPECT_EQ(got->outputs(0).data(), want.outputs(0).data());
    EXPECT_EQ(got->lse(0).data(), want.lse(0).data());
  }
  HostProblem reference = p;
  reference.block_k = 0;
  ExpectMatches(by_step.outputs(0), reference);

  // Bad cuts: named, and nothing changes.
  auto truncate = [&](const std::string& id, int64_t length, std::optional<int64_t> expected) {
    v1::TruncateCacheRequest request;
    request.set_cache_id(id);
    request.set_length(length);
    if (expected) request.set_expected_length(*expected);
    v1::CacheInfo answer;
    return Call(&v1::AttentionService::Stub::TruncateCache, request, &answer);
  };
  grpc::Status status = truncate(clean, 154, std::nullopt);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(status.error_message(),
              ::testing::HasSubstr("length: is 154 but the cache holds 153"));
  status = truncate(clean, -1, std::nullopt);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("length"));
  status = truncate(clean, 10, 152);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("expected_length"));
  EXPECT_EQ(LengthOf(clean), 153);
  status = truncate("0123456789abcdef0123456789abcdef", 0, std::nullopt);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);

  // A batch that fails after its cut (item 1's query is not finite, found once its cache is
  // bound): item 0's cache keeps every token it had, bit for bit.
  const std::string other = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(other, p, 0, 20, 0, &info).ok());
  ASSERT_TRUE(Append(decoded, drafts, 30, 40, 153, &info).ok());  // 163 tokens now.
  v1::DecodeResponse before;
  {
    v1::DecodeRequest request;
    request.mutable_options()->set_causal(true);
    request.mutable_options()->set_return_lse(true);
    v1::DecodeItem* item = request.add_items();
    item->set_cache_id(decoded);
    *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                      p.query_bytes.size(), p.dtype);
    item->set_expected_length(163);
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Decode, request, &before).ok());
    item->set_truncate_to(100);
    *item->mutable_key() = Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 0, 2);
    *item->mutable_value() =
        Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 0, 2);
    v1::DecodeItem* bad = request.add_items();
    bad->set_cache_id(other);
    std::vector<uint8_t> nan_query = p.query_bytes;
    std::fill(nan_query.begin(), nan_query.begin() + 2, uint8_t{0xff});  // A bf16 NaN.
    *bad->mutable_query() =
        ToTensor({s.heads, s.query_len, s.head_dim}, nan_query.data(), nan_query.size(), p.dtype);
    bad->set_expected_length(20);
    v1::DecodeResponse failed;
    status = Call(&v1::AttentionService::Stub::Decode, request, &failed);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr("items[1].query"));
    EXPECT_EQ(LengthOf(decoded), 163);
    // A cut past the length is refused by name, before anything changes.
    request.mutable_items()->RemoveLast();
    item->set_truncate_to(164);
    status = Call(&v1::AttentionService::Stub::Decode, request, &failed);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr("items[0].truncate_to"));
    item->set_truncate_to(-3);
    status = Call(&v1::AttentionService::Stub::Decode, request, &failed);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr("items[0].truncate_to"));
    // The cache answers as before the failed calls.
    item->clear_truncate_to();
    item->clear_key();
    item->clear_value();
    v1::DecodeResponse after;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Decode, request, &after).ok());
    EXPECT_EQ(after.outputs(0).data(), before.outputs(0).data());
    EXPECT_EQ(after.lse(0).data(), before.lse(0).data());
  }
}

// ForkCache: a fork decodes bit for bit as a copy of the source's prefix would, before and after
// each appends tokens of its own (an append into the shared partly filled page copies it: the
// source's answers do not change); shared pages count once against --cache-bytes, so forks fit
// where copies would not; deleting the source keeps what its forks use, and the budget comes
// back only when the last holder goes. Bad forks are refused by name and create nothing.
TEST_F(CacheServiceTest, AForkDecodesAsACopyAndSharesItsPagesInTheBudget) {
  const HostProblem p = RandomCacheProblem(3, 153, DType::kBFloat16, true, 81);
  const HostProblem own = RandomCacheProblem(3, 153, DType::kBFloat16, true, 82);
  const Shape& s = p.shape;
  auto fork = [&](const std::string& id, std::optional<int64_t> length,
                  std::optional<int64_t> expected, v1::CacheInfo* info) {
    v1::ForkCacheRequest request;
    request.set_cache_id(id);
    if (length) request.set_length(*length);
    if (expected) request.set_expected_length(*expected);
    return Call(&v1::AttentionService::Stub::ForkCache, request, info);
  };
  auto decode = [&](const std::string& id, int64_t length, v1::DecodeResponse* response) {
    v1::DecodeRequest request;
    request.mutable_options()->set_causal(true);
    request.mutable_options()->set_return_lse(true);
    request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
    v1::DecodeItem* item = request.add_items();
    item->set_cache_id(id);
    item->set_expected_length(length);
    *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                      p.query_bytes.size(), p.dtype);
    const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  };
  auto same = [](const v1::DecodeResponse& a, const v1::DecodeResponse& b) {
    return a.outputs(0).data() == b.outputs(0).data() && a.lse(0).data() == b.lse(0).data();
  };
  // Pages of 16 tokens, and a budget of about three such caches (measured on a server of its
  // own first).
  TearDown();
  StartServer(int64_t{256} << 20, 0, /*page_tokens=*/16);
  v1::CacheInfo info;
  const std::string sized = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(sized, p, 0, s.key_len, 0, &info).ok());  // 153 tokens: 10 pages.
  const int64_t page_bytes = info.bytes() / 10;
  const int64_t cache_bytes = 10 * page_bytes;  // 150 tokens.
  TearDown();
  StartServer(/*cache_bytes=*/3 * cache_bytes + 8192, 0, /*page_tokens=*/16);
  const std::string source = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(source, p, 0, 150, 0, &info).ok());
  ASSERT_EQ(info.bytes(), cache_bytes);
  EXPECT_EQ(info.shared_bytes(), 0);
  v1::DecodeResponse source_before;
  decode(source, 150, &source_before);

  // Eight forks of all 150 tokens fit a budget of three caches; the ninth cache's pages do not.
  std::vector<std::string> forks;
  for (int i = 0; i < 8; ++i) {
    grpc::Status status = fork(source, std::nullopt, 150, &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(info.length(), 150);
    EXPECT_EQ(info.bytes(), 10 * page_bytes);
    EXPECT_EQ(info.shared_bytes(), info.bytes());
    EXPECT_NE(info.cache_id(), source);
    forks.push_back(info.cache_id());
  }
  v1::GetCacheInfoRequest get;
  get.set_cache_id(source);
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetCacheInfo, get, &info).ok());
  EXPECT_EQ(info.shared_bytes(), info.bytes());
  for (const std::string& id : forks) {
    v1::DecodeResponse got;
    decode(id, 150, &got);
    EXPECT_TRUE(same(got, source_before)) << id;
  }

  // A fork of 100 tokens (inside page 6) against a copy of them, each then given the same 53
  // tokens of its own: bit for bit equal, and the source's answer unchanged.
  ASSERT_TRUE(fork(source, 100, std::nullopt, &info).ok());
  const std::string short_fork = info.cache_id();
  EXPECT_EQ(info.bytes(), 7 * page_bytes);
  const std::string copy = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(copy, p, 0, 100, 0, &info).ok());
  for (const std::string& id : {short_fork, copy}) {
    v1::AppendCacheRequest request;
    request.set_cache_id(id);
    *request.mutable_key() =
        Tokens(own.key_bytes, own.dtype, s.kv_heads, s.key_len, s.head_dim, 0, 53);
    *request.mutable_value() =
        Tokens(own.value_bytes, own.dtype, s.kv_heads, s.key_len, s.value_dim, 0, 53);
    request.set_expected_length(100);
    const grpc::Status status = Call(&v1::AttentionService::Stub::AppendCache, request, &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(info.shared_bytes(), 0);  // The copy shares nothing.
  get.set_cache_id(short_fork);
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetCacheInfo, get, &info).ok());
  EXPECT_EQ(info.shared_bytes(), 6 * page_bytes);  // Page 6 was copied before the write.
  v1::DecodeResponse from_fork, from_copy, source_after;
  decode(short_fork, 153, &from_fork);
  decode(copy, 153, &from_copy);
  decode(source, 150, &source_after);
  EXPECT_TRUE(same(from_fork, from_copy));
  EXPECT_TRUE(same(source_after, source_before));

  // Deleting the source keeps what the forks use: their answers stay, the budget stays full.
  v1::DeleteCacheRequest drop;
  v1::DeleteCacheResponse dropped;
  drop.set_cache_id(source);
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::DeleteCache, drop, &dropped).ok());
  v1::DecodeResponse after_delete;
  decode(forks[3], 150, &after_delete);
  EXPECT_TRUE(same(after_delete, source_before));
  const std::string big = Create(s, p.dtype).cache_id();
  grpc::Status status = Append(big, p, 0, 150, 0, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("--cache-bytes"));
  for (const std::string& id : {copy, short_fork}) {
    drop.set_cache_id(id);
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::DeleteCache, drop, &dropped).ok());
  }
  status = Append(big, p, 0, 150, 0, &info);  // The copy's pages and short_fork's own are back.
  EXPECT_TRUE(status.ok()) << status.error_message();

  // Bad forks: named, and no cache appears.
  const size_t caches = forks.size() + 1;
  status = fork(forks[0], 151, std::nullopt, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(status.error_message(),
              ::testing::HasSubstr("length: is 151 but the cache holds 150"));
  status = fork(forks[0], -1, std::nullopt, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("length"));
  status = fork(forks[0], std::nullopt, 149, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("expected_length"));
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("150"));
  status = fork("0123456789abcdef0123456789abcdef", std::nullopt, std::nullopt, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("cache_id"));
  v1::ListCachesResponse list;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::ListCaches, v1::ListCachesRequest(), &list).ok());
  EXPECT_EQ(static_cast<size_t>(list.caches_size()), caches);
}

// A tree step (tree_parents): each row sees the cache, its ancestors and itself — against the
// float64 reference's own walk up each chain — in one call with a cut of the last step's drafts;
// then the accepted branch alone, appended to a cache that never saw the tree, decodes the same
// bits as the tree's cache cut back to it. Bad trees are refused by name and change nothing.
TEST_F(CacheServiceTest, ATreeStepSeesEachRowsBranchAndItsAcceptedBranchIsACache) {
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 1, 2, -1};  // Two roots; 3 and 4 under 1.
  HostProblem p = RandomCacheProblem(7, 207, DType::kBFloat16, true, 81);
  p.SetTree(parents);
  const HostProblem drafts = RandomCacheProblem(7, 207, DType::kBFloat16, true, 82);
  const Shape& s = p.shape;
  v1::CacheInfo info;
  const std::string id = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(id, p, 0, 200, 0, &info).ok());
  ASSERT_TRUE(Append(id, drafts, 0, 5, 200, &info).ok());  // The last step's drafts.
  v1::DecodeRequest request;
  request.mutable_options()->set_causal(true);
  request.mutable_options()->set_return_lse(true);
  request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
  v1::DecodeItem* item = request.add_items();
  item->set_cache_id(id);
  *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                    p.query_bytes.size(), p.dtype);
  item->set_expected_length(205);
  item->set_truncate_to(200);
  *item->mutable_key() = Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 200, 207);
  *item->mutable_value() =
      Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 200, 207);
  for (int32_t parent : parents) item->add_tree_parents(parent);
  v1::DecodeResponse response;
  grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.caches(0).length(), 207);
  HostProblem reference = p;
  reference.block_k = 0;
  ExpectMatches(response.outputs(0), reference);
  const testing::Reference ref = testing::ReferenceAttention(p);
  EXPECT_LE(testing::MaxAbsError(Floats(response.lse(0)), ref.lse), 1e-4);

  // The branch 0 → 1 → 4 accepted: the tree's cache cut to it and a cache that had only it.
  v1::DecodeRequest accept = request;
  v1::DecodeItem* next = accept.mutable_items(0);
  next->clear_tree_parents();
  next->clear_key();
  next->clear_value();
  next->set_expected_length(207);
  next->set_truncate_to(202);  // Tokens 0 and 1 of the tree lie in place; 4 does not.
  *next->mutable_query() =
      ToTensor({s.heads, 1, s.head_dim}, p.query_bytes.data(), p.query_bytes.size() / 7, p.dtype);
  // Token 4 goes after them: p's key 204 (the tree's token 4).
  *next->mutable_key() = Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 204, 205);
  *next->mutable_value() =
      Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 204, 205);
  v1::DecodeResponse cut_back, direct;
  status = Call(&v1::AttentionService::Stub::Decode, accept, &cut_back);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const std::string branch = Create(s, p.dtype).cache_id();
  ASSERT_TRUE(Append(branch, p, 0, 202, 0, &info).ok());
  next->set_cache_id(branch);
  next->set_expected_length(202);
  next->clear_truncate_to();
  status = Call(&v1::AttentionService::Stub::Decode, accept, &direct);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(cut_back.outputs(0).data(), direct.outputs(0).data());
  EXPECT_EQ(cut_back.lse(0).data(), direct.lse(0).data());

  // Bad trees: named, nothing appended.
  const struct {
    std::vector<int32_t> parents;
    const char* field;
  } bad[] = {{{-1, 0, 0, 1, 1, 2}, "items[0].tree_parents: has 6 entries but the item appends 7"},
             {{-1, 0, 0, 1, 5, 2, -1}, "items[0].tree_parents[4]: is 5"},
             {{-1, 0, 0, 1, 1, 2, -2}, "items[0].tree_parents[6]: is -2"},
             {{0, 0, 0, 1, 1, 2, -1}, "items[0].tree_parents[0]: is 0"}};
  for (const auto& b : bad) {
    v1::DecodeRequest wrong = request;
    wrong.mutable_items(0)->set_expected_length(209);
    wrong.mutable_items(0)->clear_truncate_to();
    wrong.mutable_items(0)->clear_tree_parents();
    for (int32_t parent : b.parents) wrong.mutable_items(0)->add_tree_parents(parent);
    status = Call(&v1::AttentionService::Stub::Decode, wrong, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << b.field;
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr(b.field));
  }
  v1::DecodeRequest rows = request;  // One query row fewer than new tokens.
  rows.mutable_items(0)->set_expected_length(209);
  rows.mutable_items(0)->clear_truncate_to();
  *rows.mutable_items(0)->mutable_query() = ToTensor({s.heads, 6, s.head_dim}, p.query_bytes.data(),
                                                     p.query_bytes.size() / 7 * 6, p.dtype);
  status = Call(&v1::AttentionService::Stub::Decode, rows, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("items[0].query"));
  EXPECT_EQ(LengthOf(id), 203);
}

// A Decode item's cut keeps a copy of what it drops until the call succeeds: bounded before it
// is made, naming the count allowed.
TEST(DecodeCutTest, AnItemDropsAtMost64MiBOfTokens) {
  const KvLayout layout{
      .kv_heads = 8, .head_dim = 128, .value_dim = 128, .dtype = DType::kBFloat16};
  const int64_t most = kMaxDecodeCutBytes / TokenBytes(layout);  // 16384 tokens of 4 KiB.
  EXPECT_EQ(most, 16384);
  EXPECT_TRUE(CheckDecodeCut("items[0].", 100000 - most, 100000, layout).ok());
  const absl::Status over = CheckDecodeCut("items[3].", 100000 - most - 1, 100000, layout);
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(over.message()), ::testing::HasSubstr("items[3].truncate_to"));
  EXPECT_THAT(std::string(over.message()), ::testing::HasSubstr("at most 16384"));
  EXPECT_THAT(std::string(over.message()), ::testing::HasSubstr("TruncateCache"));
  EXPECT_EQ(CheckDecodeCut("", 5, 4, layout).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CheckDecodeCut("", -1, 4, layout).code(), absl::StatusCode::kInvalidArgument);
}

// A cache's keys placed by key_position and a Decode's queries by query_position (per item):
// the causal mask compares the positions, over a cache as over inline keys.
TEST_F(CacheServiceTest, PositionsPlaceACachesKeysAndADecodesQueries) {
  HostProblem p = RandomCacheProblem(4, 40, DType::kFloat32, /*causal=*/true, 64);
  p.key_position = 100;
  p.query_position = 120;  // Rows see 21, 22, 23 and 24 of the 40 keys.
  const Shape& s = p.shape;
  const std::string id = Create(s, DType::kFloat32).cache_id();
  v1::CacheInfo info;
  ASSERT_TRUE(Append(id, p, 0, s.key_len - 1, 0, &info).ok());
  v1::DecodeRequest request;
  request.mutable_options()->set_causal(true);
  request.mutable_options()->set_return_lse(true);
  request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
  v1::DecodeItem* item = request.add_items();
  item->set_cache_id(id);
  *item->mutable_query() = ToTensor({s.heads, s.query_len, s.head_dim}, p.query_bytes.data(),
                                    p.query_bytes.size(), p.dtype);
  *item->mutable_key() =
      Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, s.key_len - 1, s.key_len);
  *item->mutable_value() =
      Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, s.key_len - 1, s.key_len);
  item->set_expected_length(s.key_len - 1);
  item->set_key_position(100);
  item->set_query_position(120);
  v1::DecodeResponse response;
  const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const testing::Reference ref = testing::ReferenceAttention(p);
  EXPECT_LE(testing::MaxAbsError(Floats(response.outputs(0)), ref.output),
            1e-5 * testing::MaxAbs(ref.output));
  EXPECT_LE(testing::MaxAbsError(Floats(response.lse(0)), ref.lse), 1e-4);
  // Tiled over the cache with the same positions in its options.
  v1::AttentionResponse tiled;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, OverCache(p, id), &tiled).ok());
  EXPECT_LE(testing::MaxAbsError(Floats(tiled.output()), ref.output),
            1e-5 * testing::MaxAbs(ref.output));
  // Without positions the same Decode is bottom-right: every row sees a different prefix.
  p.key_position = 0;
  p.query_position.reset();
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, OverCache(p, id), &tiled).ok());
  EXPECT_GT(testing::MaxAbsError(Floats(tiled.output()), ref.output),
            1e-3 * testing::MaxAbs(ref.output));
}

// One bad request: what it must answer, and the field its message must name.
struct BadCall {
  const char* name;
  grpc::StatusCode code;
  const char* names;
  std::function<grpc::Status(CacheServiceTest&, const std::string& id, const HostProblem& p)> call;
};

TEST_F(CacheServiceTest, EveryBadCallIsRefusedAndLeavesTheCacheAsItWas) {
  TearDown();
  StartServer(int64_t{8} << 20);  // Room for about 3 000 tokens of this problem.
  const HostProblem p = RandomCacheProblem(1, 301, DType::kFloat32, false, 61);
  const std::string id = Filled(p);
  const v1::AttentionRequest query = OverCache(p, id);
  v1::AttentionResponse before;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, query, &before).ok());
  const Shape& s = p.shape;
  auto append = [](CacheServiceTest& t, const std::string& id, const HostProblem& p,
                   const std::function<void(v1::AppendCacheRequest&)>& mutate) {
    const Shape& s = p.shape;
    v1::AppendCacheRequest request;
    request.set_cache_id(id);
    *request.mutable_key() = Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 0, 3);
    *request.mutable_value() =
        Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 0, 3);
    request.set_expected_length(s.key_len);
    mutate(request);
    v1::CacheInfo info;
    return t.Call(&v1::AttentionService::Stub::AppendCache, request, &info);
  };
  auto reshaped = [](v1::Tensor* tensor, int axis, int64_t dim) {
    const int64_t old = tensor->shape(axis);
    tensor->set_shape(axis, dim);
    tensor->mutable_data()->resize(tensor->data().size() / old * dim);
  };
  const std::vector<BadCall> bad = {
      {"unknown cache", grpc::StatusCode::NOT_FOUND, "cache_id",
       [&](CacheServiceTest& t, const std::string&, const HostProblem& p) {
         return append(t, "0123456789abcdef0123456789abcdef", p, [](auto&) {});
       }},
      {"wrong head_dim", grpc::StatusCode::INVALID_ARGUMENT, "key.shape[2]",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) { reshaped(r.mutable_key(), 2, 32); });
       }},
      {"wrong value_dim", grpc::StatusCode::INVALID_ARGUMENT, "value.shape[2]",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) { reshaped(r.mutable_value(), 2, 16); });
       }},
      {"wrong kv heads", grpc::StatusCode::INVALID_ARGUMENT, "key.shape",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) {
           reshaped(r.mutable_key(), 0, 1);
           reshaped(r.mutable_value(), 0, 1);
         });
       }},
      {"wrong dtype", grpc::StatusCode::INVALID_ARGUMENT, "key.dtype",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) {
           r.mutable_key()->set_dtype(v1::DTYPE_FLOAT16);
           r.mutable_key()->mutable_data()->resize(r.key().data().size() / 2);
         });
       }},
      {"keys and values of different lengths", grpc::StatusCode::INVALID_ARGUMENT, "value.shape[1]",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) { reshaped(r.mutable_value(), 1, 2); });
       }},
      {"a NaN among the new keys", grpc::StatusCode::INVALID_ARGUMENT, "key.data",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [&](auto& r) {
           const float nan = std::numeric_limits<float>::quiet_NaN();
           std::memcpy(r.mutable_key()->mutable_data()->data() + 40, &nan, 4);
         });
       }},
      {"a stale expected_length", grpc::StatusCode::FAILED_PRECONDITION, "holds 301 tokens",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [](auto& r) { r.set_expected_length(300); });
       }},
      {"a negative expected_length", grpc::StatusCode::INVALID_ARGUMENT, "expected_length",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         return append(t, id, p, [](auto& r) { r.set_expected_length(-1); });
       }},
      {"over the budget", grpc::StatusCode::RESOURCE_EXHAUSTED, "--cache-bytes",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         const HostProblem big = RandomCacheProblem(1, 40000, DType::kFloat32, false, 62);
         v1::CacheInfo info;
         return t.Append(id, big, 0, big.shape.key_len, p.shape.key_len, &info);
       }},
      {"query heads not a multiple of kv heads", grpc::StatusCode::INVALID_ARGUMENT, "query.shape",
       [&](CacheServiceTest& t, const std::string&, const HostProblem&) {
         v1::AttentionRequest request = query;
         reshaped(request.mutable_query(), 0, 3);
         v1::AttentionResponse response;
         return t.Call(&v1::AttentionService::Stub::Tiled, request, &response);
       }},
      {"inline keys beside a cache", grpc::StatusCode::INVALID_ARGUMENT, "key",
       [&](CacheServiceTest& t, const std::string&, const HostProblem& p) {
         v1::AttentionRequest request = query;
         *request.mutable_key() = request.query();
         v1::AttentionResponse response;
         return t.Call(&v1::AttentionService::Stub::Naive, request, &response);
       }},
      {"a Decode whose second item is stale", grpc::StatusCode::FAILED_PRECONDITION,
       "items[1].expected_length",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         const HostProblem other = RandomCacheProblem(1, 9, DType::kFloat32, false, 63);
         const std::string other_id = t.Filled(other);
         v1::DecodeRequest request;
         for (const std::string& cache : {id, other_id}) {
           v1::DecodeItem* item = request.add_items();
           item->set_cache_id(cache);
           *item->mutable_query() = query.query();
           *item->mutable_key() =
               Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 0, 1);
           *item->mutable_value() =
               Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 0, 1);
           item->set_expected_length(cache == id ? s.key_len : 5);
         }
         v1::DecodeResponse response;
         const grpc::Status status =
             t.Call(&v1::AttentionService::Stub::Decode, request, &response);
         EXPECT_EQ(t.LengthOf(other_id), 9);
         return status;
       }},
      {"a Decode with positions in its options", grpc::StatusCode::INVALID_ARGUMENT,
       "options.key_position",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem&) {
         v1::DecodeRequest request;
         request.mutable_options()->set_key_position(4);
         v1::DecodeItem* item = request.add_items();
         item->set_cache_id(id);
         *item->mutable_query() = query.query();
         item->set_expected_length(s.key_len);
         v1::DecodeResponse response;
         return t.Call(&v1::AttentionService::Stub::Decode, request, &response);
       }},
      {"a Decode item with a negative query_position", grpc::StatusCode::INVALID_ARGUMENT,
       "items[0].query_position",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem& p) {
         v1::DecodeRequest request;
         v1::DecodeItem* item = request.add_items();
         item->set_cache_id(id);
         *item->mutable_query() = query.query();
         *item->mutable_key() =
             Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, 0, 1);
         *item->mutable_value() =
             Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, 0, 1);
         item->set_expected_length(s.key_len);
         item->set_query_position(-1);
         v1::DecodeResponse response;
         return t.Call(&v1::AttentionService::Stub::Decode, request, &response);
       }},
      {"a negative key_position over a cache", grpc::StatusCode::INVALID_ARGUMENT,
       "options.key_position",
       [&](CacheServiceTest& t, const std::string&, const HostProblem&) {
         v1::AttentionRequest request = query;
         request.mutable_options()->set_key_position(-2);
         v1::AttentionResponse response;
         return t.Call(&v1::AttentionService::Stub::Tiled, request, &response);
       }},
      {"a Decode naming one cache twice", grpc::StatusCode::INVALID_ARGUMENT, "items[1].cache_id",
       [&](CacheServiceTest& t, const std::string& id, const HostProblem&) {
         v1::DecodeRequest request;
         for (int i = 0; i < 2; ++i) {
           v1::DecodeItem* item = request.add_items();
           item->set_cache_id(id);
           *item->mutable_query() = query.query();
           item->set_expected_length(s.key_len);
         }
         v1::DecodeResponse response;
         return t.Call(&v1::AttentionService::Stub::Decode, request, &response);
       }},
  };
  for (const BadCall& call : bad) {
    SCOPED_TRACE(call.name);
    const grpc::Status status = call.call(*this, id, p);
    EXPECT_EQ(status.error_code(), call.code) << status.error_message();
    EXPECT_NE(status.error_message().find(call.names), std::string::npos) << status.error_message();
    EXPECT_EQ(LengthOf(id), s.key_len);
    v1::AttentionResponse after;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, query, &after).ok());
    EXPECT_EQ(after.output().data(), before.output().data()) << "the cache's contents changed";
  }
  // An empty cache has nothing to attend over.
  const v1::CacheInfo empty = Create(s, DType::kFloat32);
  v1::AttentionResponse response;
  const grpc::Status status =
      Call(&v1::AttentionService::Stub::Tiled, OverCache(p, empty.cache_id()), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
}

// Four decoders on their own caches, and a reader of a fifth while a writer appends to it: every
// answer right, and every read sees whole appends only.
TEST_F(CacheServiceTest, ConcurrentDecodersAndAReaderDuringAppendsSeeOnlyWholeAppends) {
  constexpr int kDecoders = 4, kSteps = 12, kChunk = 7, kChunks = 20;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int d = 0; d < kDecoders; ++d) {
    threads.emplace_back([&, d] {
      const HostProblem p = RandomCacheProblem(1, 100 + kSteps, DType::kFloat32, false, 70 + d);
      const Shape& s = p.shape;
      const std::string id = Create(s, p.dtype).cache_id();
      v1::CacheInfo info;
      if (!Append(id, p, 0, 100, 0, &info).ok()) ++failures;
      for (int step = 0; step < kSteps; ++step) {
        const int64_t length = 100 + step;
        v1::DecodeRequest request;
        request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
        v1::DecodeItem* item = request.add_items();
        item->set_cache_id(id);
        *item->mutable_query() = OverCache(p, id).query();
        *item->mutable_key() =
            Tokens(p.key_bytes, p.dtype, s.kv_heads, s.key_len, s.head_dim, length, length + 1);
        *item->mutable_value() =
            Tokens(p.value_bytes, p.dtype, s.kv_heads, s.key_len, s.value_dim, length, length + 1);
        item->set_expected_length(length);
        v1::DecodeResponse response;
        if (!Call(&v1::AttentionService::Stub::Decode, request, &response).ok()) {
          ++failures;
          return;
        }
        HostProblem seen = Prefix(p, length + 1);
        ExpectMatches(response.outputs(0), seen);
      }
    });
  }
  const HostProblem p = RandomCacheProblem(1, kChunk * kChunks, DType::kFloat32, false, 80);
  const std::string id = Create(p.shape, p.dtype).cache_id();
  {
    v1::CacheInfo info;
    ASSERT_TRUE(Append(id, p, 0, kChunk, 0, &info).ok());
  }
  std::atomic<bool> writing{true};
  threads.emplace_back([&] {
    for (int c = 1; c < kChunks; ++c) {
      v1::CacheInfo info;
      if (!Append(id, p, c * kChunk, (c + 1) * kChunk, c * kChunk, &info).ok()) ++failures;
    }
    writing = false;
  });
  int reads = 0;
  while (writing.load() || reads < 3) {
    v1::DecodeRequest request;
    request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
    v1::DecodeItem* item = request.add_items();
    item->set_cache_id(id);
    *item->mutable_query() = OverCache(p, id).query();
    item->set_expected_length(LengthOf(id));
    v1::DecodeResponse response;
    const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, &response);
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) continue;  // It grew.
    ASSERT_TRUE(status.ok()) << status.error_message();
    const int64_t length = response.caches(0).length();
    EXPECT_EQ(length % kChunk, 0) << "a read saw part of an append";
    ExpectMatches(response.outputs(0), Prefix(p, length));
    ++reads;
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(LengthOf(id), kChunk * kChunks);
}

// A trace over a cache copies the tokens it reads; those copies stay within --max-naive-bytes.
TEST_F(CacheServiceTest, ATraceWhoseCopyPassesTheBudgetIsRefused) {
  TearDown();
  StartServer(int64_t{256} << 20, /*max_naive_bytes=*/64 << 10);
  const HostProblem p = RandomCacheProblem(1, 601, DType::kFloat32, false, 90);  // 240 KB
  v1::TraceRequest trace;
  *trace.mutable_attention() = OverCache(p, Filled(p));
  trace.mutable_attention()->mutable_options()->set_block_k(0);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader = stub_->Trace(&context, trace);
  v1::TraceEvent event;
  int events = 0;
  while (reader->Read(&event)) ++events;
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(events, 0);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("--max-naive-bytes"), std::string::npos)
      << status.error_message();
}

TEST_F(CacheServiceTest, ServerInfoReportsTheCacheLimits) {
  v1::ServerInfo info;
  ASSERT_TRUE(
      Call(&v1::AttentionService::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.cache_bytes(), int64_t{256} << 20);
  EXPECT_EQ(info.cache_page_tokens(), backend_->kv_page_tokens());
  EXPECT_EQ(info.cache_idle_seconds(), 0);
  // The CPU backend keeps fp8 caches: the tensor dtypes, and fp8.
  ASSERT_EQ(info.cache_dtypes_size(), info.dtypes_size() + 1);
  EXPECT_EQ(info.cache_dtypes(info.cache_dtypes_size() - 1), v1::DTYPE_FLOAT8_E4M3);
}

// --- The registry itself -------------------------------------------------------------------

KvLayout SmallLayout() {
  return KvLayout{.kv_heads = 2, .head_dim = 8, .value_dim = 8, .dtype = DType::kFloat32};
}

// n tokens of SmallLayout's shape, each element `value`.
struct SmallTokens {
  explicit SmallTokens(int64_t n, float value = 0.5f) : data(2 * n * 8, value), n(n) {}
  TensorView view() const { return TensorView{data.data(), DType::kFloat32}; }
  std::vector<float> data;
  int64_t n;
};

TEST(CacheRegistryTest, AnotherIdentityNeverSeesACache) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0});
  const absl::StatusOr<CacheDescription> mine = registry.Create("x509:CN=alice", SmallLayout());
  ASSERT_TRUE(mine.ok()) << mine.status();
  for (const std::string& other : {std::string(""), std::string("x509:CN=bob")}) {
    EXPECT_EQ(registry.Describe(other, mine->id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(registry.Acquire(other, mine->id, "cache_id").status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(registry.Delete(other, mine->id).code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(registry.List(other).empty());
  }
  EXPECT_TRUE(registry.Describe("x509:CN=alice", mine->id).ok());
  EXPECT_EQ(registry.List("x509:CN=alice").size(), 1u);
}

TEST(CacheRegistryTest, RollbackAndDeleteGiveTheBudgetBack) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0});
  const absl::StatusOr<CacheDescription> cache = registry.Create("", SmallLayout());
  ASSERT_TRUE(cache.ok());
  {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("", cache->id, "cache_id");
    ASSERT_TRUE(lease.ok());
    const SmallTokens tokens(1000);
    ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    EXPECT_EQ(lease->length(), 1000);
    EXPECT_GT(registry.bytes(), 0);
    lease->Rollback();
    EXPECT_EQ(lease->length(), 0);
  }
  EXPECT_EQ(registry.bytes(), 0);
  {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("", cache->id, "cache_id");
    const SmallTokens tokens(10);
    ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    lease->Commit();
  }
  EXPECT_EQ(registry.tokens(), 10);
  ASSERT_TRUE(registry.Delete("", cache->id).ok());
  EXPECT_EQ(registry.bytes(), 0);
  EXPECT_EQ(registry.caches(), 0);
}

TEST(CacheRegistryTest, AcquireAllHoldsSeveralCachesInRequestOrderAllOrNothing) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0});
  const absl::StatusOr<CacheDescription> a = registry.Create("", SmallLayout());
  const absl::StatusOr<CacheDescription> b = registry.Create("", SmallLayout());
  ASSERT_TRUE(a.ok() && b.ok());
  const SmallTokens tokens(7);
  {
    absl::StatusOr<CacheRegistry::LeaseGroup> leases =
        registry.AcquireAll("", {b->id, a->id}, {"items[0].cache_id", "items[1].cache_id"});
    ASSERT_TRUE(leases.ok()) << leases.status();
    ASSERT_EQ(leases->size(), 2);
    EXPECT_EQ((*leases)[0].Describe().id, b->id);  // The request's order, whatever the ids'.
    EXPECT_EQ((*leases)[1].Describe().id, a->id);
    ASSERT_TRUE((*leases)[1].Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    leases->Rollback();
    EXPECT_EQ((*leases)[1].length(), 0);
    ASSERT_TRUE((*leases)[0].Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    ASSERT_TRUE((*leases)[1].Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    leases->Commit();
  }
  EXPECT_EQ(registry.Describe("", a->id)->length, 7);
  EXPECT_EQ(registry.Describe("", b->id)->length, 7);
  // A missing cache fails the whole call, and the caches taken before it are released.
  const absl::StatusOr<CacheRegistry::LeaseGroup> missing =
      registry.AcquireAll("", {a->id, b->id, "no-such-cache"}, {"x", "y", "items[2].cache_id"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("items[2].cache_id"), std::string::npos)
      << missing.status();
  EXPECT_TRUE(registry.Acquire("", a->id, "cache_id").ok());
  EXPECT_TRUE(registry.Acquire("", b->id, "cache_id").ok());
  // The same cache twice would wait for itself.
  const absl::StatusOr<CacheRegistry::LeaseGroup> twice =
      registry.AcquireAll("", {a->id, b->id, a->id}, {"x", "y", "items[2].cache_id"});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("items[2].cache_id"), std::string::npos)
      << twice.status();
}

TEST(CacheRegistryTest, AppendsShowOnlyOnceCommittedAndALeaseEndingUncommittedTakesThemBack) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0});
  const absl::StatusOr<CacheDescription> cache = registry.Create("", SmallLayout());
  ASSERT_TRUE(cache.ok());
  const SmallTokens tokens(300);
  {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("", cache->id, "cache_id");
    ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
    EXPECT_EQ(lease->length(), 300);                         // The lease sees its own append,
    EXPECT_EQ(registry.Describe("", cache->id)->length, 0);  // nobody else yet.
    EXPECT_EQ(registry.List("")[0].length, 0);
    EXPECT_EQ(registry.tokens(), 0);
    lease->Commit();
    EXPECT_EQ(registry.Describe("", cache->id)->length, 300);
    ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
  }  // Ends without committing the second append: it is taken back.
  EXPECT_EQ(registry.Describe("", cache->id)->length, 300);
  absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("", cache->id, "cache_id");
  EXPECT_EQ(lease->length(), 300);
  EXPECT_EQ(registry.bytes(), lease->Describe().bytes);
}

TEST(CacheRegistryTest, MaxCachesBoundsTheCachesAliveAndNamesTheFlag) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0, .max_caches = 2});
  const absl::StatusOr<CacheDescription> first = registry.Create("a", SmallLayout());
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(registry.Create("b", SmallLayout()).ok());  // Counted over every owner.
  const absl::StatusOr<CacheDescription> third = registry.Create("a", SmallLayout());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max-caches=2"), std::string::npos) << third.status();
  ASSERT_TRUE(registry.Delete("a", first->id).ok());
  EXPECT_TRUE(registry.Create("a", SmallLayout()).ok());
}

TEST(CacheRegistryTest, AForkCountsAgainstMaxCachesAndItsPageTableAgainstTheBudget) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0, .max_caches = 2});
  const absl::StatusOr<CacheDescription> cache = registry.Create("a", SmallLayout());
  ASSERT_TRUE(cache.ok());
  absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("a", cache->id, "cache_id");
  ASSERT_TRUE(lease.ok());
  const SmallTokens tokens(1000);
  ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
  lease->Commit();
  const int64_t pages_bytes = registry.bytes();
  absl::StatusOr<CacheDescription> fork = registry.Fork(*lease, 1000);
  ASSERT_TRUE(fork.ok()) << fork.status();
  const int64_t pages = (1000 + fork->page_tokens - 1) / fork->page_tokens;
  EXPECT_EQ(registry.bytes(), pages_bytes + pages * CacheRegistry::kForkTableBytesPerPage);
  const absl::StatusOr<CacheDescription> third = registry.Fork(*lease, 10);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max-caches=2"), std::string::npos) << third.status();
  lease = absl::CancelledError("released");
  ASSERT_TRUE(registry.Delete("a", fork->id).ok());
  EXPECT_EQ(registry.bytes(), pages_bytes);
}

// Forks and appends from several threads at once, on pages of 3 tokens (so nearly every fork
// shares a partly filled page): an appender grows the source a token at a time, forkers fork it
// and append their own tokens to their forks, deleting every other one. Every cache always holds
// exactly its own history (a token's elements name it), and once all are deleted every byte of
// the budget is back.
TEST(CacheRegistryTest, ForksAndAppendsFromManyThreadsKeepEveryCachesTokens) {
  CpuBackend backend(1, 0, CpuBackend::kDefaultMaxPackedHeadBytes, /*kv_page_tokens=*/3);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 0});
  const std::string source = registry.Create("o", SmallLayout())->id;
  // Token t of a cache: every element `value(t)`; a fork's own tokens are negative.
  auto check = [&](const std::string& id, const std::function<float(int64_t)>& value) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("o", id, "cache_id");
    if (!lease.ok()) return ::testing::AssertionFailure() << lease.status();
    const int64_t n = lease->length();
    std::vector<float> key(2 * n * 8), stored_value(2 * n * 8);
    if (!lease->CopyOut(0, n, key.data(), stored_value.data()).ok()) {
      return ::testing::AssertionFailure() << "CopyOut";
    }
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < 8; ++c) {
          const int64_t at = (h * n + t) * 8 + c;
          if (key[at] != value(t) || stored_value[at] != value(t)) {
            return ::testing::AssertionFailure()
                   << id << " token " << t << " is " << key[at] << ", expected " << value(t);
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  };
  auto append = [&](const std::string& id, int64_t n, float value) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("o", id, "cache_id");
    ASSERT_TRUE(lease.ok());
    const SmallTokens tokens(n, value);
    ASSERT_TRUE(
        lease->Append(tokens.view(), tokens.view(), n, std::abs(value), std::abs(value)).ok());
    lease->Commit();
  };
  append(source, 1, 0.f);
  std::thread appender([&] {
    for (int i = 1; i < 300; ++i) append(source, 1, static_cast<float>(i));
  });
  std::vector<std::thread> forkers;
  std::atomic<int> failures{0};
  std::vector<std::vector<std::pair<std::string, int64_t>>> kept(3);  // (fork, its length).
  for (int f = 0; f < 3; ++f) {
    forkers.emplace_back([&, f] {
      for (int i = 0; i < 40; ++i) {
        int64_t length;
        std::string id;
        {
          absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("o", source, "cache_id");
          length = lease->length();
          absl::StatusOr<CacheDescription> fork = registry.Fork(*lease, length - i % 2);
          if (!fork.ok()) {
            ++failures;
            continue;
          }
          id = fork->id;
          length = fork->length;
        }
        const float own = -static_cast<float>(1000 * f + i + 1);
        append(id, 1 + i % 4, own);
        if (!check(id, [&](int64_t t) { return t < length ? static_cast<float>(t) : own; })) {
          ++failures;
        }
        if (i % 2 == 0) {
          if (!registry.Delete("o", id).ok()) ++failures;
        } else {
          kept[f].emplace_back(id, length);
        }
      }
    });
  }
  appender.join();
  for (std::thread& forker : forkers) forker.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(check(source, [](int64_t t) { return static_cast<float>(t); }));
  for (int f = 0; f < 3; ++f) {
    for (size_t k = 0; k < kept[f].size(); ++k) {
      const auto& [id, length] = kept[f][k];
      const float own = -static_cast<float>(1000 * f + 2 * k + 2);  // The odd i's.
      EXPECT_TRUE(check(id, [&](int64_t t) { return t < length ? static_cast<float>(t) : own; }));
      ASSERT_TRUE(registry.Delete("o", id).ok());
    }
  }
  ASSERT_TRUE(registry.Delete("o", source).ok());
  EXPECT_EQ(registry.bytes(), 0);
}

TEST(CacheRegistryTest, AnIdleCacheExpiresAndSaysSo) {
  CpuBackend backend(1, 0);
  CacheRegistry registry(backend, {.budget_bytes = 64 << 20, .idle_seconds = 1});
  const absl::StatusOr<CacheDescription> idle = registry.Create("", SmallLayout());
  const absl::StatusOr<CacheDescription> busy = registry.Create("", SmallLayout());
  ASSERT_TRUE(idle.ok() && busy.ok());
  {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("", idle->id, "cache_id");
    const SmallTokens tokens(5);
    ASSERT_TRUE(lease->Append(tokens.view(), tokens.view(), tokens.n, 0.5, 0.5).ok());
  }
  // `busy` is used every 300 ms, `idle` never again: after 2.4 s only `busy` is left.
  for (int i = 0; i < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ASSERT_TRUE(registry.Describe("", busy->id).ok()) << i;
  }
  const absl::StatusOr<CacheDescription> gone = registry.Describe("", idle->id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("expired"), std::string::npos) << gone.status();
  EXPECT_EQ(registry.caches(), 1);
  EXPECT_EQ(registry.bytes(), 0) << "the expired cache's pages were not given back";
}

}  // namespace
}  // namespace attn
