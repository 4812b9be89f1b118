#!/usr/bin/env bash
# The docs cannot drift: every command README.md and docs/*.md show in a fenced block is run here
# (or, where ctest cannot run it, checked against what it names), and every link between them
# resolves. Usage: docs_test.sh ATTND ATTN PYTHON_STUBS [SOURCE_DIR]
#
# The convention, by a block's info string (GitHub reads only its first word, the language):
#   ```sh          run, one line (or `\`-continued lines) at a time, every block of a file in one
#                  bash session, top to bottom (a variable set in one block is seen by the next),
#                  from a scratch directory laid out like a built checkout: build/release/attnd,
#                  attn and python are the build's, everything else links to SOURCE_DIR. Each
#                  command must exit 0; `attn` without --target reaches the attnd this test starts.
#   ```python      every python block of a file, in order, as one script (PYTHONPATH
#                  build/release/python:client/python, /usr/bin/python3); it must exit 0.
#   ```js          every js block of a file, in order, as one async function run by node.
#   ```sh static   not run (Docker, Kubernetes, a GPU, a long build): each command is checked
#                  against what it names — attnd/attn flags exist, docker build-args are ARGs of
#                  the Dockerfile, a run image was built above, compose services and Kubernetes
#                  objects exist, scripts exist and parse. A program with no check here fails.
#   ```sh run-by=PATH  not run here: each command must appear verbatim in PATH, the test (or CI
#                  script) that runs it.
#   Any other block (```text, ```proto) is output or a formula, never a command; an unlabelled
#   block whose first line looks like a command fails, so a command cannot hide from this test.
# In runnable blocks a comment `# => TEXT` (`// => TEXT` in js; it may follow prose: `# prose  # =>
# TEXT`) says the output contains TEXT (a trailing `...` or `…` is dropped); `# fails: TEXT` says the command exits non-zero and its
# output contains TEXT. Other comments are prose. 127.0.0.1:50051 and 127.0.0.1:8080 in a
# runnable block are replaced by this test's attnd's gRPC and HTTP addresses.
# Also: docs/operations.md's table of server flags names every flag attnd has, and each plain
# number or string default in it is attnd's own.
set -euo pipefail
source "$(dirname "$0")/attnd_lib.sh"
attnd=$(realpath "$1")
attn=$(realpath "$2")
stubs=$(realpath "$3")
root=$(cd "${4:-$(dirname "$0")/..}" && pwd)
python=/usr/bin/python3

work=$(mktemp -d)
server=""
cleanup() {
  [ -z "$server" ] || kill "$server" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$attnd" --helpfull >"$work/attnd.flags" 2>&1 || true
"$attn" --helpfull >"$work/attn.flags" 2>&1 || true

# 1. Extract the blocks, check links, static and run-by blocks; write one script per file.
"$python" - "$root" "$work" <<'EOF' || { echo "docs: extraction failed"; exit 1; }
import os, re, shlex, subprocess, sys
import yaml

root, work = sys.argv[1], sys.argv[2]
docs = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(root, "docs"))
                              if f.endswith(".md"))
failures = []
def fail(where, message):
    failures.append(f"FAIL {where}: {message}")

def slug(heading):  # GitHub's anchor for a heading
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")

def split_comment(line, marker):
    """(code, comment) of a line: the comment starts at `marker` outside quotes."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote != "'":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"`" and not (marker == "#" and c == "`"):
            quote = c
        elif line.startswith(marker, i) and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + len(marker):].strip()
        i += 1
    return line.rstrip(), ""

def expectation(comment):
    """("prints" | "fails", TEXT) from a comment's `=> TEXT` or `fails: TEXT` (which may follow
    prose and a second `#`), else ("ok", "")."""
    for part in re.split(r"\s(?:#|//)\s*", comment):
        for kind, prefix in (("prints", "=>"), ("fails", "fails:")):
            if part.startswith(prefix):
                text = part[len(prefix):].strip()
                text = re.sub(r"\s*(\.\.\.|…)$", "", text)
                return kind, text
    return "ok", ""

def flags_of(path):
    text = open(path).read()
    return set(re.findall(r"^\s+--([a-z0-9_]+) \(", text, re.M))

attnd_flags = flags_of(os.path.join(work, "attnd.flags"))
attn_flags = flags_of(os.path.join(work, "attn.flags"))
if not attnd_flags or not attn_flags:
    fail("docs_test", "could not read attnd's or attn's --helpfull")

def read_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]

def check_flags(where, words, known, program):
    for word in words:
        m = re.match(r"--([a-z0-9_-]+)", word)
        if m and m.group(1).replace("-", "_") not in known:
            fail(where, f"{program} has no flag {m.group(0)}")

dockerfile = open(os.path.join(root, "Dockerfile")).read()
docker_args = set(re.findall(r"^ARG\s+([A-Z_0-9]+)", dockerfile, re.M))
exposed = set(" ".join(re.findall(r"^EXPOSE\s+(.*)$", dockerfile, re.M)).split())
k8s = []
for name in os.listdir(os.path.join(root, "deploy/k8s")):
    if name.endswith(".yaml") and name != "kustomization.yaml":
        k8s += read_yaml_docs(os.path.join(root, "deploy/k8s", name))

def static_check(where, command, built_images):
    words = shlex.split(command)
    env = []
    while words and re.match(r"^[A-Z_]+=", words[0]):
        env.append(words.pop(0))
    if not words:
        return fail(where, "no command")
    program = os.path.basename(words[0])
    args = words[1:]
    if program in ("attnd", "attn"):
        check_flags(where, args, attnd_flags if program == "attnd" else attn_flags, program)
    elif program == "docker" and args[:1] == ["build"]:
        for i, word in enumerate(args):
            if word == "--build-arg":
                name = args[i + 1].split("=")[0]
                if name not in docker_args:
                    fail(where, f"the Dockerfile has no ARG {name}")
            if word == "-t":
                built_images.add(args[i + 1])
        if not os.path.isfile(os.path.join(root, args[-1], "Dockerfile")):
            fail(where, f"no Dockerfile in {args[-1]}")
    elif program == "docker" and args[:1] == ["run"]:
        image = [a for a in args if not a.startswith("-")][-1]
        if image not in built_images:
            fail(where, f"image {image} is built by no docker build above")
        for i, word in enumerate(args):
            if word == "-p" and args[i + 1].split(":")[-1] not in exposed:
                fail(where, f"the Dockerfile exposes no port {args[i + 1].split(':')[-1]}")
    elif program == "docker" and args[:1] == ["compose"]:
        path = args[args.index("-f") + 1]
        services = read_yaml_docs(os.path.join(root, path))[0]["services"]
        rest = args[args.index("-f") + 2:]
        if rest[:1] != ["up"]:
            fail(where, "only `docker compose -f FILE up` is checked")
        for name in [a for a in rest[1:] if not a.startswith("-")]:
            if name not in services:
                fail(where, f"{path} has no service {name}")
    elif program == "kubectl":
        if args[:3] == ["create", "secret", "generic"]:
            name = args[3]
            key = [a for a in args if a.startswith("--from-file=")][0].split("=")[1]
            workloads = [d for d in k8s if d.get("kind") in ("Deployment", "StatefulSet")]
            volumes = [v for d in workloads
                       for v in d["spec"]["template"]["spec"].get("volumes", [])]
            if not any(v.get("secret", {}).get("secretName") == name for v in volumes):
                fail(where, f"no Deployment or StatefulSet in deploy/k8s mounts the Secret {name}")
            args = [str(a) for d in workloads for c in d["spec"]["template"]["spec"]["containers"]
                    for a in c.get("args", []) + c.get("command", [])]
            if not any(a.endswith(f"/{key}") for a in args):
                fail(where, f"no container in deploy/k8s reads a file named {key}")
        elif args[:2] == ["apply", "-k"]:
            if not os.path.isfile(os.path.join(root, args[2], "kustomization.yaml")):
                fail(where, f"no kustomization.yaml in {args[2]}")
        elif args[:1] == ["scale"]:
            kind, name = args[1].split("/")
            kind = {"deploy": "Deployment", "deployment": "Deployment", "sts": "StatefulSet",
                    "statefulset": "StatefulSet"}.get(kind, kind)
            if not any(d.get("kind") == kind and d["metadata"]["name"] == name for d in k8s):
                fail(where, f"deploy/k8s has no {kind} {name}")
        else:
            fail(where, f"no static check for kubectl {' '.join(args[:2])}")
    elif words[0] == "bash" or program.endswith(".sh"):
        script = args[0] if words[0] == "bash" else words[0]
        path = os.path.join(root, script)
        if not os.path.isfile(path):
            fail(where, f"no script {script}")
        elif subprocess.run(["bash", "-n", path]).returncode != 0:
            fail(where, f"{script} does not parse")
    else:
        fail(where, f"no static check for {program}")

def logical_lines(lines, start):
    """(line number, text) of each command, `\\`-continued lines joined."""
    out, pending, first = [], "", 0
    for number, line in enumerate(lines, start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    return out

command_like = re.compile(r"^\s*(\$ |\$B/|\./|build/|attnd? |docker |kubectl |curl |python3? |node )")
headings = {}
bodies = {}
for doc in docs:
    text = open(os.path.join(root, doc)).read()
    bodies[doc] = text
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    headings[doc] = {slug(h) for h in re.findall(r"^#+ (.*)$", outside, re.M)}

for doc in docs:
    text = bodies[doc]
    name = doc.replace("/", "_")
    # Links: [text](target) outside fenced blocks.
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(os.path.join(root, resolved)):
            fail(doc, f"link to {target}: no {resolved}")
        elif anchor and resolved.endswith(".md"):
            if resolved not in headings:
                fail(doc, f"link to {target}: {resolved} is not one of the checked docs")
            elif anchor not in headings[resolved]:
                fail(doc, f"link to {target}: {resolved} has no heading #{anchor}")
    # Blocks.
    lines = text.split("\n")
    sh, py, js = [], [], []
    py_expect, js_expect = [], []
    built_images = set()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        info = m.group(1).split()
        start = i + 2
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        block = lines[i + 1:j]
        i = j + 1
        lang = info[0] if info else ""
        attrs = info[1:]
        where = f"{doc}:{start}"
        if lang in ("sh", "bash"):
            commands = [(n, split_comment(l, "#")) for n, l in logical_lines(block, start)]
            commands = [(n, code, comment) for n, (code, comment) in commands if code.strip()]
            if attrs == ["static"]:
                for n, code, _ in commands:
                    static_check(f"{doc}:{n}", code, built_images)
            elif attrs and attrs[0].startswith("run-by="):
                runner_path = attrs[0].split("=", 1)[1]
                try:
                    runner = " ".join(open(os.path.join(root, runner_path)).read().split())
                except OSError:
                    fail(where, f"run-by={runner_path}: no such file")
                    continue
                for n, code, _ in commands:
                    if " ".join(code.split()) not in runner:
                        fail(f"{doc}:{n}", f"`{code.strip()}` does not appear in {runner_path}")
            elif attrs:
                fail(where, f"unknown block attributes {attrs}")
            else:
                for n, code, comment in commands:
                    kind, want = expectation(comment)
                    sh.append((f"{doc}:{n}", kind, want, code))
        elif lang == "python":
            for n, line in enumerate(block, start):
                kind, want = expectation(split_comment(line, "#")[1])
                if kind == "prints":
                    py_expect.append((f"{doc}:{n}", want))
            py.append(f"# {where}\n" + "\n".join(block))
        elif lang in ("js", "javascript"):
            for n, line in enumerate(block, start):
                kind, want = expectation(split_comment(line, "//")[1])
                if kind == "prints":
                    js_expect.append((f"{doc}:{n}", want))
            js.append(f"// {where}\n" + "\n".join(block))
        else:
            first = next((l for l in block if l.strip()), "")
            if not lang and command_like.match(first):
                fail(where, "an unlabelled block that starts like a command: label it sh "
                            "(or sh static, or text for output)")
    def q(s):
        return "'" + s.replace("'", "'\\''") + "'"
    with open(os.path.join(work, name + ".sh"), "w") as f:
        for where, kind, want, code in sh:
            f.write(f"docs_cmd {q(where)} {kind} {q(want)} <<'DOCS_CMD_EOF'\n{code}\nDOCS_CMD_EOF\n")
    if py:
        open(os.path.join(work, name + ".py"), "w").write("\n\n".join(py) + "\n")
        open(os.path.join(work, name + ".py.expect"), "w").write(
            "".join(f"{w}\t{t}\n" for w, t in py_expect))
    if js:
        body = "\n".join(js)
        open(os.path.join(work, name + ".js"), "w").write(
            "(async () => {\n" + body + "\n})().catch((e) => { console.error(e); process.exit(1); });\n")
        open(os.path.join(work, name + ".js.expect"), "w").write(
            "".join(f"{w}\t{t}\n" for w, t in js_expect))

# docs/operations.md's server flag table: every attnd flag, attnd's own plain defaults.
ops = bodies.get("docs/operations.md", "")
helpfull = open(os.path.join(work, "attnd.flags")).read()
server_section = "\n".join(re.findall(r"Flags from server/.*?(?=\n\n  Flags from |\Z)", helpfull, re.S))
defaults = dict(re.findall(r"--([a-z0-9_]+) \(.*?\); +default: ([^;]*);",
                           " ".join(server_section.split())))
rows = {}
for line in ops.split("\n"):
    cells = line.split("|")
    if line.startswith("| ") and len(cells) > 3:
        for name in re.findall(r"`--([a-z0-9-]+)", cells[1]):
            rows.setdefault(name, cells[2])
for flag, default in sorted(defaults.items()):
    dashed = flag.replace("_", "-")
    if dashed not in rows:
        fail("docs/operations.md", f"the server flag table has no row for --{dashed}")
        continue
    cell = rows[dashed].strip()
    if re.fullmatch(r"[0-9]+", cell) and cell != default:
        fail("docs/operations.md", f"--{dashed}: the table says {cell}, attnd's default is {default}")
    if re.fullmatch(r"`[^`]*`", cell) and f'"{cell[1:-1]}"' != default and cell[1:-1] != default:
        fail("docs/operations.md", f"--{dashed}: the table says {cell}, attnd's default is {default}")

for line in failures:
    print(line)
open(os.path.join(work, "static.failures"), "w").write(str(len(failures)))
EOF
failed=$(cat "$work/static.failures")

# 2. A scratch checkout: the build's binaries and stubs where a Release build puts them.
scratch=$work/checkout
mkdir -p "$scratch/build/release"
for entry in "$root"/* "$root"/.ci; do
  [ "$(basename "$entry")" = build ] || ln -s "$entry" "$scratch/$(basename "$entry")"
done
ln -s "$stubs" "$scratch/build/release/python"
ln -s "$attnd" "$scratch/build/release/attnd"

"$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --threads 2 --log-level error \
  --allow-shared-memory \
  >"$work/attnd.log" 2>&1 &
server=$!
port=$(attnd_wait_port "$server" "$work/attnd.log")
http=$(sed -n 's|.*http: http://\([0-9.:]*\).*|\1|p' "$work/attnd.log")
[ -n "$http" ] || { cat "$work/attnd.log"; echo "FAIL: attnd reported no HTTP address"; exit 1; }
# attn without --target reaches this attnd (flags may come anywhere on attn's line).
cat >"$scratch/build/release/attn" <<WRAP
#!/usr/bin/env bash
for arg in "\$@"; do case \$arg in --target|--target=*) exec "$attn" "\$@";; esac; done
exec "$attn" "\$@" --target 127.0.0.1:$port
WRAP
chmod +x "$scratch/build/release/attn"
addresses="s/127\.0\.0\.1:50051/127.0.0.1:$port/g; s/127\.0\.0\.1:8080/$http/g"

# 3. Run the blocks.
passed=0
report() {  # report WHERE OK OUTPUT MESSAGE
  if [ "$2" = 1 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    printf 'FAIL %s: %s\n%s\n' "$1" "$4" "$3" | head -n 40
  fi
}
expect_all() {  # expect_all EXPECT_FILE OUTPUT: every "WHERE<TAB>TEXT" line's TEXT in OUTPUT
  local where text
  while IFS=$'\t' read -r where text; do
    if grep -qF -- "$text" <<<"$2"; then report "$where" 1 "" ""; else
      report "$where" 0 "$2" "the output does not contain \"$text\""
    fi
  done <"$1"
}

cat >"$work/docs_cmd.sh" <<'LIB'
# docs_cmd WHERE ok|prints|fails TEXT <<<COMMAND: eval COMMAND in this shell, in the scratch
# checkout; prints "PASS WHERE" or "FAIL WHERE" with the output.
docs_cmd() {
  local where=$1 kind=$2 want=$3 command rc=0 out
  command=$(sed "$DOCS_ADDRESSES")
  eval "$command" >"$DOCS_OUT" 2>&1 </dev/null || rc=$?
  out=$(cat "$DOCS_OUT")
  local ok=1
  case $kind in
    ok) [ "$rc" -eq 0 ] || ok=0 ;;
    prints) [ "$rc" -eq 0 ] && grep -qF -- "$want" <<<"$out" || ok=0 ;;
    fails) [ "$rc" -ne 0 ] && grep -qF -- "$want" <<<"$out" || ok=0 ;;
  esac
  if [ "$ok" = 1 ]; then echo "PASS $where"; else
    printf 'FAIL %s: `%s` (exit %s; wanted %s %s)\n%s\n' "$where" "$command" "$rc" "$kind" \
      "$want" "$(head -n 30 <<<"$out")"
  fi
}
LIB
node_skipped=0
for script in "$work"/*.sh; do
  case $(basename "$script") in docs_cmd.sh) continue ;; esac
  [ -s "$script" ] || continue
  results=$(cd "$scratch" && DOCS_ADDRESSES=$addresses DOCS_OUT=$work/out.txt \
    timeout 300 bash -c 'source "$1"; source "$2"; kill $(jobs -p) 2>/dev/null || true' _ \
    "$work/docs_cmd.sh" "$script" 2>&1) || true
  passed=$((passed + $(grep -c '^PASS ' <<<"$results" || true)))
  failed=$((failed + $(grep -c '^FAIL ' <<<"$results" || true)))
  grep -v '^PASS ' <<<"$results" || true
done
for script in "$work"/*.py; do
  [ -e "$script" ] || continue
  sed "$addresses" "$script" >"$scratch/$(basename "$script")"
  rc=0
  out=$(cd "$scratch" && PYTHONPATH=build/release/python:client/python \
    "$python" "$(basename "$script")" 2>&1) || rc=$?
  report "$(basename "$script")" "$([ "$rc" -eq 0 ] && echo 1 || echo 0)" "$out" "exit $rc"
  expect_all "$script.expect" "$out"
done
for script in "$work"/*.js; do
  [ -e "$script" ] || continue
  if ! command -v node >/dev/null 2>&1; then node_skipped=1; continue; fi
  sed "$addresses" "$script" >"$scratch/$(basename "$script")"
  rc=0
  out=$(cd "$scratch" && node "$(basename "$script")" 2>&1) || rc=$?
  report "$(basename "$script")" "$([ "$rc" -eq 0 ] && echo 1 || echo 0)" "$out" "exit $rc"
  expect_all "$script.expect" "$out"
done

kill -0 "$server" || { echo "FAIL: attnd died"; cat "$work/attnd.log"; exit 1; }
echo "docs: $passed passed, $failed failed"
[ "$failed" -eq 0 ] || exit 1
if [ "$node_skipped" = 1 ]; then echo "SKIPPED: node not found, the js blocks did not run"; exit 77; fi
