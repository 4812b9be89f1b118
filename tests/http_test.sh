#!/usr/bin/env bash
# attnd's HTTP side port and request log, as main wires them: the banner reports the bound
# --http-listen port; after one OK and one INVALID_ARGUMENT call (through attn) /metrics counts
# them by method and code with matching histogram counts, /healthz and /readyz answer 200, and
# stderr holds one log line per call; the port's own routes take no body (GET /healthz with a
# Content-Length or chunked body is 413 and the connection closed, a POST with neither header
# 411, both within 2 s, over raw sockets); a busy HTTP port, a bad address, a bad --log-level and
# a non-loopback --http-listen without --insecure (0.0.0.0, [::], an empty host: plain HTTP,
# named in the message with --insecure) stop start-up with exit 2, while --insecure lets
# 0.0.0.0 serve; SIGTERM with an HTTP connection open still exits 0 promptly.
# Usage: http_test.sh ATTND ATTN
set -euo pipefail
attnd=$1
attn=$2
dir=$(mktemp -d)
server=""
trap 'kill $server 2>/dev/null || true; rm -rf "$dir"' EXIT

passed=0
failed=0
check() {  # check NAME COMMAND...: passes when COMMAND succeeds
  local name=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL $name"
  fi
}

get() {  # get PATH: prints "STATUS BODY" for http://127.0.0.1:$http_port/PATH
  /usr/bin/python3 - "http://127.0.0.1:$http_port$1" <<'EOF'
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=10) as response:
        print(response.status, response.read().decode())
except urllib.error.HTTPError as error:
    print(error.code, error.read().decode())
EOF
}

# Created here, not only by the redirection below: that runs in the background job, and the
# loop's first read could otherwise come before it (sed on a missing file fails the script).
: >"$dir/out"
: >"$dir/err"
"$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --threads 2 >"$dir/out" 2>"$dir/err" &
server=$!
port=""
http_port=""
for _ in $(seq 100); do
  port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$dir/out")
  http_port=$(sed -n 's|^  http: http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$dir/out")
  [ -n "$port" ] && [ -n "$http_port" ] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ] || [ -z "$http_port" ]; then
  cat "$dir/out" "$dir/err"
  echo "FAIL: attnd never reported its gRPC and HTTP ports"
  exit 1
fi
target=(--target "127.0.0.1:$port")

"$attn" "${target[@]}" tiled --example seed >/dev/null
rc=0
"$attn" "${target[@]}" naive --example seed --block-k -5 >/dev/null 2>&1 || rc=$?
check "naive with block_k -5 fails (exit $rc)" test "$rc" -eq 1
"$attn" "${target[@]}" health >/dev/null

metrics=$(get /metrics)
rpc='service="attention.v1.AttentionService"'
has() { grep -qxF -- "$1" <<<"$metrics"; }
matches() { grep -qE -- "$1" <<<"$metrics"; }
check "Tiled OK counted once" has "attnd_rpc_requests_total{$rpc,method=\"Tiled\",code=\"OK\"} 1"
check "Naive INVALID_ARGUMENT counted once" \
  has "attnd_rpc_requests_total{$rpc,method=\"Naive\",code=\"INVALID_ARGUMENT\"} 1"
check "Tiled OK histogram count 1" \
  has "attnd_rpc_duration_seconds_count{$rpc,method=\"Tiled\",code=\"OK\"} 1"
check "Tiled OK +Inf bucket 1" \
  has "attnd_rpc_duration_seconds_bucket{$rpc,method=\"Tiled\",code=\"OK\",le=\"+Inf\"} 1"
check "Naive INVALID_ARGUMENT histogram count 1" \
  has "attnd_rpc_duration_seconds_count{$rpc,method=\"Naive\",code=\"INVALID_ARGUMENT\"} 1"
check "health check counted under its own name" \
  has 'attnd_rpc_requests_total{service="grpc.health.v1.Health",method="Check",code="OK"} 1'
check "Tiled request bytes counted" \
  matches '^attnd_rpc_received_bytes_total\{'"$rpc"',method="Tiled",code="OK"\} [1-9][0-9]*$'
check "Tiled response bytes counted" \
  matches '^attnd_rpc_sent_bytes_total\{'"$rpc"',method="Tiled",code="OK"\} [1-9][0-9]*$'
check "RSS gauge" matches '^attnd_host_memory_rss_bytes [1-9][0-9]*$'
for family in "attnd_rpc_requests_total counter" "attnd_rpc_duration_seconds histogram" \
  "attnd_compute_inflight gauge" "attnd_compute_queued gauge"; do
  check "# TYPE $family" has "# TYPE $family"
done
[ "$failed" -eq 0 ] || printf '/metrics:\n%s\n' "$metrics"

check "/healthz 200" test "$(get /healthz)" = "200 ok"
check "/readyz 200" test "$(get /readyz)" = "200 ready"

# The port's routes take no body: refused from the headers, the body never read.
raw() {  # raw REQUEST: prints the answer's status and "closed" once the server closed (2 s max)
  /usr/bin/python3 - "$http_port" "$1" <<'EOF'
import socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
sock.sendall(sys.argv[2].encode().decode("unicode_escape").encode("latin-1"))
start, answer, closed = time.time(), b"", False
try:
    while time.time() - start < 2:
        chunk = sock.recv(65536)
        if not chunk:
            closed = True
            break
        answer += chunk
except (socket.timeout, ConnectionResetError):
    pass
print(answer.split(b" ")[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none",
      "closed" if closed else "open")
EOF
}
check "GET /healthz with a body: 413, closed" \
  test "$(raw 'GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello')" = "413 closed"
check "GET /metrics with a chunked body: 413, closed" \
  test "$(raw 'GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n')" = "413 closed"
check "POST /metrics with neither length nor chunked: 411 within 2 s" \
  test "$(raw 'POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n')" = "411 closed"
check "POST / with a 100 MB Content-Length, no body sent: 413 within 2 s" \
  test "$(raw 'POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n')" = "413 closed"

log=$(cat "$dir/err")
logged() { grep -qE -- "$1" <<<"$log"; }
check "info log line for Tiled" logged ' attnd level=info method=/attention\.v1\.AttentionService/Tiled code=OK ms=[0-9.]+ shape=1,1,8,8,4 dtype=f32 .*peer=ipv'
check "error log line for Naive" logged ' attnd level=error method=/attention\.v1\.AttentionService/Naive code=INVALID_ARGUMENT .* message="options\.block_k: '
check "health checks not logged at info" test "$(grep -c 'Health/Check' <<<"$log")" -eq 0
[ "$failed" -eq 0 ] || printf 'stderr:\n%s\n' "$log"

# Start-up refusals: exit 2 with a message naming the flag.
refuses() {  # refuses PATTERN ATTND_FLAGS...: attnd exits 2 printing PATTERN
  local pattern=$1 out rc=0
  shift
  out=$(timeout 30 "$attnd" --listen 127.0.0.1:0 "$@" 2>&1) || rc=$?
  [ "$rc" -eq 2 ] && grep -q -- "$pattern" <<<"$out" && return 0
  printf 'exit %s, wanted 2 and /%s/:\n%s\n' "$rc" "$pattern" "$out"
  return 1
}
check "busy HTTP port" \
  refuses "cannot bind HTTP to 127.0.0.1:$http_port.*(--http-listen)" --http-listen "127.0.0.1:$http_port"
check "bad HTTP address" refuses 'is not host:port' --http-listen nonsense
check "bad --log-level" refuses '--log-level must be error, info or debug' --http-listen= \
  --log-level loud
# Plain HTTP off loopback needs --insecure, as plaintext gRPC does.
for address in 0.0.0.0:0 '[::]:0' :0; do
  pattern=$(sed 's/[].[]/\\&/g' <<<"$address")  # The address, literally, in the regex.
  check "non-loopback --http-listen $address without --insecure" \
    refuses "plain HTTP on --http-listen $pattern, which is not a loopback address.*--insecure" \
    --http-listen "$address"
done
serves_insecure() {  # attnd --http-listen 0.0.0.0:0 --insecure starts and reports the port
  local out="$dir/insecure.out" pid banner=""
  : >"$out"  # Before the background job's own redirection, which the loop may outrun.
  "$attnd" --listen 127.0.0.1:0 --http-listen 0.0.0.0:0 --insecure --threads 1 >"$out" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    banner=$(grep -E '^  http: http://0\.0\.0\.0:[1-9][0-9]* ' "$out" || true)
    [ -n "$banner" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  [ -n "$banner" ] || { cat "$out"; return 1; }
}
check "--http-listen 0.0.0.0:0 with --insecure serves" serves_insecure

# SIGTERM with an idle keep-alive HTTP connection open: attnd still exits 0, promptly.
kill -0 "$server" || { echo "FAIL: attnd died"; cat "$dir/err"; exit 1; }
exec 3<>"/dev/tcp/127.0.0.1/$http_port"
printf 'GET /healthz HTTP/1.1\r\nHost: attnd\r\n\r\n' >&3
start=$(date +%s%N)
kill -TERM "$server"
rc=0
wait "$server" || rc=$?
ms=$((($(date +%s%N) - start) / 1000000))
server=""
exec 3>&-
check "SIGTERM: exit 0 within 5 s with an HTTP connection open (exit $rc after $ms ms)" \
  test "$rc" -eq 0 -a "$ms" -lt 5000

echo "http: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
