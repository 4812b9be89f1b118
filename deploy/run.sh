#!/usr/bin/env bash
# Installs what is missing, builds Release and runs attnd in the foreground on
# 127.0.0.1:50051. Extra arguments go to attnd, e.g. ./deploy/run.sh --threads 4.
set -euo pipefail
cd "$(dirname "$0")/.."

./deploy/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j"$(nproc)" --target attnd attn
exec ./build/release/attnd "$@"
