#!/usr/bin/env bash
# The attn CLI against a real attnd: every subcommand, the seed example's numbers, and clear
# errors for bad flags and bad requests. Usage: cli_test.sh ATTND ATTN
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$1
attn=$2
log=$(mktemp)
log2=$(mktemp)
bench=$(mktemp -d)
server=""
server2=""
trap 'kill $server $server2 2>/dev/null || true; rm -rf "$log" "$log2" "$bench"' EXIT

"$attnd" --listen 127.0.0.1:0 --http-listen= --threads 2 >"$log" 2>&1 &
server=$!
port=$(attnd_wait_port "$server" "$log")
target=(--target "127.0.0.1:$port")

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
check trace-json-start 0 '^\{"start":\{.*"naiveIntermediateBytes":"1024"' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2 --json
check trace-json-lines 0 '^\{"end":' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2 --json
check trace-follow 0 'tile 4 of 4, keys \[6, 8\) +\[#{30}\]' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2 --follow --follow-ms 0
check trace-follow-final 0 'online output +\[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]' -- \
  "$attn" "${target[@]}" trace --example seed --block-k 2 --follow --follow-ms 0
check trace-follow-json 1 '--follow and --json: choose one' -- \
  "$attn" "${target[@]}" trace --example seed --follow --json
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

# attn bench: a tiny sweep, its table, CSV and SVG.
csv_header='^method,n,batch,heads,kv_heads,dim,dtype,causal,block_k,repeats,status,wall_s,compute_s,'
csv_header+='server_s,rpc_overhead_s,flops,gflops,intermediate_bytes,scratch_bytes,peak_memory_bytes,'
csv_header+='message$'
bench_run=("$attn" "${target[@]}" bench --ns "128,64" --heads 2 --dim 16 --repeats 1
  --csv "$bench/a.csv" --svg "$bench/a.svg")
check bench 0 '^tiled +128 +[0-9.]+ (ns|µs|ms|s) .* 0 B$' -- "${bench_run[@]}"
check bench-progress 0 '^\[4/4\] tiled N=128 … [0-9.]+ (ns|µs|ms|s) ' -- "${bench_run[@]}"
check bench-csv-header 0 "$csv_header" -- head -n 1 "$bench/a.csv"
check bench-csv-naive 0 '^naive,64,1,2,2,16,f32,0,0,1,ok,[0-9.]+,' -- cat "$bench/a.csv"
check bench-csv-tiled 0 '^tiled,128,1,2,2,16,f32,0,[0-9]+,1,ok,[0-9.]+,' -- cat "$bench/a.csv"
check bench-csv-rows 0 '^4$' -- grep -cE '^(naive|tiled),(64|128),.*,ok,' "$bench/a.csv"
check bench-svg-start 0 '^<svg ' -- head -c 5 "$bench/a.svg"
check bench-svg-xml 0 '^\{http://www.w3.org/2000/svg\}svg$' -- /usr/bin/python3 -c \
  'import sys, xml.etree.ElementTree as et; print(et.parse(sys.argv[1]).getroot().tag)' \
  "$bench/a.svg"
check bench-svg-naive 0 'Naive scratch' -- cat "$bench/a.svg"
check bench-svg-tiled 0 'Tiled scratch' -- cat "$bench/a.svg"
check bench-tiled-only 0 '^tiled +64 ' -- "$attn" "${target[@]}" bench --ns 64 --heads 1 \
  --dim 8 --repeats 2 --methods tiled --csv "" --svg ""
check bench-bad-ns 1 '--ns expects positive integers' -- "$attn" "${target[@]}" bench --ns 64,x
check bench-bad-methods 1 '--methods expects naive, tiled' -- \
  "$attn" "${target[@]}" bench --methods flash
check bench-bad-path 1 'cannot write' -- "$attn" "${target[@]}" bench --ns 16 --repeats 1 \
  --csv "$bench/missing/a.csv" --svg ""

# A server whose Naive budget (200 000 bytes) holds N=64 (2·2·64²·4 = 65 536 bytes of scores
# and weights) but not N=128 (262 144): the Naive point is refused and the sweep goes on.
"$attnd" --listen 127.0.0.1:0 --http-listen= --threads 2 --max-naive-bytes 200000 >"$log2" 2>&1 &
server2=$!
port2=$(attnd_wait_port "$server2" "$log2")
refused_run=("$attn" --target "127.0.0.1:$port2" bench --ns "64,128" --heads 2 --dim 16 --repeats 1
  --csv "$bench/b.csv" --svg "$bench/b.svg")
check bench-refused 0 '^naive +128 +refused: over --max-naive-bytes' -- "${refused_run[@]}"
check bench-refused-goes-on 0 '^tiled +128 +[0-9.]+ (µs|ms|s) ' -- "${refused_run[@]}"
check bench-refused-csv 0 '^naive,128,1,2,2,16,f32,0,0,1,refused,,.*max-naive-bytes' -- \
  cat "$bench/b.csv"
check bench-refused-svg 0 'Naive refused from N = 128' -- cat "$bench/b.svg"

# The README's table of limits states attnd's defaults, which the flags take from TraceLimits
# (server/request.h) and AdmissionLimits (server/compute_queue.h).
help=$("$attnd" --helpfull 2>&1 | tr '\n' ' ' || true)
for flag in max_trace_rows max_trace_steps max_traces max_queue; do
  default=$(grep -oE -- "--$flag \([^)]*\); +default: [0-9]+;" <<<"$help" | grep -oE '[0-9]+;$' |
    tr -d ';' || true)
  check "readme-default-$flag" 0 "^\| \`--${flag//_/-}\` \| ${default:-?} \|" -- \
    cat "$(dirname "$0")/../README.md"
done

kill -0 "$server" || { echo "FAIL: attnd died"; cat "$log"; exit 1; }
echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
