// Cache-line-aligned vectors for the CPU kernels' buffers.
//
// The kernels load and store whole 64-byte AVX-512 vectors from packed tiles and score rows. A
// std::vector's storage is only 16-byte aligned, so those accesses straddled two cache lines,
// and a split access costs two of the core's load or store slots: aligning the packed keys alone
// sped the key-tile score kernel up by about 10 % (docs/perf.md).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace attn {

inline constexpr size_t kCacheLineBytes = 64;

// std::allocator, but every block starts on a cache line.
template <class T>
struct CacheLineAllocator {
  using value_type = T;

  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}

  T* allocate(size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{kCacheLineBytes}); }

  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace attn
