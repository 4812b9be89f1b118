#!/usr/bin/env bash
# attnd over the emulated CUDA backend (tests/simt): `attnd_simt --device cuda` serves the seed
# example through gRPC as the CPU does — Tiled (the fused fp32 kernel at the default block_k, the
# row kernel at block_k 3), Naive (cuBLAS and the softmax kernel), Trace — and a bf16 and an fp8
# KV-cache decode (the split-KV kernels over pages), a fork of a cache (shared pages, copy on
# write), Tiled and Trace over an fp8 cache, every answer from the CUDA kernels, then drains on
# SIGTERM. Usage: smoke_test.sh ATTND_SIMT ATTN
set -euo pipefail
source "$(dirname "$0")/../attnd_lib.sh"
attnd=$1
attn=$2
log=$(mktemp)
server=""
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT

"$attnd" --device cuda --listen 127.0.0.1:0 --http-listen= >"$log" 2>&1 &
server=$!
port=$(attnd_wait_port "$server" "$log")
target=(--target "127.0.0.1:$port")
seed_row='out\[0\] = \[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]'

check startup 0 'device: SIMT emulator \(CPU\) \(cuda:0, .*\[cuda\]' -- cat "$log"
check info 0 'backend +cuda' -- "$attn" "${target[@]}" info
check tiled-fused 0 "Tiled on cuda .*$seed_row" -- \
  bash -c 'out=$("$@") && tr "\n" " " <<<"$out"' _ "$attn" "${target[@]}" tiled --example seed
check tiled-rows 0 "$seed_row" -- "$attn" "${target[@]}" tiled --example seed --block-k 3
check naive 0 "Naive on cuda .*$seed_row" -- \
  bash -c 'out=$("$@") && tr "\n" " " <<<"$out"' _ "$attn" "${target[@]}" naive --example seed
check trace 0 'max \|online − full\| = [0-9.e-]+, lse = 3\.1894' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2
out=$("$attn" "${target[@]}" decode --dtype bf16 --heads 4 --kv-heads 1 --head-dim 32 \
  --tokens 300 --steps 3 --seed 5 2>&1) || true
error=$(sed -n 's/^max |decode - float64 reference| \/ max |reference| = \([0-9.e+-]*\) over 3 steps$/\1/p' \
  <<<"$out")
check decode 0 '^ok$' -- \
  awk -v e="${error:-nan}" 'BEGIN { if (e != "nan" && e + 0 <= 1e-2) print "ok"; else print "error " e }'
[ -n "$error" ] || echo "$out"
# An fp8 cache on the device: the tokens (sent as bf16) quantized into rows with their scales,
# read by the decode kernel's fp8 instance; the error against float64 on the bf16 tokens is
# E4M3's rounding, a few percent, and not 0 (something was quantized).
out=$("$attn" "${target[@]}" decode --dtype fp8 --heads 4 --kv-heads 1 --head-dim 32 \
  --tokens 300 --steps 3 --seed 5 2>&1) || true
error=$(sed -n 's/^max |decode - float64 reference| \/ max |reference| = \([0-9.e+-]*\) over 3 steps$/\1/p' \
  <<<"$out")
check decode-fp8 0 '^ok$' -- \
  awk -v e="${error:-nan}" 'BEGIN { if (e != "nan" && e + 0 <= 0.1 && e + 0 > 1e-4) print "ok"; else print "error " e }'
[ -n "$error" ] || echo "$out"

# A fork on the device (ForkCache): it shares the source's pages; Tiled over either gives the
# same bytes; an append to the fork copies the shared partly filled page first, so the source
# still answers as before; deleting the source keeps the fork's pages.
cache=("$attn" "${target[@]}" cache)
created=$("${cache[@]}" create --kv-heads 1 --head-dim 8 2>&1) || true
source_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
"${cache[@]}" append "$source_id" --tokens 300 >/dev/null 2>&1 || true
forked=$("${cache[@]}" fork "$source_id" 2>&1) || true
fork_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$forked")
check fork 0 '^  shared .* of them with other caches' -- echo "$forked"
tiled_over() {  # tiled_over CACHE_ID FILE: Tiled over a cache's 300 tokens, its output in FILE
  "$attn" "${target[@]}" tiled --cache "$1" --random 1,2,1,8 --output-file "$2" >/dev/null 2>&1
}
tiled_over "$source_id" "$log.source" || true
tiled_over "$fork_id" "$log.fork" || true
check fork-same-bits 0 '' -- cmp "$log.source" "$log.fork"
check fork-append 0 'length 310 tokens' -- "${cache[@]}" append "$fork_id" --tokens 10
tiled_over "$source_id" "$log.source2" || true
check fork-source-unchanged 0 '' -- cmp "$log.source" "$log.source2"
check fork-delete-source 0 "^deleted cache $source_id$" -- "${cache[@]}" delete "$source_id"
check fork-outlives-source 0 'length 310 tokens' -- "${cache[@]}" info "$fork_id"
rm -f "$log".source "$log".fork "$log".source2

# Tiled and Trace over an fp8 cache: the pages gathered as code · scale on the device; the trace
# reads a dequantized copy taken on the host (a GPU reads only its own pages), and its online
# rows agree with its full-matrix rows.
created=$("${cache[@]}" create --kv-heads 1 --head-dim 8 --dtype fp8 2>&1) || true
fp8_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
check fp8-append 0 'length 100 tokens' -- "${cache[@]}" append "$fp8_id" --tokens 100
check fp8-tiled 0 'Tiled on cuda' -- \
  bash -c 'out=$("$@") && tr "\n" " " <<<"$out"' _ "$attn" "${target[@]}" tiled --cache "$fp8_id" \
  --random 1,2,1,8
check fp8-trace 0 'max \|online − full\| = [0-9.e-]+, lse' -- \
  "$attn" "${target[@]}" trace --cache "$fp8_id" --random 1,2,1,8 --block-k 16

kill -TERM "$server"
rc=0
wait "$server" || rc=$?
server=""
check drain 0 'drained, exiting' -- bash -c 'cat "$1"; exit "$2"' _ "$log" "$rc"

echo "simt smoke: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
