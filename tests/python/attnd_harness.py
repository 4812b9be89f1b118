"""Shared support for every Python test in tests/python: each starts its own attnd.

What it gives: `parse_args` (the --attnd and --stubs arguments every test takes, as
tests/CMakeLists.txt passes them, plus the test's own; it puts the generated stubs and the Python
client on sys.path), `AttndProcess` (attnd on a free loopback port, read back from its startup
line, with the HTTP side port off when the binary has one), `ServerCase` (a unittest class with
its own attnd and a Python Client to it), tensor encoding and decoding for the
three dtypes, a float64 reference, a grpc.health.v1 check without generated health stubs, and the
output tolerances the tests share. The generated modules are imported lazily (`pb()`,
`pb_grpc()`), so a test imports them only after `parse_args`.

A test's preamble:

    import attnd_harness as h  # tests/python is sys.path[0] for a script run from anywhere.
    ARGS = h.parse_args(__doc__, unittest=True)  # unittest.main(argv=ARGS.unittest_argv)

Needs the Debian python3-grpcio and python3-numpy, i.e. /usr/bin/python3.
"""

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(doc, add_arguments=None, unittest=False):
    """The test's arguments: --attnd and --stubs (defaults: the release preset's build), then
    what `add_arguments(parser)` adds. With unittest=True the arguments it does not know are left
    for unittest.main, in `args.unittest_argv` (the program name first). Puts the stubs and the
    Python client on sys.path (add_stubs_path)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0],
                                     add_help=not unittest)
    parser.add_argument("--attnd", default=os.path.join(REPO_ROOT, "build", "release", "attnd"))
    parser.add_argument("--stubs", default=os.path.join(REPO_ROOT, "build", "release", "python"))
    if add_arguments is not None:
        add_arguments(parser)
    if unittest:
        args, rest = parser.parse_known_args()
        args.unittest_argv = [sys.argv[0]] + rest
    else:
        args = parser.parse_args()
    add_stubs_path(args.stubs)
    return args


def add_stubs_path(stubs_dir):
    """Makes `from attention.v1 import attention_pb2` find the stubs the build generated, and
    `import attn_client` the Python client (client/python)."""
    sys.path.insert(0, os.path.abspath(stubs_dir))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))


def seed_problem():
    """The explainer's 8×4 example: float32 q, k, v, rank 2, scale 1/2 (the Python client's)."""
    import attn_client  # noqa: E402 (needs add_stubs_path first)
    return attn_client.seed_example()


import grpc  # noqa: E402
import numpy as np  # noqa: E402

STARTUP_TIMEOUT_S = 20.0
STARTUP_LINE = re.compile(r"^attnd .* serving attention\.v1 on (\S+) \(port (\d+)\)")


def pb():
    """The generated attention_pb2 module (imported lazily, once the stubs path is set)."""
    from attention.v1 import attention_pb2
    return attention_pb2


def pb_grpc():
    from attention.v1 import attention_pb2_grpc
    return attention_pb2_grpc


# --- The server ---------------------------------------------------------------------------------

def attnd_flags(binary):
    """The flag names `binary --help` lists (with dashes), e.g. {"max-inflight", ...}."""
    try:
        text = subprocess.run([binary, "--helpfull"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=20,
                              check=False).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {name.replace("_", "-") for name in re.findall(r"^\s+--([a-z0-9_]+)", text, re.M)}


class AttndProcess:
    """attnd on 127.0.0.1:0 with `extra_args`; stdout drained by a thread, stderr to a file.

    The HTTP side port (--http-listen, default 127.0.0.1:8080) is disabled when the binary has
    the flag, so tests running in parallel never clash on it.
    """

    def __init__(self, binary, extra_args=()):
        if not os.access(binary, os.X_OK):
            raise RuntimeError("attnd binary not found or not executable: %s" % binary)
        args = [binary, "--listen", "127.0.0.1:0"]
        if "http-listen" in attnd_flags(binary):
            args.append("--http-listen=")
        args += list(extra_args)
        self.args = args
        self.stderr_file = tempfile.TemporaryFile(mode="w+b")
        self.stdout_lines = []
        self.port = None
        self._ready = threading.Event()
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=self.stderr_file)
        self.pid = self.process.pid
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready.wait(0.05):
            if self.process.poll() is not None:
                self._reader.join(1.0)
                if self.port is not None:
                    break
                message = ("attnd exited with status %d before listening (%s)\nstdout:\n%s\n"
                           "stderr:\n%s" % (self.process.returncode, " ".join(args),
                                            "".join(self.stdout_lines), self.stderr()))
                self.close()
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                self.stop()
                message = ("attnd printed no startup line within %.0f s\nstdout:\n%s\n"
                           "stderr:\n%s" % (STARTUP_TIMEOUT_S, "".join(self.stdout_lines),
                                            self.stderr()))
                self.close()
                raise RuntimeError(message)
        self.address = "127.0.0.1:%d" % self.port

    def _read_stdout(self):
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.stdout_lines.append(line)
            match = STARTUP_LINE.match(line)
            if match and self.port is None:
                self.port = int(match.group(2))
                self._ready.set()
        self.process.stdout.close()

    def alive(self):
        return self.process.poll() is None

    def rss_kib(self):
        """attnd's resident set (VmRSS) in KiB, or None once it has exited."""
        try:
            with open("/proc/%d/status" % self.pid) as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def stderr(self):
        self.stderr_file.flush()
        self.stderr_file.seek(0)
        return self.stderr_file.read().decode("utf-8", "replace")

    def stop(self):
        """Kills attnd (idempotent); stderr() stays readable until close()."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self):
        self.stop()
        self.stderr_file.close()


class CodeAssertions:
    """assertCode for a unittest class: the call raises an AttnError of that code, and its
    message is returned."""

    def assertCode(self, code, call, *args, **kwargs):
        from attn_client import AttnError
        with self.assertRaises(AttnError) as raised:
            call(*args, **kwargs)
        self.assertEqual(raised.exception.code, code, raised.exception.message)
        return raised.exception.message


class ServerCase(CodeAssertions, unittest.TestCase):
    """A unittest class with its own attnd (`attnd`: the binary, which the test module sets;
    `server_args` after --threads `server_threads`) and an attn_client.Client to it with
    `rpc_timeout`; attnd's stderr is printed when a test of the class failed; assertCode
    (CodeAssertions)."""

    attnd = None
    server_args = ()
    server_threads = 2
    rpc_timeout = 60.0
    server = None
    client = None
    _failed = False

    @classmethod
    def setUpClass(cls):
        from attn_client import Client  # On sys.path once parse_args ran.
        cls._failed = False
        cls.server = AttndProcess(cls.attnd,
                                  ("--threads", str(cls.server_threads)) + tuple(cls.server_args))
        cls.client = Client(cls.server.address, timeout=cls.rpc_timeout)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        if cls._failed:
            sys.stderr.write("\n--- attnd stderr (%s) ---\n%s--- end attnd stderr ---\n"
                             % (cls.__name__, cls.server.stderr()))
        cls.server.close()

    def run(self, result=None):
        before = len(result.failures) + len(result.errors) if result is not None else 0
        result = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            type(self)._failed = True
        return result


def open_channel(address, max_message_bytes=256 * 1024 * 1024, own_connection=False,
                 fixed_window=False):
    """An insecure channel to `address`, ready. `own_connection`: its own TCP connection rather
    than one shared with other channels of the same target and arguments (gRPC's global
    subchannel pool would otherwise share it). `fixed_window`: no bandwidth-delay probing, so a
    stream nobody reads keeps HTTP/2's default 64 KiB window instead of one that grows (to MBs)
    whenever other traffic on the connection flows."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if fixed_window:
        options.append(("grpc.http2.bdp_probe", 0))
    channel = grpc.insecure_channel(address, options=options)
    grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
    return channel


def health_status(channel, service="", timeout=10.0):
    """grpc.health.v1.Health/Check → the status number (1 = SERVING), with hand-encoded
    messages: HealthCheckRequest{string service = 1}, HealthCheckResponse{enum status = 1}."""
    encoded = service.encode()
    request = (b"\x0a" + bytes([len(encoded)]) + encoded) if encoded else b""
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda raw: raw,
                                response_deserializer=lambda raw: raw)
    response = check(request, timeout=timeout)
    if response == b"":
        return 0  # UNKNOWN, the default, is not sent.
    if len(response) != 2 or response[0] != 0x08:
        raise AssertionError("unexpected HealthCheckResponse bytes %r" % response)
    return response[1]


HEALTH_SERVING = 1


# --- Tensors ------------------------------------------------------------------------------------

DTYPE_NAMES = {1: "fp32", 2: "fp16", 3: "bf16"}  # attention.v1 DType numbers.
DTYPE_NUMBER = {name: number for number, name in DTYPE_NAMES.items()}
ELEMENT_BYTES = {1: 4, 2: 2, 3: 2}

# Row 0 of the seed's example (seed_problem) as the explainer prints it.
SEED_OUT_ROW0 = [-0.593223, 0.406777, -1.332858, -0.371937]


def as4(x):
    """A rank 2–4 array as rank 4, in float64 (for the reference)."""
    x = np.asarray(x, dtype=np.float64)
    while x.ndim < 4:
        x = x[None]
    return x


def round_to_bf16_bits(array):
    """fp32 → bf16 bit patterns (uint16), round to nearest even on the uint32 view."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def bf16_bits_to_fp32(bits):
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def encode(array, dtype):
    """(Tensor, the float64 values the server will see) for a float array stored as `dtype`."""
    p = pb()
    array = np.asarray(array, dtype=np.float32)
    if dtype == p.DTYPE_FLOAT32:
        stored = np.ascontiguousarray(array, dtype="<f4")
        seen = stored
    elif dtype == p.DTYPE_FLOAT16:
        stored = np.ascontiguousarray(array, dtype="<f2")
        seen = stored
    elif dtype == p.DTYPE_BFLOAT16:
        stored = round_to_bf16_bits(array)
        seen = bf16_bits_to_fp32(stored)
    else:
        raise ValueError("dtype %r" % dtype)
    tensor = p.Tensor(shape=list(array.shape), dtype=dtype, data=stored.tobytes())
    return tensor, np.asarray(seen, dtype=np.float64).reshape(array.shape)


def decode(tensor):
    """A response Tensor as a numpy float64 array of its shape."""
    p = pb()
    shape = tuple(tensor.shape)
    if tensor.dtype == p.DTYPE_FLOAT32:
        values = np.frombuffer(tensor.data, dtype="<f4")
    elif tensor.dtype == p.DTYPE_BFLOAT16:
        values = bf16_bits_to_fp32(np.frombuffer(tensor.data, dtype="<u2"))
    elif tensor.dtype == p.DTYPE_FLOAT16:
        values = np.frombuffer(tensor.data, dtype="<f2")
    else:
        raise AssertionError("unexpected dtype %d" % tensor.dtype)
    if values.size != int(np.prod(shape)):
        raise AssertionError("tensor data has %d elements, shape %s" % (values.size, shape))
    return values.astype(np.float64).reshape(shape)


# --- Reference and tolerances -------------------------------------------------------------------

def reference_attention(q, k, v, scale=None, causal=False):
    """float64 attention over [B, H, Nq, d] / [B, Hkv, Nk, d] / [B, Hkv, Nk, dv] →
    (out, lse, score_max): score_max is max |scale · q·k| over the visible pairs (it sets the fp32
    tolerance, see output_error). Rows that see no key give zeros and lse −inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    _, heads, query_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    v = np.repeat(v, group, axis=1)
    scores = scale * np.matmul(q, np.swapaxes(k, -1, -2))
    if causal:
        rows = np.arange(query_len)[:, None]
        cols = np.arange(key_len)[None, :]
        scores = np.where(cols <= rows + key_len - query_len, scores, -np.inf)
    finite = np.isfinite(scores)
    score_max = float(np.max(np.abs(scores[finite]))) if finite.any() else 0.0
    row_max = scores.max(axis=-1, keepdims=True)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - safe_max)
    denominator = weights.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(denominator > 0, np.matmul(weights, v) / denominator, 0.0)
        lse = np.where(denominator[..., 0] > 0,
                       np.log(denominator[..., 0]) + safe_max[..., 0], -np.inf)
    return out, lse, score_max


FP32_RTOL = 1e-5  # DESIGN.md: fp32 relative error (max |out − ref| / max |ref|) ≤ 1e-5.
# Scores up to this size get the flat fp32 rule; past it the rule scales with the largest score.
SCORE_SCALE_FREE = 8.0
# One output ulp relative to the element (half an ulp for round-to-nearest-even of an exact
# value, doubled for the fp32 accumulation error that can move it across a rounding boundary).
OUTPUT_ULP = {1: 2.0 ** -23, 2: 2.0 ** -10, 3: 2.0 ** -7}


def fp32_rtol(score_max=0.0):
    """The fp32 relative tolerance: 1e-5 (DESIGN.md, tests/checks.cc) while every |score| ≤ 8,
    which covers every default-scale problem with inputs in [-1, 1] and head_dim ≤ 64
    (|q·k|/sqrt(d) ≤ sqrt(d)); beyond that 1e-5 · score_max / 8. Why: fp32 rounds a score s to
    within a few ulps, an absolute error ∝ |s|, and an absolute error δ in a score is a relative
    error δ in its softmax weight, so the output's relative error grows with the largest score
    (observed: 1.03e-5 at inputs in [-3, 3], head_dim 60, where scores reach ~20)."""
    return FP32_RTOL * max(1.0, score_max / SCORE_SCALE_FREE)


def output_error_ratio(out, ref, output_dtype, score_max=0.0, magnitude=None):
    """max over elements of |out − ref| / bound (≤ 1 passes; inf for NaN or a shape mismatch).
    `magnitude` replaces max |ref| when `ref` is part of a larger output (a traced row).

    fp32 output: bound = fp32_rtol(score_max) · max |ref|. f16/bf16 output: the kernel
    accumulates in fp32 and rounds once on store, so an element may miss by one output ulp of
    itself plus the fp32 budget: bound = ulp·|ref| + fp32_rtol · max |ref| + 1e-7 (the last for
    f16 subnormals). That is tighter than test_service.py's bf16 2e-2 absolute and
    kernels_test's twice-the-same-precision-baseline rule on these input ranges.
    """
    if out.shape != ref.shape or np.isnan(out).any():
        return math.inf
    if out.size == 0:
        return 0.0
    if magnitude is None:
        magnitude = float(np.max(np.abs(ref)))
    rtol = fp32_rtol(score_max)
    miss = np.abs(out - ref)
    if output_dtype == 1:
        bound = rtol * magnitude if magnitude > 0 else 1e-30
        return float(miss.max()) / bound
    bound = OUTPUT_ULP[output_dtype] * np.abs(ref) + rtol * magnitude + 1e-7
    return float(np.max(miss / bound))


def output_error(out, ref, output_dtype, score_max=0.0, magnitude=None):
    """'' when `out` (decoded, float64) matches the float64 `ref` for an output stored as
    `output_dtype` (output_error_ratio ≤ 1), else a description of the worst miss."""
    ratio = output_error_ratio(out, ref, output_dtype, score_max, magnitude)
    if ratio <= 1.0:
        return ""
    if out.shape != ref.shape:
        return "shape %s, expected %s" % (out.shape, ref.shape)
    if np.isnan(out).any():
        return "NaN in output"
    miss = np.abs(out - ref)
    index = np.unravel_index(int(np.argmax(miss)), miss.shape)
    return ("%s output misses by %.3g × its bound (max |score| %.3g, max |ref| %.3g; worst "
            "element %s = %.8g, reference %.8g)"
            % (DTYPE_NAMES[output_dtype], ratio, score_max,
               magnitude if magnitude is not None else float(np.max(np.abs(ref))),
               tuple(int(i) for i in index), out[index], ref[index]))


def lse_error(lse, ref_lse):
    """'' when lse is within 1e-5 · max(1, |ref|) and exactly −inf where the reference is."""
    if lse.shape != ref_lse.shape:
        return "lse shape %s, expected %s" % (lse.shape, ref_lse.shape)
    hidden = np.isneginf(ref_lse)
    if not np.array_equal(np.isneginf(lse), hidden):
        return "lse −inf pattern differs from the reference"
    seen = ~hidden
    if np.isnan(lse).any():
        return "NaN in lse"
    miss = np.abs(lse[seen] - ref_lse[seen])
    bound = FP32_RTOL * np.maximum(1.0, np.abs(ref_lse[seen]))
    if (miss > bound).any():
        return "lse max miss %.3g over its bound" % float(np.max(miss - bound))
    return ""
