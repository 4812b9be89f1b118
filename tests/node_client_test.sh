#!/usr/bin/env bash
# The Node client (client/node, @grpc/grpc-js) against a real attnd: client/node/test.js calls
# all four RPCs and checks the seed example's out[0] and a random problem against a float64
# reference, the trace's last estimate against Tiled's row, KV caches (a batched decode and Tiled
# over a cache against float64, stale expectedLength, NOT_FOUND), fp16/bf16 tensors, INVALID_ARGUMENT
# naming the field, and TLS with a bearer token (a second attnd with certificates made here by
# openssl); persistent caches (crc32c, export / import between servers and through files,
# DATA_LOSS for damaged exports, the Cache's replay tail re-sent by refresh() to an attnd
# restored from a copy of another's --cache-dir, DATA_LOSS when no tail was kept, moved_to
# followed once), for which test.js starts attnd servers of its own (--attnd); speculative
# decoding (truncate and truncateTo: a cut cache bit-equal to one that never had the cut tokens,
# rounds of k drafts, errors naming the field and failed batches leaving every cache as it was,
# and with --cache-dir a SIGKILL after cuts, a restart and refresh() never re-sending a cut
# token, a cut whose answer is lost not undone); token trees (treeParents: each row against
# float64 and a causal decode over its branch, a cut keeping one branch bit-equal to a cache built
# from it, the server's and the client's errors naming the field and leaving the cache); then
# client/node/example.js must print the seed's out[0] and its trace.
# Exits 77 (ctest: skipped) when node is absent; fails when client/node/node_modules is missing.
# Usage: node_client_test.sh ATTND
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$1
node_dir=$(cd "$(dirname "$0")/../client/node" && pwd)

if ! command -v node >/dev/null 2>&1; then
  echo "SKIPPED: node not found (install Node.js >= 18 to test client/node)"
  exit 77
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$node_major" -lt 18 ]; then
  echo "SKIPPED: node $(node --version) is older than 18 (node:test is needed)"
  exit 77
fi
for module in @grpc/grpc-js @grpc/proto-loader; do
  if [ ! -d "$node_dir/node_modules/$module" ]; then
    echo "FAIL: $node_dir/node_modules/$module is missing: run deploy/install-deps.sh" \
      "(it runs npm ci in client/node)"
    exit 1
  fi
done

dir=$(mktemp -d)
servers=()
cleanup() {
  for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${servers[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

# start NAME ATTND_FLAGS...: starts attnd on a free port and sets $port (from its banner line
# "... (port N)"); its output is $dir/NAME.log.
start() {
  local name=$1 log="$dir/$1.log"
  shift
  "$attnd" --listen 127.0.0.1:0 --http-listen= --threads 2 "$@" >"$log" 2>&1 &
  servers+=($!)
  port=$(attnd_wait_port "${servers[-1]}" "$log") || { echo "FAIL: attnd ($name)" >&2; exit 1; }
}

start plain
plain_port=$port
test_args=(--target "127.0.0.1:$plain_port" --attnd "$attnd")

# TLS + token: a CA and a server certificate for 127.0.0.1, made here (skipped without openssl).
if command -v openssl >/dev/null 2>&1; then
  ssl() { openssl "$@" 2>>"$dir/openssl.log"; }
  ssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=attn node test ca" -keyout "$dir/ca.key" -out "$dir/ca.pem"
  ssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=attn node test server" \
    -keyout "$dir/server.key" -out "$dir/server.csr"
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' \
    >"$dir/server.ext"
  ssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -set_serial 1 \
    -days 1 -extfile "$dir/server.ext" -out "$dir/server.pem"
  od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$dir/token"
  start secure --tls-cert "$dir/server.pem" --tls-key "$dir/server.key" \
    --auth-token-file "$dir/token"
  test_args+=(--secure-target "127.0.0.1:$port" --tls-ca "$dir/ca.pem" --token-file "$dir/token")
else
  echo "note: openssl not found; the TLS + token test is skipped"
fi

failed=0
node "$node_dir/test.js" "${test_args[@]}" || failed=1

# The example prints the seed's out[0] and every trace step.
example=$(node "$node_dir/example.js" "127.0.0.1:$plain_port" 2>&1) || failed=1
for pattern in 'out\[0\] = \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]' \
  'tile 3, keys \[6, 8\)' 'max -inf -> 2\.000000  rescale 0\.000000' \
  'estimate \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]' 'trace end: 1 rows, 4 steps'; do
  grep -qE -- "$pattern" <<<"$example" || {
    failed=1
    printf 'FAIL example.js output lacks /%s/:\n%s\n' "$pattern" "$example"
  }
done

for pid in "${servers[@]}"; do
  kill -0 "$pid" 2>/dev/null || { echo "FAIL: an attnd died"; cat "$dir"/*.log; exit 1; }
done
[ "$failed" -eq 0 ] && echo "node client: passed"
[ "$failed" -eq 0 ]
