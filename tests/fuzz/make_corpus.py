#!/usr/bin/python3
"""Writes the fuzz target's seed corpus (tests/fuzz/corpus/): small requests, each file one byte
choosing the message (0: AttentionRequest, 1: TraceRequest, 2: a cache step) and then the message
in protobuf's binary format; a cache step is the CreateCacheRequest's length as a varint, that
CreateCacheRequest and a DecodeRequest (tests/fuzz/fuzz_input.h). Deterministic; rerun it after
changing the proto and commit the result:

  /usr/bin/python3 tests/fuzz/make_corpus.py --stubs build/release/python

Needs the Debian python3-grpcio (for protobuf) and python3-numpy, and the Python stubs the build
generates.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--stubs", default=os.path.join(REPO_ROOT, "build", "release", "python"))
parser.add_argument("--out", default=os.path.join(HERE, "corpus"))
args = parser.parse_args()
sys.path.insert(0, os.path.abspath(args.stubs))

import numpy as np  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402

ATTENTION, TRACE, CACHE_STEP = b"\x00", b"\x01", b"\x02"


def tensor(values, dtype):
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == pb.DTYPE_FLOAT32:
        data = values.astype("<f4").tobytes()
    elif dtype == pb.DTYPE_FLOAT16:
        data = values.astype("<f2").tobytes()
    else:  # bf16: round to nearest even on the fp32 bits
        bits = values.astype("<f4").view("<u4").astype(np.uint64)
        data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return pb.Tensor(shape=list(values.shape), dtype=dtype, data=data)


def seed_example(multiplier=1.0):
    """The explainer's 8×4 example (README, tests/reference.h)."""
    n, d = 8, 4
    q = np.array([[((i + j) % 5 - 2) * multiplier for j in range(d)] for i in range(n)])
    k = np.array([[((2 * i + j) % 7 - 3) / 2 for j in range(d)] for i in range(n)])
    v = np.array([[(i + j) % 9 - 4 for j in range(d)] for i in range(n)])
    f32 = pb.DTYPE_FLOAT32
    return pb.AttentionRequest(query=tensor(q, f32), key=tensor(k, f32), value=tensor(v, f32))


def random_request(seed, leading, kv_heads, query_len, key_len, head_dim, value_dim,
                   dtypes=(pb.DTYPE_FLOAT32,) * 3, **options):
    """Uniform(−1, 1) inputs; `leading` is [] (rank 2), [heads] or [batch, heads]."""
    rng = np.random.default_rng(seed)
    kv_leading = leading[:-1] + [kv_heads] if leading else []
    q = rng.uniform(-1, 1, leading + [query_len, head_dim])
    k = rng.uniform(-1, 1, kv_leading + [key_len, head_dim])
    v = rng.uniform(-1, 1, kv_leading + [key_len, value_dim])
    return pb.AttentionRequest(query=tensor(q, dtypes[0]), key=tensor(k, dtypes[1]),
                               value=tensor(v, dtypes[2]),
                               options=pb.AttentionOptions(**options))


def ragged(request, cu_seqlens_q, cu_seqlens_k):
    """The request as a ragged batch (AttentionRequest.cu_seqlens_q/k)."""
    request.cu_seqlens_q.extend(cu_seqlens_q)
    request.cu_seqlens_k.extend(cu_seqlens_k)
    return request


def varint(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n >= 0x80 else 0))
        n >>= 7
        if not n:
            return bytes(out)


def cache_step(seed, kv_heads, head_dim, value_dim, dtype, heads, query_len, new_tokens,
               latent=False, send_value=None, item=None, **options):
    """CreateCache, then a Decode of one item over it (attention_fuzz.cc's FuzzCacheStep): the
    item's new_tokens (key, and value unless latent or send_value is False) and its query of
    `heads` heads, in the cache's dtype; `item` sets more DecodeItem fields."""
    rng = np.random.default_rng(seed)
    create = pb.CreateCacheRequest(kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                                   dtype=dtype, values_from_keys=latent)
    width = value_dim or head_dim
    decode_item = pb.DecodeItem(
        cache_id="c", query=tensor(rng.uniform(-1, 1, [heads, query_len, head_dim]), dtype),
        **(item or {}))
    if new_tokens:
        decode_item.key.CopyFrom(tensor(rng.uniform(-1, 1, [kv_heads, new_tokens, head_dim]),
                                        dtype))
        if send_value if send_value is not None else not latent:
            decode_item.value.CopyFrom(tensor(rng.uniform(-1, 1, [kv_heads, new_tokens, width]),
                                              dtype))
    decode = pb.DecodeRequest(items=[decode_item], options=pb.AttentionOptions(**options))
    create_bytes = create.SerializeToString()
    return CACHE_STEP + varint(len(create_bytes)) + create_bytes + decode.SerializeToString()


def rows(*refs):
    return [pb.RowRef(batch=b, head=h, row=r) for b, h, r in refs]


F32, F16, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16
seed = seed_example()
seed.options.block_k = 2
ties = seed_example(1000.0)
ties.options.return_lse = True

seeds = {
    "attention-seed-8x4": ATTENTION + seed.SerializeToString(),
    "attention-seed-ties-lse": ATTENTION + ties.SerializeToString(),
    "attention-causal-gqa": ATTENTION + random_request(
        1, [2, 4], 2, 7, 11, 5, 3, causal=True, block_k=4, return_lse=True).SerializeToString(),
    "attention-causal-unseeing-rows": ATTENTION + random_request(
        2, [2], 2, 9, 5, 3, 3, causal=True, block_k=2, return_lse=True).SerializeToString(),
    "attention-f16-gqa": ATTENTION + random_request(
        3, [1, 2], 1, 13, 13, 8, 8, (F16, F16, F16), block_k=5,
        output_dtype=F32).SerializeToString(),
    "attention-bf16-causal": ATTENTION + random_request(
        4, [3], 3, 6, 17, 4, 6, (BF16, BF16, BF16), causal=True, return_lse=True,
        scale=0.75).SerializeToString(),
    # A slice of a causal problem's keys placed by positions: some rows see none of it.
    "attention-causal-key-slice": ATTENTION + random_request(
        8, [2, 2], 1, 9, 6, 4, 5, causal=True, block_k=4, return_lse=True, key_position=12,
        query_position=9).SerializeToString(),
    # A causal left window: tiles hidden on both sides of each block's rows.
    "attention-causal-window": ATTENTION + random_request(
        10, [2, 2], 1, 13, 19, 5, 4, causal=True, block_k=3, return_lse=True,
        window_left=4).SerializeToString(),
    # A softcap below the largest scores, with a causal window.
    "attention-softcap-window": ATTENTION + random_request(
        12, [2], 1, 11, 14, 6, 5, causal=True, block_k=4, return_lse=True, window_left=5,
        softcap=0.5).SerializeToString(),
    # ALiBi with GQA, causal, and a key slice placed by positions (distances on both sides).
    "attention-alibi-gqa": ATTENTION + random_request(
        14, [1, 4], 2, 9, 13, 5, 4, causal=True, block_k=3, return_lse=True,
        alibi_slopes=[0.5, 0.25, 0.125, 0.0625]).SerializeToString(),
    "attention-alibi-key-slice": ATTENTION + random_request(
        15, [2], 1, 7, 8, 4, 3, block_k=5, return_lse=True, key_position=6, query_position=3,
        alibi_slopes=[0.7, -0.3], softcap=2.0).SerializeToString(),
    # Attention sinks (gpt-oss): GQA, causal with a window; a key slice whose first rows see no
    # key (output 0, lse = sink); sinks far above every score with a softcap and ALiBi.
    "attention-sinks-window-gqa": ATTENTION + random_request(
        18, [1, 4], 2, 9, 13, 5, 4, causal=True, block_k=3, return_lse=True, window_left=4,
        sinks=[0.5, -1.0, 2.0, 0.0]).SerializeToString(),
    "attention-sinks-key-slice": ATTENTION + random_request(
        19, [2], 1, 9, 5, 4, 3, causal=True, block_k=2, return_lse=True, key_position=6,
        query_position=3, sinks=[0.25, -0.5]).SerializeToString(),
    "attention-sinks-far-above": ATTENTION + random_request(
        20, [2], 2, 6, 11, 4, 4, block_k=4, return_lse=True, softcap=2.0,
        alibi_slopes=[0.5, 0.25], sinks=[40.0, 1e4]).SerializeToString(),
    # Ragged batches: unequal lengths, an empty sequence, causal with ALiBi and a window.
    "attention-ragged-causal": ATTENTION + ragged(random_request(
        16, [4], 2, 12, 10, 5, 4, causal=True, block_k=3, return_lse=True, window_left=4,
        alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), [0, 5, 5, 12], [0, 3, 7, 10]).SerializeToString(),
    "attention-ragged-decreasing": ATTENTION + ragged(random_request(
        17, [2], 1, 6, 6, 3, 3, block_k=2), [0, 4, 2, 6], [0, 1, 2, 6]).SerializeToString(),
    "attention-mixed-dtypes": ATTENTION + random_request(
        5, [], 1, 5, 9, 6, 2, (F16, BF16, F32), block_k=3, output_dtype=F16).SerializeToString(),
    # Finite inputs whose scores overflow fp32 (4·1e20·1e20 > 3.4e38): inf − inf in the softmax.
    "attention-overflowing-scores": ATTENTION + pb.AttentionRequest(
        query=tensor(np.full((2, 4), 1e20), F32), key=tensor(np.full((3, 4), 1e20), F32),
        value=tensor(np.ones((3, 2)), F32),
        options=pb.AttentionOptions(block_k=2)).SerializeToString(),
    "attention-invalid-head-dim": ATTENTION + pb.AttentionRequest(
        query=tensor(np.ones((2, 4)), F32), key=tensor(np.ones((3, 8)), F32),
        value=tensor(np.ones((3, 8)), F32)).SerializeToString(),
    "trace-seed-8x4": TRACE + pb.TraceRequest(attention=seed).SerializeToString(),
    "trace-ragged-rows": TRACE + pb.TraceRequest(
        attention=ragged(random_request(18, [2], 2, 9, 11, 4, 4, causal=True, block_k=3),
                         [0, 2, 9], [0, 6, 11]),
        rows=rows((0, 0, 1), (0, 1, 5))).SerializeToString(),
    "trace-causal-gqa-rows": TRACE + pb.TraceRequest(
        attention=random_request(6, [2, 4], 2, 7, 11, 5, 3, causal=True, block_k=3),
        rows=rows((0, 0, 0), (1, 3, 6), (0, 1, 3))).SerializeToString(),
    "trace-causal-query-position": TRACE + pb.TraceRequest(
        attention=random_request(9, [3], 3, 5, 13, 4, 4, causal=True, block_k=3, key_position=2,
                                 query_position=7),
        rows=rows((0, 0, 0), (0, 2, 4))).SerializeToString(),
    "trace-sinks-unseeing-row": TRACE + pb.TraceRequest(
        attention=random_request(21, [2], 1, 7, 5, 4, 3, causal=True, block_k=2, sinks=[0.5, 3.0]),
        rows=rows((0, 0, 0), (0, 1, 6))).SerializeToString(),
    "trace-two-sided-window": TRACE + pb.TraceRequest(
        attention=random_request(11, [2], 2, 9, 15, 4, 3, block_k=2, window_left=3,
                                 window_right=2),
        rows=rows((0, 0, 0), (0, 1, 8))).SerializeToString(),
    "trace-bf16-unseeing-row": TRACE + pb.TraceRequest(
        attention=random_request(7, [2], 1, 6, 4, 4, 4, (BF16, BF16, BF16), causal=True,
                                 block_k=3),
        rows=rows((0, 1, 0), (0, 0, 5))).SerializeToString(),
    # KV caches (CreateCache, then one Decode item over the cache holding the item's new tokens
    # once). Latent (MLA-like: 8 heads over one kv head, the values the keys' first 16 of 24
    # columns), bf16, with a cut; a GQA cache with sinks; a token tree over a cached prefix.
    "cache-latent-mla-bf16": cache_step(
        30, 1, 24, 16, BF16, 8, 2, 9, latent=True, item={"truncate_to": 4}, causal=True,
        return_lse=True),
    "cache-gqa-sinks": cache_step(
        31, 2, 8, 6, F16, 4, 3, 4, item={"truncate_to": 2}, causal=True, return_lse=True,
        sinks=[0.5, -1.0, 2.0, 0.0]),
    "cache-tree": cache_step(
        32, 1, 8, 0, F32, 2, 5, 5, item={"tree_parents": [-1, 0, 0, 1, -1]}, causal=True,
        return_lse=True),
    # A fork at the cut (an odd expected_length): the fork copies the shared partly filled page
    # before it appends; the source keeps its tokens.
    "cache-fork-bf16": cache_step(
        38, 2, 8, 6, BF16, 4, 2, 7, item={"truncate_to": 5, "expected_length": 7}, causal=True,
        return_lse=True),
    "cache-fork-latent": cache_step(
        39, 1, 24, 16, BF16, 8, 1, 6, latent=True, item={"truncate_to": 3, "expected_length": 1},
        return_lse=True),
    "cache-latent-tree-window": cache_step(
        33, 2, 12, 5, F32, 4, 4, 4, latent=True, item={"tree_parents": [-1, 0, 1, 0]},
        causal=True, window_left=5, return_lse=True),
    # Refused: a value sent to a latent cache; a latent cache with value_dim > head_dim; a cut
    # past the cache's length (OUT_OF_RANGE); a query over an empty cache (FAILED_PRECONDITION).
    "cache-latent-value-refused": cache_step(
        34, 1, 8, 4, BF16, 2, 1, 3, latent=True, send_value=True),
    "cache-latent-value-dim-refused": cache_step(
        35, 1, 24, 32, BF16, 8, 1, 2, latent=True),
    "cache-cut-past-length": cache_step(
        36, 1, 4, 0, F32, 1, 1, 2, item={"truncate_to": 3}),
    "cache-empty": cache_step(37, 1, 4, 0, F32, 1, 1, 0),
}

os.makedirs(args.out, exist_ok=True)
for name, data in sorted(seeds.items()):
    with open(os.path.join(args.out, name), "wb") as f:
        f.write(data)
    print("%-32s %5d bytes" % (name, len(data)))
