// The edge benchmark's baseline (tests/bench/edge.sh): a bare gRPC C++ callback server that
// answers attention.v1's Naive and Tiled with a reply of the size attnd's would have, and computes
// nothing. It is built with attnd's own ServerBuilder options (server/builder_options.h) and takes
// the same request bytes, so edge_bench's "echo" column is what gRPC and protobuf alone cost for a
// call: parse the request, allocate and zero the output, serialize it, move both over loopback.
// attnd's time beyond that (minus its reported compute_ns) is its edge.
//
//   echo_server [--listen=127.0.0.1:0] [--max-message-bytes=N]
//
// Prints "echo_server serving attention.v1 on ADDRESS (port N)" once listening (the line
// tests/attnd_lib.sh's attnd_wait_port reads) and serves until killed. No validation: the
// benchmark sends only well-formed requests; a malformed shape gets INVALID_ARGUMENT.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "attention/v1/attention.grpc.pb.h"
#include "common/dashed_flags.h"
#include "grpcpp/grpcpp.h"
#include "server/builder_options.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "Address to serve on (host:port; :0 picks a port).");
ABSL_FLAG(int64_t, max_message_bytes, attn::BuilderOptions{}.max_message_bytes,
          "Largest request or response message, bytes (attnd's --max-message-bytes).");

namespace {

namespace v1 = attention::v1;

int64_t ElementBytes(v1::DType dtype) { return dtype == v1::DTYPE_FLOAT32 ? 4 : 2; }

// Elements of a shape without its last dimension (rows), or -1 for an empty shape.
int64_t Rows(const v1::Tensor& tensor) {
  if (tensor.shape_size() == 0) return -1;
  int64_t rows = 1;
  for (int i = 0; i + 1 < tensor.shape_size(); ++i) rows *= tensor.shape(i);
  return rows;
}

class EchoService final : public v1::AttentionService::CallbackService {
 public:
  grpc::ServerUnaryReactor* Naive(grpc::CallbackServerContext* context,
                                  const v1::AttentionRequest* request,
                                  v1::AttentionResponse* response) override {
    return Answer(context, *request, response);
  }
  grpc::ServerUnaryReactor* Tiled(grpc::CallbackServerContext* context,
                                  const v1::AttentionRequest* request,
                                  v1::AttentionResponse* response) override {
    return Answer(context, *request, response);
  }

 private:
  // The reply attnd would send: output [.., heads, query_len, value_dim] in the output dtype,
  // lse when asked, and stats with every field set (their values are not attnd's).
  static grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                          const v1::AttentionRequest& request,
                                          v1::AttentionResponse* response) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const v1::Tensor& query = request.query();
    const int64_t rows = Rows(query);
    if (rows < 0 || request.value().shape_size() == 0) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty shape"));
      return reactor;
    }
    const int64_t value_dim = request.value().shape(request.value().shape_size() - 1);
    const v1::DType dtype = request.options().output_dtype() != v1::DTYPE_UNSPECIFIED
                                ? request.options().output_dtype()
                                : query.dtype();
    v1::Tensor* output = response->mutable_output();
    *output->mutable_shape() = query.shape();
    output->set_shape(output->shape_size() - 1, value_dim);
    output->set_dtype(dtype);
    output->mutable_data()->resize(rows * value_dim * ElementBytes(dtype));
    if (request.options().return_lse()) {
      v1::Tensor* lse = response->mutable_lse();
      *lse->mutable_shape() = query.shape();
      lse->mutable_shape()->RemoveLast();
      lse->set_dtype(v1::DTYPE_FLOAT32);
      lse->mutable_data()->resize(rows * sizeof(float));
    }
    v1::ExecutionStats* stats = response->mutable_stats();
    stats->set_backend("echo");
    stats->set_device("bare gRPC echo (no attention)");
    stats->set_block_k(64);
    stats->set_compute_ns(1);
    stats->set_server_ns(1);
    stats->set_flops(1.0);
    stats->set_scratch_bytes(1);
    stats->set_peak_memory_bytes(1);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("echo_server: attention.v1 replies of attnd's size, no compute.");
  attn::DashedFlags flags(argc, argv);
  absl::ParseCommandLine(flags.argc(), flags.argv());
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1024 || max_message_bytes > INT32_MAX) {
    std::fprintf(stderr, "echo_server: --max-message-bytes must be in [1024, %d]\n", INT32_MAX);
    return 2;
  }

  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  attn::ApplyBuilderOptions(builder, {.max_message_bytes = max_message_bytes});
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "echo_server: cannot listen on %s\n", listen.c_str());
    return 2;
  }
  std::printf("echo_server serving attention.v1 on %s (port %d) max-message-bytes=%lld\n",
              listen.c_str(), port, static_cast<long long>(max_message_bytes));
  std::fflush(stdout);
  server->Wait();
  return 0;
}
