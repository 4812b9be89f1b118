#!/usr/bin/env bash
# The web viewer (client/viewer, served by attnd's JSON gateway) in a real headless browser:
# Debian's chromium driven by playwright-core (tests/browser/viewer_test.js). Starts attnd on free
# ports, loads the page, runs the seed trace with block_k 2, steps to the end, checks the final
# output against the seed's out[0], the 1024 bytes of Naive at N = 8, no console errors, that a
# server error is shown, and that the page opened as a file runs all its scripts; saves a
# screenshot as viewer.png. Then (tests/browser/mask_test.js) a
# causal window with ALiBi: the hidden keys' reasons, the window band, each key's bias and the
# final output; a ragged batch (the other-sequence marks, the row's sequence); split and merge
# with a window, softcap and ALiBi against the unsplit row; saves viewer-masks.png and
# viewer-masks-ragged.png.
# Usage: browser_test.sh ATTND [SCREENSHOT_DIR]   (the screenshot goes to $ATTN_SCREENSHOT_DIR when
# set, else SCREENSHOT_DIR, else ATTND's directory)
# Exit 77 (skipped) when chromium or node is absent; deploy/install-deps.sh installs both and
# tests/browser/node_modules.
set -euo pipefail
attnd=$1
shots=${ATTN_SCREENSHOT_DIR:-${2:-$(dirname "$attnd")}}
here="$(cd "$(dirname "$0")" && pwd)"

if [ ! -x /usr/bin/chromium ]; then
  echo "SKIP: /usr/bin/chromium is absent (deploy/install-deps.sh installs it)"
  exit 77
fi
if ! command -v node >/dev/null; then
  echo "SKIP: node is absent (deploy/install-deps.sh installs it)"
  exit 77
fi
if [ ! -d "$here/browser/node_modules/playwright-core" ]; then
  echo "FAIL: tests/browser/node_modules lacks playwright-core; run deploy/install-deps.sh"
  exit 1
fi

dir=$(mktemp -d)
server=""
trap 'kill $server 2>/dev/null || true; rm -rf "$dir"' EXIT

# Created here, not only by the redirection below: that runs in the background job, and the
# loop's first read could otherwise come before it (sed on a missing file fails the script).
: >"$dir/out"
: >"$dir/err"
"$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --threads 2 >"$dir/out" 2>"$dir/err" &
server=$!
http_port=""
for _ in $(seq 100); do
  http_port=$(sed -n 's|^  http: http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$dir/out")
  [ -n "$http_port" ] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$http_port" ]; then
  cat "$dir/out" "$dir/err"
  echo "FAIL: attnd never reported its HTTP port"
  exit 1
fi

mkdir -p "$shots"
rc=0
timeout 120 node "$here/browser/viewer_test.js" "http://127.0.0.1:$http_port/" "$shots/viewer.png" ||
  rc=$?
timeout 120 node "$here/browser/mask_test.js" \
  "http://127.0.0.1:$http_port/" "$shots/viewer-masks.png" || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "--- attnd stderr (last 20 lines)"
  tail -n 20 "$dir/err"
fi
exit "$rc"
