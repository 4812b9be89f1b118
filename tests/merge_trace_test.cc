// attn trace --shard-keys (client/cli/merge_trace.h; issue 14): the keys of a traced problem
// split over three in-process servers on loopback (CPU backend), each slice traced with its
// positions, the slices' final states merged one server at a time. Checked: the merged estimate
// against the float64 reference of tests/reference.h (3e-6 relative), every merge step's rescale
// factors against exp(m − m_new) recomputed in double and its denominator against the rule,
// rows that see no key of a slice (max −inf, no steps, a 0 factor), GQA, causal with query_len ≠
// key_len, explicit positions, bf16 inputs, the single-server case said plainly, a stopped server
// named in the error, and the JSON lines' order and schema.
#include "client/cli/merge_trace.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/client.h"
#include "client/shard.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "server/service.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using cli::MergeTrace;
using testing::HostProblem;

constexpr int kServers = 3;
constexpr double kRelative = 3e-6;

v1::Tensor TensorOf(const std::vector<uint8_t>& bytes, DType dtype,
                    std::initializer_list<int64_t> shape) {
  v1::Tensor tensor;
  for (const int64_t extent : shape) tensor.add_shape(extent);
  tensor.set_dtype(ToProtoDType(dtype));
  tensor.set_data(bytes.data(), bytes.size());
  return tensor;
}

// The trace request of a problem (rank 4), over `rows`.
v1::TraceRequest RequestOf(const HostProblem& p, const std::vector<RowRef>& rows) {
  const Shape& s = p.shape;
  v1::TraceRequest request;
  v1::AttentionRequest& a = *request.mutable_attention();
  *a.mutable_query() =
      TensorOf(p.query_bytes, p.dtype, {s.batch, s.heads, s.query_len, s.head_dim});
  *a.mutable_key() = TensorOf(p.key_bytes, p.dtype, {s.batch, s.kv_heads, s.key_len, s.head_dim});
  *a.mutable_value() =
      TensorOf(p.value_bytes, p.dtype, {s.batch, s.kv_heads, s.key_len, s.value_dim});
  a.mutable_options()->set_causal(p.causal);
  a.mutable_options()->set_block_k(p.block_k);
  a.mutable_options()->set_key_position(p.key_position);
  if (p.query_position) a.mutable_options()->set_query_position(*p.query_position);
  if (p.window_left) a.mutable_options()->set_window_left(*p.window_left);
  if (p.window_right) a.mutable_options()->set_window_right(*p.window_right);
  a.mutable_options()->mutable_sinks()->Assign(p.sinks.begin(), p.sinks.end());
  for (const RowRef& row : rows) {
    v1::RowRef& r = *request.add_rows();
    r.set_batch(row.batch);
    r.set_head(row.head);
    r.set_row(row.row);
  }
  return request;
}

// The command's output: text and JSON lines.
std::string RunCommand(const std::vector<std::string>& endpoints,
                       const client::ClientOptions& options, const v1::TraceRequest& request,
                       bool json, absl::Status* status) {
  std::FILE* out = std::tmpfile();
  if (out == nullptr) return "";
  *status = cli::RunShardedTrace(endpoints, options, request, json, out);
  std::rewind(out);
  std::string text;
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof buffer, out)) text.append(buffer, n);
  std::fclose(out);
  return text;
}

class MergeTraceTest : public ::testing::Test {
 protected:
  struct Server {
    std::unique_ptr<CpuBackend> backend;
    std::unique_ptr<AttentionService> service;
    std::unique_ptr<grpc::Server> server;
    std::string endpoint;
  };

  void SetUp() override {
    for (Server& s : servers_) {
      s.backend = std::make_unique<CpuBackend>(2, 0);
      s.service = std::make_unique<AttentionService>(*s.backend, ServiceConfig{});
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(s.service.get());
      s.server = builder.BuildAndStart();
      ASSERT_NE(s.server, nullptr);
      s.endpoint = absl::StrCat("127.0.0.1:", port);
    }
    options_.timeout = std::chrono::seconds(30);
    // Each server answers before a test starts: on a loaded machine (ctest -j) a first connect
    // to a server just started was once refused, which a trace part does not retry.
    for (const Server& s : servers_) {
      client::Client probe(s.endpoint, options_);
      absl::StatusOr<v1::ServerInfo> info = probe.Info();
      for (int attempt = 0; !info.ok() && attempt < 100; ++attempt) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        info = probe.Info();
      }
      ASSERT_TRUE(info.ok()) << s.endpoint << ": " << info.status();
    }
  }
  void TearDown() override {
    for (Server& s : servers_) Stop(s);
  }
  static void Stop(Server& s) {
    if (s.server) s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    s.server.reset();
    s.service.reset();
    s.backend.reset();
  }

  std::vector<std::string> Endpoints(int count = kServers) const {
    std::vector<std::string> endpoints;
    for (int i = 0; i < count; ++i) endpoints.push_back(servers_[i].endpoint);
    return endpoints;
  }

  // Traces and merges `p` over `endpoints` servers, checking everything that holds for any
  // problem; returns the merge trace.
  MergeTrace Check(const HostProblem& p, const std::vector<RowRef>& rows, int endpoints) {
    const v1::TraceRequest request = RequestOf(p, rows);
    absl::StatusOr<MergeTrace> trace = cli::TraceAndMerge(Endpoints(endpoints), options_, request);
    EXPECT_TRUE(trace.ok()) << trace.status();
    if (!trace.ok()) return {};
    const testing::Reference reference = testing::ReferenceAttention(p);
    const Shape& s = p.shape;
    EXPECT_EQ(trace->rows.size(), rows.size());
    EXPECT_EQ(trace->key_len, s.key_len);
    EXPECT_EQ(trace->single_server, trace->parts.size() == 1);
    // The parts tile keys [keys_first, keys_sent) in order.
    int64_t next = trace->keys_first;
    for (const cli::TracedPart& part : trace->parts) {
      EXPECT_EQ(part.key_begin, next);
      EXPECT_LT(part.key_begin, part.key_end);
      next = part.key_end;
    }
    EXPECT_EQ(next, trace->keys_sent);
    for (size_t r = 0; r < trace->rows.size() && r < rows.size(); ++r) {
      const cli::RowMerge& row = trace->rows[r];
      const RowRef& ref = rows[r];
      SCOPED_TRACE(absl::StrCat("row ", ref.batch, ":", ref.head, ":", ref.row));
      const int64_t offset = ((ref.batch * s.heads + ref.head) * s.query_len + ref.row);
      const std::vector<double> expected(reference.output.begin() + offset * s.value_dim,
                                         reference.output.begin() + (offset + 1) * s.value_dim);
      double scale = 0, error = 0;
      for (int64_t c = 0; c < s.value_dim; ++c) {
        scale = std::max(scale, std::abs(expected[c]));
        error = std::max(error, std::abs(double(row.output[c]) - expected[c]));
        // The client's own float64 reference agrees with the tests'.
        EXPECT_NEAR(row.reference[c], expected[c], 1e-12 * std::max(1.0, scale));
      }
      EXPECT_LE(error, kRelative * scale + 1e-30) << "scale " << scale;
      EXPECT_LE(row.relative_error, kRelative);
      if (std::isinf(reference.lse[offset])) {
        EXPECT_EQ(row.lse, -INFINITY);
      } else {
        EXPECT_NEAR(row.lse, reference.lse[offset],
                    1e-5 * std::max(1.0, std::abs(double(row.lse))));
      }
      // The merge of the parts' finished (output, lse) agrees with the merge of their states.
      EXPECT_LE(row.row_done_max_abs_diff, kRelative * std::max(scale, 1e-30));
      if (row.steps.size() != trace->parts.size() || row.parts.size() != trace->parts.size()) {
        ADD_FAILURE() << row.steps.size() << " steps and " << row.parts.size() << " states of "
                      << trace->parts.size() << " parts";
        continue;
      }
      // With sinks only the first part's RowDone includes the row's sink (SplitKeys sends it
      // there); the merge adds it once at the end.
      const double sink = p.sinks.empty() ? -INFINITY : p.sinks[ref.head];
      if (!p.sinks.empty()) {
        EXPECT_NEAR(row.sink_share, std::exp(sink - reference.lse[offset]), 1e-5);
      }
      double running_max = -INFINITY;
      for (size_t i = 0; i < row.steps.size(); ++i) {
        const cli::MergeStep& step = row.steps[i];
        const cli::PartState& part = row.parts[i];
        SCOPED_TRACE(absl::StrCat("merge step ", i));
        EXPECT_EQ(step.part, static_cast<int>(i));
        EXPECT_EQ(step.max_before, static_cast<float>(running_max));
        EXPECT_EQ(step.part_max, part.max);
        const double m_new = std::max(running_max, double(part.max));
        EXPECT_EQ(step.max_after, static_cast<float>(m_new));
        // exp(m − m_new), 0 for a side that saw no key (−inf).
        const auto factor = [&](double m) { return m == -INFINITY ? 0.0 : std::exp(m - m_new); };
        EXPECT_NEAR(step.running_rescale, factor(step.max_before), 1e-6);
        EXPECT_NEAR(step.part_rescale, factor(step.part_max), 1e-6);
        if (i == 0) {
          EXPECT_EQ(step.running_rescale, 0.f);  // The running state starts empty.
        }
        const double denominator = double(step.denominator_before) * step.running_rescale +
                                   double(step.part_denominator) * step.part_rescale;
        EXPECT_NEAR(step.denominator, denominator, 1e-6 * std::max(1.0, denominator));
        EXPECT_EQ(step.denominator_before, i == 0 ? 0.f : row.steps[i - 1].denominator);
        const double part_sink = i == 0 ? sink : -INFINITY;
        if (part.steps == 0) {  // The row sees no key of this slice.
          EXPECT_EQ(part.max, -INFINITY);
          EXPECT_EQ(part.denominator, 0.f);
          EXPECT_EQ(part.lse, static_cast<float>(part_sink));
          EXPECT_EQ(step.part_rescale, 0.f);
        } else {
          EXPECT_GT(part.denominator, 0.f);
          const double keys = double(part.max) + std::log(double(part.denominator));
          const double lse =
              std::isinf(part_sink)
                  ? keys
                  : std::max(keys, part_sink) + std::log1p(std::exp(-std::abs(keys - part_sink)));
          EXPECT_NEAR(part.lse, lse, 1e-5 * std::max(1.0, std::abs(double(part.lse))));
        }
        running_max = m_new;
      }
      if (p.sinks.empty()) {
        EXPECT_EQ(row.output, row.steps.back().estimate);
      }
    }
    return *std::move(trace);
  }

  Server servers_[kServers];
  client::ClientOptions options_;
};

// Every row of every (batch, head) of a small problem.
std::vector<RowRef> AllRows(const Shape& s) {
  std::vector<RowRef> rows;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.query_len; ++i) rows.push_back({b, h, i});
    }
  }
  return rows;
}

TEST_F(MergeTraceTest, ThreeServersMergeToTheReference) {
  // Non-causal, odd sizes: the keys split evenly into three slices.
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 2, 2, 5, 37, 11, 9),
                                               DType::kFloat32, false, 5, 11);
  const MergeTrace trace = Check(p, AllRows(p.shape), kServers);
  ASSERT_EQ(trace.parts.size(), 3u);
  EXPECT_FALSE(trace.single_server);
  for (int i = 0; i < kServers; ++i) EXPECT_EQ(trace.parts[i].endpoint, servers_[i].endpoint);
  // Each slice is traced at its own key position.
  for (const cli::TracedPart& part : trace.parts) EXPECT_EQ(part.key_position, part.key_begin);
  // The estimate is not the answer until the last server is merged (here: it moves).
  const cli::RowMerge& row = trace.rows[0];
  EXPECT_GT(row.steps[0].max_abs_error, 10 * row.max_abs_error);
}

TEST_F(MergeTraceTest, SinksCountOnceOverThreeServers) {
  // Causal GQA with a window and a sink per head, more query rows than keys (the first rows see
  // no key: output 0, lse = the sink): only the first slice carries the sinks; the merged row
  // equals the reference with each sink counted once.
  // Nq 20 against Nk 13, bottom-right: rows 0..6 see no key.
  HostProblem p = testing::RandomProblem(testing::MakeShape(1, 4, 2, 20, 13, 8, 7), DType::kFloat32,
                                         true, 2, 16);
  p.window_left = 9;
  p.sinks = {0.5f, -1.f, 2.f, 1.f};
  std::vector<RowRef> rows;
  for (int64_t h = 0; h < 4; ++h) {
    for (int64_t i : {0, 6, 7, 8, 12, 19}) rows.push_back({0, h, i});
  }
  const MergeTrace trace = Check(p, rows, kServers);
  ASSERT_EQ(trace.parts.size(), 3u);
  EXPECT_EQ(trace.sinks, p.sinks);
}

TEST_F(MergeTraceTest, GroupedQueryHeads) {
  // Four query heads read two kv heads: head h reads kv head h / 2.
  const HostProblem p = testing::RandomProblem(testing::MakeShape(2, 4, 2, 3, 29, 8, 13),
                                               DType::kFloat32, false, 4, 12);
  const MergeTrace trace =
      Check(p, {{0, 0, 0}, {0, 1, 2}, {0, 3, 1}, {1, 2, 0}, {1, 3, 2}}, kServers);
  EXPECT_EQ(trace.parts.size(), 3u);
  EXPECT_EQ(trace.heads, 4);
  EXPECT_EQ(trace.kv_heads, 2);
}

TEST_F(MergeTraceTest, CausalRowsThatSeeNoKeyOfASlice) {
  // Causal with query_len ≠ key_len: bottom-right, row i sees keys [0, 20 − 12 + i]; the
  // slices are balanced by visible pairs (about 58 each: keys [0, 5), [5, 10), [10, 20)), so
  // rows 0 and 1 see nothing of the last slice.
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 2, 1, 12, 20, 10, 6),
                                               DType::kFloat32, true, 3, 13);
  const MergeTrace trace = Check(p, AllRows(p.shape), kServers);
  ASSERT_EQ(trace.parts.size(), 3u);
  int unseen = 0;
  for (const cli::RowMerge& row : trace.rows) {
    for (const cli::PartState& part : row.parts) unseen += part.steps == 0;
  }
  EXPECT_GT(unseen, 0) << "no row missed a whole slice; the test no longer covers that";
}

TEST_F(MergeTraceTest, CausalMoreQueriesThanKeysAndExplicitPositions) {
  // More query rows than keys: the first rows see no key at all (zeros, lse −inf).
  HostProblem p = testing::RandomProblem(testing::MakeShape(1, 1, 1, 12, 9, 7, 5), DType::kFloat32,
                                         true, 2, 14);
  MergeTrace trace = Check(p, AllRows(p.shape), kServers);
  EXPECT_EQ(trace.rows[0].lse, -INFINITY);
  for (float x : trace.rows[0].output) EXPECT_EQ(x, 0.f);

  // Positions of a slice of a longer sequence: keys at 100…, queries at 104….
  p = testing::RandomProblem(testing::MakeShape(1, 2, 2, 6, 25, 9, 7), DType::kFloat32, true, 4,
                             15);
  p.key_position = 100;
  p.query_position = 104;
  trace = Check(p, AllRows(p.shape), kServers);
  EXPECT_EQ(trace.key_position, 100);
  EXPECT_EQ(trace.query_position, 104);
  // Row 5 at position 109 sees keys [100, 109]: ten of them; keys past 10 go to no server.
  EXPECT_EQ(trace.keys_sent, 10);
  for (const cli::TracedPart& part : trace.parts)
    EXPECT_EQ(part.key_position, 100 + part.key_begin);
}

TEST_F(MergeTraceTest, CausalWindowSendsOnlyTheKeysSomeRowSees) {
  // Nq 8 against Nk 40, causal, window_left 6: row i (at position 32 + i) sees keys 26 + i …
  // 32 + i, so keys [0, 26) go to no server, and the parts tile [26, 40).
  HostProblem p = testing::RandomProblem(testing::MakeShape(1, 2, 1, 8, 40, 9, 7), DType::kFloat32,
                                         true, 3, 16);
  p.window_left = 6;
  const MergeTrace trace = Check(p, AllRows(p.shape), kServers);
  EXPECT_EQ(trace.keys_first, 26);
  EXPECT_EQ(trace.keys_sent, 40);
  EXPECT_EQ(trace.window_left, 6);
  EXPECT_FALSE(trace.window_right.has_value());
}

TEST_F(MergeTraceTest, Bfloat16Inputs) {
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 2, 1, 4, 40, 16, 8),
                                               DType::kBFloat16, true, 6, 16);
  Check(p, AllRows(p.shape), kServers);
}

TEST_F(MergeTraceTest, OneServerSaysSoPlainly) {
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 1, 1, 3, 17, 6, 6),
                                               DType::kFloat32, false, 4, 17);
  const MergeTrace trace = Check(p, AllRows(p.shape), 1);
  ASSERT_EQ(trace.parts.size(), 1u);
  EXPECT_TRUE(trace.single_server);
  EXPECT_EQ(trace.rows[0].steps[0].part_rescale, 1.f);

  absl::Status status;
  const std::string text =
      RunCommand(Endpoints(1), options_, RequestOf(p, {{0, 0, 1}}), false, &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_NE(text.find("One server traced all of it"), std::string::npos) << text;
  EXPECT_NE(text.find("no merge step"), std::string::npos) << text;
  EXPECT_EQ(text.find("step 1: + part 1"), std::string::npos) << text;
}

TEST_F(MergeTraceTest, TextShowsEachServerAndEachMergeStep) {
  // Causal, 8 queries × 12 keys: row 0 sees keys [0, 5), nothing of the last slice [6, 12).
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 1, 1, 8, 12, 8, 4),
                                               DType::kFloat32, true, 3, 18);
  absl::Status status;
  const std::string text =
      RunCommand(Endpoints(), options_, RequestOf(p, {{0, 0, 0}, {0, 0, 7}}), false, &status);
  ASSERT_TRUE(status.ok()) << status;
  for (const char* expected :
       {"The keys split into 3 slices", "part 3  keys", "step 1: + part 1", "step 3: + part 3",
        "rescale      running exp(−∞ − ", "max |merged − full| =", "merged output",
        "RowDone (output, lse) merged", "the causal mask hides every key of this slice"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << expected << "\n" << text;
  }
  for (int i = 0; i < kServers; ++i) {
    EXPECT_NE(text.find(servers_[i].endpoint), std::string::npos) << text;
  }
}

TEST_F(MergeTraceTest, JsonLinesFollowTheSchema) {
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 2, 1, 4, 26, 8, 5),
                                               DType::kFloat32, true, 3, 19);
  const std::vector<RowRef> rows = {{0, 0, 0}, {0, 1, 3}};
  absl::Status status;
  const std::string text = RunCommand(Endpoints(), options_, RequestOf(p, rows), true, &status);
  ASSERT_TRUE(status.ok()) << status;
  std::vector<google::protobuf::Struct> lines;
  for (const absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    google::protobuf::Struct parsed;
    const auto parse = google::protobuf::util::JsonStringToMessage(std::string(line), &parsed);
    ASSERT_TRUE(parse.ok()) << parse.ToString() << ": " << line;
    ASSERT_EQ(parsed.fields_size(), 1) << line;
    lines.push_back(parsed);
  }
  // problem, then per row: 3 parts, 3 merge steps, merged.
  ASSERT_EQ(lines.size(), 1 + rows.size() * (3 + 3 + 1)) << text;
  const auto kind = [&](size_t i) { return lines[i].fields().begin()->first; };
  const auto body = [&](size_t i) -> const google::protobuf::Struct& {
    return lines[i].fields().begin()->second.struct_value();
  };
  const auto number = [&](size_t i, const char* field) {
    return body(i).fields().at(field).number_value();
  };
  EXPECT_EQ(kind(0), "problem");
  EXPECT_EQ(number(0, "keyLen"), 26);
  EXPECT_EQ(number(0, "parts"), 3);
  EXPECT_FALSE(body(0).fields().at("singleServer").bool_value());
  EXPECT_EQ(body(0).fields().at("endpoints").list_value().values_size(), kServers);
  for (size_t r = 0; r < rows.size(); ++r) {
    const size_t first = 1 + r * 7;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(kind(first + i), "part");
      EXPECT_EQ(number(first + i, "index"), i);
      EXPECT_EQ(body(first + i).fields().at("endpoint").string_value(), servers_[i].endpoint);
      EXPECT_EQ(body(first + i).fields().at("accumulator").list_value().values_size(), 5);
      EXPECT_EQ(kind(first + 3 + i), "merge_step");
      EXPECT_EQ(number(first + 3 + i, "part"), i);
      for (const char* field : {"maxBefore", "partMax", "maxAfter", "runningRescale", "partRescale",
                                "denominator", "estimate"}) {
        EXPECT_TRUE(body(first + 3 + i).fields().contains(field)) << field;
      }
    }
    EXPECT_EQ(kind(first + 6), "merged");
    const google::protobuf::Struct& row = body(first + 6).fields().at("row").struct_value();
    EXPECT_EQ(row.fields().at("head").number_value(), rows[r].head);
    EXPECT_EQ(row.fields().at("row").number_value(), rows[r].row);
    EXPECT_LE(number(first + 6, "relativeError"), kRelative);
  }
  // The first merge step's running max is −inf (the empty state), spelled as protobuf's JSON
  // mapping spells it.
  EXPECT_EQ(body(4).fields().at("maxBefore").string_value(), "-Infinity");
}

TEST_F(MergeTraceTest, AStoppedServerIsNamedNeverMergedAround) {
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 1, 1, 2, 30, 8, 8),
                                               DType::kFloat32, false, 4, 20);
  const std::string stopped = servers_[1].endpoint;
  Stop(servers_[1]);
  options_.timeout = std::chrono::seconds(5);
  const absl::StatusOr<MergeTrace> trace =
      cli::TraceAndMerge(Endpoints(), options_, RequestOf(p, {{0, 0, 1}}));
  ASSERT_FALSE(trace.ok());
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kUnavailable) << trace.status();
  EXPECT_NE(trace.status().message().find(stopped), std::string::npos) << trace.status();
  EXPECT_NE(trace.status().message().find("part 2 of 3"), std::string::npos) << trace.status();
}

TEST_F(MergeTraceTest, ABadRowIsTheServersError) {
  const HostProblem p = testing::RandomProblem(testing::MakeShape(1, 1, 1, 2, 30, 8, 8),
                                               DType::kFloat32, false, 4, 21);
  const absl::StatusOr<MergeTrace> trace =
      cli::TraceAndMerge(Endpoints(), options_, RequestOf(p, {{0, 0, 7}}));
  ASSERT_FALSE(trace.ok());
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument) << trace.status();
  EXPECT_NE(trace.status().message().find("rows[0].row"), std::string::npos) << trace.status();
}

}  // namespace
}  // namespace attn
