#!/usr/bin/env bash
# Installs what is missing, builds (Release preset, the same build deploy/run.sh serves from)
# and runs every test: C++ unit and service tests, the Python client test, the CLI test and
# the format check. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

./deploy/install-deps.sh
cmake --preset release
cmake --build --preset release -j"$(nproc)"
ctest --preset release -j"$(nproc)"
