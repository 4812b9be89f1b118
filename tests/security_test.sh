#!/usr/bin/env bash
# attnd's transport security against the attn CLI (and raw gRPC from Python): TLS with
# certificates made here by openssl, mutual TLS, bearer tokens (missing, wrong, right; health
# exempt; reflection covered; the token never in attnd's output), and the start-up rules
# (non-loopback plaintext refused without --insecure; bad flag combinations exit 2).
# Usage: security_test.sh ATTND ATTN
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$1
attn=$2
dir=$(mktemp -d)
servers=()
cleanup() {
  for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${servers[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

# --- certificates: a CA, a server certificate for 127.0.0.1/localhost, a client certificate,
# and a second ("rogue") CA with its own client certificate that the server must not trust.
ssl() { openssl "$@" 2>>"$dir/openssl.log"; }
make_ca() {  # make_ca NAME
  ssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj "/CN=attn test $1" -keyout "$dir/$1.key" -out "$dir/$1.pem"
}
make_cert() {  # make_cert NAME CA EXTENSIONS
  ssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=attn test $1" \
    -keyout "$dir/$1.key" -out "$dir/$1.csr"
  printf '%s\n' "$3" >"$dir/$1.ext"
  ssl x509 -req -in "$dir/$1.csr" -CA "$dir/$2.pem" -CAkey "$dir/$2.key" -set_serial "$RANDOM" \
    -days 1 -extfile "$dir/$1.ext" -out "$dir/$1.pem"
}
make_ca ca
make_ca rogue
make_cert server ca $'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth'
make_cert client ca 'extendedKeyUsage=clientAuth'
make_cert intruder rogue 'extendedKeyUsage=clientAuth'

# Tokens: random hex, the server's file with a trailing newline (stripped), the client's without.
token=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
wrong=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
printf '%s\n' "$token" >"$dir/token"
printf '%s' "$token" >"$dir/client-token"
printf '%s\n' "$wrong" >"$dir/wrong-token"
: >"$dir/empty-token"
printf '  \n\n' >"$dir/blank-token"
printf 'two words\n' >"$dir/spaced-token"

# Every attnd here runs without the HTTP side port (when it has one), so none collide on it.
common=(--threads 2)
if grep -q -- '--http_listen' <<<"$("$attnd" --helpfull 2>&1 || true)"; then
  common+=(--http-listen=)
fi

# start NAME ATTND_FLAGS...: starts attnd on a free port; sets $port; its output is $dir/NAME.log.
start() {
  local name=$1 log="$dir/$1.log"
  shift
  "$attnd" "${common[@]}" "$@" >"$log" 2>&1 &
  servers+=($!)
  port=$(attnd_wait_port "${servers[-1]}" "$log") || { echo "FAIL: attnd $name"; exit 1; }
}

# Neither token may ever be echoed back, in a message or anywhere else (after every check).
check_also() {  # check_also NAME OUTPUT
  if grep -qF -e "$token" -e "$wrong" <<<"$2"; then
    failed=$((failed + 1))
    echo "FAIL $1: the output holds a token"
  fi
}
refused='UNAVAILABLE|DEADLINE_EXCEEDED'  # A failed handshake, seen from the client.
seed_out='out\[0\] = \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]'
tls=(--tls-ca "$dir/ca.pem")
mtls=(--tls-ca "$dir/ca.pem" --tls-cert "$dir/client.pem" --tls-key "$dir/client.key")

# --- TLS ---------------------------------------------------------------------------------------
start tls --listen 127.0.0.1:0 --tls-cert "$dir/server.pem" --tls-key "$dir/server.key"
t=(--target "127.0.0.1:$port" --timeout-ms 5000)
check tls-banner 0 'security: TLS$' -- cat "$dir/tls.log"
check tls-health 0 '^SERVING$' -- "$attn" "${t[@]}" "${tls[@]}" health
check tls-localhost-name 0 'backend +cpu' -- \
  "$attn" --target "localhost:$port" --timeout-ms 5000 "${tls[@]}" info
check tls-tiled 0 "$seed_out" -- "$attn" "${t[@]}" "${tls[@]}" tiled --example seed --block-k 3
check tls-plaintext-client 1 "$refused" -- "$attn" "${t[@]}" health
check tls-untrusted-server 1 "$refused" -- "$attn" "${t[@]}" --tls-ca "$dir/rogue.pem" health

# --- mutual TLS --------------------------------------------------------------------------------
start mtls --listen 127.0.0.1:0 --tls-cert "$dir/server.pem" --tls-key "$dir/server.key" \
  --tls-client-ca "$dir/ca.pem"
t=(--target "127.0.0.1:$port" --timeout-ms 5000)
check mtls-banner 0 'security: mutual TLS' -- cat "$dir/mtls.log"
check mtls-health 0 '^SERVING$' -- "$attn" "${t[@]}" "${mtls[@]}" health
check mtls-info 0 'backend +cpu' -- "$attn" "${t[@]}" "${mtls[@]}" info
check mtls-no-client-cert 1 "$refused" -- "$attn" "${t[@]}" "${tls[@]}" info
check mtls-untrusted-client-cert 1 "$refused" -- "$attn" "${t[@]}" "${tls[@]}" \
  --tls-cert "$dir/intruder.pem" --tls-key "$dir/intruder.key" info
check mtls-plaintext-client 1 "$refused" -- "$attn" "${t[@]}" health

# --- bearer token over plaintext on loopback ---------------------------------------------------
start token --listen 127.0.0.1:0 --auth-token-file "$dir/token"
t=(--target "127.0.0.1:$port" --timeout-ms 5000)
check token-banner 0 'security: plaintext, bearer token required' -- cat "$dir/token.log"
check token-missing 1 'UNAUTHENTICATED: this server requires a bearer token' -- \
  "$attn" "${t[@]}" info
check token-wrong 1 'UNAUTHENTICATED: the bearer token was not accepted' -- \
  "$attn" "${t[@]}" --token-file "$dir/wrong-token" info
check token-right 0 'backend +cpu' -- "$attn" "${t[@]}" --token-file "$dir/client-token" info
check token-right-newline 0 "$seed_out" -- \
  "$attn" "${t[@]}" --token-file "$dir/token" tiled --example seed --block-k 3
check token-trace 0 'tile 3, keys \[6, 8\)' -- \
  "$attn" "${t[@]}" --token-file "$dir/token" trace --example seed --block-k 2
check token-trace-missing 1 'UNAUTHENTICATED' -- "$attn" "${t[@]}" trace --example seed
check token-health-without 0 '^SERVING$' -- "$attn" "${t[@]}" health
check token-health-wrong 0 '^SERVING$' -- "$attn" "${t[@]}" --token-file "$dir/wrong-token" health
check token-client-empty-file 1 '--token-file: .* is empty' -- \
  "$attn" "${t[@]}" --token-file "$dir/empty-token" info
# attn reads the token file by attnd's rules (proto/credential_files.h): the same refusals.
check token-client-blank-file 1 '--token-file: .*blank-token is empty' -- \
  "$attn" "${t[@]}" --token-file "$dir/blank-token" info
check token-client-spaced-file 1 '--token-file: .*spaced-token holds a character that is not visible' \
  -- "$attn" "${t[@]}" --token-file "$dir/spaced-token" info
check token-client-missing-file 1 '--token-file: cannot read .*missing-token' -- \
  "$attn" "${t[@]}" --token-file "$dir/missing-token" info
check tls-client-not-pem 1 '--tls-ca: .*token is not a PEM file' -- \
  "$attn" "${t[@]}" --tls-ca "$dir/token" info
# Raw gRPC: reflection needs the token too; the scheme is case-insensitive; malformed and
# repeated authorization metadata are refused.
check token-raw 0 '^raw: 7 passed$' -- /usr/bin/python3 - "$port" "$token" "$wrong" <<'EOF'
import sys
import grpc
port, token, wrong = sys.argv[1], sys.argv[2], sys.argv[3]
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
same = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
info = channel.unary_unary("/attention.v1.AttentionService/GetServerInfo", **same)
health = channel.unary_unary("/grpc.health.v1.Health/Check", **same)
reflection = channel.stream_stream(
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", **same)
list_services = b"\x3a\x00"  # ServerReflectionRequest{list_services: ""}

def call(fn, metadata):
    try:
        return grpc.StatusCode.OK, fn(metadata)
    except grpc.RpcError as error:
        return error.code(), error.details()

cases = [
    ("reflection-missing", lambda md: list(reflection(iter([list_services]), metadata=md, timeout=5)),
     [], grpc.StatusCode.UNAUTHENTICATED, "requires a bearer token"),
    ("reflection-right", lambda md: b"".join(reflection(iter([list_services]), metadata=md, timeout=5)),
     [("authorization", "Bearer " + token)], grpc.StatusCode.OK, b"attention.v1.AttentionService"),
    ("lowercase-scheme", lambda md: info(b"", metadata=md, timeout=5),
     [("authorization", "bearer " + token)], grpc.StatusCode.OK, b""),
    ("basic-scheme", lambda md: info(b"", metadata=md, timeout=5),
     [("authorization", "Basic " + token)], grpc.StatusCode.UNAUTHENTICATED, 'must read "Bearer'),
    ("bare-token", lambda md: info(b"", metadata=md, timeout=5),
     [("authorization", token)], grpc.StatusCode.UNAUTHENTICATED, 'must read "Bearer'),
    ("two-entries", lambda md: info(b"", metadata=md, timeout=5),
     [("authorization", "Bearer " + token), ("authorization", "Bearer " + wrong)],
     grpc.StatusCode.UNAUTHENTICATED, "one authorization metadata entry"),
    ("health-wrong", lambda md: health(b"", metadata=md, timeout=5),
     [("authorization", "Bearer " + wrong)], grpc.StatusCode.OK, b"\x08\x01"),  # SERVING
]
failed = 0
for name, fn, metadata, want_code, want_text in cases:
    code, result = call(fn, metadata)
    text = result if isinstance(result, (bytes, str)) else repr(result)
    leaked = any(t in (text if isinstance(text, str) else text.decode("latin-1"))
                 for t in (token, wrong))
    if code != want_code or want_text not in text or leaked:
        failed += 1
        print(f"FAIL {name}: {code} {text!r}")
if failed:
    sys.exit(1)
print(f"raw: {len(cases)} passed")
EOF

# --- TLS + mutual TLS + token together ---------------------------------------------------------
start all --listen 127.0.0.1:0 --tls-cert "$dir/server.pem" --tls-key "$dir/server.key" \
  --tls-client-ca "$dir/ca.pem" --auth-token-file "$dir/token"
t=(--target "127.0.0.1:$port" --timeout-ms 5000)
check all-health 0 '^SERVING$' -- "$attn" "${t[@]}" "${mtls[@]}" health
check all-missing 1 'UNAUTHENTICATED' -- "$attn" "${t[@]}" "${mtls[@]}" info
check all-wrong 1 'UNAUTHENTICATED' -- "$attn" "${t[@]}" "${mtls[@]}" --token-file "$dir/wrong-token" info
check all-right 0 "$seed_out" -- "$attn" "${t[@]}" "${mtls[@]}" --token-file "$dir/token" \
  naive --example seed

# --- the listen address rule -------------------------------------------------------------------
startup() {  # startup ATTND_FLAGS...: runs an attnd that must refuse to start
  timeout 30 "$attnd" "${common[@]}" "$@"
}
check wildcard-v4-refused 2 'not a loopback address.*--insecure' -- startup --listen 0.0.0.0:0
check wildcard-v6-refused 2 'not a loopback address.*--insecure' -- startup --listen '[::]:0'
check empty-host-refused 2 '--insecure' -- startup --listen :0
check other-address-refused 2 '--insecure' -- startup --listen 192.0.2.1:0
check hostname-refused 2 '--insecure' -- startup --listen attn.example:0
check token-alone-refused 2 '--insecure' -- \
  startup --listen 0.0.0.0:0 --auth-token-file "$dir/token"
start insecure --listen 0.0.0.0:0 --insecure
check insecure-banner 0 'security: plaintext \[--insecure\]' -- cat "$dir/insecure.log"
check insecure-health 0 '^SERVING$' -- "$attn" --target "127.0.0.1:$port" --timeout-ms 5000 health
start wildcard-tls --listen 0.0.0.0:0 --tls-cert "$dir/server.pem" --tls-key "$dir/server.key"
check wildcard-tls-health 0 '^SERVING$' -- \
  "$attn" --target "127.0.0.1:$port" --timeout-ms 5000 "${tls[@]}" health
start localhost --listen localhost:0
check localhost-plaintext 0 'security: plaintext$' -- cat "$dir/localhost.log"
start loopback-net --listen 127.0.0.2:0  # All of 127.0.0.0/8 is loopback.
check loopback-net-health 0 '^SERVING$' -- "$attn" --target "127.0.0.2:$port" --timeout-ms 5000 health

# --- flag errors at start-up -------------------------------------------------------------------
check cert-without-key 2 '--tls-cert and --tls-key go together' -- \
  startup --listen 127.0.0.1:0 --tls-cert "$dir/server.pem"
check client-ca-without-tls 2 '--tls-client-ca .*needs TLS' -- \
  startup --listen 127.0.0.1:0 --tls-client-ca "$dir/ca.pem"
check missing-cert 2 '--tls-cert: cannot read .*missing.pem' -- \
  startup --listen 127.0.0.1:0 --tls-cert "$dir/missing.pem" --tls-key "$dir/server.key"
check not-pem 2 '--tls-key: .* is not a PEM file' -- \
  startup --listen 127.0.0.1:0 --tls-cert "$dir/server.pem" --tls-key "$dir/token"
check mismatched-key 2 'Invalid private key' -- \
  startup --listen 127.0.0.1:0 --tls-cert "$dir/server.pem" --tls-key "$dir/client.key"
check empty-token 2 '--auth-token-file: .*empty-token is empty' -- \
  startup --listen 127.0.0.1:0 --auth-token-file "$dir/empty-token"
check blank-token 2 '--auth-token-file: .*blank-token is empty' -- \
  startup --listen 127.0.0.1:0 --auth-token-file "$dir/blank-token"
check spaced-token 2 '--auth-token-file: .*spaced-token holds a character that is not visible' -- \
  startup --listen 127.0.0.1:0 --auth-token-file "$dir/spaced-token"
check missing-token 2 '--auth-token-file: cannot read .*missing-token' -- \
  startup --listen 127.0.0.1:0 --auth-token-file "$dir/missing-token"

# Every server still up, and none ever printed the token.
for pid in "${servers[@]}"; do
  kill -0 "$pid" 2>/dev/null || { echo "FAIL: an attnd died"; failed=$((failed + 1)); }
done
if grep -lF -e "$token" -e "$wrong" "$dir"/*.log; then
  echo "FAIL: a token appears in attnd's output (files above)"
  failed=$((failed + 1))
fi
echo "security: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
