#!/usr/bin/python3
"""Malformed and hostile requests against attnd: a table of cases, each with its status code.

Starts its own attnd on a free loopback port with small limits (1 MiB messages, a 1 MiB Naive
budget, 4 trace rows, 100 trace steps), sends every case of the table below and checks the gRPC
status code and that the message names the offending field (substrings taken from
server/request.cc's wording). Cases expected to succeed (boundary values the contract allows)
are checked against a float64 numpy reference. Afterwards the server must still answer
grpc.health.v1 Check with SERVING and still compute a correct answer. Prints one line per case.

  /usr/bin/python3 tests/python/hostile_test.py --attnd <attnd> --stubs <generated stubs dir>

Exit status 0 when every case passed. Needs python3-grpcio and python3-numpy (Debian).
"""

import struct
import sys



import attnd_harness as h  # noqa: E402 (tests/python is sys.path[0] for a script)


def add_arguments(parser):
    parser.add_argument("--verbose", action="store_true", help="print each status message too")


ARGS = h.parse_args(__doc__, add_arguments)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

# The server's limits for this test; the cases are sized against them.
MAX_MESSAGE_BYTES = 1 << 20
MAX_NAIVE_BYTES = 1 << 20
MAX_TRACE_ROWS = 4
MAX_TRACE_STEPS = 100
RPC_TIMEOUT_S = 30.0

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED

F32, F16, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16
ELEMENT_BYTES = h.ELEMENT_BYTES  # By attention.v1 DType number.
DTYPE_WORD = {F32: "f32", F16: "f16", BF16: "bf16"}  # kernels/dtype.h DTypeName
RNG = np.random.default_rng(20240605)


# --- Valid problems and their mutations ---------------------------------------------------------

class Problem:
    """A valid request plus the float64 values the server sees, to mutate or to check against."""

    def __init__(self, q_shape=(2, 4, 9, 8), k_shape=(2, 2, 11, 8), v_shape=(2, 2, 11, 5),
                 dtype=F32, **options):
        self.arrays = {}
        self.seen = {}
        self.request = pb.AttentionRequest(options=pb.AttentionOptions(**options))
        for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
            array = RNG.uniform(-1, 1, size=shape).astype(np.float32)
            tensor, seen = h.encode(array, dtype)
            getattr(self.request, name).CopyFrom(tensor)
            self.seen[name] = seen

    def reference(self):
        def as4(x):
            return x.reshape((1,) * (4 - x.ndim) + x.shape)
        options = self.request.options
        scale = options.scale if options.HasField("scale") else None
        out, lse, self.score_max = h.reference_attention(
            as4(self.seen["query"]), as4(self.seen["key"]), as4(self.seen["value"]), scale=scale,
            causal=options.causal)
        q_shape = tuple(self.request.query.shape)
        return out.reshape(q_shape[:-1] + (out.shape[-1],)), lse.reshape(q_shape[:-1])


def base(**options):
    return Problem(**options).request


def mutated(mutate, problem=None):
    """A valid request after `mutate(request)`."""
    request = (problem or Problem()).request
    mutate(request)
    return request


def with_shape(name, shape, data_bytes=None, dtype=F32):
    """The base request with tensor `name` replaced by `shape` (data zero-filled to match, or
    `data_bytes` long)."""
    def mutate(request):
        tensor = getattr(request, name)
        del tensor.shape[:]
        tensor.shape.extend(shape)
        tensor.dtype = dtype
        count = int(np.prod(shape, dtype=object)) if shape else 0
        length = data_bytes if data_bytes is not None else max(count, 0) * ELEMENT_BYTES[dtype]
        tensor.data = np.full(length, 0x3C, dtype=np.uint8).tobytes()  # finite in every dtype
    return mutated(mutate)


def all_dtype(dtype):
    return Problem(dtype=dtype)


def off_by_one(name, dtype, delta):
    """Tensor `name`'s data one byte short (delta −1) or long (+1), all tensors in `dtype`."""
    problem = all_dtype(dtype)
    tensor = getattr(problem.request, name)
    needed = len(tensor.data)
    tensor.data = tensor.data[:-1] if delta < 0 else tensor.data + b"\x00"
    shape = "[" + ", ".join(str(d) for d in tensor.shape) + "]"
    return problem.request, ["%s.data" % name, "has %d bytes" % (needed + delta),
                             "shape %s of %s needs %d" % (shape, DTYPE_WORD[dtype], needed)]


def poisoned(name, dtype, bits, index=3):
    """Tensor `name` with element `index` replaced by the raw pattern `bits` (a NaN or inf)."""
    problem = all_dtype(dtype)
    tensor = getattr(problem.request, name)
    size = ELEMENT_BYTES[dtype]
    data = bytearray(tensor.data)
    data[index * size:(index + 1) * size] = bits.to_bytes(size, "little")
    tensor.data = bytes(data)
    return problem.request


def trace(attention, rows=()):
    return pb.TraceRequest(attention=attention,
                           rows=[pb.RowRef(batch=b, head=hd, row=r) for b, hd, r in rows])


# --- Checks for cases that succeed --------------------------------------------------------------

def check_response(problem, method):
    """A checker comparing an AttentionResponse with `problem`'s reference."""
    def check(response):
        out_ref, lse_ref = problem.reference()
        options = problem.request.options
        output_dtype = options.output_dtype or problem.request.query.dtype
        if response.output.dtype != output_dtype:
            return "output dtype %d, expected %d" % (response.output.dtype, output_dtype)
        problem_text = h.output_error(h.decode(response.output), out_ref, output_dtype,
                                      problem.score_max)
        if problem_text:
            return problem_text
        if options.return_lse:
            problem_text = h.lse_error(h.decode(response.lse), lse_ref)
            if problem_text:
                return problem_text
        if response.stats.backend != "cpu":
            return "stats.backend %r" % response.stats.backend
        return ""
    return check


def check_trace(problem, rows):
    """A checker for a Trace stream's events: start, steps and row_done per row, end; each
    row's output against the reference row."""
    def check(events):
        out_ref, _ = problem.reference()
        out_ref = out_ref.reshape((1,) * (4 - out_ref.ndim) + out_ref.shape)
        kinds = [event.WhichOneof("event") for event in events]
        if not kinds or kinds[0] != "start" or kinds[-1] != "end":
            return "events %s" % kinds[:6]
        done = [event.row_done for event in events if event.HasField("row_done")]
        if len(done) != len(rows) or events[-1].end.rows != len(rows):
            return "%d rows done, expected %d" % (len(done), len(rows))
        steps = sum(1 for kind in kinds if kind == "step")
        if events[-1].end.steps != steps:
            return "end.steps %d, %d step events" % (events[-1].end.steps, steps)
        for (batch, head, row), row_done in zip(rows, done):
            expected = out_ref[batch, head, row]
            error = h.output_error(np.array(row_done.output, dtype=np.float64), expected, F32,
                                   problem.score_max, float(np.max(np.abs(out_ref))))
            if error:
                return "row %s: %s" % ((batch, head, row), error)
        return ""
    return check


def check_server_info(info):
    expected = {"backend": "cpu", "max_message_bytes": MAX_MESSAGE_BYTES,
                "max_naive_bytes": MAX_NAIVE_BYTES, "max_trace_rows": MAX_TRACE_ROWS,
                "max_trace_steps": MAX_TRACE_STEPS, "max_inflight": 1, "max_queue": 8}
    for field, value in expected.items():
        if getattr(info, field) != value:
            return "%s = %r, expected %r" % (field, getattr(info, field), value)
    for field in ("version", "device"):
        if not getattr(info, field):
            return "%s is empty" % field
    if info.device_memory_bytes <= 0 or info.default_block_k <= 0:
        return "device_memory_bytes %d, default_block_k %d" % (info.device_memory_bytes,
                                                               info.default_block_k)
    if sorted(info.dtypes) != [F32, F16, BF16]:
        return "dtypes %s" % list(info.dtypes)
    return ""


# --- The table ----------------------------------------------------------------------------------

class Case:
    def __init__(self, name, method, request, code, mentions=(), check=None):
        self.name, self.method, self.request, self.code = name, method, request, code
        self.mentions = [mentions] if isinstance(mentions, str) else list(mentions)
        self.check = check


def cases():
    table = []

    def add(name, method, request, code, mentions=(), check=None):
        table.append(Case(name, method, request, code, mentions, check))

    def cleared(field):
        return mutated(lambda request: request.ClearField(field))

    # Missing tensors.
    add("missing query", "Naive", cleared("query"), INVALID, "query: is required")
    add("missing key", "Tiled", cleared("key"), INVALID, "key: is required")
    add("missing value", "Naive", cleared("value"), INVALID, "value: is required")
    add("empty request", "Tiled", pb.AttentionRequest(), INVALID, "query: is required")

    # Ranks.
    add("query rank 1", "Naive", with_shape("query", [8]), INVALID,
        ["query.shape", "has rank 1"])
    add("query rank 5", "Tiled", with_shape("query", [1, 2, 4, 9, 8]), INVALID,
        ["query.shape", "has rank 5"])
    add("key rank 0 (present, empty)", "Naive",
        mutated(lambda r: (r.ClearField("key"), r.key.SetInParent())), INVALID,
        ["key.shape", "has rank 0"])
    # (The message echoes the shape: at rank 100000 it is ~300 KB, over gRPC's 8 KiB metadata
    # limit, and the client sees RESOURCE_EXHAUSTED instead; rank 1000 keeps it under.)
    add("value rank 1000", "Naive", with_shape("value", [1] * 1000), INVALID,
        ["value.shape", "has rank 1000"])
    add("key rank 3, query rank 4", "Naive", with_shape("key", [2, 11, 8]), INVALID,
        ["key.shape/value.shape", "ranks are 3 and 4"])

    # Zero and negative dimensions.
    add("query.shape[0] = 0", "Naive", with_shape("query", [0, 4, 9, 8]), INVALID,
        ["query.shape[0]", "is 0"])
    add("key.shape[1] = -3", "Tiled", with_shape("key", [2, -3, 11, 8]), INVALID,
        ["key.shape[1]", "is -3"])
    add("value.shape[3] = 0", "Naive", with_shape("value", [2, 2, 11, 0]), INVALID,
        ["value.shape[3]", "is 0"])
    add("query.shape[2] = -2^63", "Naive", with_shape("query", [2, 4, -(1 << 63), 8]), INVALID,
        ["query.shape[2]", "is -9223372036854775808"])

    # Shape consistency.
    add("key batch 1 vs query 2", "Naive", with_shape("key", [1, 2, 11, 8]), INVALID,
        ["key.shape[0]", "batch is 1 but query's is 2"])
    add("value batch 3 vs query 2", "Tiled", with_shape("value", [3, 2, 11, 5]), INVALID,
        ["value.shape[0]", "batch is 3"])
    add("value heads 1 vs key 2", "Naive", with_shape("value", [2, 1, 11, 5]), INVALID,
        ["value.shape[1]", "heads is 1 but key's is 2"])
    add("kv_heads 3 does not divide heads 4", "Tiled",
        mutated(lambda r: None, Problem(k_shape=(2, 3, 11, 8), v_shape=(2, 3, 11, 5))),
        INVALID, ["key.shape[1]", "does not divide"])
    add("kv_heads 8 > heads 4", "Naive",
        mutated(lambda r: None, Problem(k_shape=(2, 8, 11, 8), v_shape=(2, 8, 11, 5))),
        INVALID, ["key.shape[1]", "has 8 heads"])
    add("value key_len 10 vs key 11", "Naive", with_shape("value", [2, 2, 10, 5]), INVALID,
        ["value.shape[2]", "key_len is 10 but key's is 11"])
    add("key head_dim 7 vs query 8", "Tiled", with_shape("key", [2, 2, 11, 7]), INVALID,
        ["key.shape[3]", "head_dim is 7 but query's is 8"])
    add("rank-2 head_dim mismatch", "Naive",
        mutated(lambda r: None, Problem((9, 8), (11, 6), (11, 5))), INVALID,
        ["key.shape[1]", "head_dim is 6"])

    # Dtypes.
    add("query dtype unspecified", "Naive",
        mutated(lambda r: setattr(r.query, "dtype", pb.DTYPE_UNSPECIFIED)), INVALID,
        ["query.dtype", "is unspecified"])
    add("key dtype 7 (unknown)", "Tiled", mutated(lambda r: setattr(r.key, "dtype", 7)),
        INVALID, ["key.dtype", "is 7, not a known DType"])
    add("value dtype -1 (unknown)", "Naive", mutated(lambda r: setattr(r.value, "dtype", -1)),
        INVALID, ["value.dtype", "is -1"])
    add("output_dtype 42 (unknown)", "Tiled",
        mutated(lambda r: setattr(r.options, "output_dtype", 42)), INVALID,
        ["options.output_dtype", "is 42"])

    # Data lengths one byte off, each tensor, each dtype, short and long.
    for name in ("query", "key", "value"):
        for dtype in (F32, F16, BF16):
            for delta, word in ((-1, "short"), (1, "long")):
                request, mentions = off_by_one(name, dtype, delta)
                method = "Naive" if delta < 0 else "Tiled"
                add("%s %s data 1 byte %s" % (name, DTYPE_WORD[dtype], word), method, request,
                    INVALID, mentions)
    add("query data empty", "Naive", mutated(lambda r: setattr(r.query, "data", b"")), INVALID,
        ["query.data", "has 0 bytes"])

    # Huge and overflowing shapes.
    add("query [2^62, 2^62]: elements overflow int64", "Naive",
        with_shape("query", [1 << 62, 1 << 62], data_bytes=64), INVALID,
        ["query.shape", "more elements than int64 can count"])
    add("key [2, 2, 2^61, 2^2]: elements overflow int64", "Tiled",
        with_shape("key", [2, 2, 1 << 61, 4], data_bytes=64), INVALID,
        ["key.shape", "more elements than int64 can count"])
    add("value [2^31, 2^31] f32: bytes overflow int64", "Naive",
        with_shape("value", [1 << 31, 1 << 31], data_bytes=64), INVALID,
        ["value.data", "needs more than int64 can count"])
    add("query [2^40, 8]: 32 TiB claimed, 64 B sent", "Tiled",
        with_shape("query", [1 << 40, 8], data_bytes=64), INVALID,
        ["query.data", "needs %d" % ((1 << 40) * 8 * 4)])

    # Non-finite elements (inputs must be finite).
    add("query f32 NaN element", "Naive", poisoned("query", F32, 0x7FC00000), INVALID,
        ["query.data", "element 3", "finite"])
    add("key f16 +inf element", "Tiled", poisoned("key", F16, 0x7C00), INVALID,
        ["key.data", "element 3", "finite"])
    add("value bf16 NaN element", "Naive", poisoned("value", BF16, 0x7FC1), INVALID,
        ["value.data", "element 3", "finite"])
    # Finite but so large that scores or weighted sums would pass fp32 (then inf - inf = NaN).
    big = struct.unpack("<I", struct.pack("<f", 3e38))[0]
    add("query f32 element 3e38: scores past fp32", "Tiled", poisoned("query", F32, big), INVALID,
        ["query.data/key.data", "past fp32's largest value"])
    add("value f32 element 3e38: sums past fp32", "Naive", poisoned("value", F32, big), INVALID,
        ["value.data", "past fp32's largest value"])

    # Options.
    add("scale NaN", "Naive", base(scale=float("nan")), INVALID, ["options.scale", "finite"])
    add("scale +inf", "Tiled", base(scale=float("inf")), INVALID, ["options.scale", "finite"])
    add("scale -inf", "Naive", base(scale=float("-inf")), INVALID, ["options.scale", "finite"])
    add("block_k -1", "Tiled", base(block_k=-1), INVALID, ["options.block_k", "is -1"])
    add("block_k -2^31", "Tiled", base(block_k=-(1 << 31)), INVALID,
        ["options.block_k", "is -2147483648"])

    # Boundary values the contract accepts: answered correctly.
    problem = Problem(block_k=(1 << 31) - 1, return_lse=True)
    add("block_k 2^31-1 (clamped to key_len)", "Tiled", problem.request, OK,
        check=check_response(problem, "Tiled"))
    problem = Problem(q_shape=(2, 4, 15, 8), causal=True, block_k=4, return_lse=True)
    add("causal, query_len 15 > key_len 11", "Tiled", problem.request, OK,
        check=check_response(problem, "Tiled"))
    problem = Problem(q_shape=(2, 4, 15, 8), causal=True, return_lse=True)
    add("causal, query_len 15 > key_len 11", "Naive", problem.request, OK,
        check=check_response(problem, "Naive"))
    problem = Problem(scale=0.0, output_dtype=BF16)
    add("scale 0, bf16 output of f32 inputs", "Naive", problem.request, OK,
        check=check_response(problem, "Naive"))

    # Memory and message limits.
    big = Problem((1, 1, 400, 4), (1, 1, 400, 4), (1, 1, 400, 4))
    add("Naive 400x400 over --max-naive-bytes", "Naive", big.request, EXHAUSTED,
        ["--max-naive-bytes=%d" % MAX_NAIVE_BYTES, "Tiled"])
    add("same problem via Tiled", "Tiled", big.request, OK, check=check_response(big, "Tiled"))
    huge = Problem((1, 1, 520, 512), (1, 1, 4, 512), (1, 1, 4, 4))  # query 1,064,960 bytes
    add("request over --max-message-bytes", "Naive", huge.request, EXHAUSTED,
        ["larger than max"])
    add("request over --max-message-bytes", "Trace", trace(huge.request), EXHAUSTED,
        ["larger than max"])
    # 2 KB of query and 4 KB of value ask for a 512 × 1024 f32 output, 2 MiB: over the limit,
    # refused before the output is allocated (issue 27), naming the field and the limit.
    amplified = Problem((1, 1, 512, 1), (1, 1, 1, 1), (1, 1, 1, 1024))
    for method in ("Tiled", "Naive"):
        add("response over --max-message-bytes", method, amplified.request, EXHAUSTED,
            ["query: ", "2097152 bytes", "--max-message-bytes=%d" % MAX_MESSAGE_BYTES])

    # Trace.
    add("trace without attention", "Trace", pb.TraceRequest(), INVALID, "attention: is required")
    add("trace of an invalid problem", "Trace", trace(cleared("query")), INVALID,
        "attention.query: is required")
    add("trace, key data 1 byte short", "Trace", trace(off_by_one("key", F16, -1)[0]), INVALID,
        "attention.key.data")
    add("trace row 9 of query_len 9", "Trace", trace(base(), [(0, 0, 9)]), INVALID,
        ["rows[0].row", "is 9; expected 0 ≤ row < 9"])
    add("trace head 4 of 4", "Trace", trace(base(), [(0, 0, 0), (1, 4, 0)]), INVALID,
        ["rows[1].head", "is 4"])
    add("trace batch -1", "Trace", trace(base(), [(-1, 0, 0)]), INVALID, ["rows[0].batch",
                                                                         "is -1"])
    add("trace batch 2^62", "Trace", trace(base(), [(1 << 62, 0, 0)]), INVALID,
        ["rows[0].batch", "is 4611686018427387904"])
    add("trace %d rows (max %d)" % (MAX_TRACE_ROWS + 1, MAX_TRACE_ROWS), "Trace",
        trace(base(), [(0, 0, i) for i in range(MAX_TRACE_ROWS + 1)]), INVALID,
        ["rows", "has %d entries" % (MAX_TRACE_ROWS + 1), "--max-trace-rows=%d" % MAX_TRACE_ROWS])
    add("trace 100000 rows", "Trace", trace(base(), [(0, 0, 0)] * 100000), INVALID,
        ["rows", "has 100000 entries"])
    long_keys = Problem((1, 1, 4, 8), (1, 1, 200, 8), (1, 1, 200, 8), block_k=1)
    add("trace 200 steps (max %d)" % MAX_TRACE_STEPS, "Trace", trace(long_keys.request), INVALID,
        ["rows", "200 steps", "--max-trace-steps=%d" % MAX_TRACE_STEPS])
    four_rows = Problem((1, 1, 4, 8), (1, 1, 200, 8), (1, 1, 200, 8), block_k=8)
    add("trace 4 rows x 25 tiles = 100 steps (at the limit)", "Trace",
        trace(four_rows.request, [(0, 0, i) for i in range(4)]), OK,
        check=check_trace(four_rows, [(0, 0, i) for i in range(4)]))
    rows = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    seven = Problem((1, 1, 4, 8), (1, 1, 200, 8), (1, 1, 200, 8), block_k=7)
    add("trace 4 rows x 29 tiles = 116 steps", "Trace", trace(seven.request, rows), INVALID,
        ["rows", "116 steps"])
    gqa = Problem(causal=True, block_k=3)
    gqa_rows = [(0, 0, 0), (1, 3, 8), (0, 2, 4)]
    add("trace GQA causal rows", "Trace", trace(gqa.request, gqa_rows), OK,
        check=check_trace(gqa, gqa_rows))

    # Not the contract at all.
    add("unknown method", "/attention.v1.AttentionService/Nope", b"", UNIMPLEMENTED)
    add("GetServerInfo", "GetServerInfo", pb.GetServerInfoRequest(), OK, check=check_server_info)
    return table


# --- Running ------------------------------------------------------------------------------------

def call(channel, stub, case):
    """(code, details, result) of one case; a stream is read to its end."""
    try:
        if case.method.startswith("/"):
            raw = channel.unary_unary(case.method, request_serializer=lambda raw: raw,
                                      response_deserializer=lambda raw: raw)
            result = raw(case.request, timeout=RPC_TIMEOUT_S)
        elif case.method == "Trace":
            result = list(stub.Trace(case.request, timeout=RPC_TIMEOUT_S))
        else:
            result = getattr(stub, case.method)(case.request, timeout=RPC_TIMEOUT_S)
        return OK, "", result
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


def run_case(channel, stub, case):
    """'' when the case passed, else why not."""
    code, details, result = call(channel, stub, case)
    if code != case.code:
        return "got %s (%s), expected %s" % (code.name, details, case.code.name)
    missing = [text for text in case.mentions if text not in details]
    if missing:
        return "message %r lacks %r" % (details, missing)
    if code == OK and case.check is not None:
        return case.check(result)
    return ""


def main():
    server = h.AttndProcess(ARGS.attnd, [
        "--threads", "1", "--max-inflight", "1", "--max-queue", "8",
        "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-naive-bytes", str(MAX_NAIVE_BYTES),
        "--max-trace-rows", str(MAX_TRACE_ROWS), "--max-trace-steps", str(MAX_TRACE_STEPS)])
    failures = []
    try:
        # The client's own limits are far above the server's, so the server is what refuses.
        channel = h.open_channel(server.address, max_message_bytes=64 << 20)
        stub = pb_grpc.AttentionServiceStub(channel)
        table = cases()
        width = max(len(case.name) + len(case.method) for case in table) + 3
        print("%-*s %-20s %s" % (width, "case (method)", "status", "result"))
        for number, case in enumerate(table, 1):
            why = run_case(channel, stub, case)
            label = "%s (%s)" % (case.name, case.method.rsplit("/", 1)[-1])
            print("%-*s %-20s %s" % (width, label, case.code.name, "ok" if not why else
                                     "FAIL: " + why))
            if ARGS.verbose and case.code != OK:
                print("    %s" % call(channel, stub, case)[1])
            if why:
                failures.append((case.name, why))
        print("%d cases, %d failed (%d errors expected, %d successes)"
              % (len(table), len(failures), sum(c.code != OK for c in table),
                 sum(c.code == OK for c in table)))

        # The server must have survived all of it.
        if not server.alive():
            failures.append(("server alive", "attnd exited with %s" % server.process.returncode))
        else:
            status = h.health_status(channel)
            print("health after the table: %s" % ("SERVING" if status == h.HEALTH_SERVING
                                                  else status))
            if status != h.HEALTH_SERVING:
                failures.append(("health", "status %d, expected SERVING" % status))
            for method in ("Naive", "Tiled"):
                problem = Problem((1, 3, 37, 19), (1, 1, 53, 19), (1, 1, 53, 23), causal=True,
                                  return_lse=True, block_k=5)
                why = run_case(channel, stub, Case("after", method, problem.request, OK,
                                                   check=check_response(problem, method)))
                print("correct answer after the table (%s): %s" % (method, why or "ok"))
                if why:
                    failures.append(("after the table, " + method, why))
        channel.close()
    finally:
        server.stop()
        if failures:
            sys.stderr.write("--- attnd stderr (tail) ---\n%s\n" % server.stderr()[-4000:])
        server.close()
    for name, why in failures:
        print("FAILED: %s: %s" % (name, why))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
