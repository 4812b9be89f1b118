#!/usr/bin/env bash
# A local attnd cluster for trying scale-out on one machine: starts N replicas on free loopback
# ports (gRPC and HTTP, each picked by attnd itself with :0), prints one line per replica and
# then the comma-separated target for `attn --target`, and waits; Ctrl-C (or SIGTERM, or the
# end of the script for any reason) stops them all.
#
#   deploy/local-cluster.sh N [attnd flags...]
#   deploy/local-cluster.sh 3 --threads 2
#     replica 0: pid 4242 grpc 127.0.0.1:40123 http http://127.0.0.1:40125 log /tmp/…/attnd-0.log
#     …
#     target 127.0.0.1:40123,127.0.0.1:41877,127.0.0.1:35011
#   attn tiled --random 2,8,1024,64 --target <that list> --lb round_robin
#   attn tiled --random 2,8,1024,64 --kv-heads 4 --target <that list> --shard-heads
#
# The attnd binary is $ATTND (default build/release/attnd). Flags after N go to every replica;
# leave --listen and --http-listen to the script (a fixed port would collide; --http-listen=
# turns the HTTP port off). Replica logs (attnd's stdout and stderr) are in $ATTN_CLUSTER_DIR
# (default a temporary directory, removed on exit). A replica that exits is reported and the
# others keep serving; the script returns when all have exited or it is stopped.
set -euo pipefail

usage() {
  echo "usage: $0 N [attnd flags...]   (N ≥ 1 replicas; \$ATTND picks the binary)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
count=$1
shift
if ! [[ "$count" =~ ^[0-9]+$ ]] || [ "$count" -lt 1 ]; then usage; fi

root=$(cd "$(dirname "$0")/.." && pwd)
attnd=${ATTND:-$root/build/release/attnd}
[ -x "$attnd" ] || {
  echo "$0: no attnd at $attnd (build it: cmake --preset release && cmake --build --preset release --target attnd, or set ATTND)" >&2
  exit 2
}

if [ -n "${ATTN_CLUSTER_DIR:-}" ]; then
  dir=$ATTN_CLUSTER_DIR
  mkdir -p "$dir"
  keep=1
else
  dir=$(mktemp -d "${TMPDIR:-/tmp}/attnd-cluster.XXXXXX")
  keep=0
fi

pids=()
stopping=0
stop_all() {
  [ "$stopping" -eq 1 ] && return
  stopping=1
  local pid alive=()
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null && alive+=("$pid")
  done
  # attnd drains on SIGTERM (--shutdown-grace); give up after 15 s and kill what is left.
  for _ in $(seq 150); do
    local left=0
    for pid in "${alive[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" -eq 0 ] && break
    sleep 0.1
  done
  for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ "$keep" -eq 1 ] || rm -rf "$dir"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

targets=()
for ((i = 0; i < count; i++)); do
  log=$dir/attnd-$i.log
  "$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
  pids+=($!)
done

# Each replica prints its gRPC port, then its HTTP line, once it serves.
for ((i = 0; i < count; i++)); do
  log=$dir/attnd-$i.log
  pid=${pids[$i]}
  port="" http=""
  for _ in $(seq 300); do
    port=$(sed -n 's/.*serving attention\.v1 on .* (port \([0-9]*\)).*/\1/p' "$log")
    if [ -n "$port" ] && grep -q '^  http: ' "$log"; then
      http=$(sed -n 's/^  http: \(http:\/\/[^ ]*\).*/\1/p' "$log")
      break
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      cat "$log" >&2
      echo "$0: replica $i (attnd) exited during start-up" >&2
      exit 1
    fi
    sleep 0.1
  done
  if [ -z "$port" ]; then
    cat "$log" >&2
    echo "$0: replica $i never reported its port" >&2
    exit 1
  fi
  echo "replica $i: pid $pid grpc 127.0.0.1:$port http ${http:-off} log $log"
  targets+=("127.0.0.1:$port")
done
(
  IFS=,
  echo "target ${targets[*]}"
)
echo "$count replica(s) serving; Ctrl-C stops them all" >&2

# Wait for the replicas; report each one that exits while the others keep serving.
left=$count
while [ "$left" -gt 0 ]; do
  rc=0
  wait -n "${pids[@]}" 2>/dev/null || rc=$?
  [ "$rc" -eq 127 ] && break # No child left.
  left=0
  for ((i = 0; i < count; i++)); do
    if kill -0 "${pids[$i]}" 2>/dev/null; then
      left=$((left + 1))
    fi
  done
  echo "a replica exited (status $rc); $left still serving" >&2
done
