#!/usr/bin/env bash
# The persistence benchmark (issue 29; not a test): what --cache-dir costs a decode step, how fast
# a restart restores, and how fast a cache moves, beside the copy bandwidth of the same run.
#
#   tests/bench/persistence.sh [--quick] [--no-build] [--dir DIR]
#
# Starts two attnd on free loopback ports, one plain and one with --cache-dir DIR (default: a
# temporary folder), and runs persistence_bench: a bf16 32k-token decode cache on each (32/8
# heads, d 128), decode steps alternating between them (p50 ratio; the issue's target is
# ≤ 1.05×), then ExportCache and ImportCache throughput beside a memcpy of the same bytes. Then it
# fills the persistent server with caches to about 1 GiB, stops it (SIGTERM: the flush), starts
# it again on the same directory and reads the restore time from its startup line (per GiB).
# --quick: 4096 tokens, 40 steps, about 128 MiB restored. Prints the CPU model first.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
# shellcheck source=../attnd_lib.sh
source tests/attnd_lib.sh

build_dir="${ATTN_BENCH_BUILD_DIR:-build/release}"
build=1
tokens=32768
steps=200
fill=7  # 7 more 32k caches of 128 MiB: 1 GiB with the decode cache.
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) tokens=4096; steps=40; fill=7 ;;
    --no-build) build=0 ;;
    --dir) dir="$2"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "persistence.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$build" = 1 ]; then
  [ -f "$build_dir/CMakeCache.txt" ] || cmake --preset release >/dev/null
  cmake --build "$build_dir" -j"$(nproc)" --target attnd persistence_bench >/dev/null
fi
attnd="$build_dir/attnd"
bench="$build_dir/tests/bench/persistence_bench"
work=$(mktemp -d -t attn-persist.XXXXXX)
cache_dir="${dir:-$work/caches}"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

lscpu | sed -n 's/^Model name: *\(.*\)/cpu: \1/p; s/^CPU family: *\(.*\)/  family \1/p; s/^Model: *\(.*\)/  model \1/p' | paste -sd' '
echo "cache dir: $cache_dir ($(df -h --output=source,fstype "$(dirname "$cache_dir")" | tail -1))"
flags=(--listen=127.0.0.1:0 --http-listen= --log-level=error)
"$attnd" "${flags[@]}" >"$work/plain.log" 2>&1 &
pids+=($!)
plain_port=$(attnd_wait_port "${pids[0]}" "$work/plain.log")
"$attnd" "${flags[@]}" --cache-dir="$cache_dir" >"$work/persistent.log" 2>&1 &
persistent_pid=$!
pids+=("$persistent_pid")
persistent_port=$(attnd_wait_port "$persistent_pid" "$work/persistent.log")
"$bench" --phase=decode --plain="127.0.0.1:$plain_port" --persistent="127.0.0.1:$persistent_port" \
  --tokens="$tokens" --steps="$steps"
"$bench" --phase=fill --persistent="127.0.0.1:$persistent_port" --tokens="$tokens" \
  --fill_caches="$fill"
kill -TERM "$persistent_pid"
wait "$persistent_pid" || true
grep "caches flushed" "$work/persistent.log" || { cat "$work/persistent.log"; exit 1; }
sync
"$attnd" "${flags[@]}" --cache-dir="$cache_dir" >"$work/restart.log" 2>&1 &
pids+=($!)
attnd_wait_port "${pids[2]}" "$work/restart.log" >/dev/null
line=$(grep "restored " "$work/restart.log")
echo "restart:${line}"
bytes=$(sed -n 's/.*tokens, \([0-9]*\) bytes).*/\1/p' <<<"$line")
seconds=$(sed -n 's/.* in \([0-9.]*\) s.*/\1/p' <<<"$line")
awk -v b="$bytes" -v s="$seconds" 'BEGIN { printf "restore: %.3f s per GiB (%.2f GB/s; the files were in the page cache)\n", s / (b / 1073741824), b / s * 1e-9 }'
