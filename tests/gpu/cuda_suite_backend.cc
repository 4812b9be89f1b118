#include "tests/gpu/cuda_suite_backend.h"

#include <string>

#include "kernels/cuda/cuda_backend.h"

namespace attn::testing {

SuiteBackend CudaSuiteBackend() {
  return SuiteBackend{
      .name = "Cuda",
      .open =
          [](const SuiteOptions& options) {
            cuda::CudaBackendOptions cuda_options;
            cuda_options.max_naive_bytes = options.max_naive_bytes;
            cuda_options.kv_page_tokens = options.kv_page_tokens;
            return cuda::MakeCudaBackend(0, cuda_options);
          },
      .must_open = [] { return cuda::DeviceCount() > 0 || GpuRequired(); },
      .traits = {.tiled_rounds_probabilities = true,
                 .trace_is_tiled_bit_for_bit = false,
                 .naive_bits_ignore_grouping = false},
  };
}

}  // namespace attn::testing
