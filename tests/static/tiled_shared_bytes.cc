// Prints the fused Tiled kernel's launch footprint for every dtype × compiled pitch, one line
// each: `dtype pitch shared_bytes block_k` (dynamic shared memory per block in bytes, keys per
// tile). Pure host code: needs no GPU. Read by tests/static/cuda_static_check.sh, which holds
// shared_bytes to each target architecture's opt-in limit.
#include <cstdio>

#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

int main() {
  using attn::DType;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int pitch : attn::cuda::kCompiledDims) {
      attn::cuda::DeviceProblem problem;
      problem.dtype = dtype;
      problem.pitch = pitch;
      problem.shape.head_dim = pitch;
      problem.shape.value_dim = pitch;
      std::printf("%s %d %d %d\n", attn::DTypeName(dtype), pitch,
                  attn::cuda::TiledSharedBytes(problem), attn::cuda::TiledBlockK(problem));
    }
  }
  return 0;
}
