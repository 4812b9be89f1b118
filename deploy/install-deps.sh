#!/usr/bin/env bash
# Installs every system package attnd needs to build, test and run, and nothing else.
# The one install step: deploy/run.sh, tests/run.sh, .ci/run and the Dockerfile all call it.
# Idempotent and quiet when everything is present; needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git clang-format
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libcpp-httplib-dev
  python3 python3-grpcio python3-numpy
  python3-yaml yamllint  # tests/deploy_static_test.py: the Dockerfile and deploy/k8s manifests.
  openssl  # tests/security_test.sh makes its TLS certificates with it.
  clang libclang-rt-14-dev  # The libFuzzer target (tests/fuzz, the "fuzz" CMake preset).
  chromium  # tests/browser_test.sh drives the web viewer in it (with playwright-core, below).
)
# Node and npm for tests/browser and client/node: Debian's unless a node (e.g. NodeSource's,
# which brings its own npm) is already installed.
command -v node >/dev/null || packages+=(nodejs npm)
# ATTN_DEPS=build (the Dockerfile's build stage): only what configuring and building the release
# preset needs: no chromium (Ubuntu 24.04 has no such deb), fuzz toolchain, Node or npm packages.
if [ "${ATTN_DEPS:-all}" = build ]; then
  kept=()
  for p in "${packages[@]}"; do
    case "$p" in chromium | clang | libclang-rt-14-dev | nodejs | npm) ;; *) kept+=("$p") ;; esac
  done
  packages=("${kept[@]}")
fi

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
[ "${ATTN_DEPS:-all}" = build ] && exit 0
root="$(cd "$(dirname "$0")/.." && pwd)"
for dir in tests/browser client/node; do
  lock="$root/$dir/package-lock.json"
  stamp="$root/$dir/node_modules/.install-deps-lock"
  cmp -s "$lock" "$stamp" 2>/dev/null && continue
  echo "install-deps: npm ci --prefix $dir"
  npm ci --prefix "$root/$dir" --no-audit --no-fund --loglevel=error >/dev/null
  cp "$lock" "$stamp"
done
