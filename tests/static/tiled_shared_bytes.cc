// Prints the fused Tiled kernels' launch footprint for every dtype × compiled pitch, one line
// each: `dtype pitch shared_bytes block_k` (dynamic shared memory per block in bytes, keys per
// tile). Pure host code: needs no GPU. Read by tests/static/cuda_static_check.sh, which holds
// shared_bytes to each target architecture's opt-in limit (at run time a device with a lower
// limit gets the row kernel instead: PlanTiled in kernels/cuda/launch.h).
#include <cstdio>

#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

int main() {
  using attn::DType;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int pitch : attn::cuda::kCompiledDims) {
      std::printf("%s %d %d %d\n", attn::DTypeName(dtype), pitch,
                  attn::cuda::FusedSharedBytes(dtype, pitch), attn::cuda::kFusedBlockK);
    }
  }
  return 0;
}
