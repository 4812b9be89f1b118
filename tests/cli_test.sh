#!/usr/bin/env bash
# The attn CLI against a real attnd: every subcommand, the seed example's numbers, and clear
# errors for bad flags and bad requests. Usage: cli_test.sh ATTND ATTN
set -euo pipefail
attnd=$1
attn=$2
log=$(mktemp)
trap 'kill "$server" 2>/dev/null || true; rm -f "$log"' EXIT

"$attnd" --listen 127.0.0.1:0 --threads 2 >"$log" 2>&1 &
server=$!
port=""
for _ in $(seq 100); do
  port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$log")
  [ -n "$port" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "FAIL: attnd exited"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { cat "$log"; echo "FAIL: attnd never reported its port"; exit 1; }
target=(--target "127.0.0.1:$port")

passed=0
failed=0
check() {  # check NAME EXPECTED_EXIT PATTERN -- COMMAND...
  local name=$1 want=$2 pattern=$3
  shift 4
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" -eq "$want" ] && grep -qE -- "$pattern" <<<"$out"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    printf 'FAIL %s (exit %s, wanted %s and /%s/):\n%s\n' "$name" "$rc" "$want" "$pattern" "$out"
  fi
}

check health 0 '^SERVING$' -- "$attn" "${target[@]}" health
check info 0 'backend +cpu' -- "$attn" "${target[@]}" info
check tiled-seed 0 'out\[0\] = \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]' -- \
  "$attn" "${target[@]}" tiled --example seed --block-k 3
check naive-seed 0 'intermediate 1\.0 KiB' -- "$attn" "${target[@]}" naive --example seed
check naive-multiplier 0 'out\[0\] = \[-0\.500000, 0\.500000, -3\.000000, -2\.000000\]' -- \
  "$attn" "${target[@]}" naive --example seed --query-multiplier 1000
check trace-ties 0 '7 +2\.000000 +0\.304404' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2
check trace-steps 0 'tile 3, keys \[6, 8\)' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2
check trace-final 0 'max \|online − full\| = [0-9.e-]+' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2
check random-bf16 0 'output \[1, 2, 33, 8\] DTYPE_BFLOAT16' -- \
  "$attn" "${target[@]}" tiled --random 1,2,33,8 --dtype bf16 --causal --lse
check random-gqa 0 'output \[2, 4, 17, 5\]' -- \
  "$attn" "${target[@]}" naive --random 2,4,17,5 --kv-heads 2 --seed 7
check bad-random 1 '--random expects B,H,N,D' -- "$attn" "${target[@]}" tiled --random 1,2,3
check bad-dtype 1 '--dtype must be f32, f16 or bf16' -- \
  "$attn" "${target[@]}" tiled --example seed --dtype f64
check no-inputs 1 'give inputs' -- "$attn" "${target[@]}" tiled
check bad-row 1 'INVALID_ARGUMENT: rows\[0\]\.row' -- \
  "$attn" "${target[@]}" trace --example seed --rows 0:0:99
check bad-command 2 'unknown command' -- "$attn" "${target[@]}" frobnicate
check unreachable 1 'UNAVAILABLE' -- "$attn" --target 127.0.0.1:1 --timeout-ms 2000 info

kill -0 "$server" || { echo "FAIL: attnd died"; cat "$log"; exit 1; }
echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
