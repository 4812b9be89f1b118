#!/usr/bin/env bash
# Installs every system package attnd needs to build, test and run, and nothing else.
# The one install step: deploy/run.sh, tests/run.sh, .ci/run and the Dockerfile all call it.
# Idempotent and quiet when everything is present; needs root (or sudo) only when something is
# missing.
#   ATTN_DEPS=all (the default)  build, test and run on this machine
#   ATTN_DEPS=build              the Dockerfile's build stage: configure and build the release
#                                preset
#   ATTN_DEPS=runtime            the Dockerfile's runtime stage: the shared libraries attnd and attn
#                                link, by this distribution's package names
set -euo pipefail
mode=${ATTN_DEPS:-all}

packages=(
  build-essential cmake pkg-config git clang-format
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libcpp-httplib-dev
  libboost-context-dev  # tests/simt: the SIMT emulator runs each CUDA thread as a fiber.
  python3 python3-grpcio python3-numpy
  python3-yaml yamllint  # tests/deploy_static_test.py: the Dockerfile and deploy/k8s manifests.
  openssl  # tests/security_test.sh makes its TLS certificates with it.
  clang libclang-rt-14-dev  # The libFuzzer target (tests/fuzz, the "fuzz" CMake preset).
  chromium  # tests/browser_test.sh drives the web viewer in it (with playwright-core, below).
  # tests/image_test.sh: a Docker engine, a Debian 12 base image made from this machine's package
  # registry (no image registry is reachable), and Compose v1 for deploy/compose.yaml.
  docker.io debootstrap docker-compose
)
# Node and npm for tests/browser and client/node: Debian's unless a node (e.g. NodeSource's,
# which brings its own npm) is already installed.
command -v node >/dev/null || packages+=(nodejs npm)

case "$mode" in
  all) ;;
  build)
    # Only what configuring and building the release preset needs: no chromium (Ubuntu 24.04 has
    # no such deb), fuzz toolchain, container tools, Node or npm packages.
    kept=()
    for p in "${packages[@]}"; do
      case "$p" in
        chromium | clang | libclang-rt-14-dev) ;;
        docker.io | debootstrap | docker-compose | nodejs | npm) ;;
        *) kept+=("$p") ;;
      esac
    done
    packages=("${kept[@]}")
    ;;
  runtime)
    # What `ldd attnd attn` lists, by the package that ships each library; their dependencies
    # bring the rest (gRPC: re2, c-ares, OpenSSL; cpp-httplib: brotli, zlib). OpenBLAS is not
    # among them: only the CPU benchmark links it (tests/bench). The names differ by distribution: Ubuntu 24.04 renamed libraries for the
    # 64-bit time_t transition (…t64) and ships cpp-httplib 0.14 where Debian 12 has 0.11.
    # tests/image_test.sh installs the Debian 12 list into a real image on every run. The Ubuntu
    # 24.04 list is UNVERIFIED by any install: the only package registry these machines reach is
    # Debian's. It matches stored copies of Ubuntu's package pages for noble; the first GPU image
    # build is its test.
    # shellcheck source=/dev/null
    . /etc/os-release
    case "${ID:-} ${VERSION_ID:-}" in
      "debian 12")
        packages=(libgrpc++1.51 libprotobuf32 libabsl20220623 libcpp-httplib0.11)
        ;;
      "ubuntu 24.04")
        packages=(libgrpc++1.51t64 libprotobuf32t64 libabsl20220623t64 libcpp-httplib0.14t64)
        ;;
      *)
        echo "install-deps: ATTN_DEPS=runtime knows the package names of Debian 12 and" \
          "Ubuntu 24.04, not of ${PRETTY_NAME:-this system}" >&2
        exit 2
        ;;
    esac
    ;;
  *)
    echo "install-deps: ATTN_DEPS=$mode: expected all, build or runtime" >&2
    exit 2
    ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -ne 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm packages, exactly as each package-lock.json pins them; skipped while node_modules holds
# the install of the same lock (npm ci empties node_modules, so the stamp goes with it).
[ "$mode" = all ] || exit 0
root="$(cd "$(dirname "$0")/.." && pwd)"
for dir in tests/browser client/node; do
  lock="$root/$dir/package-lock.json"
  stamp="$root/$dir/node_modules/.install-deps-lock"
  cmp -s "$lock" "$stamp" 2>/dev/null && continue
  echo "install-deps: npm ci --prefix $dir"
  npm ci --prefix "$root/$dir" --no-audit --no-fund --loglevel=error >/dev/null
  cp "$lock" "$stamp"
done
