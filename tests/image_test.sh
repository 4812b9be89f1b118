#!/usr/bin/env bash
# The container image built and run for real (issue 17), checked from outside the container with
# the host's attn and Python client:
#   1. a Debian 12 base image made with debootstrap from this machine's package registry (no
#      image registry is reachable here), cached as a tarball under build/image/ and as a tag;
#   2. the Dockerfile built on it for both stages with ATTN_CUDA=OFF (the CPU image; its runtime
#      libraries come from install-deps.sh's Debian 12 list);
#   3. the image's defaults: runs as uid 10001 with a read-only root, becomes healthy by its own
#      HEALTHCHECK, answers Naive, Tiled and Trace (the seed example, and a random problem
#      against a float64 reference), keeps a KV cache across calls;
#   4. plaintext on 0.0.0.0 without --insecure exits 2; a token and TLS files mounted as the
#      Dockerfile's comments describe are served (and its HEALTHCHECK with --tls-ca works);
#   5. `docker stop` during a long call: the call finishes OK and the container exits 0;
#   6. KV caches in a Docker volume for --cache-dir (issue 29): two caches (fp32, and bf16
#      read by GQA queries) created and grown, `docker stop` (SIGTERM: drained, flushed, exit
#      0), `docker start`: the same caches, lengths and list, and Tiled over each bit for bit
#      as before the stop; they take appends where they left off; a new container from the
#      image on the same volume (an upgrade) restores them too, and the volume's files belong
#      to uid 10001;
#   7. deploy/compose.yaml's attnd-cpu comes up healthy, serves with its token secret, keeps a
#      cache in its volume across `stop` and `start`, stops 0.
# Starts dockerd when none answers (and stops it again); removes every container and volume it
# started.
# Prints the debootstrap time, the image's build time and its size.
# Usage: image_test.sh RELEASE_BUILD_DIR   (the host's attn and its Python stubs, python/)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=attnd_lib.sh
source "$root/tests/attnd_lib.sh"
release=$(cd "$1" && pwd)
attn=$release/attn
# Debian's client, the daemon's own version: /usr/local/bin/docker may be a newer client-only
# binary, first on PATH, whose `docker build` hands off to a buildx plugin that is not here.
docker=/usr/bin/docker
image=attnd:0.1.0-cpu  # The tag deploy/compose.yaml's attnd-cpu service runs.
label=attnd.image-test  # On every container this test starts, so cleanup finds them all.
work=$root/build/image
mkdir -p "$work"
dir=$(mktemp -d)
compose=(docker-compose -f "$root/deploy/compose.yaml" -p attnd-image-test)
dockerd_pid=""
client=""

cleanup() {  # Every step may fail (a half-started run): none may stop the others.
  [ -z "$client" ] || kill "$client" 2>/dev/null || true
  if [ -n "$dockerd_pid" ] || "$docker" info >/dev/null 2>&1; then
    "${compose[@]}" down -v --timeout 5 >/dev/null 2>&1 || true
    local leftover
    leftover=$("$docker" ps -aq --filter "label=$label" 2>/dev/null || true)
    # shellcheck disable=SC2086  # One id a word.
    [ -z "$leftover" ] || "$docker" rm -f $leftover >/dev/null 2>&1 || true
    leftover=$("$docker" volume ls -q --filter "label=$label" 2>/dev/null || true)
    # shellcheck disable=SC2086  # One name a word.
    [ -z "$leftover" ] || "$docker" volume rm -f $leftover >/dev/null 2>&1 || true
  fi
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {  # fail MESSAGE [LOG]: stops the test here
  [ -z "${2:-}" ] || tail -n 60 "$2"
  echo "FAIL: $1"
  exit 1
}

# --- the engine -------------------------------------------------------------------------------
# CI's machine starts no services, so the test starts dockerd itself when none answers.
if ! "$docker" info >/dev/null 2>&1; then
  dockerd >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do
    "$docker" info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || fail "dockerd exited" "$work/dockerd.log"
    sleep 1
  done
  "$docker" info >/dev/null 2>&1 || fail "dockerd did not answer in 60 s" "$work/dockerd.log"
fi
# What a killed run left (compose's container would come back by its restart policy).
"${compose[@]}" down -v --timeout 5 >/dev/null 2>&1 || true
"$docker" ps -aq --filter "label=$label" | xargs -r "$docker" rm -f >/dev/null
"$docker" volume ls -q --filter "label=$label" | xargs -r "$docker" volume rm -f >/dev/null

# --- 1. the base image ------------------------------------------------------------------------
# Everything that decides its contents is in its key, so a change makes a new base and an
# unchanged recipe reuses the imported tag, else the tarball (a clean clone has neither).
# apt in the base is configured like the host's: the same registry (Debian's suites, security
# included), and the host's Acquire::Check-* settings, since that registry serves a dated
# snapshot whose Release files are past their Valid-Until.
mirror=${ATTN_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${ATTN_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
sources="Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
apt_settings=$(apt-config dump | grep -E '^Acquire::Check-(Valid-Until|Date) ' || true)
recipe="debootstrap $(dpkg-query -W -f='${Version}' debootstrap) --variant=minbase bookworm $mirror
$sources
$apt_settings"
key=$(sha256sum <<<"$recipe" | cut -c1-12)
base=attnd-base:debian12-$key
tarball=$work/debian12-$key.tar
debootstrap_note="the tag, reused"
if ! "$docker" image inspect "$base" >/dev/null 2>&1; then
  if [ ! -f "$tarball" ]; then
    started=$SECONDS
    rootfs=$work/rootfs
    # A debootstrap killed midway can leave proc and sys mounted inside its target.
    awk -v dir="$rootfs/" 'index($2, dir) == 1 { print $2 }' /proc/mounts | sort -r |
      xargs -r umount -l
    rm -rf --one-file-system "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
      fail "debootstrap (log $work/debootstrap.log)" "$work/debootstrap.log"
    rm -f "$rootfs/etc/apt/sources.list"
    printf '%s\n' "$sources" >"$rootfs/etc/apt/sources.list.d/debian.sources"
    [ -z "$apt_settings" ] || printf '%s\n' "$apt_settings" >"$rootfs/etc/apt/apt.conf.d/99host"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    rm -rf --one-file-system "$rootfs"
    find "$work" -maxdepth 1 -name 'debian12-*.tar' ! -name "debian12-$key.tar" -delete
    debootstrap_note="debootstrap $((SECONDS - started)) s"
  else
    debootstrap_note="imported from $tarball"
  fi
  "$docker" image ls -q 'attnd-base' | xargs -r "$docker" rmi -f >/dev/null 2>&1 || true
  "$docker" import --change 'CMD ["/bin/bash"]' "$tarball" "$base" >/dev/null
fi
echo "image_test: base $base ($debootstrap_note)"

# --- 2. the CPU image -------------------------------------------------------------------------
# BuildKit (built into Debian's dockerd; DOCKER_BUILDKIT=1 asks for it without the buildx plugin)
# builds the two stages side by side and keeps its cache apart from the images: the image this
# one replaces can go, and the cache is trimmed to about two builds (a CI machine runs many).
build_args=(--build-arg "BASE_BUILD=$base" --build-arg "BASE_RUNTIME=$base"
  --build-arg ATTN_CUDA=OFF)
before=$("$docker" image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
started=$SECONDS
DOCKER_BUILDKIT=1 "$docker" build --progress=plain "${build_args[@]}" -t "$image" "$root" \
  >"$work/build.log" 2>&1 || fail "docker build (log $work/build.log)" "$work/build.log"
build_seconds=$((SECONDS - started))
after=$("$docker" image inspect -f '{{.Id}}' "$image")
if [ -n "$before" ] && [ "$before" != "$after" ]; then
  "$docker" rmi "$before" >/dev/null 2>&1 || true
fi
"$docker" builder prune -f --keep-storage 3GB >/dev/null
size=$("$docker" image inspect -f '{{.Size}}' "$image")
echo "image_test: built $image in $build_seconds s, $((size / 1000000)) MB"

# --- containers -------------------------------------------------------------------------------
# As deploy/compose.yaml and deploy/k8s run it: read-only root with a tmpfs /tmp, no
# capabilities, no privilege escalation; ports on the host's loopback, on ports Docker picks.
hardened=(--label "$label" --read-only --tmpfs /tmp --cap-drop ALL
  --security-opt no-new-privileges:true -p 127.0.0.1::50051 -p 127.0.0.1::8080)
host_port() {  # host_port CONTAINER PORT: the loopback port Docker published PORT on
  "$docker" port "$1" "$2/tcp" | sed -n 's/^127\.0\.0\.1:\([0-9]*\)$/\1/p' | head -n 1
}
wait_healthy() {  # wait_healthy CONTAINER: until its HEALTHCHECK reports healthy (120 s at most)
  local status=""
  for _ in $(seq 120); do
    status=$("$docker" inspect -f '{{.State.Health.Status}} {{.State.Running}}' "$1")
    [ "$status" = "healthy true" ] && return 0
    [ "${status#* }" = true ] || break
    sleep 1
  done
  "$docker" logs "$1" 2>&1 | tail -n 30
  "$docker" inspect -f '{{json .State.Health}}' "$1"
  fail "container $1 is not healthy ($status)"
}
http_get() {  # http_get HTTP_PORT PATH: the status and body of attnd's answer on its HTTP port
  /usr/bin/python3 - "http://127.0.0.1:$1$2" <<'PY'
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as answer:
        print(answer.status, answer.read().decode(), end="")
except urllib.error.HTTPError as error:
    print(error.code, error.read().decode(), end="")
PY
}
metric() {  # metric HTTP_PORT NAME: the value of an unlabelled metric on attnd's /metrics
  http_get "$1" /metrics | awk -v name="$2" '$1 == name { print $2 }'
}
seed_out='out\[0\] = \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]'

# --- 3. the image's defaults ------------------------------------------------------------------
main=attnd-image-test-main
"$docker" run -d --name "$main" "${hardened[@]}" "$image" >/dev/null
started=$SECONDS
wait_healthy "$main"
echo "image_test: healthy by its HEALTHCHECK after $((SECONDS - started)) s"
grpc_port=$(host_port "$main" 50051)
http_port=$(host_port "$main" 8080)
t=(--target "127.0.0.1:$grpc_port" --timeout-ms 30000)

check image-user 0 '^10001:10001$' -- "$docker" image inspect -f '{{.Config.User}}' "$image"
check runs-as-10001 0 '^Uid:\s+10001\s+10001\s' -- \
  "$docker" exec "$main" grep '^Uid:' /proc/1/status
check read-only-root 1 'Read-only file system' -- "$docker" exec -u 0 "$main" touch /probe
check banner 0 'security: plaintext \[--insecure\]' -- "$docker" logs "$main"
check info 0 'backend +cpu' -- "$attn" "${t[@]}" info
check health 0 '^SERVING$' -- "$attn" "${t[@]}" health
check naive-seed 0 "$seed_out" -- "$attn" "${t[@]}" naive --example seed
check tiled-seed 0 "$seed_out" -- "$attn" "${t[@]}" tiled --example seed --block-k 3
check trace-seed 0 'tile 3, keys \[6, 8\)' -- "$attn" "${t[@]}" trace --example seed --block-k 2
check trace-seed-final 0 'max \|online − full\| = [0-9.e-]+' -- \
  "$attn" "${t[@]}" trace --example seed --block-k 2
check readyz 0 '^200 ready$' -- http_get "$http_port" /readyz
# A random problem (odd sizes, causal, GQA, fp32 and bf16) against tests/python's float64
# reference and tolerances, through the Python client; Trace's row against the same reference.
check random-reference 0 '^reference: 4 passed$' -- \
  env PYTHONPATH="$release/python:$root/client/python:$root/tests/python" \
  /usr/bin/python3 - "127.0.0.1:$grpc_port" <<'EOF'
import sys
import numpy as np
import attnd_harness as h
from attn_client import Client

rng = np.random.default_rng(17)
q = rng.uniform(-1, 1, (1, 4, 37, 24)).astype(np.float32)
k = rng.uniform(-1, 1, (1, 2, 133, 24)).astype(np.float32)
v = rng.uniform(-1, 1, (1, 2, 133, 20)).astype(np.float32)
ref, ref_lse, score_max = h.reference_attention(q, k, v, causal=True)
as_bf16 = [h.bf16_bits_to_fp32(h.round_to_bf16_bits(x)) for x in (q, k, v)]
ref_bf16, _, score_max_bf16 = h.reference_attention(*as_bf16, causal=True)
failures = []
with Client(sys.argv[1], timeout=60) as client:
    for name, call in (("naive", client.naive), ("tiled", client.tiled)):
        result = call(q, k, v, causal=True, return_lse=True, block_k=16)
        error = (h.output_error(result.output.astype(np.float64), ref, 1, score_max)
                 or h.lse_error(result.lse.astype(np.float64), ref_lse))
        if error:
            failures.append(f"{name} fp32: {error}")
    result = client.tiled(q, k, v, causal=True, dtype="bf16", block_k=16)
    error = h.output_error(result.output_float32().astype(np.float64), ref_bf16, 3,
                           score_max_bf16)
    if error:
        failures.append(f"tiled bf16: {error}")
    row = (0, 3, 30)
    done = [e for e in client.trace(q, k, v, rows=[row], block_k=16, causal=True)
            if e["kind"] == "row_done"]
    error = "no row_done event" if len(done) != 1 else h.output_error(
        done[0]["output"].astype(np.float64), ref[row], 1, score_max,
        magnitude=float(np.max(np.abs(ref))))
    if error:
        failures.append(f"trace row {row}: {error}")
for failure in failures:
    print("FAIL", failure)
print(f"reference: {4 - len(failures)} passed")
EOF

# A KV cache lives in attnd's memory (the root file system is read-only): created, grown and
# read by separate calls, each a new connection.
cache=("$attn" "${t[@]}" cache)
created=$("${cache[@]}" create --kv-heads 2 --head-dim 16 --dtype f32 2>&1) || true
cache_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
check cache-create 0 '^cache [0-9a-f]{32}$' -- echo "$created"
check cache-append 0 'length 100 tokens' -- "${cache[@]}" append "$cache_id" --tokens 100
check cache-append-again 0 'length 130 tokens' -- \
  "${cache[@]}" append "$cache_id" --tokens 30 --expected-length 100 --seed 2
check cache-append-stale 1 'FAILED_PRECONDITION: .*130' -- \
  "${cache[@]}" append "$cache_id" --tokens 5 --expected-length 100
check cache-info 0 'length 130 tokens' -- "${cache[@]}" info "$cache_id"
check cache-list 0 "^$cache_id +2 +16 +16 +DTYPE_FLOAT32 +130 " -- "${cache[@]}" list
check cache-metric 0 '^1$' -- metric "$http_port" attnd_caches
check cache-tiled 0 'output \[1, 4, 3, 16\]' -- \
  "$attn" "${t[@]}" tiled --cache "$cache_id" --random 1,4,3,16 --causal
check cache-trace 0 'tile [0-9]+, keys \[[0-9]+, 130\)$' -- \
  "$attn" "${t[@]}" trace --cache "$cache_id" --random 1,4,3,16 --block-k 64
check cache-delete 0 "^deleted cache $cache_id$" -- "${cache[@]}" delete "$cache_id"
check cache-gone 1 'NOT_FOUND' -- "${cache[@]}" info "$cache_id"
decode=$("$attn" "${t[@]}" decode --dtype f32 --heads 4 --kv-heads 2 --head-dim 16 \
  --tokens 300 --steps 3 2>&1) || true
decode_error=$(sed -n \
  's/^max |decode - float64 reference| \/ max |reference| = \([0-9.e+-]*\) over 3 steps$/\1/p' \
  <<<"$decode")
check decode 0 '^deleted cache [0-9a-f]{32}$' -- echo "$decode"
check decode-error 0 '^ok$' -- awk -v e="${decode_error:-nan}" \
  'BEGIN { if (e != "nan" && e + 0 <= 1e-5) print "ok"; else print "error " e " over 1e-5" }'

# --- 4. the listen rule, token and TLS --------------------------------------------------------
check plaintext-refused 2 'not a loopback address.*--insecure' -- \
  timeout 60 "$docker" run --rm --label "$label" "$image" --listen 0.0.0.0:50051 \
  --http-listen 0.0.0.0:8080 --device auto
# Certificates for 127.0.0.1 (the address inside the container and the published one outside),
# made here like tests/security_test.sh's; files readable by uid 10001 in directories it can enter.
mkdir -p "$dir/certs" "$dir/secrets"
ssl() { openssl "$@" 2>>"$dir/openssl.log"; }
ssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
  -subj "/CN=attn image test ca" -keyout "$dir/ca.key" -out "$dir/certs/ca.crt"
ssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=attn image test server" \
  -keyout "$dir/certs/tls.key" -out "$dir/server.csr"
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$dir/server.ext"
ssl x509 -req -in "$dir/server.csr" -CA "$dir/certs/ca.crt" -CAkey "$dir/ca.key" \
  -set_serial "$RANDOM" -days 1 -extfile "$dir/server.ext" -out "$dir/certs/tls.crt"
token=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
printf '%s\n' "$token" >"$dir/secrets/token"
chmod 755 "$dir" "$dir/certs" "$dir/secrets"
chmod 644 "$dir/certs/"* "$dir/secrets/token"
secure=attnd-image-test-tls
# gRPC over TLS; the plain HTTP port stays on loopback (elsewhere it would need --insecure).
"$docker" run -d --name "$secure" "${hardened[@]}" \
  -v "$dir/certs:/certs:ro" -v "$dir/secrets:/secrets:ro" \
  --health-cmd 'attn --target 127.0.0.1:50051 --tls-ca /certs/ca.crt --timeout-ms 3000 health' \
  --health-interval 2s "$image" \
  --listen 0.0.0.0:50051 --http-listen 127.0.0.1:8080 --device auto \
  --tls-cert /certs/tls.crt --tls-key /certs/tls.key --auth-token-file /secrets/token >/dev/null
wait_healthy "$secure"
s=(--target "127.0.0.1:$(host_port "$secure" 50051)" --timeout-ms 30000)
tls=(--tls-ca "$dir/certs/ca.crt")
check tls-banner 0 'security: TLS, bearer token required' -- "$docker" logs "$secure"
check tls-token-info 0 'backend +cpu' -- \
  "$attn" "${s[@]}" "${tls[@]}" --token-file "$dir/secrets/token" info
check tls-token-tiled 0 "$seed_out" -- \
  "$attn" "${s[@]}" "${tls[@]}" --token-file "$dir/secrets/token" tiled --example seed
check tls-no-token 1 'UNAUTHENTICATED' -- "$attn" "${s[@]}" "${tls[@]}" info
check tls-health-without-token 0 '^SERVING$' -- "$attn" "${s[@]}" "${tls[@]}" health
check tls-plaintext-client 1 'UNAVAILABLE|DEADLINE_EXCEEDED' -- \
  "$attn" --target "${s[1]}" --timeout-ms 5000 health
if grep -qF "$token" <<<"$("$docker" logs "$secure" 2>&1)"; then
  failed=$((failed + 1))
  echo "FAIL tls-token-not-logged: attnd's output holds the token"
fi
"$docker" rm -f "$secure" >/dev/null

# --- 5. drain on docker stop ------------------------------------------------------------------
# 275 GFLOP of Tiled (seconds on two cores), started before the stop and finished after it:
# attnd drains for --shutdown-grace (30 s) on SIGTERM, inside docker stop's 60.
"$attn" "${t[@]}" tiled --random 1,1,32768,64 --print-rows 0 >"$dir/long.out" 2>&1 &
client=$!
for _ in $(seq 600); do
  [ "$(metric "$http_port" attnd_compute_inflight)" = 1 ] && break
  sleep 0.1
done
check drain-call-running 0 '^1$' -- metric "$http_port" attnd_compute_inflight
started=$SECONDS
"$docker" stop -t 60 "$main" >/dev/null
stop_seconds=$((SECONDS - started))
rc=0
wait "$client" || rc=$?
client=""
# shellcheck disable=SC2016  # The script's own $1 and $2.
check drain-call-finished 0 'compute' -- bash -c 'cat "$1"; exit "$2"' _ "$dir/long.out" "$rc"
check drain-exit-0 0 '^0 false$' -- \
  "$docker" inspect -f '{{.State.ExitCode}} {{.State.OOMKilled}}' "$main"
check drain-logged 0 'draining' -- "$docker" logs "$main"
echo "image_test: docker stop returned after $stop_seconds s, the call in flight finished"
"$docker" rm -f "$main" >/dev/null

# --- 6. KV caches in a volume, across docker stop and docker start ---------------------------
# attnd --cache-dir on a named volume at /var/lib/attnd/caches, the directory the image creates
# for uid 10001 (a new volume takes its owner), as deploy/compose.yaml and deploy/k8s mount it.
# The root stays read-only: the volume is the one place attnd writes.
volume=attnd-image-test-caches
"$docker" volume create --label "$label" "$volume" >/dev/null
disk=attnd-image-test-disk
cache_dir=/var/lib/attnd/caches
persistent=("${hardened[@]}" -v "$volume:$cache_dir" --health-interval 2s)
persistent_args=(--listen 0.0.0.0:50051 --http-listen 0.0.0.0:8080 --device auto --insecure
  --cache-dir "$cache_dir")
"$docker" run -d --name "$disk" "${persistent[@]}" "$image" "${persistent_args[@]}" >/dev/null
wait_healthy "$disk"
d=(--target "127.0.0.1:$(host_port "$disk" 50051)" --timeout-ms 30000)
check disk-banner 0 "caches: persistent in --cache-dir=$cache_dir \(cache-sync-seconds=1\)" -- \
  "$docker" logs "$disk"
check disk-restored-none 0 "restored 0 caches \(0 tokens, 0 bytes\) from --cache-dir=$cache_dir" -- \
  "$docker" logs "$disk"
new_cache() {  # new_cache ATTN_ARGS... : the id `attn cache create` printed (empty on failure)
  "$attn" "$@" 2>&1 | sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p'
}
fp32=$(new_cache "${d[@]}" cache create --kv-heads 2 --head-dim 16 --dtype f32)
bf16=$(new_cache "${d[@]}" cache create --kv-heads 2 --head-dim 64 --value-dim 32 --dtype bf16)
check disk-created 0 '^[0-9a-f]{32} [0-9a-f]{32}$' -- echo "$fp32 $bf16"
check disk-append-fp32 0 'length 100 tokens' -- "$attn" "${d[@]}" cache append "$fp32" --tokens 100
check disk-append-fp32-again 0 'length 130 tokens' -- \
  "$attn" "${d[@]}" cache append "$fp32" --tokens 30 --expected-length 100 --seed 2
check disk-append-bf16 0 'length 700 tokens' -- \
  "$attn" "${d[@]}" cache append "$bf16" --tokens 700 --seed 3
# What the caches answer before the stop: the list, and Tiled's output bytes over each (one
# causal query block over the fp32 cache; GQA, 8 query heads over its 2 kv heads, on the bf16).
tiled_over() {  # tiled_over TARGET_ARGS... OUT_PREFIX: Tiled over both caches into OUT_PREFIX.*
  local out=${*: -1}
  "$attn" "${@:1:$#-1}" tiled --cache "$fp32" --random 1,4,3,16 --causal --seed 5 \
    --output-file "$out.fp32" >/dev/null &&
    "$attn" "${@:1:$#-1}" tiled --cache "$bf16" --random 1,8,2,64 --dtype bf16 --seed 6 --lse \
      --output-file "$out.bf16" >/dev/null
}
check disk-tiled-before 0 '' -- tiled_over "${d[@]}" "$dir/before"
"$attn" "${d[@]}" cache list >"$dir/list.before" 2>&1 || true
check disk-list-before 0 "^$bf16 +2 +64 +32 +DTYPE_BFLOAT16 +700 " -- cat "$dir/list.before"
started=$SECONDS
"$docker" stop -t 60 "$disk" >/dev/null
echo "image_test: docker stop of the persistent server returned after $((SECONDS - started)) s"
check disk-stop-exit-0 0 '^0$' -- "$docker" inspect -f '{{.State.ExitCode}}' "$disk"
check disk-flushed 0 "caches flushed to --cache-dir=$cache_dir \([0-9]+ bytes\)" -- \
  "$docker" logs "$disk"
"$docker" start "$disk" >/dev/null
wait_healthy "$disk"
d=(--target "127.0.0.1:$(host_port "$disk" 50051)" --timeout-ms 30000)  # Ports may move.
check disk-restored 0 "restored 2 caches \(830 tokens, [0-9]+ bytes\) from --cache-dir=$cache_dir" -- \
  "$docker" logs "$disk"
check disk-info-fp32 0 'length 130 tokens' -- "$attn" "${d[@]}" cache info "$fp32"
check disk-info-bf16 0 'length 700 tokens' -- "$attn" "${d[@]}" cache info "$bf16"
check disk-list-same 0 '' -- diff "$dir/list.before" <("$attn" "${d[@]}" cache list 2>&1)
check disk-tiled-after 0 '' -- tiled_over "${d[@]}" "$dir/after"
check disk-tiled-same-fp32 0 '' -- cmp "$dir/before.fp32" "$dir/after.fp32"
check disk-tiled-same-bf16 0 '' -- cmp "$dir/before.bf16" "$dir/after.bf16"
check disk-append-after 0 'length 135 tokens' -- \
  "$attn" "${d[@]}" cache append "$fp32" --tokens 5 --expected-length 130 --seed 4
check disk-stale-after 1 'FAILED_PRECONDITION: .*holds 135 tokens' -- \
  "$attn" "${d[@]}" cache append "$fp32" --tokens 5 --expected-length 130
check disk-files-owned 0 '^10001 700$' -- "$docker" exec "$disk" stat -c '%u %a' "$cache_dir"
check disk-files 0 "^10001 $fp32\.kv$" -- "$docker" exec "$disk" \
  sh -c "cd $cache_dir && stat -c '%u %n' *.kv"
check disk-metric 0 '^[1-9][0-9]*$' -- metric "$(host_port "$disk" 8080)" attnd_cache_disk_bytes
# An upgrade: the container removed, a new one from the image on the same volume.
"$docker" stop -t 60 "$disk" >/dev/null
"$docker" rm -f "$disk" >/dev/null
"$docker" run -d --name "$disk" "${persistent[@]}" "$image" "${persistent_args[@]}" >/dev/null
wait_healthy "$disk"
d=(--target "127.0.0.1:$(host_port "$disk" 50051)" --timeout-ms 30000)
check disk-new-container 0 "restored 2 caches \(835 tokens, " -- "$docker" logs "$disk"
check disk-new-container-info 0 'length 135 tokens' -- "$attn" "${d[@]}" cache info "$fp32"
check disk-new-container-tiled 0 '' -- tiled_over "${d[@]}" "$dir/new"
check disk-new-container-same-bf16 0 '' -- cmp "$dir/before.bf16" "$dir/new.bf16"
check disk-delete 0 "^deleted cache $bf16$" -- "$attn" "${d[@]}" cache delete "$bf16"
check disk-delete-removes-file 1 '' -- "$docker" exec "$disk" test -e "$cache_dir/$bf16.kv"
"$docker" rm -f "$disk" >/dev/null
"$docker" volume rm "$volume" >/dev/null

# --- 7. deploy/compose.yaml -------------------------------------------------------------------
# The CPU service as the file defines it, on free loopback ports and a token of its own; the
# image built above carries its tag, so `up` builds nothing.
free_port() {
  /usr/bin/python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}
export ATTN_CPU_BASE=$base ATTN_TOKEN_FILE=$dir/secrets/token
ATTN_GRPC_PORT=$(free_port)
ATTN_HTTP_PORT=$(free_port)
export ATTN_GRPC_PORT ATTN_HTTP_PORT
"${compose[@]}" up -d --no-build attnd-cpu >"$work/compose.log" 2>&1 ||
  fail "docker-compose up (log $work/compose.log)" "$work/compose.log"
service=$("${compose[@]}" ps -q attnd-cpu)
[ -n "$service" ] || fail "docker-compose started no attnd-cpu container" "$work/compose.log"
wait_healthy "$service"
c=(--target "127.0.0.1:$ATTN_GRPC_PORT" --timeout-ms 30000 --token-file "$ATTN_TOKEN_FILE")
check compose-read-only 0 '^true 10001:10001$' -- \
  "$docker" inspect -f '{{.HostConfig.ReadonlyRootfs}} {{.Config.User}}' "$service"
check compose-token-secret 0 'security: plaintext, bearer token required .*\[--insecure\]' -- \
  "$docker" logs "$service"
check compose-no-token 1 'UNAUTHENTICATED' -- \
  "$attn" --target "127.0.0.1:$ATTN_GRPC_PORT" --timeout-ms 30000 info
check compose-tiled 0 "$seed_out" -- "$attn" "${c[@]}" tiled --example seed
check compose-persistent 0 'caches: persistent in --cache-dir=/var/lib/attnd/caches' -- \
  "$docker" logs "$service"
kept=$(new_cache "${c[@]}" cache create --kv-heads 2 --head-dim 16 --dtype f32)
check compose-cache-append 0 'length 40 tokens' -- "$attn" "${c[@]}" cache append "$kept" --tokens 40
"${compose[@]}" stop attnd-cpu >>"$work/compose.log" 2>&1
check compose-stop-exit-0 0 '^0$' -- "$docker" inspect -f '{{.State.ExitCode}}' "$service"
"${compose[@]}" start attnd-cpu >>"$work/compose.log" 2>&1
wait_healthy "$service"
check compose-cache-kept 0 'length 40 tokens' -- "$attn" "${c[@]}" cache info "$kept"
"${compose[@]}" stop attnd-cpu >>"$work/compose.log" 2>&1
"${compose[@]}" down -v --timeout 5 >>"$work/compose.log" 2>&1

echo "image_test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
