#!/usr/bin/env bash
# Graceful drain of a real attnd process: SIGTERM with a computation in flight lets it finish
# (OK), refuses new calls, flips readiness and exits 0; a second signal exits at once; a drain
# past --shutdown-grace cancels what is left and still exits 0; with a full queue and no grace,
# every queued call is answered UNAVAILABLE.
# Usage: drain_test.sh ATTND ATTN   (needs the system python3 to read attnd's /metrics)
set -euo pipefail
attnd=$1
attn=$2
dir=$(mktemp -d)
server=""
trap 'kill -9 $server 2>/dev/null || true; rm -rf "$dir"' EXIT

start() {  # start LOG FLAGS...: starts attnd; sets $server, $target and $http
  local log=$1
  shift
  : >"$log"  # Before the background job's own redirection, which the loop could outrun.
  "$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --threads 2 "$@" >"$log" 2>&1 &
  server=$!
  local port=""
  for _ in $(seq 100); do
    port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$log")
    http=$(sed -n 's|.*http: \(http://[0-9.:]*\).*|\1|p' "$log")
    [ -n "$port" ] && [ -n "$http" ] && break
    sleep 0.1
  done
  [ -n "$port" ] || { cat "$log" >&2; echo "FAIL: attnd never reported its port" >&2; exit 1; }
  target=(--target "127.0.0.1:$port")
}

metric() {  # metric NAME: the value of an unlabelled metric on attnd's /metrics
  /usr/bin/python3 - "$http/metrics" "$1" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
for line in text.splitlines():
    if line.split(" ")[0] == sys.argv[2]:
        print(line.split(" ")[1])
PY
}

start_long_call() {  # start_long_call OUT: a computation of seconds; returns once attnd runs it
  # 275 GFLOP of Tiled (a few seconds on two cores) from a 24 MiB request.
  "$attn" "${target[@]}" tiled --random 1,1,32768,64 --print-rows 0 >"$1" 2>&1 &
  client=$!
  for _ in $(seq 600); do
    [ "$(metric attnd_compute_inflight)" = 1 ] && return 0
    sleep 0.1
  done
  echo "FAIL: the long call never started computing" >&2
  cat "$1" >&2
  exit 1
}

failed=0
expect() {  # expect NAME STATUS
  if [ "$2" -eq 0 ]; then echo "ok   $1"; else echo "FAIL $1"; failed=$((failed + 1)); fi
}

# 1. SIGTERM with a call in flight: the call finishes OK, new calls are refused, exit 0.
start "$dir/a.log" --shutdown-grace 120
start_long_call "$dir/long.out"
kill -TERM "$server"
sleep 0.3
rc=0
ready=$(/usr/bin/python3 -c "
import sys, urllib.request, urllib.error
try: print(urllib.request.urlopen('$http/readyz', timeout=5).status)
except urllib.error.HTTPError as e: print(e.code)")
[ "$ready" = 503 ]
expect "/readyz answers 503 while draining (got $ready)" $?
"$attn" "${target[@]}" tiled --example seed >"$dir/new.out" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && grep -qE "UNAVAILABLE" "$dir/new.out"
expect "a new call during the drain is refused with UNAVAILABLE" $?
rc=0; wait "$client" || rc=$?
ok=0; [ "$rc" -eq 0 ] && grep -q "compute" "$dir/long.out" || ok=1
expect "the call in flight at the signal finished OK (attn exit $rc)" "$ok"
[ "$ok" -eq 0 ] || cat "$dir/long.out" "$dir/a.log"
rc=0; wait "$server" || rc=$?
expect "attnd exited 0 after draining (exit $rc)" "$rc"
grep -q "draining" "$dir/a.log"
expect "attnd logged the drain" $?

# 2. A second signal exits at once, without waiting for the call in flight.
start "$dir/b.log" --shutdown-grace 120
start_long_call "$dir/long2.out"
kill -TERM "$server"
sleep 0.3
begin=$(date +%s%N)
kill -INT "$server" 2>/dev/null || true
rc=0; wait "$server" || rc=$?
ms=$(( ($(date +%s%N) - begin) / 1000000 ))
[ "$rc" -ne 0 ] && [ "$ms" -lt 2000 ]
expect "a second signal exits at once (exit $rc after $ms ms)" $?
wait "$client" 2>/dev/null || true

# 3. Past --shutdown-grace the rest is cancelled and attnd still exits 0, promptly.
start "$dir/c.log" --shutdown-grace 1
start_long_call "$dir/long3.out"
begin=$(date +%s%N)
kill -TERM "$server"
rc=0; wait "$server" || rc=$?
ms=$(( ($(date +%s%N) - begin) / 1000000 ))
[ "$rc" -eq 0 ] && [ "$ms" -ge 900 ] && [ "$ms" -lt 5000 ]
expect "attnd waits out the 1 s grace, cancels the call and exits 0 (exit $rc after $ms ms)" $?
rc=0; wait "$client" || rc=$?
[ "$rc" -ne 0 ]
expect "the call cut off by the grace period failed (attn exit $rc)" $?

# 4. A full queue and --shutdown-grace 0 (issue 27): every call still queued is answered
#    UNAVAILABLE, the running one is cancelled, and attnd exits 0 at once; under ASan nothing a
#    queued call does may touch the server once it is gone (tests/run.sh reads every report).
start "$dir/d.log" --shutdown-grace 0 --max-inflight 1
start_long_call "$dir/long4.out"
queued=()
for i in $(seq 6); do
  "$attn" "${target[@]}" tiled --random 1,1,4096,64 --print-rows 0 >"$dir/queued$i.out" 2>&1 &
  queued+=($!)
done
for _ in $(seq 300); do
  [ "$(metric attnd_compute_queued)" = 6 ] && break
  sleep 0.1
done
[ "$(metric attnd_compute_queued)" = 6 ]
expect "six calls wait behind the running one" $?
begin=$(date +%s%N)
kill -TERM "$server"
rc=0; wait "$server" || rc=$?
ms=$(( ($(date +%s%N) - begin) / 1000000 ))
[ "$rc" -eq 0 ] && [ "$ms" -lt 5000 ]
expect "with a full queue and no grace attnd exits 0 at once (exit $rc after $ms ms)" $?
unavailable=0
for i in $(seq 6); do
  rc=0; wait "${queued[$((i - 1))]}" || rc=$?
  [ "$rc" -ne 0 ] && grep -q "UNAVAILABLE.*before this call reached a compute worker" \
    "$dir/queued$i.out" && unavailable=$((unavailable + 1))
done
[ "$unavailable" -eq 6 ]
expect "every queued call was answered UNAVAILABLE ($unavailable of 6)" $?
[ "$unavailable" -eq 6 ] || cat "$dir"/queued*.out "$dir/d.log"
wait "$client" 2>/dev/null || true

server=""
[ "$failed" -eq 0 ] || { echo "$failed check(s) failed"; exit 1; }
echo "all drain checks passed"
