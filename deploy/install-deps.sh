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
  openssl  # tests/security_test.sh makes its TLS certificates with it.
  clang libclang-rt-14-dev  # The libFuzzer target (tests/fuzz, the "fuzz" CMake preset).
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
