#!/usr/bin/env python3
"""Static checks of the deployment files (issues 7 and 29): the Dockerfile, deploy/k8s/ and
deploy/compose.yaml. tests/image_test.sh builds and runs the CPU image (issue 17); the GPU image
and the cluster run nowhere here, so this reads the files and checks what they say against each
other and against the build recipe tests/run.sh uses:

  Dockerfile, as `docker build` without --build-arg reads it (the GPU image): two stages, both
    FROM lines on an exactly pinned nvidia/cuda tag, devel then the matching runtime, through
    the build arguments BASE_BUILD and BASE_RUNTIME (ATTN_CUDA=ON by default); the build stage
    runs deploy/install-deps.sh and the CMake preset that tests/run.sh configures and builds,
    with CUDA on for sm 80 and 90; the runtime stage installs its libraries through
    install-deps.sh (ATTN_DEPS=runtime: Debian 12's and Ubuntu 24.04's names, no list of its
    own), copies attnd and attn from the build stage, runs as a non-root user, exposes the gRPC
    and HTTP ports attnd listens on, has a HEALTHCHECK with `attn health`, and starts attnd with
    arguments attnd accepts (a non-loopback plaintext --listen needs --insecure or TLS; a
    non-loopback --http-listen needs --insecure whatever gRPC uses, the HTTP port having no TLS;
    --cache-sync-seconds is at least 1; --drain-to is host:port and never beside --tls-cert or
    --tls-client-ca); the runtime stage creates the --cache-dir directory the deployments mount
    (/var/lib/attnd/caches), owned by the image's USER, so a new Docker volume there takes that
    owner and attnd can write to it under a read-only root.
  Every attnd command shown in a comment of the Dockerfile, deploy/compose.yaml or deploy/k8s/
    (an example to copy) follows the same rules.
  deploy/k8s: every file parses (yaml.safe_load_all) and is listed in kustomization.yaml; attnd
    is one StatefulSet (its caches persist, so each replica keeps a volume of its own), governed
    by the headless Service; it asks for nvidia.com/gpu 1, listens where the Dockerfile does,
    has gRPC startup, liveness and readiness probes on that port, runs non-root with a read-only
    root filesystem and no privilege escalation, and reads --auth-token-file from the Secret
    volume's path; --cache-dir is the mount path of a volumeClaimTemplates claim (one
    ReadWriteOnce volume per replica, writable through the pod's fsGroup), its
    terminationGracePeriodSeconds leaves room after --shutdown-grace for the hand-over and the
    flush, and it offers --drain-to commented out; the Services and the PDB select its pods, the
    headless one has clusterIP None.
  deploy/compose.yaml: parses, reserves an NVIDIA GPU, same ports, the token from a secret,
    --cache-dir on a named volume mounted where the image creates the directory, a
    stop_grace_period past --shutdown-grace with room for the flush; its CPU service (attnd-cpu,
    the one tests/image_test.sh brings up) is the same service without the GPU, built with
    ATTN_CUDA=OFF on one base for both stages, and starts only when named.
  yamllint --strict -c deploy/.yamllint deploy: clean.

Usage: deploy_static_test.py [REPO_ROOT]. Prints one line per check and "N passed, N failed".
"""

import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys

import yaml

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), ".."))
GPU = "nvidia.com/gpu"

results = []  # (name, error or None)


def check(fn):
    try:
        fn()
        results.append((fn.__name__, None))
    except AssertionError as e:
        results.append((fn.__name__, str(e) or "assertion failed"))
    except Exception as e:  # A broken file must fail the check, not the test runner.
        results.append((fn.__name__, f"{type(e).__name__}: {e}"))
    return fn


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


# --- the Dockerfile ---------------------------------------------------------------------------

def dockerfile_instructions():
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in read("Dockerfile").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # A comment inside a continued instruction.
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued instruction"
    return out


def arg_default(args):
    """(name, default or None) of an ARG instruction's arguments."""
    name, eq, default = args.partition("=")
    return name.strip(), (default.strip().strip('"') if eq else None)


def substitute(text, values):
    """text with ${NAME} and $NAME replaced for the names in values, as Docker expands build
    arguments; anything else (e.g. the shell's "$(nproc)") is left to the shell."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def global_args():
    """{name: default} of the ARGs before the first FROM (the ones FROM lines may use)."""
    values = {}
    for instr, args in dockerfile_instructions():
        if instr == "FROM":
            break
        assert instr == "ARG", f"{instr} before the first FROM"
        name, default = arg_default(args)
        values[name] = default
    return values


def stages():
    """[{'from': image, 'raw_from': as written, 'name': alias, 'args': {name: default},
    'lines': [(INSTR, args)]}], each with the build arguments' defaults substituted: the global
    ones in FROM, the stage's own ARGs in its other instructions (`docker build` without
    --build-arg)."""
    outer = global_args()
    result = []
    for instr, args in dockerfile_instructions():
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert m, f"FROM line not understood: {args}"
            result.append({"from": substitute(m.group(1), outer), "raw_from": m.group(1),
                           "name": m.group(2), "args": {}, "lines": []})
        elif result:
            stage = result[-1]
            if instr == "ARG":
                name, default = arg_default(args)
                stage["args"][name] = default if default is not None else outer.get(name)
            stage["lines"].append((instr, substitute(args, stage["args"])))
    return result


def exec_form(args):
    """The argv of a JSON (exec form) or shell form instruction."""
    if args.startswith("["):
        argv = json.loads(args)
        assert all(isinstance(a, str) for a in argv), f"not a list of strings: {args}"
        return argv
    return shlex.split(args)


def image_argv():
    """ENTRYPOINT + CMD of the last stage, as Docker runs them."""
    entry, cmd = [], []
    for instr, args in stages()[-1]["lines"]:
        if instr == "ENTRYPOINT":
            entry = exec_form(args)
        elif instr == "CMD":
            cmd = exec_form(args)
    return entry + cmd


def flag(argv, name):
    """The value of --name VALUE or --name=VALUE in argv, else None (the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def host_port(address):
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"not host:port: {address}"
    return host.strip("[]"), int(port)


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def attnd_ports(argv, where):
    """(grpc port, http port) from attnd's argv; also checks that attnd would start with it."""
    listen = flag(argv, "--listen")
    http = flag(argv, "--http-listen")
    assert listen, f"{where}: no --listen (the default 127.0.0.1 is unreachable from outside)"
    assert http, f"{where}: no --http-listen (the default 127.0.0.1:8080 is unreachable)"
    host, grpc_port = host_port(listen)
    tls = flag(argv, "--tls-cert") and flag(argv, "--tls-key")
    assert is_loopback(host) or tls or "--insecure" in argv, (
        f"{where}: plaintext on {listen} without --insecure: attnd exits with status 2")
    http_host, http_port = host_port(http)
    assert is_loopback(http_host) or "--insecure" in argv, (
        f"{where}: plain HTTP on --http-listen {http} without --insecure: attnd exits with "
        "status 2 (the HTTP port has no TLS, so TLS on gRPC does not cover it)")
    assert flag(argv, "--device") in (None, "auto"), f"{where}: --device is not auto"
    sync = flag(argv, "--cache-sync-seconds")
    assert sync is None or (sync.isdigit() and int(sync) >= 1), \
        f"{where}: --cache-sync-seconds {sync}: attnd wants a whole number of seconds >= 1"
    drain = flag(argv, "--drain-to")
    if drain:
        host_port(drain)
        assert not flag(argv, "--tls-cert") and not flag(argv, "--tls-client-ca"), (
            f"{where}: --drain-to with TLS: attnd refuses it (the hand-over speaks plaintext)")
    cache_dir = flag(argv, "--cache-dir")
    assert cache_dir is None or cache_dir.startswith("/"), \
        f"{where}: --cache-dir {cache_dir} is not an absolute path"
    return grpc_port, http_port


def shutdown_grace(argv):
    """attnd's --shutdown-grace in seconds (its default, 30, when not given)."""
    return int(flag(argv, "--shutdown-grace") or 30)


# The --cache-dir path compose and k8s mount a volume on, and the image creates for its user.
CACHE_DIR = "/var/lib/attnd/caches"
# Seconds a stop must leave after --shutdown-grace: the flush writes what the last
# --cache-sync-seconds appended (well under a second), and with --drain-to offered (k8s) the
# hand-over streams every cache to the peer.
FLUSH_SECONDS = 15
HAND_OVER_SECONDS = 60


def run_preset():
    """The configure preset tests/run.sh builds and tests (its first `cmake --preset`)."""
    m = re.search(r"^cmake --preset (\S+)\s*$", read("tests/run.sh"), re.M)
    assert m, "tests/run.sh has no `cmake --preset NAME` line"
    return m.group(1)


def docker_ports():
    argv = image_argv()
    assert argv and os.path.basename(argv[0]) == "attnd", f"the image does not start attnd: {argv}"
    return attnd_ports(argv[1:], "Dockerfile")


@check
def dockerfile_stages_pinned_devel_then_runtime():
    s = stages()
    assert len(s) >= 2, f"{len(s)} stage(s); want a build stage and a runtime stage"
    tags = []
    for stage in (s[0], s[-1]):
        m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-(devel|runtime)-ubuntu(\d+\.\d+)",
                         stage["from"])
        assert m, f"not an exactly pinned nvidia/cuda X.Y.Z-devel|runtime-ubuntuNN.NN tag: " \
                  f"{stage['from']}"
        tags.append(m.groups())
    (v0, kind0, os0), (v1, kind1, os1) = tags
    assert (kind0, kind1) == ("devel", "runtime"), f"stages are {kind0} then {kind1}"
    assert v0 == v1 and os0 == os1, f"devel {v0}/{os0} and runtime {v1}/{os1} differ"
    assert v0.startswith("13.0."), f"CUDA {v0}; the issue asks for 13.0.x"
    assert os0 == "24.04", f"ubuntu{os0}; the issue asks for ubuntu24.04"


@check
def dockerfile_bases_and_cuda_are_build_arguments():
    outer = global_args()
    s = stages()
    for name, stage in (("BASE_BUILD", s[0]), ("BASE_RUNTIME", s[-1])):
        assert outer.get(name), f"no global ARG {name} with a default"
        assert stage["raw_from"] in (f"${{{name}}}", f"${name}"), \
            f"stage {stage['name']} is FROM {stage['raw_from']}, not the build argument {name}"
    assert s[0]["args"].get("ATTN_CUDA") == "ON", "the build stage has no ARG ATTN_CUDA=ON"
    runs = " && ".join(a for i, a in s[0]["lines"] if i == "RUN")
    raw = read("Dockerfile")
    assert re.search(r"-DATTN_CUDA=\$\{?ATTN_CUDA\}?", raw), \
        "cmake is not configured with -DATTN_CUDA=${ATTN_CUDA}"
    assert "-DATTN_CUDA=ON" in runs


@check
def dockerfile_runtime_libraries_from_install_deps():
    runtime = stages()[-1]
    runs = re.sub(r"\s+", " ", " && ".join(a for i, a in runtime["lines"] if i == "RUN"))
    assert re.search(r"ATTN_DEPS=runtime \S*install-deps\.sh\b", runs), \
        "the runtime stage does not run install-deps.sh with ATTN_DEPS=runtime"
    assert "apt-get install" not in runs, \
        "the runtime stage installs packages itself: the list belongs in install-deps.sh"
    copies = [a for i, a in runtime["lines"] if i == "COPY"]
    assert any(re.search(r"(^|\s)deploy/install-deps\.sh\s", a) for a in copies), \
        "the runtime stage does not copy deploy/install-deps.sh from the build context"
    script = read("deploy/install-deps.sh")
    for release in ('"debian 12")', '"ubuntu 24.04")'):
        assert release in script, f"install-deps.sh's runtime mode has no case {release}"
    assert "/etc/os-release" in script, "install-deps.sh does not read /etc/os-release"


@check
def dockerfile_build_stage_uses_ci_recipe():
    preset = run_preset()
    runs = " && ".join(a for i, a in stages()[0]["lines"] if i == "RUN")
    runs = re.sub(r"\s+", " ", runs)
    assert re.search(r"(^|[\s&;])(\S+=\S+ )*\./deploy/install-deps\.sh\b", runs), \
        "the build stage does not run ./deploy/install-deps.sh"
    run_sh = read("tests/run.sh")
    assert "./deploy/install-deps.sh" in run_sh, "tests/run.sh no longer runs install-deps.sh"
    assert f"cmake --preset {preset} " in runs + " ", \
        f"the build stage does not configure with `cmake --preset {preset}` like tests/run.sh"
    assert f"cmake --build --preset {preset}" in runs, \
        f"the build stage does not build with `cmake --build --preset {preset}`"
    assert f"cmake --build --preset {preset}" in run_sh, \
        f"tests/run.sh does not build preset {preset}"
    assert "-DATTN_CUDA=ON" in runs, "the build stage does not require CUDA (-DATTN_CUDA=ON)"
    m = re.search(r"-DCMAKE_CUDA_ARCHITECTURES=\"?([0-9;]+)\"?", runs)
    assert m and set(m.group(1).split(";")) == {"80", "90"}, \
        "CUDA architectures are not 80;90"
    assert re.search(r"--target (\S+ )*attnd\b", runs) and re.search(r"--target (\S+ )*attn\b",
                                                                     runs), \
        "the build stage does not build the attnd and attn targets"
    presets = json.loads(read("CMakePresets.json"))
    binary_dir = next(p["binaryDir"] for p in presets["configurePresets"] if p["name"] == preset)
    build_dir = binary_dir.replace("${sourceDir}/", "")
    copies = [a for i, a in stages()[-1]["lines"] if i == "COPY"]
    for binary in ("attnd", "attn"):
        assert any(a.startswith("--from=") and re.search(rf"{re.escape(build_dir)}/{binary}\b", a)
                   for a in copies), \
            f"the runtime stage does not copy {build_dir}/{binary} from the build stage"


@check
def dockerfile_runs_as_non_root():
    users = [a for i, a in stages()[-1]["lines"] if i == "USER"]
    assert users, "the runtime stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"
    assert user.isdigit(), f"USER {user}: use a numeric uid so runAsNonRoot can verify it"


@check
def dockerfile_creates_the_cache_dir_for_its_user():
    runtime = stages()[-1]
    user = [a for i, a in runtime["lines"] if i == "USER"][-1]
    uid, _, gid = user.partition(":")
    runs = re.sub(r"\s+", " ", " && ".join(a for i, a in runtime["lines"] if i == "RUN"))
    made = None
    for m in re.finditer(r"\binstall -d ((?:-[ogm] \S+ )*)([^&;]*)", runs):
        if CACHE_DIR in m.group(2).split():
            made = dict(re.findall(r"-([ogm]) (\S+)", m.group(1)))
    assert made is not None, f"the runtime stage does not create {CACHE_DIR} (install -d)"
    assert made.get("o") == uid and made.get("g") == (gid or uid), \
        f"{CACHE_DIR} is owned by {made.get('o')}:{made.get('g')}, the image runs as {user}"
    assert not any(i == "VOLUME" for i, _ in runtime["lines"]), \
        "a VOLUME line makes an anonymous volume at every docker run; compose and k8s mount one"


@check
def dockerfile_exposes_attnd_ports():
    exposed = set()
    for i, a in stages()[-1]["lines"]:
        if i == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in a.split()}
    grpc_port, http_port = docker_ports()
    assert (grpc_port, http_port) == (50051, 8080), f"attnd listens on {grpc_port}, {http_port}"
    assert {grpc_port, http_port} <= exposed, f"EXPOSE {sorted(exposed)}; attnd listens on " \
                                              f"{grpc_port} and {http_port}"


@check
def dockerfile_healthcheck_uses_attn_health():
    checks = [a for i, a in stages()[-1]["lines"] if i == "HEALTHCHECK"]
    assert len(checks) == 1, f"{len(checks)} HEALTHCHECK lines in the runtime stage"
    m = re.search(r"\bCMD\s+(.*)$", checks[0])
    assert m, f"HEALTHCHECK without CMD: {checks[0]}"
    argv = exec_form(m.group(1))
    assert os.path.basename(argv[0]) == "attn" and "health" in argv, \
        f"HEALTHCHECK does not run `attn health`: {argv}"
    target = flag(argv, "--target") or "127.0.0.1:50051"
    assert host_port(target)[1] == docker_ports()[0], \
        f"HEALTHCHECK asks {target}, attnd listens on port {docker_ports()[0]}"


# --- deploy/k8s -------------------------------------------------------------------------------

def k8s_docs():
    """{file: [documents]} for every YAML file in deploy/k8s."""
    d = os.path.join(ROOT, "deploy", "k8s")
    files = sorted(f for f in os.listdir(d) if f.endswith((".yaml", ".yml")))
    return {f: [doc for doc in yaml.safe_load_all(read(f"deploy/k8s/{f}")) if doc is not None]
            for f in files}


def k8s_objects(kind):
    return [doc for docs in k8s_docs().values() for doc in docs if doc.get("kind") == kind]


def the_workload():
    """attnd's StatefulSet: each replica keeps a volume of its own for its caches."""
    sets = k8s_objects("StatefulSet")
    assert len(sets) == 1, f"{len(sets)} StatefulSets in deploy/k8s"
    assert not k8s_objects("Deployment"), \
        "a Deployment in deploy/k8s: attnd's pods keep caches on their own volumes (StatefulSet)"
    return sets[0]


def the_container():
    containers = the_workload()["spec"]["template"]["spec"]["containers"]
    attnd = [c for c in containers if c.get("name") == "attnd"]
    assert len(attnd) == 1, "no container named attnd in the StatefulSet"
    return attnd[0]


def container_argv(container):
    return list(container.get("command") or []) + [str(a) for a in container.get("args") or []]


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@check
def k8s_files_parse_and_are_listed():
    docs = k8s_docs()
    expected = {"statefulset.yaml", "service.yaml", "service-headless.yaml", "pdb.yaml",
                "kustomization.yaml"}
    assert expected <= set(docs), f"deploy/k8s lacks {sorted(expected - set(docs))}"
    for f, d in docs.items():
        assert d, f"{f} holds no document"
        for doc in d:
            assert isinstance(doc, dict) and doc.get("kind") and doc.get("apiVersion"), \
                f"{f}: a document without kind/apiVersion"
    kustomization = docs["kustomization.yaml"][0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization.get("resources") or [])
    assert listed == set(docs) - {"kustomization.yaml"}, \
        f"kustomization resources {sorted(listed)} != the files {sorted(set(docs))}"
    image = the_container()["image"].split(":")[0]
    assert any(i.get("name") == image for i in kustomization.get("images") or []), \
        f"kustomization.yaml does not set the image {image}"


@check
def k8s_workload_gpu_limit():
    resources = the_container().get("resources") or {}
    limit = (resources.get("limits") or {}).get(GPU)
    request = (resources.get("requests") or {}).get(GPU)
    assert str(limit) == "1", f"limits {GPU} is {limit!r}, want 1"
    assert request is None or str(request) == "1", f"requests {GPU} is {request!r}, want 1"
    assert (resources.get("requests") or {}).get("memory") and \
        (resources.get("limits") or {}).get("memory"), "no memory request and limit"


@check
def k8s_workload_ports_and_grpc_probes():
    container = the_container()
    grpc_port, http_port = attnd_ports(container_argv(container), "statefulset.yaml")
    assert (grpc_port, http_port) == docker_ports(), \
        f"the StatefulSet listens on {grpc_port}/{http_port}, the image on {docker_ports()}"
    ports = {p["containerPort"] for p in container.get("ports") or []}
    assert {grpc_port, http_port} <= ports, f"containerPorts {sorted(ports)}"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        spec = container.get(probe)
        assert spec, f"no {probe}"
        grpc = spec.get("grpc")
        assert grpc and grpc.get("port") == grpc_port, \
            f"{probe} is not a gRPC probe on port {grpc_port}: {spec}"
        assert grpc.get("service", "") == "", f"{probe} asks service {grpc.get('service')!r}; " \
                                              "attnd reports its status for the empty service"


@check
def k8s_workload_non_root():
    pod = the_workload()["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext") or {}
    sc = the_container().get("securityContext") or {}
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, "runAsNonRoot is not true"
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    assert uid is None or uid != 0, "runAsUser is 0"
    image_user = [a for i, a in stages()[-1]["lines"] if i == "USER"][-1].split(":")[0]
    assert uid is None or str(uid) == image_user, f"runAsUser {uid}, image USER {image_user}"
    assert sc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem is not true"
    assert sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation is not false"


@check
def k8s_token_from_secret_file():
    container = the_container()
    path = flag(container_argv(container), "--auth-token-file")
    assert path, "the StatefulSet does not pass --auth-token-file"
    volumes = {v["name"]: v for v in the_workload()["spec"]["template"]["spec"]["volumes"]}
    found = False
    for mount in container.get("volumeMounts") or []:
        secret = (volumes.get(mount["name"]) or {}).get("secret")
        if not secret:
            continue
        base = mount["mountPath"].rstrip("/")
        if mount.get("subPath"):
            files = {base}
        elif secret.get("items"):
            files = {f"{base}/{item['path']}" for item in secret["items"]}
        else:
            files = {f"{base}/token"}  # Keys become files; the README's key is "token".
        if path in files:
            found = True
            assert mount.get("readOnly") is True, "the token volume is not mounted readOnly"
            assert secret.get("secretName"), "the token volume names no Secret"
    assert found, f"--auth-token-file {path} is not a file of a mounted Secret volume"


@check
def k8s_cache_dir_on_a_volume_per_replica():
    workload = the_workload()
    container = the_container()
    pod = workload["spec"]["template"]["spec"]
    path = flag(container_argv(container), "--cache-dir")
    assert path == CACHE_DIR, f"--cache-dir is {path!r}, not {CACHE_DIR} (the image's directory)"
    claims = {c["metadata"]["name"]: c for c in workload["spec"].get("volumeClaimTemplates") or []}
    mounts = [m for m in container.get("volumeMounts") or [] if m["mountPath"] == path]
    assert len(mounts) == 1, f"{len(mounts)} volumes mounted at --cache-dir {path}"
    mount = mounts[0]
    assert not mount.get("readOnly") and not mount.get("subPath"), \
        f"the volume at {path} is mounted readOnly or as a subPath"
    assert mount["name"] in claims, (
        f"{path} is the volume {mount['name']!r}, not a claim of volumeClaimTemplates "
        f"({sorted(claims)}): the caches would not outlive the pod")
    assert mount["name"] not in {v["name"] for v in pod.get("volumes") or []}, \
        f"a pod volume named {mount['name']} shadows the claim"
    claim = claims[mount["name"]]["spec"]
    assert claim.get("accessModes") == ["ReadWriteOnce"], \
        f"the cache claim's accessModes are {claim.get('accessModes')}; one pod writes it"
    assert ((claim.get("resources") or {}).get("requests") or {}).get("storage"), \
        "the cache claim requests no storage"
    security = pod.get("securityContext") or {}
    image_user = [a for i, a in stages()[-1]["lines"] if i == "USER"][-1].partition(":")
    group = image_user[2] or image_user[0]
    assert str(security.get("fsGroup")) == group, \
        f"fsGroup {security.get('fsGroup')}: the volume must be writable by the image's group " \
        f"{group}"
    headless = [svc["metadata"]["name"] for svc in k8s_objects("Service")
                if svc["spec"].get("clusterIP") == "None"]
    assert workload["spec"].get("serviceName") in headless, \
        f"serviceName {workload['spec'].get('serviceName')!r} is not a headless Service"


@check
def k8s_grace_covers_drain_hand_over_and_flush():
    argv = container_argv(the_container())
    grace = shutdown_grace(argv)
    pod_grace = the_workload()["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    want = grace + HAND_OVER_SECONDS + FLUSH_SECONDS
    assert pod_grace >= want, (
        f"terminationGracePeriodSeconds {pod_grace}: after --shutdown-grace {grace} s the "
        f"hand-over (--drain-to) and the flush need room, at least {want} s in all")


@check
def k8s_drain_to_offered_commented_out():
    """--drain-to as a commented pair of list items in the attnd container's args (uncommented
    ones are checked by attnd_ports with the other arguments)."""
    text = read("deploy/k8s/statefulset.yaml")
    m = re.search(r"^\s*#\s*- --drain-to\s*\n\s*#\s*- (\S+)\s*$", text, re.M)
    assert m, "statefulset.yaml offers no commented `# - --drain-to` / `# - HOST:PORT`"
    host, _ = host_port(m.group(1))
    headless = [svc["metadata"]["name"] for svc in k8s_objects("Service")
                if svc["spec"].get("clusterIP") == "None"]
    assert any(host == f"{the_workload()['metadata']['name']}-0.{h}" or
               host.startswith(f"{the_workload()['metadata']['name']}-0.{h}.") for h in headless), \
        f"--drain-to {m.group(1)}: name pod 0 through the headless Service (the one that stays)"


@check
def k8s_services_and_pdb_select_the_pods():
    labels = the_workload()["spec"]["template"]["metadata"]["labels"]
    assert selects(the_workload()["spec"]["selector"]["matchLabels"], labels)
    grpc_port = docker_ports()[0]
    container_ports = {p.get("name"): p["containerPort"] for p in the_container()["ports"]}
    services = {s["metadata"]["name"]: s for s in k8s_objects("Service")}
    assert "attnd" in services and "attnd-headless" in services, \
        f"Services {sorted(services)}; want attnd and attnd-headless"
    assert services["attnd"]["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert services["attnd-headless"]["spec"].get("clusterIP") == "None", \
        "attnd-headless is not headless (clusterIP: None)"
    for name, svc in services.items():
        assert selects(svc["spec"]["selector"], labels), f"Service {name} selects no attnd pod"
        targets = set()
        for p in svc["spec"]["ports"]:
            t = p.get("targetPort", p["port"])
            targets.add(container_ports.get(t, t))
        assert grpc_port in targets, f"Service {name} does not reach port {grpc_port}"
    pdbs = k8s_objects("PodDisruptionBudget")
    assert len(pdbs) == 1 and selects(pdbs[0]["spec"]["selector"]["matchLabels"], labels), \
        "no PodDisruptionBudget selecting the attnd pods"


# --- deploy/compose.yaml ----------------------------------------------------------------------

@check
def compose_gpu_ports_and_token():
    compose = yaml.safe_load(read("deploy/compose.yaml"))
    service = compose["services"]["attnd"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
               for d in devices), "no NVIDIA GPU reservation"
    argv = [str(a) for a in service.get("command") or []]
    grpc_port, http_port = attnd_ports(argv, "compose.yaml")
    assert (grpc_port, http_port) == docker_ports(), "compose ports differ from the image's"
    published = {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports") or []}
    assert {grpc_port, http_port} <= published, f"compose publishes {sorted(published)}"
    path = flag(argv, "--auth-token-file")
    secrets = {}
    for s in service.get("secrets") or []:
        if isinstance(s, str):
            secrets[s] = f"/run/secrets/{s}"
        else:
            target = s.get("target", s["source"])
            secrets[s["source"]] = target if target.startswith("/") else f"/run/secrets/{target}"
    assert path in secrets.values(), f"--auth-token-file {path} is not a compose secret"
    user = str(service.get("user", "")).split(":")[0]
    assert user and user not in ("0", "root"), f"compose user {user!r}"


def seconds(duration):
    """Compose's duration ("45s", "1m30s", "90") in seconds."""
    text = str(duration)
    if text.isdigit():
        return int(text)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, f"not a duration: {duration!r}"
    h, m, s_ = (int(g or 0) for g in parts.groups())
    return 3600 * h + 60 * m + s_


@check
def compose_cache_dir_on_a_named_volume():
    compose = yaml.safe_load(read("deploy/compose.yaml"))
    named = compose.get("volumes") or {}
    for name, service in compose["services"].items():
        argv = [str(a) for a in service.get("command") or []]
        path = flag(argv, "--cache-dir")
        assert path == CACHE_DIR, \
            f"{name}: --cache-dir is {path!r}, not {CACHE_DIR} (the image's directory)"
        mounted = []
        for volume in service.get("volumes") or []:
            if isinstance(volume, str):
                source, _, rest = volume.partition(":")
                target, _, mode = rest.partition(":")
                volume = {"type": "volume", "source": source, "target": target,
                          "read_only": "ro" in mode.split(",")}
            if volume.get("target") == path:
                mounted.append(volume)
        assert len(mounted) == 1, f"{name}: {len(mounted)} volumes mounted at --cache-dir {path}"
        volume = mounted[0]
        assert volume.get("type", "volume") == "volume" and volume.get("source") in named, (
            f"{name}: {path} is {volume.get('source')!r}, not a named volume of the file's "
            f"volumes ({sorted(named)}); a new named volume takes the image directory's owner")
        assert not volume.get("read_only"), f"{name}: the cache volume is read-only"
        grace = shutdown_grace(argv)
        stop = seconds(service.get("stop_grace_period", "10s"))
        assert stop >= grace + FLUSH_SECONDS, (
            f"{name}: stop_grace_period {stop} s: after --shutdown-grace {grace} s the flush "
            f"needs room, at least {grace + FLUSH_SECONDS} s")


@check
def compose_cpu_service_is_the_gpu_one_without_the_gpu():
    services = yaml.safe_load(read("deploy/compose.yaml"))["services"]
    assert "attnd-cpu" in services, "no attnd-cpu service (tests/image_test.sh brings it up)"
    gpu, cpu = services["attnd"], services["attnd-cpu"]
    assert not (cpu.get("deploy") or {}).get("resources"), "attnd-cpu reserves resources"
    assert cpu.get("profiles"), "attnd-cpu has no profile: a plain `up` would start both"
    args = (cpu.get("build") or {}).get("args") or {}
    assert str(args.get("ATTN_CUDA")) == "OFF", \
        f"attnd-cpu builds with ATTN_CUDA={args.get('ATTN_CUDA')}, not OFF"
    assert args.get("BASE_BUILD") and args.get("BASE_BUILD") == args.get("BASE_RUNTIME"), \
        "attnd-cpu does not build both stages on one base"
    assert cpu.get("image") and cpu.get("image") != gpu.get("image"), \
        "attnd-cpu and attnd would tag the same image"
    for key in ("command", "ports", "secrets", "volumes", "user", "read_only", "tmpfs",
                "security_opt", "cap_drop", "stop_grace_period"):
        assert cpu.get(key) == gpu.get(key), f"attnd-cpu's {key} differs from attnd's"


# --- attnd commands in comments -------------------------------------------------------------

def commented_attnd_commands(rel):
    """[argv] of each `attnd ...` command in the comments of file `rel`, continuation lines
    (ending in a backslash) joined."""
    commands, pending = [], None
    for line in read(rel).splitlines():
        text = line.strip()
        if not text.startswith("#"):
            pending = None
            continue
        text = text.lstrip("#").strip()
        if pending is None:
            m = re.match(r"(?:\$ )?attnd(\s.*)$", text)
            if not m:
                continue
            text = m.group(1)
            pending = []
        continued = text.endswith("\\")
        pending.append(text.rstrip("\\"))
        if not continued:
            commands.append(shlex.split(" ".join(pending)))
            pending = None
    return commands


@check
def commented_attnd_commands_follow_the_listen_rules():
    files = ["Dockerfile", "deploy/compose.yaml"] + sorted(
        f"deploy/k8s/{f}" for f in os.listdir(os.path.join(ROOT, "deploy", "k8s")))
    found = 0
    for rel in files:
        for argv in commented_attnd_commands(rel):
            if flag(argv, "--listen") is None or flag(argv, "--http-listen") is None:
                continue
            found += 1
            attnd_ports(argv, f"{rel} (a command in a comment: {' '.join(argv)})")
    assert found, "no commented attnd command with --listen and --http-listen found"


# --- yamllint ---------------------------------------------------------------------------------

@check
def yamllint_clean():
    r = subprocess.run(["yamllint", "--strict", "-f", "parsable", "-c",
                        os.path.join(ROOT, "deploy", ".yamllint"), os.path.join(ROOT, "deploy")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), \
        f"yamllint exit {r.returncode}:\n{r.stdout}{r.stderr}"


failed = 0
for name, error in results:
    print(f"{'ok  ' if error is None else 'FAIL'} {name}" + ("" if error is None else f": {error}"))
    failed += error is not None
print(f"deploy_static: {len(results) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
