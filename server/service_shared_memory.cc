// AttentionService's shared-memory RPCs (RegisterSharedMemory, UnregisterSharedMemory,
// SharedMemoryStatus): each a few system calls at most (opening the region's file), answered on
// gRPC's thread. The regions themselves, and the reads and writes of tensors in them, are
// shared_memory.h's; the handlers that take such tensors resolve them through
// ResolveSharedMemory (service.h).
#include <string>
#include <vector>

#include "server/security.h"
#include "server/service.h"
#include "server/service_internal.h"

namespace attn {

namespace v1 = attention::v1;
using service_internal::Failed;
using service_internal::Finished;

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
    v1::SharedMemoryRegion* response) {
  absl::StatusOr<v1::SharedMemoryRegion> region =
      shared_memory_.Register(CallerIdentity(*context), *request);
  if (!region.ok()) return Failed(context, region.status());
  *response = *std::move(region);
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  absl::StatusOr<std::vector<std::string>> names =
      shared_memory_.Unregister(CallerIdentity(*context), request->name());
  if (!names.ok()) return Failed(context, names.status());
  for (std::string& name : *names) response->add_names(std::move(name));
  return Finished(context);
}

grpc::ServerUnaryReactor* AttentionService::SharedMemoryStatus(
    grpc::CallbackServerContext* context, const v1::SharedMemoryStatusRequest* request,
    v1::SharedMemoryStatusResponse* response) {
  absl::StatusOr<std::vector<v1::SharedMemoryRegion>> regions =
      shared_memory_.Status(CallerIdentity(*context), request->name());
  if (!regions.ok()) return Failed(context, regions.status());
  for (v1::SharedMemoryRegion& region : *regions) *response->add_regions() = std::move(region);
  return Finished(context);
}

}  // namespace attn
