# Shared by the shell tests that run attnd (source it; not a test itself):
#   attnd_wait_port PID LOG   prints the port attnd PID reported in LOG ("... (port N)"), or
#                             "unix" for a Unix socket ("... (unix socket)"), or shows LOG and
#                             fails when attnd exits or never reports one
#   check NAME EXIT PATTERN -- COMMAND...
#                             runs COMMAND, counts it in $passed or $failed: passed when it exits
#                             with EXIT and its output (stdout and stderr) matches PATTERN (ERE);
#                             a script may define check_also NAME OUTPUT for a test of its own on
#                             every output (it counts its own failures)

attnd_wait_port() {
  local pid=$1 log=$2 port=""
  for _ in $(seq 150); do
    # The log may not exist yet: the caller's background redirection can come after this read.
    port=$(sed -n -e 's/.*(port \([0-9]*\)).*/\1/p' -e 's/.*(unix socket)$/unix/p' "$log" \
      2>/dev/null || true)
    [ -n "$port" ] && { echo "$port"; return 0; }
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "FAIL: attnd exited" >&2; return 1; }
    sleep 0.1
  done
  cat "$log" >&2
  echo "FAIL: attnd never reported its port" >&2
  return 1
}

passed=0
failed=0
check() {
  local name=$1 want=$2 pattern=$3
  shift 4
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" -eq "$want" ] && grep -qE -- "$pattern" <<<"$out"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    printf 'FAIL %s (exit %s, wanted %s and /%s/):\n%s\n' "$name" "$rc" "$want" "$pattern" "$out"
  fi
  if declare -F check_also >/dev/null; then check_also "$name" "$out"; fi
}
