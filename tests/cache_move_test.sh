#!/usr/bin/env bash
# attn cache export | import | move between two attnd (issue 29): a 12 MB bf16 GQA cache (three
# export chunks) exported to a file and imported into the second server, then moved back and
# forth, each copy answering a fixed Tiled query byte for byte as the original did; the source of
# a move gone (NOT_FOUND) and an id taken on the target refused unless --new-id; damaged, cut and
# foreign export files refused with DATA_LOSS naming the file, leaving the target unchanged; an
# empty cache's export and import. Usage: cache_move_test.sh ATTND ATTN
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$1
attn=$2
work=$(mktemp -d)
server_a=""
server_b=""
trap 'kill $server_a $server_b 2>/dev/null || true; rm -rf "$work"' EXIT

"$attnd" --listen 127.0.0.1:0 --http-listen= --threads 2 >"$work/a.log" 2>&1 &
server_a=$!
"$attnd" --listen 127.0.0.1:0 --http-listen= --threads 2 >"$work/b.log" 2>&1 &
server_b=$!
a=127.0.0.1:$(attnd_wait_port "$server_a" "$work/a.log")
b=127.0.0.1:$(attnd_wait_port "$server_b" "$work/b.log")

# tiled TARGET ID OUT: a fixed query (4 heads over the cache's 2, seed 11) over cache ID on
# TARGET; the output's and lse's raw bytes go to OUT.
tiled() {
  "$attn" --target "$1" tiled --cache "$2" --random 1,4,3,128 --seed 11 --dtype bf16 --causal \
    --block-k 64 --lse --output-file "$3"
}
# caches_on TARGET: how many caches TARGET holds.
caches_on() { "$attn" --target "$1" cache list | grep -cE '^[0-9a-f]{32} ' || true; }
# records FILE: the chunks an export file holds (u32 little-endian length + CacheChunk each).
records() {
  /usr/bin/python3 -c '
import struct, sys
data = open(sys.argv[1], "rb").read()
offset, count = 8, 0
while offset < len(data):
    offset += 4 + struct.unpack_from("<I", data, offset)[0]
    count += 1
print(count if offset == len(data) else "misframed")' "$1"
}

# 12000 tokens of 2 heads × (128 + 128) bf16 = 12 288 000 bytes: chunks of at most 4 MiB − 16 KiB
# of key and value data hold 4080 tokens, so the export is three chunks.
made=$("$attn" --target "$a" cache create --kv-heads 2 --head-dim 128 --dtype bf16 2>&1) || true
id=$(sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p' <<<"$made")
check create 0 'kv_heads 2, head_dim 128, value_dim 128, DTYPE_BFLOAT16' -- echo "$made"
check append 0 'length 12000 tokens' -- "$attn" --target "$a" cache append "$id" --tokens 12000 \
  --seed 3
check tiled-a 0 'output \[1, 4, 3, 128\] DTYPE_BFLOAT16' -- tiled "$a" "$id" "$work/a.out"

exported=$("$attn" --target "$a" cache export "$id" --to "$work/c.exp" 2>&1) || true
crc=$(sed -n 's/.*CRC32C \(0x[0-9a-f]\{8\}\).*/\1/p' <<<"$exported")
check export 0 "^exported cache $id to $work/c.exp: 12000 tokens, CRC32C 0x[0-9a-f]{8}, " -- \
  echo "$exported"
check export-magic 0 '^ATTNEXP1$' -- head -c 8 "$work/c.exp"
check export-chunks 0 '^3$' -- records "$work/c.exp"
check export-leaves-source 0 'length 12000 tokens' -- "$attn" --target "$a" cache info "$id"

# The file into B: the same id, length and CRC32C, and the same answer to the same query.
check import 0 "^cache $id\$" -- "$attn" --target "$b" cache import "$work/c.exp"
check import-info 0 "length 12000 tokens" -- "$attn" --target "$b" cache info "$id"
check import-crc 0 "^  CRC32C ${crc:-none}\$" -- \
  "$attn" --target "$b" cache import "$work/c.exp" --new-id
check import-taken 1 "ALREADY_EXISTS: import into $b: .*$id already exists" -- \
  "$attn" --target "$b" cache import "$work/c.exp"
check tiled-b 0 'output \[1, 4, 3, 128\]' -- tiled "$b" "$id" "$work/b.out"
check imported-identical 0 '^same$' -- bash -c 'cmp "$1" "$2" && echo same' _ "$work/a.out" \
  "$work/b.out"
check import-list 0 '^2$' -- caches_on "$b"

# attn cache move: B already holds the id, so only --new-id moves it; then the source is gone
# and the copy answers as the original did.
check move-taken 1 "ALREADY_EXISTS: import into $b: " -- \
  "$attn" cache move "$id" --from "$a" --to "$b"
check move-taken-keeps-source 0 'length 12000 tokens' -- "$attn" --target "$a" cache info "$id"
moved=$("$attn" cache move "$id" --from "$a" --to "$b" --new-id 2>&1) || true
new_id=$(sed -n 's/.*; its id there is \([0-9a-f]\{32\}\)$/\1/p' <<<"$moved")
check move 0 "^moved $id from $a to $b: 12000 tokens, CRC32C ${crc:-none}; its id there is " -- \
  echo "$moved"
check move-info 0 "^cache ${new_id:-none}\$" -- echo "$moved"
check move-source-gone 1 "NOT_FOUND: .*$id" -- "$attn" --target "$a" cache info "$id"
check tiled-moved 0 'output \[1, 4, 3, 128\]' -- tiled "$b" "${new_id:-none}" "$work/moved.out"
check moved-identical 0 '^same$' -- bash -c 'cmp "$1" "$2" && echo same' _ "$work/a.out" \
  "$work/moved.out"
# And back to A under its own id (free there now), still the same answer.
check move-back 0 "^moved $new_id from $b to $a: 12000 tokens, CRC32C ${crc:-none}\$" -- \
  "$attn" cache move "${new_id:-none}" --from "$b" --to "$a"
check tiled-back 0 'output \[1, 4, 3, 128\]' -- tiled "$a" "${new_id:-none}" "$work/back.out"
check back-identical 0 '^same$' -- bash -c 'cmp "$1" "$2" && echo same' _ "$work/a.out" \
  "$work/back.out"
check move-unknown 1 "NOT_FOUND: export from $a: " -- \
  "$attn" cache move 00000000000000000000000000000000 --from "$a" --to "$b"

# Damaged files: nothing appears on B. A byte flipped halfway through lies in the second chunk's
# key or value data (each chunk is about 4 MiB of it): only the CRC32C can tell.
before=$(caches_on "$b")
cp "$work/c.exp" "$work/flipped.exp"
/usr/bin/python3 -c '
import sys
data = bytearray(open(sys.argv[1], "rb").read())
data[len(data) // 2] ^= 0x40
open(sys.argv[1], "wb").write(data)' "$work/flipped.exp"
check import-flipped 1 "DATA_LOSS: $work/flipped.exp: its tokens' CRC32C is 0x[0-9a-f]{8}, its last chunk states ${crc:-none}" -- \
  "$attn" --target "$b" cache import "$work/flipped.exp" --new-id
size=$(stat -c %s "$work/c.exp")
head -c $((size - 1000)) "$work/c.exp" >"$work/cut.exp"
check import-cut 1 "DATA_LOSS: $work/cut.exp: record 2 \(at byte [0-9]+\) is cut short: " -- \
  "$attn" --target "$b" cache import "$work/cut.exp" --new-id
first=$(/usr/bin/python3 -c '
import struct, sys
data = open(sys.argv[1], "rb").read()
print(12 + struct.unpack_from("<I", data, 8)[0])' "$work/c.exp")
head -c "$first" "$work/c.exp" >"$work/one-chunk.exp"
check import-one-chunk 1 "DATA_LOSS: $work/one-chunk.exp: ends after 1 chunks, before the one carrying crc32c" -- \
  "$attn" --target "$b" cache import "$work/one-chunk.exp" --new-id
{ cat "$work/c.exp"; printf 'x'; } >"$work/trailing.exp"
check import-trailing 1 "DATA_LOSS: $work/trailing.exp: goes on after its last chunk" -- \
  "$attn" --target "$b" cache import "$work/trailing.exp" --new-id
printf 'ATTNEXP2 and more' >"$work/foreign.exp"
check import-foreign 1 "DATA_LOSS: $work/foreign.exp: not an attn cache export" -- \
  "$attn" --target "$b" cache import "$work/foreign.exp"
check import-missing 1 "NOT_FOUND: cannot open $work/missing.exp" -- \
  "$attn" --target "$b" cache import "$work/missing.exp"
check damaged-leave-b 0 "^${before}\$" -- caches_on "$b"

# An empty cache: one chunk with its info and CRC32C 0; imported, it takes appends.
empty=$("$attn" --target "$a" cache create --kv-heads 2 --head-dim 64 --dtype bf16 2>&1 |
  sed -n 's/^cache \([0-9a-f]\{32\}\)$/\1/p') || true
check export-empty 0 "^exported cache $empty to $work/empty.exp: 0 tokens, CRC32C 0x00000000, " -- \
  "$attn" --target "$a" cache export "${empty:-none}" --to "$work/empty.exp"
check export-empty-chunks 0 '^1$' -- records "$work/empty.exp"
check import-empty 0 'length 0 tokens' -- "$attn" --target "$b" cache import "$work/empty.exp"
check import-empty-appends 0 'length 5 tokens' -- \
  "$attn" --target "$b" cache append "${empty:-none}" --tokens 5

# Usage and the export of an unknown cache (which leaves no file behind).
check export-unknown 1 'NOT_FOUND' -- \
  "$attn" --target "$a" cache export 00000000000000000000000000000000 --to "$work/none.exp"
check export-unknown-no-file 0 '^absent$' -- \
  bash -c '[ -e "$1" ] && echo present || echo absent' _ "$work/none.exp"
check export-usage 1 'usage: attn cache export CACHE_ID --to FILE' -- \
  "$attn" --target "$a" cache export "$id"
check move-usage 1 'usage: attn cache move CACHE_ID --from HOST:PORT --to HOST:PORT' -- \
  "$attn" cache move "$id" --from "$a"
check import-list-target 1 'puts the cache on one server: give --target one address, not 2' -- \
  "$attn" --target "$a,$b" cache import "$work/c.exp"

kill -0 "$server_a" || { echo "FAIL: attnd A died"; cat "$work/a.log"; exit 1; }
kill -0 "$server_b" || { echo "FAIL: attnd B died"; cat "$work/b.log"; exit 1; }
echo "cache_move: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
