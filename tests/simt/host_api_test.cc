// Tests of the SIMT emulator's CUDA runtime (host_api.h) and cuBLAS (include/cublas_v2.h): the
// CUDA behaviour the backend relies on, and the checks the emulator adds on top of it.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace {

constexpr size_t kDefaultDeviceMemory = size_t{4} << 30;
constexpr int kDefaultSharedMemoryOptin = 166912;

// Every test starts from a clean device and must give back all it allocated.
class HostApiTest : public ::testing::Test {
 protected:
  void SetUp() override { Restore(); }
  void TearDown() override {
    Restore();
    EXPECT_EQ(simt::AllocatedBytes(), 0u) << "the test leaked device memory";
  }

 private:
  static void Restore() {
    simt::ResetDevice();
    simt::SetDeviceMemory(kDefaultDeviceMemory);
    simt::SetSharedMemoryOptin(kDefaultSharedMemoryOptin);
  }
};

TEST_F(HostApiTest, AllocationsCountAgainstTheBudget) {
  simt::SetDeviceMemory(1 << 20);
  void* a = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 600000), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  EXPECT_EQ(simt::AllocatedBytes(), 600000u);
  EXPECT_TRUE(simt::IsDeviceRange(a, 600000));
  EXPECT_TRUE(simt::IsDeviceRange(static_cast<char*>(a) + 600000, 0));  // One past the end.
  EXPECT_FALSE(simt::IsDeviceRange(a, 600001));
  EXPECT_FALSE(simt::IsDeviceRange(static_cast<char*>(a) + 599999, 2));

  // Fresh device memory reads as NaN, not as a lucky zero.
  float fresh = 0.f;
  ASSERT_EQ(cudaMemcpy(&fresh, a, sizeof(fresh), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(fresh));

  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  EXPECT_EQ(total_bytes, size_t{1} << 20);
  EXPECT_EQ(free_bytes, (size_t{1} << 20) - 600000);
  cudaDeviceProp properties;
  ASSERT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  EXPECT_EQ(properties.totalGlobalMem, size_t{1} << 20);

  void* b = &free_bytes;
  EXPECT_EQ(cudaMalloc(&b, 500000), cudaErrorMemoryAllocation);
  EXPECT_EQ(b, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(simt::AllocatedBytes(), 600000u);

  // Stream-ordered allocations share the budget and show in the default pool's statistics.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaMallocAsync(&b, 400000, stream), cudaSuccess);
  EXPECT_EQ(simt::AllocatedBytes(), 1000000u);
  cudaMemPool_t pool;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t used = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used), cudaSuccess);
  EXPECT_EQ(used, 400000u);
  EXPECT_EQ(cudaFreeAsync(b, stream), cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used), cudaSuccess);
  EXPECT_EQ(used, 0u);
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used), cudaSuccess);
  EXPECT_EQ(used, 400000u);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  void* empty = &free_bytes;
  EXPECT_EQ(cudaMalloc(&empty, 0), cudaSuccess);
  EXPECT_EQ(empty, nullptr);
  EXPECT_EQ(cudaMalloc(static_cast<void**>(nullptr), 8), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);

  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(simt::AllocatedBytes(), 0u);
  EXPECT_FALSE(simt::IsDeviceRange(a, 1));
  ASSERT_EQ(cudaMalloc(&b, 1 << 20), cudaSuccess);  // The whole budget, now that it is free.
  EXPECT_EQ(cudaFree(b), cudaSuccess);
}

TEST_F(HostApiTest, FreeingWhatWasNotAllocatedIsInvalid) {
  int host = 0;
  EXPECT_EQ(cudaFree(&host), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(nullptr), cudaSuccess);

  char* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  EXPECT_EQ(cudaFree(device + 1), cudaErrorInvalidValue);  // Not the start of the allocation.
  EXPECT_EQ(cudaFreeHost(device), cudaErrorInvalidValue);  // Device memory is not pinned memory.
  EXPECT_EQ(simt::AllocatedBytes(), 64u);

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(device, stream), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(simt::AllocatedBytes(), 64u);

  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaErrorInvalidValue);  // Twice.
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(HostApiTest, CopiesStayInsideDeviceAllocations) {
  std::vector<unsigned char> source(64), back(64, 0);
  for (int i = 0; i < 64; ++i) source[i] = static_cast<unsigned char>(3 * i + 1);
  unsigned char* device = nullptr;
  unsigned char* other = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&other, 64), cudaSuccess);

  ASSERT_EQ(cudaMemcpy(device, source.data(), 64, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(other, device, 64, cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), other, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, source);

  // Past an allocation's end, on either side of the copy.
  EXPECT_EQ(cudaMemcpy(device + 32, source.data(), 33, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(back.data(), device + 60, 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(device, other + 1, 64, cudaMemcpyDeviceToDevice), cudaErrorInvalidValue);
  // A host pointer where a device one belongs, and the reverse.
  EXPECT_EQ(cudaMemcpy(back.data(), source.data(), 8, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(device, other, 8, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(back.data(), device, 8, cudaMemcpyHostToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(device, source.data(), 8, static_cast<cudaMemcpyKind>(7)),
            static_cast<cudaError_t>(21));
  EXPECT_STREQ(cudaGetErrorName(cudaGetLastError()), "cudaErrorInvalidMemcpyDirection");

  // cudaMemcpyDefault reads the direction from the pointers, and checks the same bounds.
  std::vector<unsigned char> reversed(source.rbegin(), source.rend());
  ASSERT_EQ(cudaMemcpy(device, reversed.data(), 64, cudaMemcpyDefault), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), device, 64, cudaMemcpyDefault), cudaSuccess);
  EXPECT_EQ(back, reversed);
  EXPECT_EQ(cudaMemcpy(device + 8, reversed.data(), 57, cudaMemcpyDefault), cudaErrorInvalidValue);

  ASSERT_EQ(cudaMemset(device + 16, 0x5A, 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), device, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(back[i], i >= 16 && i < 32 ? 0x5A : reversed[i]) << i;
  }
  EXPECT_EQ(cudaMemsetAsync(device + 60, 0, 5), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(back.data(), 0, 4), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(nullptr, nullptr, 0, cudaMemcpyHostToDevice), cudaSuccess);  // Nothing.
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);

  // 2-D: 4 rows of 10 bytes into rows 16 bytes apart, as the backend pads its inputs.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(device, 0, 64, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy2DAsync(device, 16, source.data(), 10, 10, 4, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), device, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 64; ++i) {
    const int row = i / 16, column = i % 16;
    EXPECT_EQ(back[i], column < 10 ? source[row * 10 + column] : 0) << i;
  }
  // Five rows reach byte 4·16 + 10 = 74 of 64; a row wider than its pitch is a pitch error.
  EXPECT_EQ(cudaMemcpy2D(device, 16, source.data(), 10, 10, 5, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy2DAsync(device, 8, source.data(), 10, 10, 2, cudaMemcpyHostToDevice, stream),
            static_cast<cudaError_t>(12));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaMemcpyAsync(device, source.data(), 8, cudaMemcpyHostToDevice, stream),
            cudaErrorInvalidResourceHandle);

  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFree(other), cudaSuccess);
  // A copy into memory freed a moment ago is caught, not silently done.
  EXPECT_EQ(cudaMemcpy(device, source.data(), 8, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
}

int reset_hook_calls = 0;
void CountResetHook() { ++reset_hook_calls; }

TEST_F(HostApiTest, LastErrorIsPerThreadAndClearedOnRead) {
  simt::RecordError(cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  EXPECT_EQ(cudaSetDevice(1), cudaErrorInvalidDevice);
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);  // A later success does not clear it.
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);

  // Another thread's error is its own, as with CUDA's per-thread last error.
  std::thread([] {
    simt::RecordError(cudaErrorInvalidValue);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
    simt::RecordError(cudaErrorInvalidValue);
  }).join();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);

  // ResetDevice clears every thread's last error, not only the caller's.
  std::promise<void> recorded, reset;
  std::future<cudaError_t> seen = std::async(std::launch::async, [&] {
    simt::RecordError(cudaErrorInvalidValue);
    recorded.set_value();
    reset.get_future().wait();
    return cudaPeekAtLastError();
  });
  recorded.get_future().wait();
  simt::ResetDevice();
  reset.set_value();
  EXPECT_EQ(seen.get(), cudaSuccess);
}

TEST_F(HostApiTest, StickyErrorsPersistUntilResetDevice) {
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 128), cudaSuccess);
  cudaEvent_t event;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);

  simt::RecordError(cudaErrorIllegalAddress);
  simt::RecordError(cudaErrorLaunchFailure);  // The first fault is the one reported.
  EXPECT_EQ(simt::StickyError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);  // Not cleared by reading.
  void* more = nullptr;
  EXPECT_EQ(cudaMalloc(&more, 16), cudaErrorIllegalAddress);
  EXPECT_EQ(more, nullptr);
  char host[16] = {};
  EXPECT_EQ(cudaMemcpy(device, host, 16, cudaMemcpyHostToDevice), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaSetDevice(0), cudaErrorIllegalAddress);
  int count = 0;
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaSuccess);  // Needs no context.
  EXPECT_EQ(count, 1);
  cublasHandle_t handle = nullptr;
  EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_NOT_INITIALIZED);

  // Releases still release (so a broken test does not leak), but answer with the fault.
  EXPECT_EQ(cudaFree(device), cudaErrorIllegalAddress);
  EXPECT_EQ(simt::AllocatedBytes(), 0u);
  EXPECT_EQ(cudaEventDestroy(event), cudaErrorIllegalAddress);

  static const bool hook_added = (simt::AddResetHook(&CountResetHook), true);  // Once per process.
  ASSERT_TRUE(hook_added);
  const int calls = reset_hook_calls;
  simt::ResetDevice();
  EXPECT_EQ(reset_hook_calls, calls + 1);
  EXPECT_EQ(simt::StickyError(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(event), cudaErrorInvalidResourceHandle);  // It was destroyed.
  ASSERT_EQ(cudaMalloc(&device, 16), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

TEST_F(HostApiTest, StreamsAndEvents) {
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, 0x4), cudaErrorInvalidValue);
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_TRUE(simt::IsValidStream(stream));
  EXPECT_TRUE(simt::IsValidStream(nullptr));
  EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);  // Nothing is ever pending.

  cudaEvent_t start, stop, untimed;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&stop, cudaEventDefault), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&untimed, cudaEventDisableTiming), cudaSuccess);
  float ms = -1.f;
  EXPECT_EQ(cudaEventQuery(start), cudaSuccess);  // Never recorded counts as complete.
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaErrorInvalidResourceHandle);

  ASSERT_EQ(cudaEventRecord(start, stream), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(cudaEventRecord(stop), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  EXPECT_GE(ms, 0.f);
  EXPECT_GE(ms, 1.5f);  // The steady clock saw the sleep.
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, start), cudaSuccess);
  EXPECT_EQ(ms, 0.f);
  ASSERT_EQ(cudaEventRecord(untimed, stream), cudaSuccess);
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, untimed), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventElapsedTime(nullptr, start, stop), cudaErrorInvalidValue);

  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_FALSE(simt::IsValidStream(stream));
  EXPECT_EQ(cudaStreamDestroy(stream), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventRecord(start, stream), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaStreamDestroy(nullptr), cudaErrorInvalidResourceHandle);

  for (cudaEvent_t event : {start, stop, untimed}) EXPECT_EQ(cudaEventDestroy(event), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(start), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaEventQuery(start), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
}

TEST_F(HostApiTest, DeviceLooksLikeAnA100WithAnAdjustableOptin) {
  int count = 0, device = -1;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, 0);
  cudaDeviceProp properties;
  EXPECT_EQ(cudaGetDeviceProperties(&properties, 1), cudaErrorInvalidDevice);
  ASSERT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  EXPECT_STREQ(properties.name, "SIMT emulator (CPU)");
  EXPECT_EQ(properties.major, 8);
  EXPECT_EQ(properties.minor, 0);
  EXPECT_EQ(properties.warpSize, 32);
  EXPECT_EQ(properties.sharedMemPerBlockOptin, 166912u);
  EXPECT_EQ(properties.sharedMemPerBlock, 49152u);

  simt::SetSharedMemoryOptin(101376);  // An sm_86 part's 99 KiB.
  EXPECT_EQ(simt::SharedMemoryOptin(), 101376);
  ASSERT_EQ(cudaGetDeviceProperties(&properties, 0), cudaSuccess);
  EXPECT_EQ(properties.sharedMemPerBlockOptin, 101376u);
  int value = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0),
            cudaSuccess);
  EXPECT_EQ(value, 101376);
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(value, properties.multiProcessorCount);
  ASSERT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrMaxGridDimY, 0), cudaSuccess);
  EXPECT_EQ(value, properties.maxGridSize[1]);
  EXPECT_EQ(cudaDeviceGetAttribute(&value, static_cast<cudaDeviceAttr>(14), 0),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceGetAttribute(&value, cudaDevAttrWarpSize, 3), cudaErrorInvalidDevice);

  cudaMemPool_t pool;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t threshold = UINT64_MAX, read = 0;
  ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaSuccess);
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &read), cudaSuccess);
  EXPECT_EQ(read, UINT64_MAX);
  EXPECT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &threshold),
            cudaErrorInvalidValue);  // Read-only.
  EXPECT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &threshold),
            cudaErrorInvalidValue);  // Only a reset to 0.
  EXPECT_EQ(cudaMemPoolSetAttribute(nullptr, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaErrorInvalidValue);
}

TEST_F(HostApiTest, PinnedAndRegisteredHostMemory) {
  char* staging = nullptr;  // Typed, as the backend's staging buffer is.
  ASSERT_EQ(cudaHostAlloc(&staging, 100, cudaHostAllocDefault), cudaSuccess);
  std::memset(staging, 1, 100);
  char* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 100), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, staging, 100, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(staging), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(staging), cudaErrorInvalidValue);
  EXPECT_EQ(cudaHostAlloc(&staging, 100, 0x80), cudaErrorInvalidValue);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 8), cudaSuccess);
  EXPECT_EQ(cudaHostRegister(pinned, 8, cudaHostRegisterDefault),
            static_cast<cudaError_t>(712));  // Pinned already.
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);

  std::vector<char> buffer(4096);
  ASSERT_EQ(cudaHostRegister(buffer.data(), buffer.size(), cudaHostRegisterDefault), cudaSuccess);
  EXPECT_EQ(cudaHostRegister(buffer.data() + 100, 10, cudaHostRegisterDefault),
            static_cast<cudaError_t>(712));
  EXPECT_STREQ(cudaGetErrorName(cudaGetLastError()), "cudaErrorHostMemoryAlreadyRegistered");
  EXPECT_EQ(cudaHostUnregister(buffer.data()), cudaSuccess);
  EXPECT_EQ(cudaHostUnregister(buffer.data()), static_cast<cudaError_t>(713));
  EXPECT_EQ(cudaHostRegister(device, 100, cudaHostRegisterDefault), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(device), cudaSuccess);

  EXPECT_STREQ(cudaGetErrorName(cudaErrorIllegalAddress), "cudaErrorIllegalAddress");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory");
  EXPECT_NE(cudaGetErrorString(static_cast<cudaError_t>(12345)), nullptr);
}

TEST_F(HostApiTest, ConcurrentCallsKeepTheBooks) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      std::vector<int> host(64, t), back(64);
      for (int i = 0; i < 200; ++i) {
        int* device = nullptr;
        ASSERT_EQ(cudaMalloc(&device, 64 * sizeof(int)), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(device, host.data(), 64 * sizeof(int), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(back.data(), device, 64 * sizeof(int), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(back, host);
        ASSERT_EQ(cudaFree(device), cudaSuccess);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(simt::AllocatedBytes(), 0u);
}

// ---- GEMM ------------------------------------------------------------------------------------

// The test's own decoding of the 16-bit formats, independent of the emulator's.
double DecodeHalf(uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 31, mantissa = bits & 1023;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

double DecodeBfloat(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// Host copies of matrices in any of the three element types, as raw element bits.
struct Elements {
  cudaDataType type;
  std::vector<uint32_t> bits;  // The low 16 bits for the 16-bit types.

  size_t ElementBytes() const { return type == CUDA_R_32F ? 4 : 2; }
  double Value(int64_t i) const {
    if (type == CUDA_R_16F) return DecodeHalf(static_cast<uint16_t>(bits[i]));
    if (type == CUDA_R_16BF) return DecodeBfloat(static_cast<uint16_t>(bits[i]));
    float value;
    std::memcpy(&value, &bits[i], sizeof(value));
    return value;
  }
  std::vector<unsigned char> Bytes() const {
    std::vector<unsigned char> bytes(bits.size() * ElementBytes());
    for (size_t i = 0; i < bits.size(); ++i) {
      std::memcpy(&bytes[i * ElementBytes()], &bits[i], ElementBytes());  // Little-endian.
    }
    return bytes;
  }
  void FromBytes(const std::vector<unsigned char>& bytes) {
    for (size_t i = 0; i < bits.size(); ++i) {
      bits[i] = 0;
      std::memcpy(&bits[i], &bytes[i * ElementBytes()], ElementBytes());
    }
  }
};

// `count` random values of magnitude in [1/4, 4) (exactly representable in `type`), or NaN.
Elements Random(cudaDataType type, int64_t count, std::mt19937& random) {
  Elements elements{type, std::vector<uint32_t>(count)};
  for (uint32_t& bits : elements.bits) {
    const uint32_t sign = random() & 1;
    const uint32_t scale = random() % 4;  // 2^-2 .. 2^1.
    if (type == CUDA_R_16F) {
      bits = sign << 15 | (13 + scale) << 10 | (random() & 1023);
    } else if (type == CUDA_R_16BF) {
      bits = sign << 15 | (125 + scale) << 7 | (random() & 127);
    } else {
      bits = sign << 31 | (125 + scale) << 23 | (random() & 0x7FFFFF);
    }
  }
  return elements;
}

uint32_t NanBits(cudaDataType type) { return type == CUDA_R_32F ? 0x7FC00000u : 0x7E00u; }

struct GemmCase {
  cudaDataType input, output;
  cublasOperation_t transa, transb;
  int m, n, k;
  int pad;      // Extra rows in each leading dimension.
  int batches;  // 0: cublasGemmEx; otherwise cublasGemmStridedBatchedEx.
  int64_t stride_pad;
  bool shared_b;  // strideB 0: one B for every batch.
  float alpha, beta;
};

std::string Describe(const GemmCase& c) {
  auto type = [](cudaDataType t) {
    return t == CUDA_R_32F ? "32F" : t == CUDA_R_16F ? "16F" : "16BF";
  };
  return std::string(type(c.input)) + "→" + type(c.output) + " " +
         (c.transa == CUBLAS_OP_N ? "N" : "T") + (c.transb == CUBLAS_OP_N ? "N" : "T") + " " +
         std::to_string(c.m) + "×" + std::to_string(c.n) + "×" + std::to_string(c.k) + " pad " +
         std::to_string(c.pad) + " batches " + std::to_string(c.batches) +
         (c.shared_b ? " shared B" : "") + " alpha " + std::to_string(c.alpha) + " beta " +
         std::to_string(c.beta);
}

template <class T>
T* Upload(const Elements& elements) {
  const std::vector<unsigned char> bytes = elements.Bytes();
  void* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, bytes.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(device);
}

// Runs one case on the emulator and checks every element of C against a float64 product of the
// same inputs; elements of C outside the m × n matrices (leading-dimension and stride padding)
// must keep their bits. A and B padding holds NaN, so reading it would show.
void CheckGemm(const GemmCase& c, cublasHandle_t handle, std::mt19937& random) {
  SCOPED_TRACE(Describe(c));
  const bool a_plain = c.transa == CUBLAS_OP_N, b_plain = c.transb == CUBLAS_OP_N;
  const int a_rows = a_plain ? c.m : c.k, a_cols = a_plain ? c.k : c.m;
  const int b_rows = b_plain ? c.k : c.n, b_cols = b_plain ? c.n : c.k;
  const int lda = a_rows + c.pad, ldb = b_rows + c.pad, ldc = c.m + c.pad;
  const int batches = std::max(c.batches, 1);
  const int64_t stride_a = int64_t{lda} * a_cols + c.stride_pad;
  const int64_t stride_b = c.shared_b ? 0 : int64_t{ldb} * b_cols + c.stride_pad;
  const int64_t stride_c = int64_t{ldc} * c.n + c.stride_pad;

  Elements a = Random(c.input, stride_a * batches, random);
  Elements b = Random(c.input, c.shared_b ? int64_t{ldb} * b_cols : stride_b * batches, random);
  Elements c_before = Random(c.output, stride_c * batches, random);
  auto poison_padding = [](Elements& e, int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
    for (int64_t i = 0; i < static_cast<int64_t>(e.bits.size()); ++i) {
      const int64_t in_batch = stride > 0 ? i % stride : i;
      if (in_batch >= ld * cols || in_batch % ld >= rows) e.bits[i] = NanBits(e.type);
    }
  };
  poison_padding(a, a_rows, a_cols, lda, stride_a);
  poison_padding(b, b_rows, b_cols, ldb, stride_b);
  if (c.beta == 0.f) {  // C must not be read: NaN there must not reach the result.
    for (int64_t batch = 0; batch < batches; ++batch) {
      for (int j = 0; j < c.n; ++j) {
        for (int i = 0; i < c.m; ++i) {
          c_before.bits[batch * stride_c + int64_t{j} * ldc + i] = NanBits(c.output);
        }
      }
    }
  }

  const void* device_a = Upload<void>(a);
  const void* device_b = Upload<void>(b);
  void* device_c = Upload<void>(c_before);
  cublasStatus_t status;
  if (c.batches == 0) {
    status = cublasGemmEx(handle, c.transa, c.transb, c.m, c.n, c.k, &c.alpha, device_a, c.input,
                          lda, device_b, c.input, ldb, &c.beta, device_c, c.output, ldc,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  } else {
    status = cublasGemmStridedBatchedEx(handle, c.transa, c.transb, c.m, c.n, c.k, &c.alpha,
                                        device_a, c.input, lda, stride_a, device_b, c.input, ldb,
                                        stride_b, &c.beta, device_c, c.output, ldc, stride_c,
                                        c.batches, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  ASSERT_EQ(status, CUBLAS_STATUS_SUCCESS) << cublasGetStatusName(status);
  Elements c_after = c_before;
  std::vector<unsigned char> bytes(c_after.bits.size() * c_after.ElementBytes());
  ASSERT_EQ(cudaMemcpy(bytes.data(), device_c, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  c_after.FromBytes(bytes);
  cudaFree(const_cast<void*>(device_a));
  cudaFree(const_cast<void*>(device_b));
  cudaFree(device_c);

  // Rounding allowance: fp32 accumulation over k terms, then the output type's rounding.
  const double output_epsilon = c.output == CUDA_R_32F   ? 0x1p-24
                                : c.output == CUDA_R_16F ? 0x1p-11
                                                         : 0x1p-8;
  int failures = 0;
  for (int64_t batch = 0; batch < batches; ++batch) {
    const int64_t a_base = batch * stride_a, b_base = batch * stride_b;
    for (int j = 0; j < c.n; ++j) {
      for (int i = 0; i < c.m; ++i) {
        double sum = 0, magnitude = 0;
        for (int p = 0; p < c.k; ++p) {
          const double x =
              a.Value(a_base + (a_plain ? int64_t{p} * lda + i : int64_t{i} * lda + p));
          const double y =
              b.Value(b_base + (b_plain ? int64_t{j} * ldb + p : int64_t{p} * ldb + j));
          sum += x * y;
          magnitude += std::abs(x * y);
        }
        const int64_t index = batch * stride_c + int64_t{j} * ldc + i;
        const double old = c.beta != 0.f ? c_before.Value(index) : 0.0;
        const double expected = c.alpha * sum + c.beta * old;
        const double allowed = (c.k + 2) * 0x1p-24 * (std::abs(c.alpha) * magnitude) +
                               0x1p-23 * std::abs(c.beta * old) +
                               output_epsilon * std::abs(expected) + 0x1p-24;
        const double got = c_after.Value(index);
        if (!(std::abs(got - expected) <= allowed) && ++failures <= 5) {
          ADD_FAILURE() << "C[" << batch << "](" << i << ", " << j << ") = " << got << ", expected "
                        << expected << " ± " << allowed;
        }
      }
    }
  }
  for (size_t index = 0; index < c_after.bits.size(); ++index) {
    const int64_t in_batch = static_cast<int64_t>(index) % stride_c;
    const bool inside = in_batch < int64_t{ldc} * c.n && in_batch % ldc < c.m &&
                        static_cast<int64_t>(index) < stride_c * batches;
    if (!inside && c_after.bits[index] != c_before.bits[index] && ++failures <= 10) {
      ADD_FAILURE() << "C padding element " << index << " was written";
    }
  }
  EXPECT_EQ(failures, 0);
}

class GemmTest : public HostApiTest {
 protected:
  void SetUp() override {
    HostApiTest::SetUp();
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    EXPECT_EQ(cublasDestroy(handle_), CUBLAS_STATUS_SUCCESS);
    HostApiTest::TearDown();
  }
  cublasHandle_t handle_ = nullptr;
};

TEST_F(GemmTest, MatchesAFloat64ProductForEveryTypeOperationAndLayout) {
  std::mt19937 random(20240530);
  struct Shape {
    int m, n, k;
  };
  const Shape shapes[] = {{13, 7, 9}, {1, 1, 1}, {5, 17, 33}, {16, 8, 64}};
  for (cudaDataType input : {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF}) {
    for (cublasOperation_t transa : {CUBLAS_OP_N, CUBLAS_OP_T}) {
      for (cublasOperation_t transb : {CUBLAS_OP_N, CUBLAS_OP_T}) {
        for (const Shape& shape : shapes) {
          // Plain GEMM with tight leading dimensions, then a strided batch with padding.
          CheckGemm({input, CUDA_R_32F, transa, transb, shape.m, shape.n, shape.k, 0, 0, 0, false,
                     1.f, 0.f},
                    handle_, random);
          CheckGemm({input, CUDA_R_32F, transa, transb, shape.m, shape.n, shape.k, 3, 3, 5, false,
                     0.75f, -0.5f},
                    handle_, random);
        }
      }
    }
    // The backend's scores product: K (transposed) times Q per batch, scaled.
    CheckGemm({input, CUDA_R_32F, CUBLAS_OP_T, CUBLAS_OP_N, 13, 7, 9, 7, 4, 0, false, 0.125f, 0.f},
              handle_, random);
    // One B for every batch (strideB 0), as a broadcast.
    CheckGemm({input, CUDA_R_32F, CUBLAS_OP_N, CUBLAS_OP_N, 13, 7, 9, 1, 3, 2, true, 1.f, 1.f},
              handle_, random);
    // C in the inputs' own 16-bit type.
    if (input != CUDA_R_32F) {
      CheckGemm({input, input, CUBLAS_OP_N, CUBLAS_OP_T, 13, 7, 9, 2, 2, 1, false, 1.f, 0.5f},
                handle_, random);
      CheckGemm({input, input, CUBLAS_OP_T, CUBLAS_OP_N, 13, 7, 9, 0, 0, 0, false, 1.f, 0.f},
                handle_, random);
    }
  }
}

TEST_F(GemmTest, ZeroSizesAndZeroAlphaReadNeitherAnorB) {
  float c[6] = {1, 2, 3, 4, 5, 6};
  float* device_c = nullptr;
  ASSERT_EQ(cudaMalloc(&device_c, sizeof(c)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device_c, c, sizeof(c), cudaMemcpyHostToDevice), cudaSuccess);
  const float one = 1.f, half = 0.5f, zero = 0.f;
  // k = 0: C = beta C, with A and B null (not referenced).
  ASSERT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 3, 0, &one, nullptr, CUDA_R_32F, 2,
                         nullptr, CUDA_R_32F, 1, &half, device_c, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  // alpha = 0: the same, whatever A and B hold.
  ASSERT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 3, 4, &zero, nullptr, CUDA_R_32F, 2,
                         nullptr, CUDA_R_32F, 4, &half, device_c, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  // m = 0: nothing at all, not even C.
  ASSERT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 0, 3, 4, &one, nullptr, CUDA_R_32F, 1,
                         nullptr, CUDA_R_32F, 4, &one, nullptr, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  float result[6];
  ASSERT_EQ(cudaMemcpy(result, device_c, sizeof(c), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(result[i], c[i] * 0.25f) << i;
  EXPECT_EQ(cudaFree(device_c), cudaSuccess);
}

TEST_F(GemmTest, ChecksArgumentsAsCublasDoes) {
  float* a = nullptr;
  float* b = nullptr;
  float* c = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 64 * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, 64 * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&c, 64 * 4), cudaSuccess);
  const float one = 1.f, zero = 0.f;
  // m × n × k = 4 × 3 × 2; returns the status for the given changes.
  auto gemm = [&](int m, int lda, int ldb, int ldc, cudaDataType a_type, cudaDataType b_type,
                  cudaDataType c_type, cublasComputeType_t compute,
                  cublasOperation_t transa = CUBLAS_OP_N, int batches = 1) {
    return cublasGemmStridedBatchedEx(handle_, transa, CUBLAS_OP_N, m, 3, 2, &one, a, a_type, lda,
                                      0, b, b_type, ldb, 0, &zero, c, c_type, ldc, 0, batches,
                                      compute, CUBLAS_GEMM_DEFAULT);
  };
  constexpr cudaDataType f32 = CUDA_R_32F;
  constexpr cublasComputeType_t c32 = CUBLAS_COMPUTE_32F;
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, f32, f32, c32), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(gemm(-1, 4, 2, 4, f32, f32, f32, c32), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm(4, 3, 2, 4, f32, f32, f32, c32), CUBLAS_STATUS_INVALID_VALUE);  // lda < m.
  EXPECT_EQ(gemm(4, 1, 2, 4, f32, f32, f32, c32, CUBLAS_OP_T),
            CUBLAS_STATUS_INVALID_VALUE);  // Transposed A stores k = 2 rows.
  EXPECT_EQ(gemm(4, 2, 2, 4, f32, f32, f32, c32, CUBLAS_OP_T), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(gemm(4, 4, 1, 4, f32, f32, f32, c32), CUBLAS_STATUS_INVALID_VALUE);  // ldb < k.
  EXPECT_EQ(gemm(4, 4, 2, 3, f32, f32, f32, c32), CUBLAS_STATUS_INVALID_VALUE);  // ldc < m.
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, f32, f32, c32, CUBLAS_OP_N, -1), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, CUDA_R_16F, f32, c32), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, f32, CUDA_R_16F, c32), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(gemm(4, 4, 2, 4, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F, c32), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, f32, f32, CUBLAS_COMPUTE_16F), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 4, 3, 2, &one, a, f32, 4, b, f32, 2,
                         &zero, c, f32, 4, c32, static_cast<cublasGemmAlgo_t>(50)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 4, 3, 2, nullptr, a, f32, 4, b, f32, 2,
                         &zero, c, f32, 4, c32, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  EXPECT_NE(cublasGetStatusString(static_cast<cublasStatus_t>(99)), nullptr);

  // A destroyed stream fails the call as a launch on it would.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cublasSetStream(handle_, stream), CUBLAS_STATUS_SUCCESS);
  cudaStream_t got = nullptr;
  ASSERT_EQ(cublasGetStream(handle_, &got), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(got, stream);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(gemm(4, 4, 2, 4, f32, f32, f32, c32), CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  ASSERT_EQ(cublasSetStream(handle_, nullptr), CUBLAS_STATUS_SUCCESS);

  // A destroyed handle is not initialized.
  cublasHandle_t other;
  ASSERT_EQ(cublasCreate(&other), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasDestroy(other), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasDestroy(other), CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasSetStream(other, nullptr), CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cublasGemmEx(other, CUBLAS_OP_N, CUBLAS_OP_N, 4, 3, 2, &one, a, f32, 4, b, f32, 2,
                         &zero, c, f32, 4, c32, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(cudaFree(b), cudaSuccess);
  EXPECT_EQ(cudaFree(c), cudaSuccess);
}

TEST_F(GemmTest, OperandsOutsideDeviceMemoryFaultTheDevice) {
  float* a = nullptr;
  float* c = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 8 * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&c, 4 * 4), cudaSuccess);
  std::vector<float> host_b(8, 1.f);
  const float one = 1.f, zero = 0.f;
  // B in host memory: a GPU kernel would fault on it.
  EXPECT_EQ(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 4, &one, a, CUDA_R_32F, 2,
                         host_b.data(), CUDA_R_32F, 4, &zero, c, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_EQ(simt::StickyError(), cudaErrorIllegalAddress);
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  EXPECT_EQ(
      cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 4, &one, a, CUDA_R_32F, 2, a,
                   CUDA_R_32F, 4, &zero, c, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_EXECUTION_FAILED);  // The device stays broken.
  simt::ResetDevice();

  // The second batch of A runs past its allocation: nothing is written, not even batch 0.
  float poison[4] = {7, 7, 7, 7};
  ASSERT_EQ(cudaMemcpy(c, poison, sizeof(poison), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cublasGemmStridedBatchedEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 1, 4, &one, a,
                                       CUDA_R_32F, 2, 4, a, CUDA_R_32F, 4, 0, &zero, c, CUDA_R_32F,
                                       2, 2, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_EXECUTION_FAILED);
  float result[4];
  simt::ResetDevice();
  ASSERT_EQ(cudaMemcpy(result, c, sizeof(result), cudaMemcpyDeviceToHost), cudaSuccess);
  for (float value : result) EXPECT_EQ(value, 7.f);
  EXPECT_EQ(cudaFree(a), cudaSuccess);
  EXPECT_EQ(cudaFree(c), cudaSuccess);
}

}  // namespace
