#!/usr/bin/env bash
# Scale-out across three attnd replicas on loopback, started by deploy/local-cluster.sh (issue 7):
#   1. 300 round-robin requests (attn bench --repeats 300 over the target list, --lb round_robin)
#      all succeed, and each replica's /metrics counts a share of them;
#   2. attn --shard-heads (naive and tiled, GQA, causal, lse, f32 and bf16) writes the same bytes
#      as one server answering the whole request;
#   3. attn --shard-keys (issue 14: the keys split along the sequence, balanced by the pairs the
#      causal mask lets through, each slice's (output, lse) merged by the client) equals one
#      server's answer to fp32 rounding (rel ≤ 3e-6; bf16/f16 within one rounding step; lse
#      within 1e-4): naive and tiled, causal with query_len ≠ key_len (fewer and more query rows),
#      GQA, lse, f32, bf16 and f16; also with --shard-heads (a grid of parts);
#   3b. attn trace --shard-keys merges the replicas' traced slices to the full row, and attn decode
#      --shard-keys keeps one cache in three parts and matches the float64 reference;
#   4. killing one replica (SIGKILL) while sharded requests (--shard-heads and --shard-keys) run
#      loses no answer: each part it held is retried on another replica, and every answer still
#      equals the single-server one (to fp32 rounding for --shard-keys; a call that fails must
#      name its part, and with a live replica to retry on none may fail).
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

# --- 3. --shard-keys == single server, to fp32 rounding ---------------------------------------
# Compares two --output-file dumps: the output (ELEMENTS values of DTYPE), then the lse (fp32)
# when present. fp32: max |got − want| / max |want| ≤ 3e-6; bf16/f16 (rounded from fp32 values
# that differ by a few ulps): each element within one rounding step; lse within 1e-4 · max(1,
# |lse|) and −inf exactly where one server's is. NaN never passes.
same_numbers() {
  /usr/bin/python3 - "$@" <<'EOF'
import sys
import numpy as np
want_path, got_path, dtype, elements = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
want, got = open(want_path, "rb").read(), open(got_path, "rb").read()
if len(want) != len(got):
    sys.exit(f"{len(got)} bytes, one server wrote {len(want)}")
size = 4 if dtype == "f32" else 2
def decode(data):
    if dtype == "f32":
        return np.frombuffer(data, "<f4").astype(np.float64)
    if dtype == "f16":
        return np.frombuffer(data, "<f2").astype(np.float64)
    return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
w, g = decode(want[: elements * size]), decode(got[: elements * size])
if np.isnan(g).any() or np.isnan(w).any():
    sys.exit("NaN in the output")
error = np.abs(g - w)
if dtype == "f32":
    worst = error.max() / np.abs(w).max()
    if worst > 3e-6:
        sys.exit(f"output relative error {worst:.3g} > 3e-6")
    report = f"output rel {worst:.2g}"
else:
    step = 2.0**-7 if dtype == "bf16" else 2.0**-10
    over = error > step * np.abs(w) + 1e-6
    if over.any():
        i = int(np.argmax(over))
        sys.exit(f"output[{i}] = {g[i]} vs {w[i]}: more than one {dtype} step apart")
    report = f"output max abs {error.max():.2g} ({int((error > 0).sum())} of {len(w)} one step off)"
lse_want = np.frombuffer(want[elements * size :], "<f4").astype(np.float64)
lse_got = np.frombuffer(got[elements * size :], "<f4").astype(np.float64)
if len(lse_want):
    if np.isnan(lse_got).any() or (np.isinf(lse_want) != np.isinf(lse_got)).any():
        sys.exit("lse: NaN, or −inf rows differ")
    finite = ~np.isinf(lse_want)
    lse_error = np.abs(lse_got[finite] - lse_want[finite])
    bound = 1e-4 * np.maximum(1.0, np.abs(lse_want[finite]))
    if (lse_error > bound).any():
        sys.exit(f"lse error {lse_error.max():.3g} > 1e-4")
    report += f", lse max abs {lse_error.max() if len(lse_error) else 0:.2g}"
    report += f" ({int((~finite).sum())} rows −inf)"
print(report)
EOF
}

# "dtype elements|attn arguments": elements = B·H·query_len·D of the output.
key_cases=(
  "f32 20480|tiled --random 2,8,96,32 --kv-heads 2 --seed 3 --causal --query-len 40 --lse"
  "f32 66560|naive --random 2,8,96,32 --kv-heads 4 --seed 4 --causal --query-len 130 --lse"
  "bf16 9504|tiled --random 3,6,70,16 --kv-heads 3 --seed 5 --causal --query-len 33 --block-k 16 --dtype bf16 --lse"
  "bf16 672|naive --random 1,4,50,8 --kv-heads 2 --seed 6 --causal --query-len 21 --dtype bf16 --lse"
  "f16 1088|tiled --random 1,4,64,16 --kv-heads 1 --seed 10 --causal --query-len 17 --dtype f16"
  "f32 320|tiled --random 1,1,40,8 --seed 7"
  "f32 32|tiled --example seed --block-k 3 --causal --lse"
)
for c in "${key_cases[@]}"; do
  read -r dtype elements <<<"${c%%|*}"
  args=${c#*|}
  # shellcheck disable=SC2086
  "$attn" --target "$single" $args --output-file "$work/one.bin" >/dev/null ||
    fail "single server: $args"
  # shellcheck disable=SC2086
  "$attn" --target "$target" $args --shard-keys --output-file "$work/keys.bin" \
    >"$work/keys.out" 2>&1 || { cat "$work/keys.out" >&2; fail "--shard-keys: $args"; }
  parts=$(grep -c '^shard: part [0-9]/3 units \[0, [0-9]*) keys \[[0-9]*, [0-9]*) -> ' \
    "$work/keys.out" || true)
  [ "$parts" -eq 3 ] || { cat "$work/keys.out" >&2; fail "--shard-keys: $parts key slices: $args"; }
  result=$(same_numbers "$work/one.bin" "$work/keys.bin" "$dtype" "$elements" 2>&1) ||
    fail "--shard-keys differs from one server's ($result): $args"
  echo "ok: $args --shard-keys — 3 key slices, $result"
done

# Heads and keys together: a grid of 3 head parts × 3 key slices.
grid_cases=(
  "f32 25600|tiled --random 2,8,96,32 --kv-heads 4 --seed 8 --causal --query-len 50 --lse"
  "bf16 30720|naive --random 2,6,77,32 --kv-heads 3 --seed 12 --causal --query-len 80 --dtype bf16 --lse"
)
for c in "${grid_cases[@]}"; do
  read -r dtype elements <<<"${c%%|*}"
  args=${c#*|}
  # shellcheck disable=SC2086
  "$attn" --target "$single" $args --output-file "$work/one.bin" >/dev/null ||
    fail "single server: $args"
  # shellcheck disable=SC2086
  "$attn" --target "$target" $args --shard-heads --shard-keys --output-file "$work/grid.bin" \
    >"$work/grid.out" 2>&1 || { cat "$work/grid.out" >&2; fail "grid: $args"; }
  grep -q '^shard: part 9/9 units \[[0-9]*, [0-9]*) keys ' "$work/grid.out" ||
    { cat "$work/grid.out" >&2; fail "--shard-heads --shard-keys did not make 9 parts: $args"; }
  result=$(same_numbers "$work/one.bin" "$work/grid.bin" "$dtype" "$elements" 2>&1) ||
    fail "--shard-heads --shard-keys differs from one server's ($result): $args"
  echo "ok: $args --shard-heads --shard-keys — 9 parts, $result"
done

# attn trace --shard-keys: each replica traces its slice, then the merge reaches the full row
# (tests/merge_trace_test.cc checks the steps themselves).
"$attn" --target "$target" trace --example seed --block-k 2 --causal --rows 0:0:7 --shard-keys \
  >"$work/trace.out" 2>&1 || { cat "$work/trace.out" >&2; fail "trace --shard-keys"; }
grep -q '^  part 3 ' "$work/trace.out" || { cat "$work/trace.out" >&2; fail "trace: not 3 parts"; }
merged_error=$(sed -n 's/^  max |merged − full| = \([^ ]*\) .*/\1/p' "$work/trace.out")
/usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 1e-5 else 1)" \
  "${merged_error:-nan}" || { cat "$work/trace.out" >&2; fail "trace merge error ${merged_error}"; }
echo "ok: trace --example seed --causal --shard-keys — 3 parts merged, max |merged − full| $merged_error"
# attn decode --shard-keys: one cache in a part on each replica, every step merged, against the
# float64 reference over the tokens sent (tests/sharded_cache_test.cc checks the placement, the
# positions and the failures in detail).
"$attn" --target "$target" decode --shard-keys --causal --heads 4 --kv-heads 2 --head-dim 24 \
  --tokens 700 --steps 3 >"$work/decode.out" 2>&1 ||
  { cat "$work/decode.out" >&2; fail "decode --shard-keys"; }
grep -q '^parts hold [0-9]* + [0-9]* + [0-9]* = 703 tokens' "$work/decode.out" ||
  { cat "$work/decode.out" >&2; fail "decode --shard-keys: not 3 parts holding 703 tokens"; }
decode_error=$(sed -n 's/^max |decode - float64 reference| \/ max |reference| = \([^ ]*\) .*/\1/p' \
  "$work/decode.out")
/usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 1e-5 else 1)" \
  "${decode_error:-nan}" || { cat "$work/decode.out" >&2; fail "decode error ${decode_error}"; }
echo "ok: decode --causal --shard-keys — 3 parts, max rel error $decode_error"
# A command that cannot split keys, and a cache (one server's), are refused by name.
"$attn" --target "$target" bench --shard-keys >"$work/err" 2>&1 && fail "bench --shard-keys accepted"
grep -q 'shard-keys applies to naive, tiled, trace and decode' "$work/err" ||
  fail "bench: $(cat "$work/err")"
"$attn" --target "$target" tiled --random 1,2,8,4 --cache 0123 --shard-keys >"$work/err" 2>&1 &&
  fail "--cache --shard-keys accepted"
grep -q 'a cache lives on one server' "$work/err" || fail "--cache: $(cat "$work/err")"

# --- 4. kill a replica mid-run: no answer lost, none wrong -----------------------------------
# Sized so that one round's two calls cost a few seconds of the three single-threaded replicas
# (the asan stage computes them several times slower, beside other tests).
problem=(tiled --random "3,12,1024,64" --kv-heads 6 --seed 9 --causal --lse)
"$attn" --target "$single" "${problem[@]}" --output-file "$work/expected.bin" >/dev/null ||
  fail "single server: ${problem[*]}"
# Big enough that a key slice computes for a good fraction of a second on one thread.
key_problem=(tiled --random "4,8,2048,64" --kv-heads 2 --seed 11 --causal --query-len 1500 --lse)
key_elements=$((4 * 8 * 1500 * 64))
"$attn" --target "$single" "${key_problem[@]}" --output-file "$work/key_expected.bin" >/dev/null ||
  fail "single server: ${key_problem[*]}"
answers=0
retried=0
key_answers=0
key_failures=0
key_retried=0
# Replica 2's /metrics matches all the given patterns (within 3 s; 1 if it never did).
replica2_shows() {
  local metrics deadline=$((SECONDS + 3))
  while [ "$SECONDS" -lt "$deadline" ]; do
    metrics=$(curl -sf "${https[2]}/metrics" || true)
    local all=1
    for pattern in "$@"; do grep -q "$pattern" <<<"$metrics" || all=0; done
    [ "$all" -eq 1 ] && return 0
    sleep 0.01
  done
  return 1
}
for round in $(seq 8); do
  "$attn" --target "$target" "${key_problem[@]}" --shard-keys --output-file "$work/key_run.bin" \
    >"$work/key_run.out" 2>&1 &
  key_call=$!
  if [ "$round" -eq 3 ]; then
    # Kill replica 2 with a part of each call on it, so both are lost in flight, not merely
    # refused: the --shard-keys call's third slice (part i goes to endpoint i mod 3) computing
    # there, then the --shard-heads call's third part queued behind it (--threads 1 computes
    # one at a time), as its compute gauges show.
    replica2_shows '^attnd_compute_inflight 1' || echo "round 3: replica 2 computed no key slice"
    "$attn" --target "$target" "${problem[@]}" --shard-heads --output-file "$work/run.bin" \
      >"$work/run.out" 2>&1 &
    call=$!
    replica2_shows '^attnd_compute_inflight 1' '^attnd_compute_queued [1-9]' ||
      echo "round 3: replica 2 never held both parts at once"
    kill -KILL "${pids[2]}"
    echo "killed replica 2 (pid ${pids[2]}) during round $round"
  else
    "$attn" --target "$target" "${problem[@]}" --shard-heads --output-file "$work/run.bin" \
      >"$work/run.out" 2>&1 &
    call=$!
  fi
  if wait "$key_call"; then
    result=$(same_numbers "$work/key_expected.bin" "$work/key_run.bin" f32 "$key_elements" 2>&1) ||
      fail "round $round: --shard-keys answered wrongly ($result)"
    key_answers=$((key_answers + 1))
  else
    # A failure must say which part failed where, never pass for an answer.
    grep -q '^attn: [A-Z_]*: part [0-9]* of [0-9]* (127\.0\.0\.1:[0-9]*' "$work/key_run.out" ||
      { cat "$work/key_run.out" >&2; fail "round $round: --shard-keys failed without naming its part"; }
    key_failures=$((key_failures + 1))
    echo "round $round: --shard-keys failed: $(grep '^attn: ' "$work/key_run.out")"
  fi
  k=$(grep -c 'retried after' "$work/key_run.out" || true)
  [ "$round" -eq 3 ] && { grep "retried after" "$work/key_run.out" || true; }
  key_retried=$((key_retried + k))
  # Its third slice was on replica 2: from round 4 on, with the replica gone, it is always
  # retried (refused); in round 3 it is when the kill caught it in flight, which a loaded
  # machine's timing does not promise (the answer is checked either way).
  if [ "$round" -ge 4 ] && [ "$k" -eq 0 ]; then
    fail "round $round: the dead replica's key slice was not retried"
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
[ "$key_retried" -gt 0 ] || fail "no key slice was retried after the kill"
# Every key slice has a live replica to retry on, so none of the 8 calls may have failed.
[ "$key_failures" -eq 0 ] || fail "$key_failures --shard-keys call(s) failed with replicas to retry on"
echo "ok: $key_answers of 8 --shard-keys answers with a replica killed, $key_retried slice(s) retried, all within tolerance"

# Round robin also routes around the dead replica.
"$attn" bench --target "$target" --lb round_robin --methods tiled --ns 64 --batch 1 --heads 2 \
  --dim 16 --repeats 30 --csv= --svg= >"$work/bench.out" 2>&1 ||
  { cat "$work/bench.out" >&2; fail "round robin with a dead replica failed"; }
echo "ok: round robin with one replica dead"
echo "PASS scale_out"
