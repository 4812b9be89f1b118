// The edge benchmark's client (tests/bench/edge.sh): what attnd's edge costs beyond gRPC itself.
//
// Each case is one attention.v1 request, serialized once before the timed loop and sent as the
// same bytes (grpc::GenericStub) to attnd and to the bare echo server (echo_server.cc, built with
// attnd's ServerBuilder options, replying with as many bytes and computing nothing), one call to
// each in turn, in one process and one run. Per call it times the wall round trip; from attnd's
// reply it reads ExecutionStats.compute_ns, so overhead = wall − compute is what attnd spends
// outside the kernel. Cases (fp32, Tiled):
//   small   [1, 4, 8] q, k, v: about 420 request bytes          target p50 wall / echo ≤ 1.5
//   large   q [8, 256, 64], k, v [8, 6272, 64]: 25 MiB          target p50 overhead / echo ≤ 1.2
//   decode  q [1, 32, 1, 128], k, v [1, 8, 4096, 128]: 33.6 MB  target p50 overhead / echo ≤ 1.1
//   large-shm  the large case with q, k, v and the output in a /dev/shm region registered with
//           attnd (attnd --allow-shared-memory; attnd only: the echo has no regions)
//                                                     target p50 overhead / large's ≤ 0.3
// and, with --request=FILE, a serialized request of your own sent to --method.
//
//   edge_bench --attnd=HOST:PORT --echo=HOST:PORT [--cases=small,large,decode,large-shm]
//              [--small-calls=2000] [--large-calls=30] [--warmup=5]
//              [--request=FILE --method=/attention.v1.AttentionService/Tiled]
//
// Either target may be left out (its columns print "-"). Exits 1 on a failed call, else 0
// whether or not the targets are met: it is a benchmark, not a test.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "attention/v1/attention.grpc.pb.h"
#include "attention/v1/attention.pb.h"
#include "client/shared_memory.h"
#include "common/dashed_flags.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"

ABSL_FLAG(std::string, attnd, "", "attnd's address (host:port); empty skips it.");
ABSL_FLAG(std::string, echo, "", "The echo server's address (host:port); empty skips it.");
ABSL_FLAG(std::string, cases, "small,large,decode,large-shm", "Cases to run, comma-separated.");
ABSL_FLAG(int, small_calls, 2000, "Timed calls to each server in the small case.");
ABSL_FLAG(int, large_calls, 30, "Timed calls to each server in the large, decode and file cases.");
ABSL_FLAG(int, warmup, 5, "Untimed calls to each server before a case (10x for small).");
ABSL_FLAG(std::string, request, "", "A serialized request to send as one more case, 'file'.");
ABSL_FLAG(std::string, method, "/attention.v1.AttentionService/Tiled",
          "Full method name for --request.");
ABSL_FLAG(int, deadline_s, 120, "Deadline of each call, seconds.");

namespace {

namespace v1 = attention::v1;
using Clock = std::chrono::steady_clock;

constexpr char kTiled[] = "/attention.v1.AttentionService/Tiled";

struct Case {
  std::string name;
  std::string method;
  std::string shape{};  // For the header.
  std::string bytes{};  // The serialized request.
  int calls = 0;
  // Which ratio the target is about: wall / echo (small) or overhead / echo.
  bool target_on_wall = false;
  double target = 0;        // 0: none.
  bool attnd_only = false;  // Not sent to the echo (large-shm).
  std::string baseline;     // A case whose attnd overhead this one's is divided by (large-shm).
};

// Deterministic finite values in [-1, 1), cheap to make.
void FillTensor(v1::Tensor* tensor, std::vector<int64_t> shape, uint32_t seed) {
  int64_t elements = 1;
  for (int64_t dim : shape) {
    tensor->add_shape(dim);
    elements *= dim;
  }
  tensor->set_dtype(v1::DTYPE_FLOAT32);
  std::vector<float> values(elements);
  uint32_t state = seed * 2654435761u + 1;
  for (float& value : values) {
    state = state * 1664525u + 1013904223u;
    value = static_cast<float>(state >> 8) / static_cast<float>(1 << 23) - 1.0f;
  }
  tensor->set_data(values.data(), values.size() * sizeof(float));
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&text, i ? ", " : "", shape[i]);
  return text + "]";
}

Case MakeCase(std::string name, std::vector<int64_t> q, std::vector<int64_t> kv, int calls,
              bool target_on_wall, double target) {
  v1::AttentionRequest request;
  FillTensor(request.mutable_query(), q, 1);
  FillTensor(request.mutable_key(), kv, 2);
  FillTensor(request.mutable_value(), kv, 3);
  Case c{.name = std::move(name),
         .method = kTiled,
         .shape = absl::StrCat("q ", ShapeText(q), " k, v ", ShapeText(kv), " fp32 Tiled"),
         .calls = calls,
         .target_on_wall = target_on_wall,
         .target = target};
  request.SerializeToString(&c.bytes);
  return c;
}

// The large case through shared memory: q, k, v written into a /dev/shm file registered with
// attnd as region "edge-bench", the output written there too; the request holds shapes and
// references only. The file lives as long as `file`.
Case MakeSharedCase(const Case& large, const std::string& attnd_address,
                    std::unique_ptr<attn::client::SharedMemoryFile>& file) {
  v1::AttentionRequest inline_request;
  inline_request.ParseFromString(large.bytes);
  const int64_t output_bytes = int64_t{8} * 256 * 64 * 4;
  int64_t total = output_bytes;
  for (const v1::Tensor* t :
       {&inline_request.query(), &inline_request.key(), &inline_request.value()}) {
    total += static_cast<int64_t>(t->data().size());
  }
  absl::StatusOr<std::unique_ptr<attn::client::SharedMemoryFile>> made =
      attn::client::SharedMemoryFile::Create(absl::StrCat("attn-edge-bench-", getpid()), total);
  if (!made.ok()) {
    std::fprintf(stderr, "edge_bench: %s\n", made.status().ToString().c_str());
    std::exit(1);
  }
  file = *std::move(made);
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel(attnd_address, grpc::InsecureChannelCredentials()));
  v1::RegisterSharedMemoryRequest registration;
  registration.set_name("edge-bench");
  registration.set_key(file->key());
  registration.set_byte_size(total);
  grpc::ClientContext context;
  v1::SharedMemoryRegion region;
  if (const grpc::Status status = stub->RegisterSharedMemory(&context, registration, &region);
      !status.ok()) {
    std::fprintf(stderr, "edge_bench: large-shm needs attnd --allow-shared-memory: %s\n",
                 status.error_message().c_str());
    std::exit(1);
  }
  v1::AttentionRequest request = inline_request;
  int64_t offset = 0;
  for (v1::Tensor* t : {request.mutable_query(), request.mutable_key(), request.mutable_value()}) {
    std::memcpy(file->data() + offset, t->data().data(), t->data().size());
    *t = attn::client::SharedTensor({t->shape().begin(), t->shape().end()}, t->dtype(),
                                    "edge-bench", offset);
    offset += t->shared_memory().byte_size();
  }
  *request.mutable_output_to() = attn::client::SharedRange("edge-bench", offset, output_bytes);
  Case c{.name = "large-shm",
         .method = kTiled,
         .shape = large.shape + ", in /dev/shm",
         .calls = large.calls,
         .target = 0.3,
         .attnd_only = true,
         .baseline = "large"};
  request.SerializeToString(&c.bytes);
  return c;
}

struct Target {
  std::string label;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  grpc::CompletionQueue queue;
};

std::unique_ptr<Target> Connect(const std::string& label, const std::string& address) {
  if (address.empty()) return nullptr;
  auto target = std::make_unique<Target>();
  target->label = label;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(-1);
  arguments.SetMaxSendMessageSize(-1);
  target->channel =
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), arguments);
  if (!target->channel->WaitForConnected(std::chrono::system_clock::now() +
                                         std::chrono::seconds(20))) {
    std::fprintf(stderr, "edge_bench: cannot connect to %s at %s\n", label.c_str(),
                 address.c_str());
    std::exit(1);
  }
  target->stub = std::make_unique<grpc::GenericStub>(target->channel);
  return target;
}

struct Reply {
  int64_t wall_ns = 0;
  size_t bytes = 0;
  grpc::ByteBuffer buffer;
};

// One unary call of the pre-built bytes, timed from before the call starts to its completion.
Reply Call(Target& target, const std::string& method, const grpc::ByteBuffer& request) {
  Reply reply;
  grpc::Status status;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(absl::GetFlag(FLAGS_deadline_s)));
  const Clock::time_point start = Clock::now();
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      target.stub->PrepareUnaryCall(&context, method, request, &target.queue);
  call->StartCall();
  call->Finish(&reply.buffer, &status, nullptr);
  void* tag = nullptr;
  bool ok = false;
  if (!target.queue.Next(&tag, &ok) || !ok) status = grpc::Status(grpc::StatusCode::UNKNOWN, "");
  reply.wall_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  if (!status.ok()) {
    std::fprintf(
        stderr, "edge_bench: %s %s failed: %s %s\n", target.label.c_str(), method.c_str(),
        absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())).c_str(),
        status.error_message().c_str());
    std::exit(1);
  }
  reply.bytes = reply.buffer.Length();
  return reply;
}

// The reply's ExecutionStats.compute_ns, parsed outside the timed part (0 if it has none).
int64_t ComputeNs(grpc::ByteBuffer& buffer) {
  v1::AttentionResponse response;
  grpc::ProtoBufferReader reader(&buffer);
  if (!response.ParseFromZeroCopyStream(&reader)) return 0;
  return response.stats().compute_ns();
}

struct Samples {
  std::vector<int64_t> wall, compute, overhead;
  size_t reply_bytes = 0;
};

double Percentile(std::vector<int64_t> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  size_t rank = static_cast<size_t>(p / 100.0 * values.size() + 0.999999);
  rank = std::clamp<size_t>(rank, 1, values.size());
  return static_cast<double>(values[rank - 1]);
}

std::string Time(double ns) {
  if (ns >= 1e7) return absl::StrFormat("%.1f ms", ns / 1e6);
  if (ns >= 1e6) return absl::StrFormat("%.2f ms", ns / 1e6);
  return absl::StrFormat("%.0f us", ns / 1e3);
}

std::string Triple(const std::vector<int64_t>& values) {
  if (values.empty()) return "-";
  return absl::StrCat(Time(Percentile(values, 50)), " / ", Time(Percentile(values, 90)), " / ",
                      Time(Percentile(values, 99)));
}

std::string Bytes(size_t bytes) {
  if (bytes >= 1000000) return absl::StrFormat("%.1f MB", bytes / 1e6);
  return absl::StrCat(bytes, " B");
}

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "unknown";
}

struct Result {
  const Case* c;
  size_t request_bytes = 0;
  Samples attnd{}, echo{};
};

Result Run(const Case& c, Target* attnd, Target* echo) {
  Result result{.c = &c, .request_bytes = c.bytes.size()};
  grpc::Slice slice(c.bytes);  // One copy here; every call shares it.
  const grpc::ByteBuffer request(&slice, 1);
  const int warmup = absl::GetFlag(FLAGS_warmup) * (c.calls >= 1000 ? 10 : 1);
  std::vector<Target*> targets;
  if (attnd != nullptr) targets.push_back(attnd);
  if (echo != nullptr && !c.attnd_only) targets.push_back(echo);
  for (int i = 0; i < warmup; ++i) {
    for (Target* target : targets) Call(*target, c.method, request);
  }
  for (int i = 0; i < c.calls; ++i) {
    // Alternate which server goes first, so neither always follows the other's work.
    for (size_t t = 0; t < targets.size(); ++t) {
      Target* target = targets[(t + i) % targets.size()];
      Reply reply = Call(*target, c.method, request);
      Samples& samples = target == attnd ? result.attnd : result.echo;
      samples.wall.push_back(reply.wall_ns);
      samples.reply_bytes = reply.bytes;
      if (target == attnd) {
        const int64_t compute = ComputeNs(reply.buffer);
        samples.compute.push_back(compute);
        samples.overhead.push_back(reply.wall_ns - compute);
      }
    }
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("edge_bench: attnd's per-call cost beside a bare gRPC echo.");
  attn::DashedFlags flags(argc, argv);
  absl::ParseCommandLine(flags.argc(), flags.argv());
  std::unique_ptr<Target> attnd = Connect("attnd", absl::GetFlag(FLAGS_attnd));
  std::unique_ptr<Target> echo = Connect("echo", absl::GetFlag(FLAGS_echo));
  if (!attnd && !echo) {
    std::fprintf(stderr, "edge_bench: give --attnd and/or --echo\n");
    return 2;
  }

  const int small_calls = absl::GetFlag(FLAGS_small_calls);
  const int large_calls = absl::GetFlag(FLAGS_large_calls);
  std::vector<Case> cases;
  std::unique_ptr<attn::client::SharedMemoryFile> shared_file;  // large-shm's region.
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_cases), ',', absl::SkipEmpty())) {
    if (name == "small") {
      cases.push_back(MakeCase("small", {1, 4, 8}, {1, 4, 8}, small_calls, true, 1.5));
    } else if (name == "large") {
      cases.push_back(MakeCase("large", {8, 256, 64}, {8, 6272, 64}, large_calls, false, 1.2));
    } else if (name == "decode") {
      cases.push_back(
          MakeCase("decode", {1, 32, 1, 128}, {1, 8, 4096, 128}, large_calls, false, 1.1));
    } else if (name == "large-shm") {
      if (!attnd) {
        std::fprintf(stderr, "edge_bench: large-shm needs --attnd\n");
        return 2;
      }
      const Case large = MakeCase("large", {8, 256, 64}, {8, 6272, 64}, large_calls, false, 1.2);
      cases.push_back(MakeSharedCase(large, absl::GetFlag(FLAGS_attnd), shared_file));
    } else {
      std::fprintf(stderr, "edge_bench: unknown case %s (small, large, decode, large-shm)\n",
                   std::string(name).c_str());
      return 2;
    }
  }
  if (const std::string file = absl::GetFlag(FLAGS_request); !file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "edge_bench: cannot read %s\n", file.c_str());
      return 2;
    }
    Case c{
        .name = "file", .method = absl::GetFlag(FLAGS_method), .shape = file, .calls = large_calls};
    c.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    cases.push_back(std::move(c));
  }

  std::printf("edge benchmark: attnd %s vs bare gRPC echo %s (attnd's ServerBuilder options)\n",
              attnd ? absl::GetFlag(FLAGS_attnd).c_str() : "-",
              echo ? absl::GetFlag(FLAGS_echo).c_str() : "-");
  std::printf("CPU: %s, %u hardware threads; one call at a time, servers alternating\n",
              CpuModel().c_str(), std::thread::hardware_concurrency());
  std::vector<Result> results;
  for (const Case& c : cases) {
    std::printf("  %-6s %s: %zu request bytes, %d timed calls each\n", c.name.c_str(),
                c.shape.c_str(), c.bytes.size(), c.calls);
    std::fflush(stdout);
    results.push_back(Run(c, attnd.get(), echo.get()));
  }

  std::printf("\n%-6s  %-10s  %-15s  %-30s  %-9s  %-30s  %-30s  %9s  %8s\n", "case", "request",
              "reply attnd/echo", "attnd wall p50 / p90 / p99", "compute",
              "attnd overhead p50 / p90 / p99", "echo p50 / p90 / p99", "wall/echo", "ovh/echo");
  for (const Result& r : results) {
    const double echo_p50 = Percentile(r.echo.wall, 50);
    const bool both = !r.attnd.wall.empty() && echo_p50 > 0;
    const std::string reply =
        absl::StrCat(r.attnd.wall.empty() ? "-" : absl::StrCat(r.attnd.reply_bytes), "/",
                     r.echo.wall.empty() ? "-" : absl::StrCat(r.echo.reply_bytes));
    std::printf(
        "%-6s  %-10s  %-15s  %-30s  %-9s  %-30s  %-30s  %9s  %8s\n", r.c->name.c_str(),
        Bytes(r.request_bytes).c_str(), reply.c_str(), Triple(r.attnd.wall).c_str(),
        r.attnd.compute.empty() ? "-" : Time(Percentile(r.attnd.compute, 50)).c_str(),
        Triple(r.attnd.overhead).c_str(), Triple(r.echo.wall).c_str(),
        both ? absl::StrFormat("%.2f", Percentile(r.attnd.wall, 50) / echo_p50).c_str() : "-",
        both ? absl::StrFormat("%.2f", Percentile(r.attnd.overhead, 50) / echo_p50).c_str() : "-");
  }
  if (std::any_of(results.begin(), results.end(),
                  [](const Result& r) { return r.c->target > 0; })) {
    std::printf("\ntargets (issue 12, item 7), ratios of p50s:\n");
  }
  for (const Result& r : results) {
    if (r.c->target == 0) continue;
    if (!r.c->baseline.empty()) {  // This case's attnd overhead against another case's.
      const Result* base = nullptr;
      for (const Result& other : results) {
        if (other.c->name == r.c->baseline) base = &other;
      }
      const std::string what = absl::StrCat("attnd overhead / ", r.c->baseline, "'s over gRPC");
      if (base == nullptr || base->attnd.overhead.empty()) {
        std::printf("  %-6s %-50s not measured (run the %s case too)\n", r.c->name.c_str(),
                    what.c_str(), r.c->baseline.c_str());
        continue;
      }
      const double ratio = Percentile(r.attnd.overhead, 50) / Percentile(base->attnd.overhead, 50);
      std::printf("  %-6s %-50s %5.2f  target <= %.1f  %s (issue 32)\n", r.c->name.c_str(),
                  what.c_str(), ratio, r.c->target, ratio <= r.c->target ? "met" : "MISSED");
      continue;
    }
    const double echo_p50 = Percentile(r.echo.wall, 50);
    const char* what = r.c->target_on_wall ? "attnd wall / echo round trip"
                                           : "attnd overhead (wall - compute) / echo round trip";
    if (r.attnd.wall.empty() || echo_p50 <= 0) {
      std::printf("  %-6s %-50s not measured (needs both servers)\n", r.c->name.c_str(), what);
      continue;
    }
    const double ratio =
        Percentile(r.c->target_on_wall ? r.attnd.wall : r.attnd.overhead, 50) / echo_p50;
    std::printf("  %-6s %-50s %5.2f  target <= %.1f  %s\n", r.c->name.c_str(), what, ratio,
                r.c->target, ratio <= r.c->target ? "met" : "MISSED");
  }
  return 0;
}
