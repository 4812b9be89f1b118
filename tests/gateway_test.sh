#!/usr/bin/env bash
# attnd's JSON gateway (server/gateway.h) against its own gRPC service, as main wires them:
#  1. attnd with no CORS and no token: Naive and Tiled through POST /v1/naive|tiled give the
#     same bytes as gRPC for the seed example (whose out[0] is checked) and a random GQA causal
#     bf16 problem; GET /v1/info equals GetServerInfo; POST /v1/trace's server-sent events parse
#     into exactly gRPC's Trace events; bad JSON and unknown fields are 400; a bad request is 400
#     with gRPC's INVALID_ARGUMENT message (Naive and Trace); a client that leaves a long trace
#     stream cancels it; /metrics counts the gateway's calls with gRPC's; X-Timeout-Ms: 1 on a
#     long call is 504; GET / and the viewer files are served as embedded, with their content
#     types; no CORS header anywhere. The KV-cache routes (/v1/caches..., /v1/decode): create,
#     append, info and list equal to gRPC's, decode and tiled/trace over a cache against a float64
#     reference on the tokens sent, FAILED_PRECONDITION 400, NOT_FOUND 404 after delete; a
#     latent cache (POST /v1/caches with "values_from_keys": true, and "valuesFromKeys") shown by
#     info and list, keys appended alone, decode against float64 with values from the keys,
#     its bytes those of its keys, a value 400 INVALID_ARGUMENT naming it, value_dim > head_dim
#     400 naming value_dim.
#  2. attnd with --http-cors-origin and --auth-token-file: a missing or wrong token is 401 with
#     the message gRPC gives; the right token works (and the answer carries the origin); the
#     OPTIONS preflight allows Authorization and Content-Type (and DELETE); the page loads
#     without a token; the cache routes need the token too.
#  3. SIGTERM while a trace streams and a body is half sent: /v1 answers 503, the stream goes on
#     through the grace, and attnd exits 0.
#  4. The admission from the headers (--auth-token-file, --max-message-bytes 1024), each over raw
#     sockets so nothing sends more than the test says: a wrong token with a 100 MB Content-Length
#     and no body sent is 401 within 2 s, the connection closed (with Expect: 100-continue too,
#     and no "100 Continue" first); a Content-Length one byte over the JSON limit is 413 within
#     2 s; a chunked body one byte over it is 413; GET and DELETE with a body (Content-Length or
#     chunked) are 413; a POST that is text/plain, a form or has no Content-Type is 415, while
#     application/json; charset=utf-8 goes through; a POST with neither Content-Length nor
#     chunked is 411 within 2 s; X-Timeout-Ms -1, abc and 10^12 are 400 naming X-Timeout-Ms; an
#     unknown /v1 path is 404 and a wrong method 405; a body that stalls, and one trickled a byte
#     a second, are answered 408 and closed within the 10 s read timeout + 3 s; attnd still
#     answers afterwards (~10 s: the two slow bodies run beside the rest).
#  5. --tls-client-ca (gRPC requires client certificates, which HTTP cannot check): every /v1
#     call is 403 PERMISSION_DENIED naming --tls-client-ca; /healthz still answers.
# Usage: gateway_test.sh ATTND PYTHON_STUBS_DIR SOURCE_DIR
set -euo pipefail
attnd=$1
stubs=$2
source_dir=$3
dir=$(mktemp -d)
server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

start() {  # start ARGS...: starts attnd, sets $server, $port and $http_port
  # Emptied here, not only by the redirection below: that runs in the background job, and the
  # loop could otherwise read the previous server's ports before it does.
  : >"$dir/out"
  : >"$dir/err"
  "$attnd" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --threads 2 "$@" \
    >"$dir/out" 2>"$dir/err" &
  server=$!
  port=""
  http_port=""
  for _ in $(seq 200); do
    port=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$dir/out")
    http_port=$(sed -n 's|^  http: http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$dir/out")
    [ -n "$port" ] && [ -n "$http_port" ] && return 0
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  cat "$dir/out" "$dir/err"
  echo "FAIL: attnd never reported its gRPC and HTTP ports"
  exit 1
}

stop() {
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=""
}

cat >"$dir/check.py" <<'EOF'
import base64, http.client, json, math, os, sys, time, urllib.error, urllib.request

mode, grpc_port, http_port, stubs, source_dir, token_file = sys.argv[1:7]
sys.path.insert(0, stubs)
import grpc
import numpy as np
from google.protobuf import json_format
from attention.v1 import attention_pb2 as pb
from attention.v1 import attention_pb2_grpc as pb_grpc

base = "http://127.0.0.1:%s" % http_port
channel = grpc.insecure_channel("127.0.0.1:%s" % grpc_port, options=[
    ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
stub = pb_grpc.AttentionServiceStub(channel)
token = open(token_file).read().strip() if token_file else ""
grpc_metadata = [("authorization", "Bearer " + token)] if token else []
http_auth = {"Authorization": "Bearer " + token} if token else {}
failures = []
passed = 0


def check(name, condition, detail=""):
    global passed
    if condition:
        passed += 1
    else:
        failures.append(name)
        print("FAIL %s %s" % (name, detail))


def http_call(method, path, body=None, headers=None):
    """(status, headers, body bytes) for one HTTP request; never raises on an HTTP error."""
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def post_message(path, message, headers=None):
    return http_call("POST", path, json_format.MessageToJson(message), headers)


def fp32(array):
    array = np.ascontiguousarray(array, dtype="<f4")
    return pb.Tensor(shape=list(array.shape), dtype=pb.DTYPE_FLOAT32, data=array.tobytes())


def bf16(array):
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4").astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return pb.Tensor(shape=list(array.shape), dtype=pb.DTYPE_BFLOAT16, data=bits.tobytes())


def seed_request(block_k=0):
    i, j = np.meshgrid(np.arange(8), np.arange(4), indexing="ij")
    q = (i + j) % 5 - 2
    k = ((2 * i + j) % 7 - 3) / 2
    v = (i + j) % 9 - 4
    return pb.AttentionRequest(query=fp32(q), key=fp32(k), value=fp32(v),
                               options=pb.AttentionOptions(block_k=block_k, return_lse=True))


def random_request():
    rng = np.random.default_rng(20261129)
    q = rng.standard_normal((2, 4, 37, 24))
    k = rng.standard_normal((2, 2, 53, 24))
    v = rng.standard_normal((2, 2, 53, 24))
    return pb.AttentionRequest(query=bf16(q), key=bf16(k), value=bf16(v),
                               options=pb.AttentionOptions(causal=True, block_k=7,
                                                           return_lse=True))


def error_of(body):
    try:
        return json.loads(body)
    except ValueError:
        return {}


def sse_events(body):
    """The data lines of a text/event-stream body, as (event name, JSON text) pairs."""
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        events.append((name, "\n".join(data)))
    return events


def same_numbers(name, grpc_response, json_body):
    got = json_format.Parse(json_body, pb.AttentionResponse())
    for field in ("output", "lse"):
        a, b = getattr(grpc_response, field), getattr(got, field)
        check("%s %s bytes equal gRPC's" % (name, field),
              a.data == b.data and list(a.shape) == list(b.shape) and a.dtype == b.dtype)
    # Not timings, nor scratch_bytes (Naive's row blocks follow the memory free at the time).
    for field in ("backend", "device", "block_k", "flops", "intermediate_bytes"):
        check("%s stats.%s equals gRPC's" % (name, field),
              getattr(grpc_response.stats, field) == getattr(got.stats, field),
              "%r vs %r" % (getattr(grpc_response.stats, field), getattr(got.stats, field)))
    return got


def rpc_error(call, request):
    try:
        call(request, timeout=60, metadata=grpc_metadata)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def main_checks():
    # Naive and Tiled: seed example (out[0] too) and a random problem, same bytes as gRPC.
    for method, path in (("Naive", "/v1/naive"), ("Tiled", "/v1/tiled")):
        call = getattr(stub, method)
        for label, request in (("seed", seed_request()), ("random", random_request())):
            expected = call(request, timeout=60, metadata=grpc_metadata)
            status, headers, body = post_message(path, request, http_auth)
            check("%s %s: 200" % (method, label), status == 200, body[:300])
            check("%s %s: JSON content type" % (method, label),
                  headers.get("Content-Type", "").startswith("application/json"))
            if status != 200:
                continue
            got = same_numbers("%s %s" % (method, label), expected, body)
            if label == "seed":
                row0 = np.frombuffer(got.output.data, dtype="<f4")[:4]
                check("%s seed out[0]" % method,
                      np.allclose(row0, [-0.593223, 0.406777, -1.332858, -0.371937], atol=1e-5),
                      str(row0))
                # Every field is printed, defaults included (always_print_primitive_fields).
                check("%s answer prints default fields" % method,
                      "scratchBytes" in json.loads(body)["stats"])

    # GetServerInfo.
    expected = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30, metadata=grpc_metadata)
    status, _, body = http_call("GET", "/v1/info", headers=http_auth)
    check("info: 200", status == 200, body[:300])
    if status == 200:
        check("info equals GetServerInfo", json_format.Parse(body, pb.ServerInfo()) == expected)

    # Trace: the SSE events are exactly gRPC's stream.
    trace = pb.TraceRequest(attention=seed_request(block_k=2),
                            rows=[pb.RowRef(row=0), pb.RowRef(row=5)])
    expected = list(stub.Trace(trace, timeout=60, metadata=grpc_metadata))
    status, headers, body = post_message("/v1/trace", trace, http_auth)
    check("trace: 200", status == 200, body[:300])
    check("trace: text/event-stream",
          headers.get("Content-Type", "").startswith("text/event-stream"))
    events = sse_events(body)
    check("trace: one plain data event per TraceEvent",
          len(events) == len(expected) and all(name == "message" for name, _ in events),
          "%d events, gRPC %d" % (len(events), len(expected)))
    got = [json_format.Parse(data, pb.TraceEvent()) for _, data in events]
    for event in got + expected:  # The end's timings differ from call to call.
        if event.WhichOneof("event") == "end":
            event.end.stats.compute_ns = event.end.stats.server_ns = 0
    check("trace: events equal gRPC's",
          [e.SerializeToString(deterministic=True) for e in got] ==
          [e.SerializeToString(deterministic=True) for e in expected])
    check("trace: start, 4 steps per row, row_done, end",
          len(got) == 1 + 2 * (4 + 1) + 1 and got[0].WhichOneof("event") == "start" and
          got[-1].WhichOneof("event") == "end")

    if token:
        return

    # Errors: bad JSON, unknown field, a request the service refuses (same message as gRPC).
    status, _, body = http_call("POST", "/v1/naive", "{\"query\": ")
    error = error_of(body)
    check("bad JSON: 400 INVALID_ARGUMENT", status == 400 and
          error.get("code") == "INVALID_ARGUMENT", "%d %s" % (status, body[:300]))
    check("bad JSON: the parser's message", "AttentionRequest" in error.get("message", ""),
          str(error))
    status, _, body = http_call("POST", "/v1/tiled", "{\"qurey\": {}}")
    check("unknown field: 400", status == 400 and "qurey" in error_of(body).get("message", ""),
          "%d %s" % (status, body[:300]))
    bad = seed_request(block_k=-5)
    code, details = rpc_error(stub.Naive, bad)
    status, _, body = post_message("/v1/naive", bad)
    error = error_of(body)
    check("bad request: gRPC says INVALID_ARGUMENT", code == grpc.StatusCode.INVALID_ARGUMENT)
    check("bad request: 400 with gRPC's code and message",
          status == 400 and error == {"code": "INVALID_ARGUMENT", "message": details},
          "%d %s vs %r" % (status, body[:300], details))
    bad_trace = pb.TraceRequest(attention=seed_request(), rows=[pb.RowRef(row=99)])
    code, details = rpc_error(lambda r, **kw: list(stub.Trace(r, **kw)), bad_trace)
    status, headers, body = post_message("/v1/trace", bad_trace)
    check("bad trace: 400 JSON with gRPC's message",
          status == 400 and code == grpc.StatusCode.INVALID_ARGUMENT and
          error_of(body) == {"code": "INVALID_ARGUMENT", "message": details},
          "%d %s vs %r" % (status, body[:300], details))
    status, _, body = http_call("POST", "/v1/naive", "{}", {"X-Timeout-Ms": "soon"})
    check("bad X-Timeout-Ms: 400", status == 400, body[:200])

    # A client that reads one event of a long trace and leaves cancels the call.
    rng = np.random.default_rng(7)
    long_trace = pb.TraceRequest(
        attention=pb.AttentionRequest(query=fp32(rng.standard_normal((64, 16))),
                                    key=fp32(rng.standard_normal((4096, 16))),
                                    value=fp32(rng.standard_normal((4096, 16))),
                                    options=pb.AttentionOptions(block_k=1)),
        rows=[pb.RowRef(row=r) for r in range(8)])
    connection = http.client.HTTPConnection("127.0.0.1", int(http_port), timeout=30)
    connection.request("POST", "/v1/trace", json_format.MessageToJson(long_trace),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = response.readline()
    check("long trace: streams before it ends", response.status == 200 and b"data: " in first,
          repr(first[:100]))
    connection.sock.shutdown(2)
    connection.close()
    cancelled = False
    for _ in range(100):
        _, _, metrics = http_call("GET", "/metrics")
        for line in metrics.decode().splitlines():
            if (line.startswith("attnd_rpc_requests_total{") and 'method="Trace"' in line and
                    'code="OK"' not in line and 'code="INVALID_ARGUMENT"' not in line):
                cancelled = True
                print("  left trace counted as: " + line)
        if cancelled:
            break
        time.sleep(0.1)
    check("long trace: leaving cancels the stream (counted with a non-OK code)", cancelled)

    # The gateway's calls are the service's calls: metrics count both paths alike.
    _, _, metrics = http_call("GET", "/metrics")
    metrics = metrics.decode()
    rpc = 'service="attention.v1.AttentionService"'
    for method, count in (("Naive", 4), ("Tiled", 4), ("GetServerInfo", 2)):
        line = 'attnd_rpc_requests_total{%s,method="%s",code="OK"} %d' % (rpc, method, count)
        check("metrics: %s" % line, line in metrics.splitlines())
    line = 'attnd_rpc_requests_total{%s,method="Naive",code="INVALID_ARGUMENT"} 2' % rpc
    check("metrics: %s" % line, line in metrics.splitlines())

    # X-Timeout-Ms is the call's deadline: 1 ms for a long computation is 504.
    big = fp32(np.random.default_rng(3).standard_normal((4, 2048, 64)))
    status, _, body = post_message("/v1/naive", pb.AttentionRequest(query=big, key=big, value=big),
                                   {"X-Timeout-Ms": "1"})
    check("X-Timeout-Ms 1 on a long call: 504 DEADLINE_EXCEEDED",
          status == 504 and error_of(body).get("code") == "DEADLINE_EXCEEDED",
          "%d %s" % (status, body[:200]))

    # The viewer, embedded at build time: / is index.html; each file with its content type.
    types = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
    status, headers, body = http_call("GET", "/")
    check("GET /: 200 text/html", status == 200 and
          headers.get("Content-Type", "").startswith("text/html"))
    check("GET /: an HTML page", b"<html" in body.lower(), body[:100])
    viewer = os.path.join(source_dir, "client", "viewer")
    for name in sorted(os.listdir(viewer)) if os.path.isdir(viewer) else []:
        extension = os.path.splitext(name)[1]
        if extension not in types:
            continue
        status, headers, body = http_call("GET", "/" + name)
        check("GET /%s: 200 %s, the file's bytes" % (name, types[extension]),
              status == 200 and headers.get("Content-Type", "").startswith(types[extension]) and
              body == open(os.path.join(viewer, name), "rb").read(),
              "%d %s (rebuild attnd after editing the viewer)" % (status,
                                                                   headers.get("Content-Type")))
        if name == "index.html":
            check("GET / is index.html", http_call("GET", "/")[2] == body)

    # No CORS without --http-cors-origin.
    _, headers, _ = http_call("GET", "/v1/info", headers={"Origin": "https://elsewhere.example"})
    check("no CORS header without the flag", "Access-Control-Allow-Origin" not in headers)
    _, headers, _ = http_call("OPTIONS", "/v1/naive", headers={
        "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
    check("no CORS preflight without the flag", "Access-Control-Allow-Origin" not in headers)


def reference(q, k, v, causal=False):
    """float64 softmax(q kᵀ / sqrt(d)) v, q [H, nq, d] over k [K, L, d], v [K, L, dv] (GQA)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, length = q.shape[1], k.shape[1]
        visible = np.arange(length)[None, :] <= np.arange(nq)[:, None] + length - nq
        scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights @ v) / weights.sum(axis=-1, keepdims=True)


def close_to(got, want, rtol=1e-5):
    return got.shape == want.shape and float(np.max(np.abs(got - want))) <= rtol * float(
        np.max(np.abs(want)))


def cache_checks():
    """The KV-cache routes: each against gRPC's answer or a float64 reference on the tokens sent
    (kept here), the errors as gRPC's codes, and a cache shared with gRPC callers (one identity)."""
    rng = np.random.default_rng(5)
    status, _, body = http_call("POST", "/v1/caches", json.dumps(
        {"kvHeads": 2, "headDim": 8, "valueDim": 6, "dtype": "DTYPE_FLOAT32"}))
    check("cache create: 200", status == 200, "%d %s" % (status, body[:300]))
    if status != 200:
        return
    info = json_format.Parse(body, pb.CacheInfo())
    cache_id = info.cache_id
    check("cache create: a 32-hex id, empty, the shape asked",
          len(cache_id) == 32 and all(c in "0123456789abcdef" for c in cache_id) and
          (info.length, info.kv_heads, info.head_dim, info.value_dim) == (0, 2, 8, 6), str(info))
    keys = rng.standard_normal((2, 11, 8)).astype(np.float32)
    values = rng.standard_normal((2, 11, 6)).astype(np.float32)
    append = pb.AppendCacheRequest(key=fp32(keys), value=fp32(values), expected_length=0)
    status, _, body = post_message("/v1/caches/%s/append" % cache_id, append)
    check("cache append: 200, length 11",
          status == 200 and json_format.Parse(body, pb.CacheInfo()).length == 11,
          "%d %s" % (status, body[:300]))
    status, _, body = post_message("/v1/caches/%s/append" % cache_id, append)
    error = error_of(body)
    check("cache append, stale expectedLength: 400 FAILED_PRECONDITION naming 11",
          status == 400 and error.get("code") == "FAILED_PRECONDITION" and
          "11" in error.get("message", ""), "%d %s" % (status, body[:300]))
    append.cache_id = "f" * 32
    status, _, body = post_message("/v1/caches/%s/append" % cache_id, append)
    check("cache append, another cacheId in the body: 400",
          status == 400 and error_of(body).get("code") == "INVALID_ARGUMENT",
          "%d %s" % (status, body[:300]))
    # Four draft tokens, cut back off (TruncateCache): the cache holds its 11 tokens again.
    drafts = pb.AppendCacheRequest(key=fp32(keys[:, :4]), value=fp32(values[:, :4]),
                                   expected_length=11)
    status, _, body = post_message("/v1/caches/%s/append" % cache_id, drafts)
    check("cache append of 4 drafts: 200", status == 200, "%d %s" % (status, body[:300]))
    cut = pb.TruncateCacheRequest(length=11, expected_length=15)
    status, _, body = post_message("/v1/caches/%s/truncate" % cache_id, cut)
    check("cache truncate to 11: 200, length 11",
          status == 200 and json_format.Parse(body, pb.CacheInfo()).length == 11,
          "%d %s" % (status, body[:300]))
    cut = pb.TruncateCacheRequest(length=12)
    status, _, body = post_message("/v1/caches/%s/truncate" % cache_id, cut)
    error = error_of(body)
    check("cache truncate past the length: OUT_OF_RANGE naming length",
          error.get("code") == "OUT_OF_RANGE" and "length" in error.get("message", ""),
          "%d %s" % (status, body[:300]))
    # A fork of its first 5 tokens (ForkCache), sharing the source's pages; one past is named.
    fork = pb.ForkCacheRequest(length=5, expected_length=11)
    status, _, body = post_message("/v1/caches/%s/fork" % cache_id, fork)
    forked = json_format.Parse(body, pb.CacheInfo()) if status == 200 else None
    check("cache fork of 5 tokens: 200, a new cache of length 5 sharing its pages",
          forked is not None and forked.length == 5 and forked.cache_id != cache_id and
          forked.shared_bytes == forked.bytes > 0, "%d %s" % (status, body[:300]))
    status, _, body = post_message("/v1/caches/%s/fork" % cache_id, pb.ForkCacheRequest(length=12))
    error = error_of(body)
    check("cache fork past the length: OUT_OF_RANGE naming length",
          error.get("code") == "OUT_OF_RANGE" and "length" in error.get("message", ""),
          "%d %s" % (status, body[:300]))
    if forked is not None:
        status, _, body = http_call("DELETE", "/v1/caches/%s" % forked.cache_id)
        check("cache fork deleted: 200", status == 200, "%d %s" % (status, body[:300]))
    status, _, body = http_call("GET", "/v1/caches/%s" % cache_id)
    expected = stub.GetCacheInfo(pb.GetCacheInfoRequest(cache_id=cache_id), timeout=30)
    check("cache info: equals gRPC's GetCacheInfo (one identity)",
          status == 200 and json_format.Parse(body, pb.CacheInfo()) == expected,
          "%d %s" % (status, body[:300]))
    status, _, body = http_call("GET", "/v1/caches")
    listed = json_format.Parse(body, pb.ListCachesResponse()) if status == 200 else None
    check("cache list: equals gRPC's ListCaches and holds the cache",
          listed is not None and listed == stub.ListCaches(pb.ListCachesRequest(), timeout=30) and
          cache_id in [c.cache_id for c in listed.caches], "%d %s" % (status, body[:300]))

    # Decode: one new token, then the query over all 12, against the float64 reference.
    query = rng.standard_normal((4, 1, 8)).astype(np.float32)
    new_key = rng.standard_normal((2, 1, 8)).astype(np.float32)
    new_value = rng.standard_normal((2, 1, 6)).astype(np.float32)
    decode = pb.DecodeRequest(items=[pb.DecodeItem(
        cache_id=cache_id, query=fp32(query), key=fp32(new_key), value=fp32(new_value),
        expected_length=11)], options=pb.AttentionOptions(return_lse=True))
    status, _, body = post_message("/v1/decode", decode)
    check("decode: 200", status == 200, "%d %s" % (status, body[:300]))
    keys = np.concatenate([keys, new_key], axis=1)
    values = np.concatenate([values, new_value], axis=1)
    want = reference(query, keys, values)
    if status == 200:
        got = json_format.Parse(body, pb.DecodeResponse())
        out = np.frombuffer(got.outputs[0].data, "<f4").reshape(tuple(got.outputs[0].shape))
        check("decode: output equals the float64 reference", close_to(out, want),
              "%s vs %s" % (out.ravel()[:4], want.ravel()[:4]))
        check("decode: the cache after it has 12 tokens, one lse per item",
              [c.length for c in got.caches] == [12] and len(got.lse) == 1, str(got.caches))

    # Tiled and Trace over the cache (cacheId in the AttentionRequest), causal with 3 rows.
    query3 = rng.standard_normal((2, 3, 8)).astype(np.float32)
    want3 = reference(query3, keys, values, causal=True)
    over_cache = pb.AttentionRequest(cache_id=cache_id, query=fp32(query3),
                                     options=pb.AttentionOptions(causal=True, block_k=5))
    status, _, body = post_message("/v1/tiled", over_cache)
    if status == 200:
        got = json_format.Parse(body, pb.AttentionResponse())
        out = np.frombuffer(got.output.data, "<f4").reshape(tuple(got.output.shape))
        check("tiled over a cache: the float64 reference", close_to(out, want3))
    else:
        check("tiled over a cache: 200", False, "%d %s" % (status, body[:300]))
    status, _, body = post_message("/v1/trace", pb.TraceRequest(attention=over_cache,
                                                                rows=[pb.RowRef(head=1, row=2)]))
    events = [json_format.Parse(data, pb.TraceEvent()) for _, data in sse_events(body)] \
        if status == 200 else []
    done = [e.row_done for e in events if e.WhichOneof("event") == "row_done"]
    check("trace over a cache: its row's output is the float64 reference",
          len(done) == 1 and close_to(np.array(done[0].output), want3[1, 2]),
          "%d %s" % (status, body[:300]))

    # Delete: {} then NOT_FOUND (404) for every route naming it.
    status, _, body = http_call("DELETE", "/v1/caches/%s" % cache_id)
    check("cache delete: 200 {}", status == 200 and json.loads(body) == {},
          "%d %s" % (status, body[:300]))
    for method, path, payload in (
            ("GET", "/v1/caches/%s" % cache_id, None),
            ("DELETE", "/v1/caches/%s" % cache_id, None),
            ("POST", "/v1/caches/%s/append" % cache_id, json_format.MessageToJson(
                pb.AppendCacheRequest(key=fp32(new_key), value=fp32(new_value),
                                      expected_length=12))),
            ("POST", "/v1/decode", json_format.MessageToJson(decode))):
        status, _, body = http_call(method, path, payload)
        check("after delete: %s %s is 404 NOT_FOUND" % (method, path.replace(cache_id, "ID")),
              status == 404 and error_of(body).get("code") == "NOT_FOUND",
              "%d %s" % (status, body[:300]))

    # A cache created over gRPC is the gateway's too (no client certificates: one identity).
    made = stub.CreateCache(pb.CreateCacheRequest(kv_heads=1, head_dim=4, value_dim=4,
                                                  dtype=pb.DTYPE_BFLOAT16), timeout=30)
    status, _, body = http_call("GET", "/v1/caches/%s" % made.cache_id)
    check("a gRPC-made cache through the gateway",
          status == 200 and json_format.Parse(body, pb.CacheInfo()) == made,
          "%d %s" % (status, body[:300]))
    status, _, _ = http_call("DELETE", "/v1/caches/%s" % made.cache_id)
    check("deleting it through the gateway", status == 200)
    status, _, body = http_call("POST", "/v1/caches", "{\"kvHeads\": 0, \"headDim\": 4}")
    check("cache create, bad shape: 400 INVALID_ARGUMENT",
          status == 400 and error_of(body).get("code") == "INVALID_ARGUMENT",
          "%d %s" % (status, body[:300]))


def latent_cache_checks():
    """A latent cache (values_from_keys: keys only, each value the first value_dim columns of
    its key) through the gateway: the proto JSON mapping takes the field by either spelling."""
    rng = np.random.default_rng()
    status, _, body = http_call("POST", "/v1/caches", json.dumps(
        {"kv_heads": 1, "head_dim": 72, "value_dim": 40, "dtype": "DTYPE_FLOAT32",
         "values_from_keys": True}))
    check("latent cache create (values_from_keys): 200", status == 200,
          "%d %s" % (status, body[:300]))
    if status != 200:
        return
    info = json_format.Parse(body, pb.CacheInfo())
    cache_id = info.cache_id
    check("latent cache create: valuesFromKeys in the answer, the shape asked",
          json.loads(body).get("valuesFromKeys") is True and info.values_from_keys and
          (info.kv_heads, info.head_dim, info.value_dim) == (1, 72, 40), body[:300])
    status, _, body = http_call("GET", "/v1/caches/%s" % cache_id)
    check("latent cache info: valuesFromKeys",
          status == 200 and json.loads(body).get("valuesFromKeys") is True, body[:300])
    status, _, body = http_call("GET", "/v1/caches")
    listed = json_format.Parse(body, pb.ListCachesResponse()) if status == 200 else None
    check("latent cache list: valuesFromKeys",
          listed is not None and [c.values_from_keys for c in listed.caches
                                  if c.cache_id == cache_id] == [True], body[:300])
    keys = rng.standard_normal((1, 29, 72)).astype(np.float32)
    status, _, body = post_message("/v1/caches/%s/append" % cache_id,
                                   pb.AppendCacheRequest(key=fp32(keys), expected_length=0))
    appended = json_format.Parse(body, pb.CacheInfo()) if status == 200 else None
    check("latent cache append of keys alone: 200, length 29, the keys' pages alone",
          appended is not None and appended.length == 29 and
          appended.bytes == appended.page_tokens * 72 * 4, "%d %s" % (status, body[:300]))
    append = pb.AppendCacheRequest(key=fp32(keys[:, :2]), value=fp32(keys[:, :2, :40]),
                                   expected_length=29)
    status, _, body = post_message("/v1/caches/%s/append" % cache_id, append)
    error = error_of(body)
    check("latent cache append with a value: 400 INVALID_ARGUMENT naming value",
          status == 400 and error.get("code") == "INVALID_ARGUMENT" and
          error.get("message", "").startswith("value"), "%d %s" % (status, body[:300]))
    query = rng.standard_normal((13, 1, 72)).astype(np.float32)
    new_key = rng.standard_normal((1, 1, 72)).astype(np.float32)
    decode = pb.DecodeRequest(items=[pb.DecodeItem(
        cache_id=cache_id, query=fp32(query), key=fp32(new_key), value=fp32(new_key[..., :40]),
        expected_length=29)])
    status, _, body = post_message("/v1/decode", decode)
    error = error_of(body)
    check("latent decode with a value: 400 INVALID_ARGUMENT naming items[0].value",
          status == 400 and error.get("code") == "INVALID_ARGUMENT" and
          error.get("message", "").startswith("items[0].value"), "%d %s" % (status, body[:300]))
    decode.items[0].ClearField("value")
    status, _, body = post_message("/v1/decode", decode)
    keys = np.concatenate([keys, new_key], axis=1)
    want = reference(query, keys, keys[..., :40])
    if status == 200:
        got = json_format.Parse(body, pb.DecodeResponse())
        out = np.frombuffer(got.outputs[0].data, "<f4").reshape(tuple(got.outputs[0].shape))
        check("latent decode of the key alone: the float64 reference, values from the keys",
              close_to(out, want), "%s vs %s" % (out.ravel()[:4], want.ravel()[:4]))
        check("latent decode: 30 tokens", [c.length for c in got.caches] == [30], str(got.caches))
    else:
        check("latent decode of the key alone: 200", False, "%d %s" % (status, body[:300]))
    status, _, _ = http_call("DELETE", "/v1/caches/%s" % cache_id)
    check("latent cache delete: 200", status == 200)
    # The JSON name (valuesFromKeys) too; value_dim past head_dim is refused naming it.
    status, _, body = http_call("POST", "/v1/caches", json.dumps(
        {"kvHeads": 2, "headDim": 16, "valuesFromKeys": True, "dtype": "DTYPE_BFLOAT16"}))
    made = json_format.Parse(body, pb.CacheInfo()) if status == 200 else None
    check("latent cache create (valuesFromKeys): value_dim = head_dim",
          made is not None and made.values_from_keys and made.value_dim == 16,
          "%d %s" % (status, body[:300]))
    if made is not None:
        http_call("DELETE", "/v1/caches/%s" % made.cache_id)
    status, _, body = http_call("POST", "/v1/caches", json.dumps(
        {"kvHeads": 1, "headDim": 72, "valueDim": 73, "valuesFromKeys": True}))
    error = error_of(body)
    check("latent cache create, value_dim > head_dim: 400 INVALID_ARGUMENT naming value_dim",
          status == 400 and error.get("code") == "INVALID_ARGUMENT" and
          error.get("message", "").startswith("value_dim"), "%d %s" % (status, body[:300]))


def auth_checks():
    origin = "https://viewer.example"
    no_token = grpc_metadata[:0]
    try:
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30, metadata=no_token)
        grpc_missing = ""
    except grpc.RpcError as error:
        grpc_missing = error.details()
    status, headers, body = http_call("GET", "/v1/info")
    check("no token: 401 UNAUTHENTICATED with gRPC's message",
          status == 401 and error_of(body) == {"code": "UNAUTHENTICATED", "message": grpc_missing},
          "%d %s vs %r" % (status, body[:300], grpc_missing))
    check("no token: WWW-Authenticate", headers.get("WWW-Authenticate") == "Bearer")
    check("no token: the 401 still carries the CORS origin",
          headers.get("Access-Control-Allow-Origin") == origin)
    status, _, body = post_message("/v1/tiled", seed_request(), {"Authorization": "Bearer nope"})
    check("wrong token: 401", status == 401 and
          error_of(body).get("code") == "UNAUTHENTICATED", "%d %s" % (status, body[:300]))
    status, _, body = post_message("/v1/trace", pb.TraceRequest(attention=seed_request()))
    check("trace without token: 401", status == 401, "%d %s" % (status, body[:300]))
    status, headers, body = http_call("GET", "/v1/info", headers=http_auth)
    check("right token: 200 with the CORS origin",
          status == 200 and headers.get("Access-Control-Allow-Origin") == origin,
          "%d %s" % (status, dict(headers)))
    status, headers, _ = http_call("OPTIONS", "/v1/trace", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    allowed = headers.get("Access-Control-Allow-Headers", "").lower()
    check("preflight: 2xx, origin, methods, Authorization and Content-Type",
          200 <= status < 300 and headers.get("Access-Control-Allow-Origin") == origin and
          "POST" in headers.get("Access-Control-Allow-Methods", "") and
          "authorization" in allowed and "content-type" in allowed,
          "%d %s" % (status, dict(headers)))
    status, _, _ = http_call("GET", "/")
    check("the page loads without a token", status == 200)
    # The cache routes check the token as the others do.
    for method, path, payload in (("GET", "/v1/caches", None),
                                  ("POST", "/v1/caches", "{\"kvHeads\": 1, \"headDim\": 4}"),
                                  ("GET", "/v1/caches/%s" % ("0" * 32), None),
                                  ("DELETE", "/v1/caches/%s" % ("0" * 32), None),
                                  ("POST", "/v1/decode", "{}")):
        status, _, body = http_call(method, path, payload)
        check("%s %s without a token: 401" % (method, path), status == 401,
              "%d %s" % (status, body[:200]))
    status, _, body = http_call("POST", "/v1/caches", "{\"kvHeads\": 1, \"headDim\": 4, "
                                "\"valueDim\": 4, \"dtype\": \"DTYPE_FLOAT32\"}", http_auth)
    check("cache create with the token: 200", status == 200, "%d %s" % (status, body[:200]))
    if status == 200:
        made = json.loads(body)["cacheId"]
        status, _, _ = http_call("DELETE", "/v1/caches/" + made, headers=http_auth)
        check("cache delete with the token: 200", status == 200)
    _, headers, _ = http_call("OPTIONS", "/v1/caches/" + "0" * 32, headers={
        "Origin": origin, "Access-Control-Request-Method": "DELETE"})
    check("preflight allows DELETE", "DELETE" in headers.get("Access-Control-Allow-Methods", ""),
          str(dict(headers)))


def raw_exchange(head, body=b"", timeout=2.0, feed=None):
    """Sends `head` (the request line and headers, without the blank line) and `body` on a new
    connection, then `feed(sock)` if given; reads the answer until the server closes it or
    `timeout` seconds have passed since the send. Returns (status, error JSON, seconds, closed,
    raw answer); status 0 when nothing came."""
    import socket
    sock = socket.create_connection(("127.0.0.1", int(http_port)), timeout=timeout)
    start = time.time()
    sock.sendall(head + b"\r\n" + body)
    if feed:
        feed(sock)
    answer, closed = b"", False
    while True:
        left = start + timeout - time.time()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
            break
        answer += chunk
    elapsed = time.time() - start
    sock.close()
    status = int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    error = error_of(answer.split(b"\r\n\r\n", 1)[1]) if b"\r\n\r\n" in answer else {}
    return status, error, elapsed, closed, answer


def limits_checks():
    """attnd with --auth-token-file and --max-message-bytes 1024: requests judged from their
    headers before any body is read."""
    import threading
    limit = 1024 // 3 * 4 + (1 << 20)  # The gateway's JSON limit for --max-message-bytes 1024.
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n"
    json_type = b"Content-Type: application/json\r\n"

    # The slow bodies first, in threads: each takes the 10 s read timeout.
    slow = {}

    def stall():
        slow["stall"] = raw_exchange(b"POST /v1/naive HTTP/1.1\r\nHost: x\r\n" + auth + json_type +
                                     b"Content-Length: 1000\r\n", b"{\"qu", timeout=16)

    def trickle_feed(sock):
        import select
        for _ in range(20):  # A byte a second (each read finds data) until the server answers.
            if select.select([sock], [], [], 1)[0]:
                return
            try:
                sock.sendall(b" ")
            except OSError:
                return

    def trickle():
        slow["trickle"] = raw_exchange(b"POST /v1/naive HTTP/1.1\r\nHost: x\r\n" + auth +
                                       json_type + b"Content-Length: 1000\r\n", b"{",
                                       timeout=30, feed=trickle_feed)
    threads = [threading.Thread(target=stall), threading.Thread(target=trickle)]
    for thread in threads:
        thread.start()

    # A wrong token with a 100 MB body announced and none sent: refused from the headers.
    head = (b"POST /v1/naive HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n" + json_type +
            b"Content-Length: 100000000\r\n")
    status, error, elapsed, closed, answer = raw_exchange(head)
    check("wrong token, 100 MB Content-Length, no body sent: 401 UNAUTHENTICATED within 2 s, "
          "closed", status == 401 and error.get("code") == "UNAUTHENTICATED" and closed and
          elapsed < 2, "%d %.1fs closed=%s %r" % (status, elapsed, closed, answer[:200]))
    status, error, elapsed, closed, answer = raw_exchange(head + b"Expect: 100-continue\r\n")
    check("wrong token with Expect: 100-continue: 401 at once, no 100 Continue",
          status == 401 and closed and elapsed < 2,
          "%d %.1fs closed=%s %r" % (status, elapsed, closed, answer[:200]))

    # Bodies over the JSON limit: by Content-Length before reading, chunked once past it.
    status, error, elapsed, closed, answer = raw_exchange(
        b"POST /v1/tiled HTTP/1.1\r\nHost: x\r\n" + auth + json_type +
        b"Content-Length: %d\r\n" % (limit + 1))
    check("Content-Length one over the limit, no body sent: 413 within 2 s naming the limit",
          status == 413 and error.get("code") == "RESOURCE_EXHAUSTED" and
          str(limit) in error.get("message", "") and closed and elapsed < 2,
          "%d %.1fs %r" % (status, elapsed, answer[:300]))

    def chunked_feed(sock):
        # limit + 1 bytes in all, the last chunk's end unsent: the server reads every byte sent.
        sent = 0
        while sent <= limit:
            size = min(65536, limit + 1 - sent)
            sock.sendall(b"%x\r\n" % size + b" " * size + (b"\r\n" if sent + size <= limit else b""))
            sent += size
    status, error, elapsed, closed, answer = raw_exchange(
        b"POST /v1/tiled HTTP/1.1\r\nHost: x\r\n" + auth + json_type +
        b"Transfer-Encoding: chunked\r\n", timeout=5, feed=chunked_feed)
    check("a chunked body one byte over the limit: 413, closed",
          status == 413 and error.get("code") == "RESOURCE_EXHAUSTED" and closed,
          "%d %.1fs %r" % (status, elapsed, answer[:300]))

    # Routes that take no body.
    for name, head, body in (
            ("GET /v1/info with a Content-Length body",
             b"GET /v1/info HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 5\r\n", b"hello"),
            ("GET /v1/caches with a chunked body",
             b"GET /v1/caches HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n",
             b"5\r\nhello\r\n0\r\n\r\n"),
            ("DELETE /v1/caches/ID with a body",
             b"DELETE /v1/caches/%s HTTP/1.1\r\nHost: x\r\n" % (b"0" * 32) + auth +
             b"Content-Length: 2\r\n", b"{}")):
        status, error, elapsed, closed, answer = raw_exchange(head, body)
        check("%s: 413, closed" % name, status == 413 and
              "takes no request body" in error.get("message", "") and closed,
              "%d %.1fs %r" % (status, elapsed, answer[:300]))

    # Only JSON reaches a call: no cross-origin "simple request".
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        head = b"POST /v1/naive HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 2\r\n"
        if content_type:
            head += b"Content-Type: %s\r\n" % content_type.encode()
        status, error, elapsed, closed, answer = raw_exchange(head, b"{}")
        check("POST with Content-Type %s: 415 naming Content-Type" % content_type,
              status == 415 and "Content-Type" in error.get("message", ""),
              "%d %r" % (status, answer[:300]))
    status, _, body = http_call("POST", "/v1/naive", "{}", dict(
        http_auth, **{"Content-Type": "application/json; charset=utf-8"}))
    check("application/json; charset=utf-8 reaches the call (400 from validation)",
          status == 400 and "query" in error_of(body).get("message", ""),
          "%d %s" % (status, body[:200]))
    status, error, elapsed, closed, answer = raw_exchange(
        b"POST /v1/naive HTTP/1.1\r\nHost: x\r\n" + auth + json_type, b"{}")
    check("POST with neither Content-Length nor chunked: 411 within 2 s",
          status == 411 and elapsed < 2, "%d %.1fs %r" % (status, elapsed, answer[:300]))

    # X-Timeout-Ms is range-checked.
    for value in ("-1", "abc", "1000000000000"):
        status, _, body = http_call("GET", "/v1/info", headers=dict(http_auth,
                                                                      **{"X-Timeout-Ms": value}))
        check("X-Timeout-Ms %s: 400 INVALID_ARGUMENT naming X-Timeout-Ms" % value,
              status == 400 and error_of(body).get("code") == "INVALID_ARGUMENT" and
              "X-Timeout-Ms" in error_of(body).get("message", ""), "%d %s" % (status, body[:200]))

    # Routes: unknown path 404, wrong method 405 (both JSON).
    status, _, body = http_call("GET", "/v1/nothing", headers=http_auth)
    check("unknown /v1 path: 404 NOT_FOUND", status == 404 and
          error_of(body).get("code") == "NOT_FOUND", "%d %s" % (status, body[:200]))
    status, headers, body = http_call("GET", "/v1/naive", headers=http_auth)
    check("GET /v1/naive: 405 with Allow: POST", status == 405 and
          headers.get("Allow") == "POST", "%d %s %s" % (status, dict(headers), body[:200]))

    for thread in threads:
        thread.join()
    for name in ("stall", "trickle"):
        status, error, elapsed, closed, answer = slow[name]
        print("  the %s body was answered %d after %.1f s" % (name, status, elapsed))
        check("a %s body: 408 DEADLINE_EXCEEDED, closed within the 10 s read timeout + 3 s" %
              {"stall": "stalled", "trickle": "trickled"}[name], status == 408 and error.get("code") == "DEADLINE_EXCEEDED" and closed and
              elapsed < 13, "%d %.1fs closed=%s %r" % (status, elapsed, closed, answer[:200]))
    status, _, body = http_call("GET", "/v1/info", headers=http_auth)
    check("attnd answers after all that", status == 200, "%d %s" % (status, body[:200]))


def mtls_checks():
    """--tls-client-ca: the gateway cannot check client certificates, so /v1 is refused."""
    for method, path, payload in (("GET", "/v1/info", None), ("POST", "/v1/naive", "{}"),
                                  ("GET", "/v1/caches", None)):
        status, _, body = http_call(method, path, payload)
        error = error_of(body)
        check("%s %s with --tls-client-ca: 403 PERMISSION_DENIED naming --tls-client-ca" %
              (method, path), status == 403 and error.get("code") == "PERMISSION_DENIED" and
              "--tls-client-ca" in error.get("message", ""), "%d %s" % (status, body[:200]))
    status, _, body = http_call("GET", "/healthz")
    check("/healthz still answers", status == 200, "%d %s" % (status, body[:100]))


def drain_checks(pid):
    """SIGTERM with a gateway trace streaming and a request body half sent: /v1 answers 503 while
    draining, the half-sent request too once complete (no call starts on a stopping server)."""
    import signal, socket
    body = json_format.MessageToJson(pb.TraceRequest(attention=seed_request(block_k=1))).encode()
    upload = socket.create_connection(("127.0.0.1", int(http_port)), timeout=30)
    upload.sendall(b"POST /v1/trace HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    upload.sendall(body[:10])
    rng = np.random.default_rng(11)
    keys = fp32(rng.standard_normal((4096, 16)))
    stream = http.client.HTTPConnection("127.0.0.1", int(http_port), timeout=30)
    stream.request("POST", "/v1/trace", json_format.MessageToJson(pb.TraceRequest(
        attention=pb.AttentionRequest(query=fp32(rng.standard_normal((8, 16))), key=keys,
                                      value=keys, options=pb.AttentionOptions(block_k=1)),
        rows=[pb.RowRef(row=r) for r in range(8)])), {"Content-Type": "application/json"})
    response = stream.getresponse()
    check("drain: the trace streams", b"data: " in response.readline())
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    status, _, body_info = http_call("GET", "/v1/info")
    check("drain: a new /v1 call is 503 UNAVAILABLE",
          status == 503 and error_of(body_info).get("code") == "UNAVAILABLE",
          "%d %s" % (status, body_info[:200]))
    upload.sendall(body[10:])
    answer = b""
    while True:
        chunk = upload.recv(65536)
        if not chunk:
            break
        answer += chunk
    check("drain: the half-sent request is answered 503", answer.startswith(b"HTTP/1.1 503"),
          repr(answer[:100]))
    read = 0
    while response.readline():
        read += 1
    check("drain: the trace stream went on, then ended", read > 0)


if mode in ("drain", "limits", "mtls"):
    if mode == "drain":
        drain_checks(int(sys.argv[7]))
    elif mode == "limits":
        limits_checks()
    else:
        mtls_checks()
    print("%s: %d passed, %d failed" % (mode, passed, len(failures)))
    sys.exit(1 if failures else 0)
main_checks()
if mode == "plain":
    cache_checks()
    latent_cache_checks()
if mode == "auth":
    auth_checks()
print("%s: %d passed, %d failed" % (mode, passed, len(failures)))
sys.exit(1 if failures else 0)
EOF

rc=0
start
/usr/bin/python3 "$dir/check.py" plain "$port" "$http_port" "$stubs" "$source_dir" "" || rc=1
stop

printf 'gateway-test-token\n' >"$dir/token"
start --http-cors-origin https://viewer.example --auth-token-file "$dir/token"
/usr/bin/python3 "$dir/check.py" auth "$port" "$http_port" "$stubs" "$source_dir" "$dir/token" ||
  rc=1
stop

# The admission from the headers: token, body limits, Content-Type, X-Timeout-Ms, slow bodies.
start --auth-token-file "$dir/token" --max-message-bytes 1024
/usr/bin/python3 "$dir/check.py" limits "$port" "$http_port" "$stubs" "$source_dir" "$dir/token" ||
  rc=1
stop

# gRPC requires client certificates: the gateway is off (a self-signed certificate serves as the
# server's and as the client CA).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj "/CN=127.0.0.1" \
  -addext "subjectAltName=IP:127.0.0.1" -keyout "$dir/tls.key" -out "$dir/tls.crt" 2>"$dir/openssl.log"
start --tls-cert "$dir/tls.crt" --tls-key "$dir/tls.key" --tls-client-ca "$dir/tls.crt"
/usr/bin/python3 "$dir/check.py" mtls "$port" "$http_port" "$stubs" "$source_dir" "" || rc=1
stop

# SIGTERM while the gateway streams a trace and receives a body: exit 0 within the grace.
start --shutdown-grace 3
/usr/bin/python3 "$dir/check.py" drain "$port" "$http_port" "$stubs" "$source_dir" "" "$server" ||
  rc=1
status=0
for _ in $(seq 100); do
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
wait "$server" || status=$?
server=""
if [ "$status" -ne 0 ]; then
  echo "FAIL drain: attnd exited with status $status (want 0, within the 3 s grace)"
  rc=1
fi

if [ "$rc" -ne 0 ]; then
  echo "--- attnd stderr (last run)"
  tail -20 "$dir/err"
  echo "FAIL gateway_test"
  exit 1
fi
echo "PASS gateway_test"
