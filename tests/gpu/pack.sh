#!/usr/bin/env bash
# Packs what tests/gpu/device_check.sh needs on a GPU machine that has no network, no abseil and
# no GoogleTest: run it here, on the development machine, then name the folder in the device
# tool's carry list.
#
#   tests/gpu/pack.sh            # → build/gpu-carry (must stay well under the 64 MiB carry limit)
#
# It builds gpu_test and gpu_bench (Release, CUDA on, sm_90 machine code plus compute_90 PTX;
# static cudart and GoogleTest) in its own build folder, build/gpu-carry-build, and fills
# build/gpu-carry with:
#   bin/      gpu_test, gpu_bench
#   lib/      the shared libraries they load that a bare CUDA machine lacks (abseil's, from
#             ldd); not glibc, libstdc++, libgcc, the driver (libcuda) or cuBLAS, which the GPU
#             machine has (device_check.sh finds libcublas.so.13 in its CUDA toolkit or PyTorch)
#   include/  abseil and GoogleTest headers, and
#   static/   their static libraries, for device_check.sh's fallback build with the machine's
#             own nvcc when the carried binaries do not start there
#   MANIFEST  how and from which sources it was built (device_check.sh compares the checksum)
#
# Environment: ATTN_CARRY_BUILD (build folder), ATTN_CARRY_DIR (output folder),
# ATTN_CARRY_ARCHS (CMAKE_CUDA_ARCHITECTURES, default 90), JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${ATTN_CARRY_BUILD:-build/gpu-carry-build}
CARRY=${ATTN_CARRY_DIR:-build/gpu-carry}
ARCHS=${ATTN_CARRY_ARCHS:-90}
JOBS=${JOBS:-$(nproc)}
LIMIT_MIB=48  # The device tool carries 64 MiB with the working tree; leave room for it.
start=$SECONDS

generator=()
if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja > /dev/null; then generator=(-G Ninja); fi
echo "pack: configuring $BUILD (CUDA archs $ARCHS)"
cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DATTN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -DATTN_BUILD_TESTS=ON > "$BUILD.configure.log" 2>&1 ||
  { cat "$BUILD.configure.log"; exit 1; }
echo "pack: building gpu_test gpu_bench with $JOBS jobs"
cmake --build "$BUILD" --target gpu_test gpu_bench -j "$JOBS"

bins=("$BUILD/tests/gpu/gpu_test" "$BUILD/tests/gpu/gpu_bench")
rm -rf "$CARRY"
mkdir -p "$CARRY/bin" "$CARRY/lib" "$CARRY/include" "$CARRY/static"
for bin in "${bins[@]}"; do
  cp "$bin" "$CARRY/bin/"
  strip --strip-debug "$CARRY/bin/$(basename "$bin")"
done

# Shared libraries: everything ldd resolves except what every CUDA machine has.
system='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libnvidia|libcublas|libcublasLt|libcudart)\.'
for bin in "${bins[@]}"; do
  if ldd "$bin" | grep -q 'not found'; then
    echo "pack: $bin has unresolved libraries here:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  if [[ ! $soname =~ $system ]]; then cp -L "$path" "$CARRY/lib/$soname"; fi
done
cuda_libs=$(ldd "${bins[@]}" | awk '$2 == "=>" {print $1}' | grep -E '^libcu' | sort -u | tr '\n' ' ')

# For the fallback build there: headers and static libraries of abseil and GoogleTest.
multiarch=/usr/lib/$(gcc -print-multiarch 2> /dev/null || echo x86_64-linux-gnu)
fallback=yes
for dir in /usr/include/absl /usr/include/gtest; do
  if [ -d "$dir" ]; then cp -r "$dir" "$CARRY/include/"; else fallback="no ($dir missing)"; fi
done
for lib in "$multiarch"/libabsl_*.a "$multiarch"/libgtest.a "$multiarch"/libgtest_main.a; do
  if [ -f "$lib" ]; then cp "$lib" "$CARRY/static/"; else fallback="no ($lib missing)"; fi
done

# The sources the binaries were built from, as device_check.sh checksums them.
sources=$(tests/gpu/device_check.sh --source-checksum)
# shellcheck disable=SC1091
{
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "commit: $(git rev-parse --short HEAD 2> /dev/null || echo none)$(git diff --quiet HEAD -- 2> /dev/null || echo ' (plus uncommitted changes)')"
  echo "compiler: $(c++ --version | head -1); $(/usr/local/cuda/bin/nvcc --version 2> /dev/null | tail -1)"
  echo "cuda_architectures: $ARCHS"
  echo "needs_from_the_machine: $cuda_libs"
  echo "fallback_material: $fallback"
  echo "glibc_needed: $(objdump -T "$CARRY"/bin/* "$CARRY"/lib/* 2> /dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
  echo "glibcxx_needed: $(objdump -T "$CARRY"/bin/* "$CARRY"/lib/* 2> /dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
  echo "sources: $sources"
} > "$CARRY/MANIFEST"

echo "pack: $CARRY ($((SECONDS - start)) s):"
cat "$CARRY/MANIFEST"
du -sh "$CARRY"/* | sed 's/^/  /'
kib=$(du -sk "$CARRY" | cut -f1)
echo "pack: total $((kib / 1024)) MiB ($kib KiB)"
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "pack: over $LIMIT_MIB MiB: too large to carry with the working tree" >&2
  exit 1
fi
