"""attn_client: call attnd (attention.v1) from Python with NumPy arrays.

A small layer over grpcio and the stubs the build generates from proto/attention/v1/
attention.proto. It needs Debian's python3-grpcio and python3-numpy (i.e. /usr/bin/python3) and
finds the generated `attention.v1` package through PYTHONPATH:

    PYTHONPATH=build/release/python:client/python /usr/bin/python3 client/python/example.py

    import numpy as np
    from attn_client import Client

    client = Client("127.0.0.1:50051")              # token=..., tls_ca="ca.pem", timeout=30
    q = np.random.rand(4, 128, 64).astype(np.float32)  # [heads, seq, dim]
    result = client.tiled(q, q, q, causal=True, return_lse=True)
    result.output, result.lse, result.stats["compute_ns"]
    for event in client.trace(q, q, q, rows=[(0, 0, 5)], block_k=16):
        if event["kind"] == "step":
            print(event["tile"], event["max_after"], event["denominator"], event["estimate"])

Tensors: `q`, `k`, `v` are NumPy arrays of rank 2 [seq, dim], 3 [heads, seq, dim] or 4 [batch,
heads, seq, dim] (key/value heads may divide query heads: grouped-query attention). Element types:

    float32            sent as DTYPE_FLOAT32
    float16            sent as DTYPE_FLOAT16
    uint16             bfloat16 *bit patterns* (the upper half of each float32); NumPy has no
                       bfloat16, so pass dtype="bf16" to say so (a uint16 array without it is a
                       TypeError: it could be anything)

`dtype=` ("fp32", "fp16", "bf16", or np.float32 / np.float16) converts all three inputs to that
storage type instead: float arrays are rounded (to nearest even for bf16, like the server), so
`client.naive(q, k, v, dtype="bf16")` on float32 arrays works too. Without `dtype=`, float64 and
integer arrays are sent as float32. An attention_pb2.Tensor is passed through as it is.
Arithmetic on the server is always fp32.

Results (`Result`): `.output` is float32 for fp32 output, float16 for fp16, and uint16 bfloat16
bits for bf16 (`.output_float32()` or `bf16_to_float32()` widens them); `.lse` a float32 array
[.., heads, query_len] when `return_lse=True`, else None; `.stats` a dict of ExecutionStats
(backend, device, block_k, compute_ns, server_ns, flops, intermediate_bytes, scratch_bytes,
peak_memory_bytes); `.response` the AttentionResponse itself.

Trace events are plain dicts, one per TraceEvent, with "kind" set to "start", "step",
"row_done" or "end" and the message's fields by their proto names; repeated floats (scores,
weights, accumulator, estimate, output, reference) are float32 NumPy arrays, a RowRef is a
(batch, head, row) tuple and ExecutionStats a dict. `event["message"]` keeps the protobuf
message for anything else.

Errors: every failed RPC raises `AttnError` (`.code`, a grpc.StatusCode; `.message`, the
server's text, which names the offending field for INVALID_ARGUMENT). Arguments the client can
check itself (rank, element type, option types) raise ValueError or TypeError before any RPC.

A Client is safe to share between threads (the grpc channel is). Use it as a context manager,
or call close(), to release the channel.
"""

import math
import numbers

import grpc
import numpy as np

from attention.v1 import attention_pb2 as pb
from attention.v1 import attention_pb2_grpc as pb_grpc

__all__ = ["Client", "Result", "AttnError", "bf16_to_float32", "float32_to_bf16",
           "seed_example", "MAX_MESSAGE_BYTES"]

# Like the C++ client (client/client.h) and attnd's default --max-message-bytes.
MAX_MESSAGE_BYTES = 1 << 30

_DTYPES = {
    "fp32": pb.DTYPE_FLOAT32, "float32": pb.DTYPE_FLOAT32,
    "fp16": pb.DTYPE_FLOAT16, "float16": pb.DTYPE_FLOAT16,
    "bf16": pb.DTYPE_BFLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
}
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "fp32", pb.DTYPE_FLOAT16: "fp16", pb.DTYPE_BFLOAT16: "bf16"}
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class AttnError(Exception):
    """A failed RPC: `code` is the grpc.StatusCode, `message` the server's details."""

    def __init__(self, rpc, code, message):
        self.rpc = rpc
        self.code = code
        self.message = message or ""
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        super().__init__("%s failed: %s: %s" % (rpc, name, self.message))

    @classmethod
    def from_rpc_error(cls, rpc, error):
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(rpc, code, details)


# --- bfloat16 -----------------------------------------------------------------------------------

def seed_example():
    """The explainer's 8×4 example as float32 arrays q, k, v (rank 2; its scale is 1/2 = 1/√4):
    q[i][j] = (i + j) % 5 − 2, k[i][j] = ((2i + j) % 7 − 3) / 2, v[i][j] = (i + j) % 9 − 4."""
    i, j = np.meshgrid(np.arange(8), np.arange(4), indexing="ij")
    q = ((i + j) % 5 - 2).astype(np.float32)
    k = (((2 * i + j) % 7 - 3) / 2).astype(np.float32)
    v = ((i + j) % 9 - 4).astype(np.float32)
    return q, k, v


def bf16_to_float32(bits):
    """bfloat16 bit patterns (a uint16 array) → float32 values, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError("bf16_to_float32 takes a uint16 array of bfloat16 bits, not %s"
                        % bits.dtype)
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bf16(values):
    """float values → bfloat16 bit patterns (uint16), rounded to nearest even as attnd does.
    NaNs stay NaN (quiet)."""
    values = np.ascontiguousarray(values, dtype="<f4")
    bits = values.view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
    return rounded


# --- Encoding -----------------------------------------------------------------------------------

def _dtype_enum(dtype, what):
    """None, a name, a NumPy float type or a DType number → a DType number (None stays None)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        key = dtype.lower()
        if key in _DTYPES:
            return _DTYPES[key]
        raise ValueError("%s %r: expected 'fp32', 'fp16' or 'bf16'" % (what, dtype))
    if isinstance(dtype, numbers.Integral) and not isinstance(dtype, bool):
        if int(dtype) in _DTYPE_NAMES:
            return int(dtype)
        raise ValueError("%s %r is not DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"
                         % (what, dtype))
    try:
        numpy_type = np.dtype(dtype)
    except TypeError:
        raise TypeError("%s must be 'fp32', 'fp16', 'bf16' or a NumPy float type, not %r"
                        % (what, dtype)) from None
    if numpy_type == np.float32:
        return pb.DTYPE_FLOAT32
    if numpy_type == np.float16:
        return pb.DTYPE_FLOAT16
    raise ValueError("%s %s: NumPy has no bfloat16; use 'fp32', 'fp16' or 'bf16'"
                     % (what, numpy_type))


def _encode(name, array, dtype):
    """One input as a Tensor, `dtype` being a DType number or None (infer from the array)."""
    if isinstance(array, pb.Tensor):
        return array
    if not isinstance(array, np.ndarray):
        if isinstance(array, (list, tuple)):
            array = np.asarray(array)
        else:
            raise TypeError("%s must be a NumPy array, not %s" % (name, type(array).__name__))
    if not 2 <= array.ndim <= 4:
        raise ValueError("%s has rank %d (shape %s); expected rank 2 [seq, dim], 3 [heads, seq, "
                         "dim] or 4 [batch, heads, seq, dim]" % (name, array.ndim, array.shape))
    kind = array.dtype.kind
    if kind not in "fiu" or (kind == "f" and array.dtype.itemsize > 8):
        raise TypeError("%s has element type %s; expected float32, float16 or uint16 bf16 bits"
                        % (name, array.dtype))
    if dtype is None:
        if array.dtype == np.float16:
            dtype = pb.DTYPE_FLOAT16
        elif array.dtype == np.uint16:
            raise TypeError("%s is uint16: pass dtype='bf16' if it holds bfloat16 bits" % name)
        else:
            dtype = pb.DTYPE_FLOAT32
    if dtype == pb.DTYPE_FLOAT32:
        data = np.ascontiguousarray(array, dtype="<f4")
    elif dtype == pb.DTYPE_FLOAT16:
        if array.dtype == np.uint16:
            raise TypeError("%s is uint16 but dtype is fp16; pass float16 values" % name)
        data = np.ascontiguousarray(array, dtype="<f2")
    else:  # bf16: uint16 arrays are bits already, floats are rounded
        if array.dtype == np.uint16:
            data = np.ascontiguousarray(array, dtype="<u2")
        else:
            data = float32_to_bf16(array)
    return pb.Tensor(shape=[int(n) for n in array.shape], dtype=dtype, data=data.tobytes())


def _decode(tensor):
    """A response Tensor → a NumPy array of its shape (uint16 bits for bf16)."""
    shape = tuple(int(n) for n in tensor.shape)
    if tensor.dtype == pb.DTYPE_FLOAT32:
        values = np.frombuffer(tensor.data, dtype="<f4")
    elif tensor.dtype == pb.DTYPE_FLOAT16:
        values = np.frombuffer(tensor.data, dtype="<f2")
    elif tensor.dtype == pb.DTYPE_BFLOAT16:
        values = np.frombuffer(tensor.data, dtype="<u2")
    else:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor has unknown dtype %d" % tensor.dtype)
    count = int(np.prod(shape)) if shape else 0
    if values.size != count:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor has %d elements for shape %s" % (values.size, shape))
    # frombuffer views immutable bytes; copy so callers get an ordinary writable array.
    return values.reshape(shape).astype(values.dtype.newbyteorder("="), copy=True)


def _message_dict(message):
    """A flat protobuf message (ExecutionStats, ServerInfo) → {field name: value}."""
    return {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}


def _row_tuple(row):
    return (int(row.batch), int(row.head), int(row.row))


def _event_dict(event):
    kind = event.WhichOneof("event")
    message = getattr(event, kind) if kind else None
    result = {"kind": kind, "message": message}
    if message is None:
        return result
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.name == "row":
            value = _row_tuple(value)
        elif field.name == "stats":
            value = _message_dict(value)
        elif field.label == field.LABEL_REPEATED:
            value = np.array(value, dtype=np.float32)
        result[field.name] = value
    return result


class Result:
    """The answer of naive() or tiled()."""

    __slots__ = ("output", "lse", "stats", "output_dtype", "response")

    def __init__(self, response):
        self.response = response
        self.output = _decode(response.output)
        self.output_dtype = _DTYPE_NAMES.get(response.output.dtype, str(response.output.dtype))
        self.lse = _decode(response.lse) if response.HasField("lse") else None
        self.stats = _message_dict(response.stats)

    def output_float32(self):
        """The output as float32 values whatever its dtype (bf16 bits widened exactly)."""
        if self.output_dtype == "bf16":
            return bf16_to_float32(self.output)
        return self.output.astype(np.float32)

    def __repr__(self):
        return "Result(output=%s %s, lse=%s, backend=%r)" % (
            self.output_dtype, self.output.shape,
            None if self.lse is None else self.lse.shape, self.stats.get("backend"))


# --- The client ---------------------------------------------------------------------------------

class Client:
    """A connection to attnd at `target` ("host:port"); dials lazily on the first call.

    token:   sent as "authorization: Bearer <token>" on every call (attnd --auth-token-file).
    tls_ca:  path of a PEM CA bundle; TLS when given, plaintext otherwise. tls_cert/tls_key
             (paths, both or neither) add a client certificate for attnd --tls-client-ca.
    timeout: per-call deadline in seconds (None: no deadline); for trace(), the whole stream's.
    """

    def __init__(self, target, token=None, tls_ca=None, timeout=None, *, tls_cert=None,
                 tls_key=None, max_message_bytes=MAX_MESSAGE_BYTES):
        if not isinstance(target, str) or not target:
            raise ValueError("target must be a non-empty 'host:port' string")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError("timeout must be a positive number of seconds or None")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("a client certificate needs TLS: pass tls_ca too")
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        options = [("grpc.max_send_message_length", int(max_message_bytes)),
                   ("grpc.max_receive_message_length", int(max_message_bytes))]
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                root = f.read()
            chain = key = None
            if tls_cert is not None:
                with open(tls_cert, "rb") as f:
                    chain = f.read()
                with open(tls_key, "rb") as f:
                    key = f.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                                       certificate_chain=chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise AttnError.from_rpc_error(name, error) from None

    # Requests.

    @staticmethod
    def _request(q, k, v, causal, scale, block_k, return_lse, dtype, output_dtype):
        input_dtype = _dtype_enum(dtype, "dtype")
        out_dtype = _dtype_enum(output_dtype, "output_dtype")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError("causal must be a bool, not %s" % type(causal).__name__)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError("return_lse must be a bool, not %s" % type(return_lse).__name__)
        if isinstance(block_k, bool) or not isinstance(block_k, numbers.Integral):
            raise TypeError("block_k must be an int, not %s" % type(block_k).__name__)
        if block_k < 0 or block_k > 2 ** 31 - 1:
            raise ValueError("block_k must be ≥ 0 (0: the server's default), got %d" % block_k)
        options = pb.AttentionOptions(causal=bool(causal), block_k=int(block_k),
                                      return_lse=bool(return_lse))
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
                raise TypeError("scale must be a number or None, not %s" % type(scale).__name__)
            if not math.isfinite(scale):
                raise ValueError("scale must be finite, got %r" % scale)
            options.scale = float(scale)
        if out_dtype is not None:
            options.output_dtype = out_dtype
        return pb.AttentionRequest(query=_encode("query", q, input_dtype),
                                   key=_encode("key", k, input_dtype),
                                   value=_encode("value", v, input_dtype), options=options)

    # RPCs.

    def naive(self, q, k, v, *, causal=False, scale=None, block_k=0, return_lse=False,
              dtype=None, output_dtype=None):
        """Full-matrix attention (score and weight matrices materialized) → Result.
        scale None: 1/sqrt(head_dim). output_dtype None: the query's dtype. block_k is ignored."""
        request = self._request(q, k, v, causal, scale, block_k, return_lse, dtype,
                                output_dtype)
        return Result(self._call("Naive", self._stub.Naive, request))

    def tiled(self, q, k, v, *, causal=False, scale=None, block_k=0, return_lse=False,
              dtype=None, output_dtype=None):
        """Online-softmax attention over tiles of block_k keys (0: the server's default)
        → Result. Other arguments as for naive()."""
        request = self._request(q, k, v, causal, scale, block_k, return_lse, dtype,
                                output_dtype)
        return Result(self._call("Tiled", self._stub.Tiled, request))

    def trace(self, q, k, v, rows=None, *, block_k=0, causal=False, scale=None, dtype=None):
        """Streams the online softmax of `rows` → an iterator of event dicts (see the module
        docstring): one "start", then per row one "step" per key tile and a "row_done", then
        "end". rows: (batch, head, row) tuples, or ints meaning (0, 0, row); None: row 0.
        Arguments are checked now; the RPC starts on the first next(). Closing the iterator
        early (break, close()) cancels the stream. A failure mid-stream raises AttnError."""
        request = pb.TraceRequest(
            attention=self._request(q, k, v, causal, scale, block_k, False, dtype, None))
        for index, row in enumerate([] if rows is None else rows):
            if isinstance(row, numbers.Integral) and not isinstance(row, bool):
                row = (0, 0, row)
            if (not isinstance(row, (tuple, list)) or len(row) != 3
                    or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                               for x in row)):
                raise TypeError("rows[%d] must be a (batch, head, row) tuple of ints, not %r"
                                % (index, row))
            if min(row) < 0:
                raise ValueError("rows[%d] = %r has a negative index" % (index, tuple(row)))
            request.rows.add(batch=int(row[0]), head=int(row[1]), row=int(row[2]))
        return self._trace_events(request)

    def _trace_events(self, request):
        call = None
        try:
            call = self._stub.Trace(request, timeout=self.timeout, metadata=self._metadata)
            for event in call:
                yield _event_dict(event)
        except grpc.RpcError as error:
            raise AttnError.from_rpc_error("Trace", error) from None
        finally:
            if call is not None:
                call.cancel()  # no-op once the stream has finished

    def info(self):
        """GetServerInfo → a dict of ServerInfo's fields, dtypes as names ("fp32", ...)."""
        info = _message_dict(self._call("GetServerInfo", self._stub.GetServerInfo,
                                        pb.GetServerInfoRequest()))
        info["dtypes"] = [_DTYPE_NAMES.get(d, str(d)) for d in info["dtypes"]]
        return info

    def health(self, service=""):
        """grpc.health.v1 Check → "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN".
        service "": the whole server. (Health needs no token on attnd.)"""
        encoded = service.encode("utf-8")
        if len(encoded) > 127:
            raise ValueError("service name too long")
        request = (b"\x0a" + bytes([len(encoded)]) + encoded) if encoded else b""
        response = self._call("Health", self._health, request)
        # HealthCheckResponse{ServingStatus status = 1}: empty (UNKNOWN) or 0x08 <varint>.
        status, shift, position = 0, 0, 1
        if response:
            if response[0] != 0x08:
                raise AttnError("Health", grpc.StatusCode.INTERNAL,
                                "unexpected HealthCheckResponse bytes %r" % response)
            while position < len(response):
                byte = response[position]
                status |= (byte & 0x7F) << shift
                shift += 7
                position += 1
                if not byte & 0x80:
                    break
        return _HEALTH_STATUS.get(status, str(status))
