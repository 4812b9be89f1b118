#!/usr/bin/env bash
# The attn CLI against a real attnd: every subcommand (KV caches and decode too, and caches kept
# on their server through a --target list), the seed example's numbers, and clear errors for
# bad flags and bad requests. Usage: cli_test.sh ATTND ATTN
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$1
attn=$2
log=$(mktemp)
log2=$(mktemp)
bench=$(mktemp -d)
server=""
server2=""
server3=""
log3=$(mktemp)
trap 'kill $server $server2 $server3 2>/dev/null || true; rm -rf "$log" "$log2" "$log3" "$bench"' EXIT

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
# A causal window of 0: row 0 sees key 0 alone, so its output is value row 0, [-4, -3, -2, -1].
check window-zero 0 'out\[0\] = \[-4\.000000, -3\.000000, -2\.000000, -1\.000000\]' -- \
  "$attn" "${target[@]}" tiled --example seed --causal --window 0,
check window-trace 0 'tile 3, keys \[6, 8\)' -- \
  "$attn" "${target[@]}" trace --example seed --causal --window 1,-1 --block-k 2 --rows 0:0:7
# A causal window of 0 traced at row 2: tile 0 holds keys 0, 1 (window) and 3 (causal) hidden.
check hidden-window 0 ' 1 +-inf +0\.000000  \(hidden: window\)' -- \
  "$attn" "${target[@]}" trace --example seed --causal --window 0, --block-k 4 --rows 0:0:2
check hidden-causal 0 ' 3 +-inf +0\.000000  \(hidden: causal\)' -- \
  "$attn" "${target[@]}" trace --example seed --causal --window 0, --block-k 4 --rows 0:0:2
# Softcap 1 on the seed example: row 0's scores 2, 1, −1.75, … become tanh of them.
check softcap-seed 0 'out\[0\] = \[-0\.627407, 0\.372593, -0\.488769, 0\.244294\]' -- \
  "$attn" "${target[@]}" tiled --example seed --softcap 1
check softcap-trace 0 'scaled +\[2\.000000, 1\.000000\]   \(before the softcap and bias\)' -- \
  "$attn" "${target[@]}" trace --example seed --softcap 1 --block-k 2
check softcap-negative 1 'options\.softcap' -- \
  "$attn" "${target[@]}" tiled --example seed --softcap -1
# ALiBi slope 1 on the seed example: row 0's scores 2, 1, −1.75, … lose 0, 1, 2, … (numpy; fp32
# may round the last digit up).
check alibi-seed 0 'out\[0\] = \[-3\.820117, -2\.820117, -1\.827225, -0\.82750[01]\]' -- \
  "$attn" "${target[@]}" tiled --example seed --alibi 1
check alibi-trace 0 'bias +\[-0\.000000, -1\.000000\]   \(ALiBi' -- \
  "$attn" "${target[@]}" trace --example seed --alibi 1 --block-k 2
check alibi-count 1 '--alibi gives 2 slopes for 1 query heads' -- \
  "$attn" "${target[@]}" tiled --example seed --alibi 1,2
check alibi-standard 0 'output \[1, 4, 9, 8\]' -- \
  "$attn" "${target[@]}" tiled --random 1,4,9,8 --kv-heads 2 --causal --alibi standard
# A list of negative values as its own argument is a value, not a flag (common/dashed_flags.h).
check sinks-negative-list 0 'sink -1\.5 joins after the last tile: it takes 0\.[0-9]+ of the row' -- \
  "$attn" "${target[@]}" trace --random 1,2,8,4 --sinks -2,-1.5 --rows 0:1:7
check seqlens-tiled 0 'output \[1, 4, 46, 8\]' -- \
  "$attn" "${target[@]}" tiled --random 1,4,1,8 --kv-heads 2 --causal --seqlens 5,1,40/7,1,33
check seqlens-trace 0 '2 sequences \(cu_seqlens_q \[0, 3, 7\], cu_seqlens_k \[0, 5, 7\]\)' -- \
  "$attn" "${target[@]}" trace --random 1,2,1,8 --seqlens 3,4/5,2 --rows 0:0:4 --block-k 4
check seqlens-trace-hidden 0 '4 +-inf +0\.000000  \(hidden: another sequence\)' -- \
  "$attn" "${target[@]}" trace --random 1,2,1,8 --seqlens 3,4/5,2 --rows 0:0:4 --block-k 4
check seqlens-counts 1 '--seqlens expects .*: 2 query lengths but 1 key lengths' -- \
  "$attn" "${target[@]}" tiled --random 1,2,1,8 --seqlens 5,1/7
check seqlens-batch 1 'packs its sequences into one batch entry' -- \
  "$attn" "${target[@]}" tiled --random 2,2,1,8 --seqlens 5,1
check seqlens-cache 1 '--seqlens applies to naive, tiled and trace' -- \
  "$attn" "${target[@]}" tiled --cache abc --random 1,2,1,8 --seqlens 5,1
check window-bad 1 '--window expects L,R' -- \
  "$attn" "${target[@]}" tiled --example seed --window 5
check random-bf16 0 'output \[1, 2, 33, 8\] DTYPE_BFLOAT16' -- \
  "$attn" "${target[@]}" tiled --random 1,2,33,8 --dtype bf16 --causal --lse
check random-gqa 0 'output \[2, 4, 17, 5\]' -- \
  "$attn" "${target[@]}" naive --random 2,4,17,5 --kv-heads 2 --seed 7
check bad-random 1 '--random expects B,H,N,D' -- "$attn" "${target[@]}" tiled --random 1,2,3
check bad-dtype 1 '--dtype must be f32, f16, bf16 or fp8' -- \
  "$attn" "${target[@]}" tiled --example seed --dtype f64
check fp8-tensor 1 "--dtype fp8 is a KV cache's dtype only" -- \
  "$attn" "${target[@]}" tiled --random 1,2,9,8 --dtype fp8
check no-inputs 1 'give inputs' -- "$attn" "${target[@]}" tiled
check bad-row 1 'INVALID_ARGUMENT: rows\[0\]\.row' -- \
  "$attn" "${target[@]}" trace --example seed --rows 0:0:99
check bad-command 2 'unknown command' -- "$attn" "${target[@]}" frobnicate
check unreachable 1 'UNAVAILABLE' -- "$attn" --target 127.0.0.1:1 --timeout-ms 2000 info

# KV caches: create, append (a stale --expected-length refused, the cache unchanged), info, list,
# delete, NOT_FOUND afterwards; then attn decode, whose every step is checked against a float64
# reference over the tokens it sent (the CLI keeps them) — its worst relative error must be
# within the fp32 rule, or bf16's output rounding.
cache=("$attn" "${target[@]}" cache)
created=$("${cache[@]}" create --kv-heads 2 --head-dim 16 --value-dim 12 --dtype bf16 2>&1) || true
cache_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
check cache-create 0 '^cache [0-9a-f]{32}$' -- echo "$created"
check cache-create-shape 0 'kv_heads 2, head_dim 16, value_dim 12, DTYPE_BFLOAT16' -- \
  echo "$created"
check cache-create-empty 0 'length 0 tokens' -- echo "$created"
check cache-append 0 'length 100 tokens' -- "${cache[@]}" append "$cache_id" --tokens 100
check cache-append-expected 0 'length 130 tokens' -- \
  "${cache[@]}" append "$cache_id" --tokens 30 --expected-length 100 --seed 2
check cache-append-stale 1 'FAILED_PRECONDITION: .*130' -- \
  "${cache[@]}" append "$cache_id" --tokens 5 --expected-length 100
# Drafts cut back off (TruncateCache): 130 tokens again, and refusals that name the field.
"${cache[@]}" append "$cache_id" --tokens 7 >/dev/null
check cache-truncate 0 'length 130 tokens' -- "${cache[@]}" truncate "$cache_id" --keep 130
check cache-truncate-past 1 'OUT_OF_RANGE: length: is 131 but the cache holds 130' -- \
  "${cache[@]}" truncate "$cache_id" --keep 131
check cache-truncate-stale 1 'FAILED_PRECONDITION: expected_length' -- \
  "${cache[@]}" truncate "$cache_id" --keep 10 --expected-length 129
check cache-info 0 'length 130 tokens, [0-9.]+ (B|KiB) in pages of [0-9]+ tokens' -- \
  "${cache[@]}" info "$cache_id"
check cache-info-json 0 "^\\{\"cacheId\":\"$cache_id\".*\"length\":\"130\"" -- \
  "${cache[@]}" info "$cache_id" --json
check cache-list 0 "^$cache_id +2 +16 +12 +DTYPE_BFLOAT16 +130 " -- "${cache[@]}" list
# naive|tiled|trace --cache: the query alone, over the cache's keys: the trace's last tile ends at
# the length attn cache info reports.
cache_length=$("${cache[@]}" info "$cache_id" | sed -n 's/^  length \([0-9]*\) tokens.*/\1/p')
check cache-tiled 0 'output \[1, 4, 3, 12\] DTYPE_BFLOAT16' -- \
  "$attn" "${target[@]}" tiled --cache "$cache_id" --random 1,4,3,16 --dtype bf16 --causal
check cache-trace 0 "tile [0-9]+, keys \\[[0-9]+, ${cache_length:-?}\\)\$" -- \
  "$attn" "${target[@]}" trace --cache "$cache_id" --random 1,4,3,16 --block-k 64
check cache-naive-batch 1 'INVALID_ARGUMENT: query.shape\[0\]: is 2; a cache holds one sequence' -- \
  "$attn" "${target[@]}" naive --cache "$cache_id" --random 2,4,3,16
check cache-delete 0 "^deleted cache $cache_id$" -- "${cache[@]}" delete "$cache_id"
check cache-info-deleted 1 'NOT_FOUND' -- "${cache[@]}" info "$cache_id"
check cache-append-deleted 1 'NOT_FOUND' -- "${cache[@]}" append "$cache_id" --tokens 1
check cache-delete-deleted 1 'NOT_FOUND' -- "${cache[@]}" delete "$cache_id"
check cache-list-empty 0 '^no caches$' -- "${cache[@]}" list
check cache-bad-command 1 'unknown cache command "frob"' -- "${cache[@]}" frob
check cache-no-id 1 'usage: attn cache info CACHE_ID' -- "${cache[@]}" info
check cache-round-robin 1 'a cache lives on one server' -- "${cache[@]}" list --lb round_robin
check cache-bad-create 1 'INVALID_ARGUMENT' -- "${cache[@]}" create --head-dim 0

# A latent cache (--values-from-keys: keys only, each value the first value_dim columns of its
# key): info and list say so, appends send keys alone, its pages hold the keys alone (300 tokens
# in pages of 256: 2 pages × 72 × 4 bytes = 144 KiB), and value_dim > head_dim is refused naming
# it.
created=$("${cache[@]}" create --kv-heads 1 --head-dim 72 --value-dim 40 --values-from-keys 2>&1) ||
  true
latent_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
check cache-latent-create 0 \
  'kv_heads 1, head_dim 72, value_dim 40, DTYPE_FLOAT32, latent: values from keys' -- echo "$created"
check cache-latent-append 0 'length 300 tokens, 144\.0 KiB in pages of 256 tokens' -- \
  "${cache[@]}" append "$latent_id" --tokens 300
check cache-latent-info 0 'DTYPE_FLOAT32, latent: values from keys' -- \
  "${cache[@]}" info "$latent_id"
check cache-latent-info-json 0 '"valuesFromKeys":true' -- "${cache[@]}" info "$latent_id" --json
check cache-latent-list 0 \
  "^$latent_id +1 +72 +40 +DTYPE_FLOAT32 +300 +144\.0 KiB +0 B +from keys\$" -- "${cache[@]}" list
check cache-latent-tiled 0 'output \[1, 13, 2, 40\] DTYPE_FLOAT32' -- \
  "$attn" "${target[@]}" tiled --cache "$latent_id" --random 1,13,2,72
check cache-latent-delete 0 "^deleted cache $latent_id$" -- "${cache[@]}" delete "$latent_id"
check cache-latent-value-dim 1 'INVALID_ARGUMENT: value_dim: is 73 but head_dim is 72' -- \
  "${cache[@]}" create --kv-heads 1 --head-dim 72 --value-dim 73 --values-from-keys
check cache-latent-elsewhere 1 '--values-from-keys applies to cache create and decode' -- \
  "${cache[@]}" append 0123 --tokens 1 --values-from-keys

# Forks (ForkCache): 300 tokens of 64 bytes in pages of 256 tokens (16 KiB each). A fork of all
# of them shares both pages, one of the first 100 the first page; the fork's tokens are the
# source's bit for bit (Tiled over either gives the same bytes). An append to the prefix fork
# copies the shared partly filled page first, so that fork shares nothing any more; the source
# still shares both pages. Refusals name the field; deleting the source keeps what the forks use.
created=$("${cache[@]}" create --kv-heads 1 --head-dim 8 2>&1) || true
source_id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$created")
"${cache[@]}" append "$source_id" --tokens 300 >/dev/null
forked=$("${cache[@]}" fork "$source_id" 2>&1) || true
fork_all=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$forked")
check cache-fork-all 0 'length 300 tokens, 32\.0 KiB in pages of 256 tokens' -- echo "$forked"
check cache-fork-all-shared 0 '^  shared 32\.0 KiB of them with other caches' -- echo "$forked"
check cache-fork-new-id 0 '^new$' -- \
  bash -c '[ -n "$1" ] && [ "$1" != "$2" ] && echo new' _ "$fork_all" "$source_id"
forked=$("${cache[@]}" fork "$source_id" --length 100 --expected-length 300 2>&1) || true
fork_prefix=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$forked")
check cache-fork-prefix 0 'length 100 tokens, 16\.0 KiB in pages of 256 tokens' -- echo "$forked"
check cache-fork-prefix-shared 0 '^  shared 16\.0 KiB of them' -- echo "$forked"
check cache-fork-source-shared 0 '^  shared 32\.0 KiB of them' -- "${cache[@]}" info "$source_id"
check cache-fork-json 0 '"length":"300".*"sharedBytes":"32768"' -- \
  "${cache[@]}" info "$fork_all" --json
check cache-fork-list 0 "^$fork_all +1 +8 +8 +DTYPE_FLOAT32 +300 +32\.0 KiB +32\.0 KiB +stored\$" \
  -- "${cache[@]}" list
check cache-fork-tiled 0 'output \[1, 2, 1, 8\] DTYPE_FLOAT32' -- \
  "$attn" "${target[@]}" tiled --cache "$fork_all" --random 1,2,1,8 --output-file "$bench/fork.out"
"$attn" "${target[@]}" tiled --cache "$source_id" --random 1,2,1,8 \
  --output-file "$bench/source.out" >/dev/null 2>&1 || true
check cache-fork-same-bits 0 '' -- cmp "$bench/fork.out" "$bench/source.out"
check cache-fork-append 0 'length 110 tokens, 16\.0 KiB in pages' -- \
  "${cache[@]}" append "$fork_prefix" --tokens 10
check cache-fork-copied 0 '^0$' -- \
  bash -c '"$@" | grep -c shared || true' _ "${cache[@]}" info "$fork_prefix"
check cache-fork-source-after 0 '^  shared 32\.0 KiB of them' -- "${cache[@]}" info "$source_id"
check cache-fork-past 1 'OUT_OF_RANGE: length: is 301 but the cache holds 300' -- \
  "${cache[@]}" fork "$source_id" --length 301
check cache-fork-negative 1 'INVALID_ARGUMENT: length' -- \
  "${cache[@]}" fork "$source_id" --length -1
check cache-fork-stale 1 'FAILED_PRECONDITION: expected_length: is 299' -- \
  "${cache[@]}" fork "$source_id" --expected-length 299
check cache-fork-unknown 1 'NOT_FOUND' -- \
  "${cache[@]}" fork 00000000000000000000000000000000
check cache-fork-no-id 1 'usage: attn cache fork CACHE_ID' -- "${cache[@]}" fork
check cache-fork-length-elsewhere 1 '--length applies to cache fork' -- \
  "${cache[@]}" truncate "$source_id" --keep 1 --length 1
check cache-fork-delete-source 0 "^deleted cache $source_id$" -- \
  "${cache[@]}" delete "$source_id"
check cache-fork-outlives-source 0 'output \[1, 2, 1, 8\] DTYPE_FLOAT32' -- \
  "$attn" "${target[@]}" tiled --cache "$fork_all" --random 1,2,1,8 --output-file "$bench/fork2.out"
check cache-fork-outlives-same-bits 0 '' -- cmp "$bench/fork2.out" "$bench/source.out"
check cache-fork-alone 0 '^0$' -- \
  bash -c '"$@" | grep -c shared || true' _ "${cache[@]}" info "$fork_all"
for id in "$fork_all" "$fork_prefix"; do
  check "cache-fork-delete-$id" 0 "^deleted cache $id$" -- "${cache[@]}" delete "$id"
done

decode_run() {  # decode_run DTYPE MAX_ERROR ARGS...: attn decode, its error at most MAX_ERROR
  local dtype=$1 max=$2
  shift 2
  local out rc=0
  out=$("$attn" "${target[@]}" decode --dtype "$dtype" "$@" 2>&1) || rc=$?
  check "decode-$dtype-runs" 0 '^deleted cache [0-9a-f]{32}$' -- \
    bash -c 'printf "%s\n" "$1"; exit "$2"' _ "$out" "$rc"
  check "decode-$dtype-steps" 0 '^ +3 +303 +[0-9.]+ ms +[0-9.]+ ms +[0-9.]+ (B|KiB) +[0-9.]+ (KiB|MiB) ' \
    -- echo "$out"
  check "decode-$dtype-summary" 0 \
    'per step \(median of 3\): wall [0-9.]+ ms, compute [0-9.]+ ms; sent .* vs .* for stateless' \
    -- echo "$out"
  local error
  error=$(sed -n 's/^max |decode - float64 reference| \/ max |reference| = \([0-9.e+-]*\) over 3 steps$/\1/p' \
    <<<"$out")
  check "decode-$dtype-error" 0 '^ok$' -- \
    awk -v e="${error:-nan}" -v max="$max" 'BEGIN { if (e != "nan" && e + 0 <= max) print "ok"; else print "error " e " over " max }'
}
decode_run f32 1e-5 --heads 4 --kv-heads 2 --head-dim 16 --value-dim 12 --tokens 300 --steps 3
decode_run bf16 1e-2 --heads 4 --kv-heads 1 --head-dim 32 --tokens 300 --steps 3 --seed 5
# The step's float64 reference takes the sinks, the softcap and the ALiBi bias too.
decode_run f32 1e-5 --heads 4 --kv-heads 2 --head-dim 16 --tokens 300 --steps 3 --seed 7 \
  --sinks 3,-1,0.5,2 --softcap 5 --alibi standard
# A latent cache: each step sends the key alone, and the reference takes each value from its key.
decode_run f32 1e-5 --heads 13 --kv-heads 1 --head-dim 72 --value-dim 40 --tokens 300 --steps 3 \
  --seed 11 --values-from-keys
decode_run bf16 1e-2 --heads 9 --kv-heads 3 --head-dim 37 --value-dim 29 --tokens 300 --steps 3 \
  --seed 13 --values-from-keys
check decode-latent-banner 0 'value_dim 40, DTYPE_FLOAT32, latent \(values from keys\)$' -- \
  "$attn" "${target[@]}" decode --heads 2 --kv-heads 1 --head-dim 72 --value-dim 40 --tokens 5 \
  --steps 1 --values-from-keys
check decode-leaves-no-cache 0 '^no caches$' -- "${cache[@]}" list
check decode-bad-heads 1 '--kv-heads must divide --heads' -- \
  "$attn" "${target[@]}" decode --heads 4 --kv-heads 3

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

# attn bench --decode: a tiny run has its table row per (batch, length) and the targets' lines
# (their figures are the benchmark's business, not a test's).
decode_bench_rc=0
decode_bench=$("$attn" "${target[@]}" bench --decode --lengths 64,100 --batches 1,2 --steps 2 \
  --repeats 1 --heads 4 --kv-heads 2 --head-dim 16 2>&1) || decode_bench_rc=$?
check bench-decode 0 '^ +2 +100 +[0-9.]+ ms +[0-9.]+ ms .* [0-9.]+ GB/s +[0-9.]+ %$' -- \
  bash -c 'printf "%s\n" "$1"; exit "$2"' _ "$decode_bench" "$decode_bench_rc"
check bench-decode-bytes 0 '^ +1 +64 .* [0-9.]+ (B|KiB) +[0-9.]+ KiB +[0-9.]+ %' -- echo "$decode_bench"
check bench-decode-targets 0 '^  \(c\) wall ≤ compute \+ 2 ms, every row: worst .*: (met|MISSED)' \
  -- echo "$decode_bench"
check bench-decode-leaves-no-cache 0 '^no caches$' -- "${cache[@]}" list
check bench-decode-bad-lengths 1 '--lengths expects positive integers' -- \
  "$attn" "${target[@]}" bench --decode --lengths 1,x

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

# Caches over a --target list of the two servers: each cache is on exactly one of them, later
# commands naming it find it there (a fresh attn process each time), list shows both servers',
# and decode works through the list.
both=(--target "127.0.0.1:$port,127.0.0.1:$port2")
shard_ids=()
for _ in 1 2 3 4; do
  made=$("$attn" "${both[@]}" cache create --kv-heads 1 --head-dim 8 2>&1) || true
  shard_ids+=("$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$made")")
done
for id in "${shard_ids[@]}"; do
  where=""
  "$attn" --target "127.0.0.1:$port" cache info "$id" >/dev/null 2>&1 && where+=a
  "$attn" --target "127.0.0.1:$port2" cache info "$id" >/dev/null 2>&1 && where+=b
  check "shard-cache-on-one-server-$id" 0 '^(a|b)$' -- echo "${where:-none}"
  check "shard-cache-append-$id" 0 'length 9 tokens' -- \
    "$attn" "${both[@]}" cache append "$id" --tokens 9
done
check shard-cache-list 0 "^${shard_ids[3]} +1 +8 +8 +DTYPE_FLOAT32 +9 " -- \
  "$attn" "${both[@]}" cache list
check shard-cache-list-all 0 '^4$' -- \
  bash -c '"$@" | grep -cE "^[0-9a-f]{32} "' _ "$attn" "${both[@]}" cache list
for id in "${shard_ids[@]}"; do
  check "shard-cache-delete-$id" 0 "^deleted cache $id$" -- "$attn" "${both[@]}" cache delete "$id"
done
check shard-cache-unknown 1 'NOT_FOUND: cache "0{32}" is on none of the 2 endpoints' -- \
  "$attn" "${both[@]}" cache info 00000000000000000000000000000000
check shard-decode 0 '^deleted cache [0-9a-f]{32}$' -- \
  "$attn" "${both[@]}" decode --heads 2 --head-dim 8 --tokens 40 --steps 2
# A latent cache split over both servers (every part latent), checked against float64.
check shard-decode-latent 0 \
  'max \|decode - float64 reference\| / max \|reference\| = [0-9.]+(e-0[6-9]|e-[1-9][0-9])? over 2 steps' -- \
  "$attn" "${both[@]}" decode --heads 13 --kv-heads 1 --head-dim 72 --value-dim 40 --tokens 41 \
  --steps 2 --shard-keys --causal --values-from-keys

# trace --shard-keys (client/cli/merge_trace.h): each server traces its slice of the keys, then
# the merge one server at a time, ending at the seed's out[0]; the JSON lines in their documented
# order; one endpoint said plainly; a dead endpoint named, never merged around.
check trace-shard-keys-parts 0 "part 2  keys \[4, 8\) +127\.0\.0\.1:$port2 " -- \
  "$attn" "${both[@]}" trace --example seed --block-k 2 --shard-keys
check trace-shard-keys-step 0 "step 2: \+ part 2 \(keys \[4, 8\), 127\.0\.0\.1:$port2\)" -- \
  "$attn" "${both[@]}" trace --example seed --block-k 2 --shard-keys
check trace-shard-keys-rescale 0 'rescale +running exp\(−∞ − 2\) = 0, part exp\(2 − 2\) = 1' -- \
  "$attn" "${both[@]}" trace --example seed --block-k 2 --shard-keys
check trace-shard-keys-merged 0 'merged output +\[-0\.593223, 0\.406777, -1\.332858, -0\.371937\]' -- \
  "$attn" "${both[@]}" trace --example seed --block-k 2 --shard-keys
check trace-shard-keys-json 0 '^problem part part merge_step merge_step merged $' -- \
  bash -c '"$@" | sed "s/^{\"\([a-z_]*\)\".*/\1/" | tr "\n" " "' _ \
  "$attn" "${both[@]}" trace --example seed --block-k 2 --shard-keys --json
check trace-shard-keys-causal 0 'max \|merged − full\| = [0-9.e-]+ \(relative ([0-9.]+e-0[6-9]|[0-9.]+e-[1-9][0-9]|0)\)' -- \
  "$attn" "${both[@]}" trace --random 1,4,30,8 --kv-heads 2 --query-len 5 --causal --block-k 4 \
  --rows 0:3:0,0:1:4 --shard-keys
check trace-shard-keys-one 0 'One server traced all of it: 127\.0\.0\.1:[0-9]+ holds keys \[0, 8\)' -- \
  "$attn" "${target[@]}" trace --example seed --shard-keys
check trace-shard-keys-dead 1 'UNAVAILABLE: part 2 of 2 \(keys \[4, 8\)\) at 127\.0\.0\.1:1: ' -- \
  "$attn" --target "127.0.0.1:$port,127.0.0.1:1" --timeout-ms 2000 trace --example seed \
  --shard-keys
check trace-shard-keys-follow 1 '--follow and --shard-keys: choose one' -- \
  "$attn" "${both[@]}" trace --example seed --shard-keys --follow

# docs/operations.md's flag table states attnd's defaults, which the flags take from TraceLimits
# (server/request.h) and AdmissionLimits (server/compute_queue.h).
help=$("$attnd" --helpfull 2>&1 | tr '\n' ' ' || true)
for flag in max_trace_rows max_trace_steps max_traces max_queue; do
  default=$(grep -oE -- "--$flag \([^)]*\); +default: [0-9]+;" <<<"$help" | grep -oE '[0-9]+;$' |
    tr -d ';' || true)
  check "operations-default-$flag" 0 "^\| \`--${flag//_/-}\` \| ${default:-?} \|" -- \
    cat "$(dirname "$0")/../docs/operations.md"
done

# A Unix socket (--listen unix:PATH, for co-located callers): the banner names it (not gRPC's
# "port 1"), and calls and a decode step work over it.
socket_dir=$(mktemp -d)
"$attnd" --listen "unix:$socket_dir/attnd.sock" --http-listen= --threads 2 --allow-shared-memory \
  >"$log3" 2>&1 &
server3=$!
check unix-banner 0 '^unix$' -- attnd_wait_port "$server3" "$log3"
check unix-banner-line 0 "serving attention\.v1 on unix:$socket_dir/attnd\.sock \(unix socket\)\$" -- \
  cat "$log3"
check unix-info 0 'backend +cpu' -- "$attn" --target "unix:$socket_dir/attnd.sock" info
check unix-decode 0 'max \|decode - float64 reference\| / max \|reference\| = ' -- \
  "$attn" --target "unix:$socket_dir/attnd.sock" decode --heads 4 --kv-heads 2 --head-dim 16 \
  --tokens 40 --steps 2
# bench --decode --shm: the steps' tensors and outputs through a /dev/shm region (removed after:
# no more attn-bench-* files than before).
shm_files_before=$(ls /dev/shm | grep -c '^attn-bench-' || true)
check unix-bench-shm 0 "transport: each step's q, k, v and outputs in a /dev/shm region" -- \
  "$attn" --target "unix:$socket_dir/attnd.sock" bench --decode --shm --lengths 16 --batches 1,2 \
  --steps 3 --repeats 0 --heads 4 --kv-heads 2 --head-dim 16
check unix-bench-shm-removed 0 "^$shm_files_before\$" -- \
  bash -c 'ls /dev/shm | grep -c "^attn-bench-" || true'
check shm-elsewhere 1 '--shm applies to bench --decode' -- "$attn" "${target[@]}" info --shm
check shm-off 1 'FAILED_PRECONDITION: .*--allow-shared-memory' -- \
  "$attn" "${target[@]}" bench --decode --shm --lengths 16 --batches 1 --steps 1 --repeats 0
kill "$server3"
wait "$server3" 2>/dev/null || true
server3=""
rm -rf "$socket_dir"

kill -0 "$server" || { echo "FAIL: attnd died"; cat "$log"; exit 1; }
echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
