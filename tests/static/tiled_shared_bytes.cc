// Prints the launch footprint of the CUDA kernels for every dtype × compiled pitch, one line
// each. Pure host code: needs no GPU. Read by tests/static/cuda_static_check.sh, which holds the
// shared memory to each target architecture's opt-in limit.
//
//   tiled_shared_bytes           the fused Tiled kernels (kCompiledDims):
//                                `dtype pitch shared_bytes block_k` (dynamic shared memory per
//                                block in bytes, keys per tile); at run time a device with a lower
//                                limit gets the row kernel instead (PlanTiled in
//                                kernels/cuda/launch.h).
//   tiled_shared_bytes --decode  the split-KV decode kernel (kDecodeDims):
//                                `dtype pitch shared_bytes rows keys` (DecodeSharedBytes; the
//                                tile's query rows and keys, DecodeTileOf); at run time a device
//                                with a lower limit runs the item as Tiled.
#include <cstdio>
#include <cstring>

#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

int main(int argc, char** argv) {
  using attn::DType;
  const bool decode = argc == 2 && std::strcmp(argv[1], "--decode") == 0;
  if (argc > 2 || (argc == 2 && !decode)) {
    std::fprintf(stderr, "usage: %s [--decode]\n", argv[0]);
    return 2;
  }
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    if (dtype == DType::kFloat8E4M3 && !decode) continue;  // fp8 is a cache's: Decode reads it.
    if (decode) {
      for (int pitch : attn::cuda::kDecodeDims) {
        const attn::cuda::DecodeTile tile = attn::cuda::DecodeTileOf(pitch);
        std::printf("%s %d %d %d %d\n", attn::DTypeName(dtype), pitch,
                    attn::cuda::DecodeSharedBytes(pitch), tile.rows, tile.keys);
      }
      continue;
    }
    for (int pitch : attn::cuda::kCompiledDims) {
      std::printf("%s %d %d %d\n", attn::DTypeName(dtype), pitch,
                  attn::cuda::FusedSharedBytes(dtype, pitch), attn::cuda::kFusedBlockK);
    }
  }
  return 0;
}
