#!/usr/bin/env bash
# Scale-out across three attnd replicas on loopback, started by deploy/local-cluster.sh (issue 7):
#   1. 300 round-robin requests (attn bench --repeats 300 over the target list, --lb round_robin)
#      all succeed, and each replica's /metrics counts a share of them;
#   2. attn --shard-heads (naive and tiled, GQA, causal, lse, f32 and bf16) writes the same bytes
#      as one server answering the whole request;
#   3. killing one replica (SIGKILL) while sharded requests run loses no answer: each part it
#      held is retried on another replica, and every answer still equals the single-server one.
# Usage: scale_out_test.sh ATTND ATTN
set -euo pipefail
attnd=$1
attn=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
cluster=""
trap 'kill -TERM $cluster 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

ATTND=$attnd ATTN_CLUSTER_DIR=$work/cluster "$root/deploy/local-cluster.sh" 3 --threads 1 \
  --log-level error >"$work/cluster.out" 2>"$work/cluster.err" &
cluster=$!
for _ in $(seq 300); do
  grep -q '^target ' "$work/cluster.out" && break
  kill -0 "$cluster" 2>/dev/null || {
    cat "$work/cluster.out" "$work/cluster.err" >&2
    fail "local-cluster.sh exited"
  }
  sleep 0.1
done
target=$(sed -n 's/^target //p' "$work/cluster.out")
[ -n "$target" ] || fail "local-cluster.sh printed no target"
mapfile -t pids < <(sed -n 's/^replica [0-9]*: pid \([0-9]*\) .*/\1/p' "$work/cluster.out")
mapfile -t grpcs < <(sed -n 's/^replica [0-9]*: .* grpc \([^ ]*\) .*/\1/p' "$work/cluster.out")
mapfile -t https < <(sed -n 's/^replica [0-9]*: .* http \([^ ]*\) .*/\1/p' "$work/cluster.out")
if [ "${#pids[@]}" -ne 3 ] || [ "${#https[@]}" -ne 3 ]; then
  fail "expected 3 replicas: $(cat "$work/cluster.out")"
fi
echo "cluster: $target"

# Tiled calls a replica answered OK, from its /metrics.
served() {
  python3 - "$1" <<'EOF'
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read().decode()
total = 0.0
for line in text.splitlines():
    if line.startswith("attnd_rpc_requests_total{") and 'method="Tiled"' in line and 'code="OK"' in line:
        total += float(line.rsplit(" ", 1)[1])
print(int(total))
EOF
}

# --- 1. 300 round-robin requests --------------------------------------------------------------
start=$(date +%s)
"$attn" bench --target "$target" --lb round_robin --methods tiled --ns 64 --batch 1 --heads 2 \
  --dim 16 --repeats 300 --csv= --svg= >"$work/bench.out" 2>&1 ||
  { cat "$work/bench.out" >&2; fail "round-robin bench failed"; }
total=0
for i in 0 1 2; do
  n=$(served "${https[$i]}")
  echo "replica $i (${grpcs[$i]}) served $n of 300 round-robin calls"
  [ "$n" -ge 30 ] || fail "replica $i served only $n of 300 round-robin calls"
  total=$((total + n))
done
[ "$total" -eq 300 ] || fail "replicas served $total calls, expected 300"
echo "ok: 300 round-robin calls in $(($(date +%s) - start)) s, each replica a share"

# pick_first sends everything to one replica.
before=()
for i in 0 1 2; do before+=("$(served "${https[$i]}")"); done
"$attn" bench --target "$target" --methods tiled --ns 64 --batch 1 --heads 2 --dim 16 \
  --repeats 30 --csv= --svg= >/dev/null 2>&1 || fail "pick_first bench failed"
busy=0
for i in 0 1 2; do
  n=$(($(served "${https[$i]}") - before[i]))
  [ "$n" -eq 0 ] || [ "$n" -eq 30 ] || fail "pick_first split its calls: replica $i got $n of 30"
  [ "$n" -eq 30 ] && busy=$((busy + 1))
done
[ "$busy" -eq 1 ] || fail "pick_first: $busy replicas got the 30 calls"
echo "ok: pick_first keeps to one replica"

# Bad targets and policies are refused up front.
"$attn" health --target "$target" --lb random >"$work/err" 2>&1 && fail "--lb random accepted"
grep -q 'unknown load-balancing policy' "$work/err" || fail "--lb random: $(cat "$work/err")"
"$attn" health --target "no-such-host:1,127.0.0.1:2" >"$work/err" 2>&1 && fail "name list accepted"
grep -q 'not an IP address' "$work/err" || fail "name list: $(cat "$work/err")"

# --- 2. sharded == single server, bit for bit -------------------------------------------------
single=${grpcs[0]}
cases=(
  "tiled --random 2,8,96,32 --kv-heads 2 --seed 3 --lse"
  "naive --random 2,8,96,32 --kv-heads 4 --seed 4 --causal --lse"
  "tiled --random 3,6,70,16 --kv-heads 3 --seed 5 --causal --block-k 16 --dtype bf16 --lse"
  "naive --random 1,4,50,8 --seed 6 --dtype f16"
  "tiled --random 1,1,40,8 --seed 7"
  "tiled --example seed --block-k 3"
)
for c in "${cases[@]}"; do
  # shellcheck disable=SC2086
  "$attn" --target "$single" $c --output-file "$work/one.bin" >/dev/null ||
    fail "single server: $c"
  # shellcheck disable=SC2086
  "$attn" --target "$target" $c --shard-heads --output-file "$work/sharded.bin" \
    >"$work/sharded.out" 2>&1 || { cat "$work/sharded.out" >&2; fail "sharded: $c"; }
  [ -s "$work/one.bin" ] || fail "no output written for $c"
  cmp -s "$work/one.bin" "$work/sharded.bin" || fail "sharded output differs from one server's: $c"
  parts=$(grep -c '^shard: part [0-9]*/' "$work/sharded.out" || true)
  echo "ok: $c — $parts part(s), $(wc -c <"$work/one.bin") bytes identical"
done
grep -q 'shard: part 3/3' <(
  "$attn" --target "$target" tiled --random 2,8,96,32 --kv-heads 2 --shard-heads 2>&1
) || fail "a 4-unit request was not split in 3 parts"

# --- 3. kill a replica mid-run: no answer lost -----------------------------------------------
problem=(tiled --random "3,12,2048,64" --kv-heads 6 --seed 9 --causal --lse)
"$attn" --target "$single" "${problem[@]}" --output-file "$work/expected.bin" >/dev/null ||
  fail "single server: ${problem[*]}"
answers=0
retried=0
for round in $(seq 8); do
  "$attn" --target "$target" "${problem[@]}" --shard-heads --output-file "$work/run.bin" \
    >"$work/run.out" 2>&1 &
  call=$!
  if [ "$round" -eq 3 ]; then
    # Kill replica 2 while it computes its part (its compute gauge shows it), so the part is
    # lost in flight, not merely refused.
    for _ in $(seq 200); do
      curl -sf "${https[2]}/metrics" | grep -q '^attnd_compute_inflight 1' && break
      sleep 0.01
    done
    kill -KILL "${pids[2]}"
    echo "killed replica 2 (pid ${pids[2]}) during round $round"
  fi
  wait "$call" || { cat "$work/run.out" >&2; fail "round $round lost its answer"; }
  cmp -s "$work/expected.bin" "$work/run.bin" || fail "round $round: answer differs"
  answers=$((answers + 1))
  r=$(grep -c 'retried after' "$work/run.out" || true)
  [ "$round" -eq 3 ] && { grep "retried after" "$work/run.out" || true; }
  retried=$((retried + r))
  # From the next round on, the dead replica's part is refused and must be retried; in round 3
  # it is normally lost in flight ("Socket closed") and retried too, unless the kill came late.
  if [ "$round" -gt 3 ] && [ "$r" -eq 0 ]; then
    fail "round $round: the dead replica's part was not retried"
  fi
done
[ "$retried" -gt 0 ] || fail "no part was retried after the kill"
echo "ok: $answers of 8 sharded answers with a replica killed, $retried part(s) retried, all identical"

# Round robin also routes around the dead replica.
"$attn" bench --target "$target" --lb round_robin --methods tiled --ns 64 --batch 1 --heads 2 \
  --dim 16 --repeats 30 --csv= --svg= >"$work/bench.out" 2>&1 ||
  { cat "$work/bench.out" >&2; fail "round robin with a dead replica failed"; }
echo "ok: round robin with one replica dead"
echo "PASS scale_out"
