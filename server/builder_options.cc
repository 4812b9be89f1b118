#include "server/builder_options.h"

namespace attn {

void ApplyBuilderOptions(grpc::ServerBuilder& builder, const BuilderOptions& options) {
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
}

}  // namespace attn
