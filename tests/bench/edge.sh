#!/usr/bin/env bash
# The edge benchmark: what attnd's edge (request check, hand-off to a compute worker, reply,
# request log) costs beyond gRPC itself. Starts attnd and the bare gRPC echo server
# (echo_server.cc: attnd's ServerBuilder options, replies of attnd's size, no compute) on free
# loopback ports, runs edge_bench against both, one call to each in turn, and prints one table:
# p50/p90/p99 wall per call, attnd's overhead (wall − its reported compute_ns), the echo's round
# trip, and the ratios of issue 12's targets (small call ≤ 1.5× the echo, 25 MiB call's overhead
# ≤ 1.2×, decode-shaped 33.6 MB call's ≤ 1.1×), and issue 32's: the 25 MiB call with its tensors
# and output in a /dev/shm region (attnd runs with --allow-shared-memory), its overhead ≤ 0.3×
# the same call's over gRPC bytes. About 20 s on 2 cores.
#
#   tests/bench/edge.sh [--quick] [--threads N] [--no-build] [--keep DIR] [-- ATTND_FLAGS...]
#
# --quick       200 small and 5 large calls each: a smoke run of seconds
# --threads N   attnd --threads (default: attnd's own, every hardware thread)
# --no-build    use the binaries as built (default: an incremental build of the three first)
# --keep DIR    keep attnd.log and echo.log there (default: a temporary folder, removed)
# after --      more attnd flags, e.g. -- --log-level=error
# Environment: ATTN_BENCH_BUILD_DIR (default build/release), ATTN_EDGE_MAX_MESSAGE_BYTES (given to
# both servers; default 1073741824), ATTN_EDGE_FLAGS (more edge_bench flags, e.g.
# "--small-calls=5000 --cases=small").
#
# Not a test: it exits 0 when the run completes, whether or not the targets are met.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
# shellcheck source=../attnd_lib.sh
source tests/attnd_lib.sh

build_dir="${ATTN_BENCH_BUILD_DIR:-build/release}"
max_message_bytes="${ATTN_EDGE_MAX_MESSAGE_BYTES:-1073741824}"
build=1
keep=""
bench_args=()
attnd_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) bench_args+=(--small-calls=200 --large-calls=5 --warmup=2) ;;
    --threads) attnd_args+=(--threads "$2"); shift ;;
    --threads=*) attnd_args+=("$1") ;;
    --no-build) build=0 ;;
    --keep) keep="$2"; shift ;;
    --keep=*) keep="${1#*=}" ;;
    --) shift; attnd_args+=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "edge.sh: unknown argument $1 (attnd flags go after --)" >&2; exit 2 ;;
  esac
  shift
done
# shellcheck disable=SC2206
bench_args+=(${ATTN_EDGE_FLAGS:-})

if [ "$build" = 1 ]; then
  if [ ! -f "$build_dir/CMakeCache.txt" ]; then
    cmake --preset release >/dev/null
  fi
  cmake --build "$build_dir" -j"$(nproc)" --target attnd echo_server edge_bench >/dev/null
fi
attnd="$build_dir/attnd"
echo_server="$build_dir/tests/bench/echo_server"
edge_bench="$build_dir/tests/bench/edge_bench"
for binary in "$attnd" "$echo_server" "$edge_bench"; do
  [ -x "$binary" ] || { echo "edge.sh: $binary is missing (build it, or drop --no-build)" >&2; exit 2; }
done

logs="${keep:-$(mktemp -d -t attn-edge.XXXXXX)}"
mkdir -p "$logs"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "$keep" ] || rm -rf "$logs"
}
trap cleanup EXIT

attnd_cmd=("$attnd" --listen=127.0.0.1:0 --http-listen= --max-message-bytes="$max_message_bytes"
  --allow-shared-memory "${attnd_args[@]}")
"${attnd_cmd[@]}" >"$logs/attnd.log" 2>&1 &
pids+=($!)
attnd_port=$(attnd_wait_port "${pids[0]}" "$logs/attnd.log")
"$echo_server" --listen=127.0.0.1:0 --max-message-bytes="$max_message_bytes" \
  >"$logs/echo.log" 2>&1 &
pids+=($!)
echo_port=$(attnd_wait_port "${pids[1]}" "$logs/echo.log")

echo "attnd: ${attnd_cmd[*]}"
sed -n 's/^ *\(device: .*\)/  \1/p' "$logs/attnd.log"
echo "echo:  $echo_server --max-message-bytes=$max_message_bytes"
"$edge_bench" --attnd="127.0.0.1:$attnd_port" --echo="127.0.0.1:$echo_port" "${bench_args[@]}"
