#!/usr/bin/python3
"""Positions and merge_states through the Python client (client/python/attn_client.py).

One causal problem split by keys: each slice [a, b) is sent with key_position = a (plus the whole
problem's first key position) and the whole problem's query_position, with return_lse and an fp32
output; attn_client.merge_states combines the parts. Checked against a float64 NumPy reference of
the unsplit problem with positions (computed here), and against the unsplit Tiled, on fresh
random inputs of odd sizes:

  - every part against the reference of its own slice (lse −inf and zeros exactly on the rows
    that see none of its keys), and the merged (output, lse) against the whole problem:
    relative error (max |out − ref| / max |ref|) ≤ 3e-6, lse within 1e-4;
  - causal with query_len ≠ key_len, GQA with value_dim ≠ head_dim (rank 4), fp16 and bf16
    inputs (the reference on the same rounded inputs: outputs are fp32, so only the rounding of
    the inputs differs from fp32, and the reference has it too), slices of one key, unequal
    slices, slices some rows cannot see, query rows placed mid-sequence by query_position (and
    past every key), whole problems starting at a large key_position, rows no part sees;
    Naive and Tiled, default and odd block_k;
  - positions leave a non-causal problem unchanged; Trace's TraceStart repeats the resolved
    positions and its rows and masked scores follow them;
  - Decode with per-item positions: one sequence held in two caches, the two items merged
    against the reference (one item with the default query_position, one new token appended);
    Cache.decode and tiled(cache=) with positions;
  - errors: negative or past-2^62 key_position / query_position → INVALID_ARGUMENT naming
    options.key_position / options.query_position (Naive, Tiled, Trace; raw stubs, since the
    client refuses them itself with ValueError/TypeError, also checked), Decode with positions
    in its options → INVALID_ARGUMENT naming options.key_position, a negative item position
    naming items[0].key_position;
  - attention sinks: the sinks sent only with the first slice (the one at the sequence's first
    key), the other slices without, in Naive and Tiled: each part against its own reference,
    the merge against the float64 reference of the whole with sinks (each head at its own
    scale: sinks near the scores, 50 and −50) and the unsplit Tiled; sinks on every part
    shown not to merge to it; GQA rank 4, not causal, a window hiding the first slice from
    some rows (lse = the sink there), rows no part sees (zeros, lse = the sink), a first
    slice of one key at 2^40 + 3; a sequence in two caches, the first cache's item decoded
    with the sinks and the other in a Decode without;
  - merge_states alone (no server): one part is itself, all-(−inf) rows give zeros and −inf
    (never NaN, whatever the parts' outputs hold there), a float64 split of a reference merges
    back to 1e-12 (with sinks on the first slice too), huge lse values do not overflow, part
    order does not matter, ValueError / TypeError naming the problem for an empty list,
    mismatched shapes, NaN lse, bf16 bits.

Run by CTest as
  /usr/bin/python3 tests/python/test_merge.py --attnd <attnd> --stubs <stubs dir>
"""

import math
import sys
import unittest

import attnd_harness as harness  # tests/python is sys.path[0] for a script.

ARGS = harness.parse_args(__doc__, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from attn_client import merge_states  # noqa: E402
from attnd_harness import as4  # noqa: E402

RPC_TIMEOUT_S = 60.0
OUTPUT_RTOL = 3e-6  # max |out − ref| / max |ref| for fp32 outputs (inputs in [-1, 1]).
LSE_ATOL = 1e-4
MAX_POSITION = 1 << 62
# The largest errors seen, printed at the end (and so in the CTest log).
WORST = {"output": 0.0, "lse": 0.0}


# --- Inputs and the float64 reference ------------------------------------------------------------

def rounded(array, dtype):
    """The float64 values the server sees for float32 `array` sent with dtype= `dtype`
    (rounded by the harness's own bf16 rounding, not the client's)."""
    if dtype is None or dtype == "fp32":
        return array.astype(np.float64)
    if dtype == "fp16":
        return array.astype(np.float16).astype(np.float64)
    return harness.bf16_bits_to_fp32(harness.round_to_bf16_bits(array)).astype(np.float64)


def reference(q, k, v, causal, key_position=0, query_position=None, scale=None, sinks=None,
              window_left=None):
    """float64 attention of q [.., heads, Nq, d] over k [.., kv_heads, Nk, d], v [.., Nk, dv]
    with positions: key j at key_position + j, query row i at query_position + i (None:
    key_position + Nk − Nq); causal: a query at p sees a key at t iff t ≤ p; window_left (None:
    unbounded): only if t ≥ p − window_left. sinks (None: none): one logit per query head in
    each row's softmax that takes weight but adds no value (attention.proto,
    AttentionOptions.sinks): m = max(max_j x_j, sink), out = Σ_j e^(x_j − m) v_j /
    (Σ_j e^(x_j − m) + e^(sink − m)), lse = m + log(Σ_j e^(x_j − m) + e^(sink − m)).
    → (out, lse) in q's leading shape; rows that see no key give zeros and lse −inf (the sink
    with sinks)."""
    lead = np.shape(q)[:-1]
    q, k, v = as4(q), as4(k), as4(v)
    heads, query_len, head_dim = q.shape[1:]
    kv_heads, key_len = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if query_position is None:
        query_position = key_position + key_len - query_len
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = scale * np.matmul(q, np.swapaxes(k, -1, -2))
    query_at = query_position + np.arange(query_len, dtype=np.int64)[:, None]
    key_at = key_position + np.arange(key_len, dtype=np.int64)[None, :]
    if causal:
        scores = np.where(key_at <= query_at, scores, -np.inf)
    if window_left is not None:
        scores = np.where(key_at >= query_at - window_left, scores, -np.inf)
    sink = np.full((1, heads, 1, 1), -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(1, heads, 1, 1)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - safe_max)
    denominator = weights.sum(axis=-1, keepdims=True) + np.exp(sink - safe_max)
    seen = denominator > 0
    out = np.where(seen, np.matmul(weights, v) / np.where(seen, denominator, 1.0), 0.0)
    lse = np.where(seen[..., 0], np.log(np.where(seen, denominator, 1.0))[..., 0] +
                   safe_max[..., 0], -np.inf)
    return out.reshape(lead + (v.shape[-1],)), lse.reshape(lead)


def hidden_rows(query_len, key_begin, query_position):
    """Whether each query row (at query_position + i) sees none of a slice's keys, the first of
    which is at key_begin, under the causal mask."""
    return query_position + np.arange(query_len) < key_begin


def output_miss(out, ref):
    """max |out − ref| / max |ref| (inf for NaN or a shape mismatch; absolute when ref is 0)."""
    out = np.asarray(out, dtype=np.float64)
    if out.shape != ref.shape or np.isnan(out).any():
        return math.inf
    if out.size == 0:
        return 0.0
    magnitude = float(np.max(np.abs(ref)))
    return float(np.max(np.abs(out - ref))) / (magnitude if magnitude > 0 else 1.0)


def lse_miss(lse, ref):
    """max |lse − ref| over rows the reference sees; inf for NaN, a shape mismatch or a −inf
    pattern that differs from the reference's."""
    lse = np.asarray(lse, dtype=np.float64)
    if lse.shape != ref.shape or np.isnan(lse).any():
        return math.inf
    hidden = np.isneginf(ref)
    if not np.array_equal(np.isneginf(lse), hidden):
        return math.inf
    return float(np.max(np.abs(lse[~hidden] - ref[~hidden]), initial=0.0))


# --- The server ----------------------------------------------------------------------------------

class ServerCase(harness.ServerCase):
    """harness.ServerCase, with a raw stub beside the Client."""

    attnd = ARGS.attnd
    rpc_timeout = RPC_TIMEOUT_S

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.channel = harness.open_channel(cls.server.address)
        cls.stub = harness.pb_grpc().AttentionServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        super().tearDownClass()

    def setUp(self):
        self.rng = np.random.default_rng()

    def uniform(self, *shape):
        return self.rng.uniform(-1, 1, size=shape).astype(np.float32)

    def assertOutput(self, out, ref, what):
        miss = output_miss(out, ref)
        WORST["output"] = max(WORST["output"], miss)
        self.assertLessEqual(miss, OUTPUT_RTOL, "%s: output relative error %.3g" % (what, miss))

    def assertLse(self, lse, ref, what):
        miss = lse_miss(lse, ref)
        WORST["lse"] = max(WORST["lse"], miss)
        self.assertLessEqual(miss, LSE_ATOL, "%s: lse miss %.3g (inf: NaN or a different −inf "
                             "pattern: %s vs %s)" % (what, miss, np.isneginf(lse).sum(),
                                                     np.isneginf(ref).sum()))


class SplitTest(ServerCase):
    """One problem's keys split into slices, each part against its own reference, the merge
    against the whole problem's."""

    def check_split(self, q_shape, k_shape, v_shape, bounds, causal=True, query_position=None,
                    key_position=0, dtype=None, block_k=0, rpcs=("tiled", "naive")):
        """bounds: the slice edges, 0 … key_len. query_position None: the whole problem's
        bottom-right (key_position + key_len − query_len), given explicitly to each part.
        Returns the parts' lse of the last rpc (for the callers' own checks)."""
        q32, k32, v32 = self.uniform(*q_shape), self.uniform(*k_shape), self.uniform(*v_shape)
        q_seen, k_seen, v_seen = (rounded(x, dtype) for x in (q32, k32, v32))
        query_len, key_len = q_shape[-2], k_shape[-2]
        self.assertEqual((bounds[0], bounds[-1]), (0, key_len))
        whole_query_position = (key_position + key_len - query_len if query_position is None
                                else query_position)
        ref, ref_lse = reference(q_seen, k_seen, v_seen, causal, key_position, query_position)
        unsplit = self.client.tiled(q32, k32, v32, causal=causal, key_position=key_position,
                                    query_position=query_position, return_lse=True,
                                    dtype=dtype, output_dtype="fp32", block_k=block_k)
        self.assertEqual(unsplit.output.dtype, np.float32)
        self.assertOutput(unsplit.output, ref, "unsplit tiled")
        self.assertLse(unsplit.lse, ref_lse, "unsplit tiled")
        part_lse = None
        for rpc in rpcs:
            parts, part_lse = [], []
            for a, b in zip(bounds[:-1], bounds[1:]):
                what = "%s slice [%d, %d) of %d keys" % (rpc, a, b, key_len)
                with self.subTest(part=what, dtype=dtype):
                    result = getattr(self.client, rpc)(
                        q32, k32[..., a:b, :], v32[..., a:b, :], causal=causal,
                        key_position=key_position + a, query_position=whole_query_position,
                        return_lse=True, dtype=dtype, output_dtype="fp32", block_k=block_k)
                    self.assertEqual(result.output_dtype, "fp32")
                    part_ref, part_ref_lse = reference(
                        q_seen, k_seen[..., a:b, :], v_seen[..., a:b, :], causal,
                        key_position + a, whole_query_position)
                    self.assertOutput(result.output, part_ref, what)
                    self.assertLse(result.lse, part_ref_lse, what)
                    if causal:  # Rows that see none of the slice's keys: exactly 0 and −inf.
                        hidden = hidden_rows(query_len, key_position + a, whole_query_position)
                        self.assertTrue(np.isneginf(result.lse[..., hidden]).all(), what)
                        self.assertTrue((result.output[..., hidden, :] == 0).all(), what)
                        self.assertTrue(np.isfinite(result.lse[..., ~hidden]).all(), what)
                    parts.append((result.output, result.lse))
                    part_lse.append(result.lse)
            with self.subTest(merged=rpc, dtype=dtype):
                output, lse = merge_states(parts)
                self.assertEqual((output.dtype, lse.dtype), (np.float32, np.float32))
                self.assertEqual(output.shape, ref.shape)
                self.assertOutput(output, ref, "merged %s vs float64" % rpc)
                self.assertLse(lse, ref_lse, "merged %s vs float64" % rpc)
                self.assertLessEqual(output_miss(output, unsplit.output.astype(np.float64)),
                                     OUTPUT_RTOL, "merged %s vs unsplit tiled" % rpc)
                self.assertLessEqual(lse_miss(lse, unsplit.lse.astype(np.float64)), LSE_ATOL,
                                     "merged %s lse vs unsplit tiled" % rpc)
        return part_lse

    def test_causal_query_len_differs(self):
        # Rank 3, 13 queries over 37 keys (bottom-right: query 0 at position 24), unequal
        # slices; the first slice's keys are seen by every row, the last's only by some.
        self.check_split((3, 13, 24), (3, 37, 24), (3, 37, 24), [0, 5, 19, 30, 37], block_k=7)

    def test_more_queries_than_keys(self):
        # 19 queries over 11 keys, bottom-right: rows 0..7 see no key at all, in any part: the
        # merge gives them zeros and lse −inf. (The keys start at 10, so that the whole
        # problem's query_position, 10 + 11 − 19 = 2, is a valid position to send the parts.)
        self.check_split((2, 19, 9), (2, 11, 9), (2, 11, 9), [0, 4, 11], key_position=10,
                         block_k=3)

    def test_gqa_value_dim_rank4(self):
        # 2 batches, 6 query heads over 2 kv heads, head_dim 20, value_dim 13.
        self.check_split((2, 6, 9, 20), (2, 2, 31, 20), (2, 2, 31, 13), [0, 10, 11, 31],
                         block_k=5)

    def test_fp16_and_bf16_inputs(self):
        for dtype in ("fp16", "bf16"):
            with self.subTest(dtype=dtype):
                self.check_split((4, 7, 17), (2, 29, 17), (2, 29, 11), [0, 9, 17, 29],
                                 dtype=dtype)

    def test_slices_of_one_key(self):
        bounds = list(range(8))
        part_lse = self.check_split((2, 5, 6), (1, 7, 6), (1, 7, 3), bounds, block_k=1)
        # Bottom-right: row i (position 2 + i) sees keys 0 … 2 + i, so key j's part hides rows
        # i < j − 2.
        for j, lse in enumerate(part_lse):
            np.testing.assert_array_equal(np.isneginf(lse[0]), np.arange(5) < j - 2)

    def test_query_rows_mid_sequence(self):
        # 6 query rows at positions 17..22 over 40 keys: the slice [20, 33) is hidden from rows
        # 17..19 (partly seen), [33, 40) from every row (all −inf, zeros).
        part_lse = self.check_split((3, 6, 10), (3, 40, 10), (3, 40, 7), [0, 12, 20, 33, 40],
                                    query_position=17, block_k=4)
        np.testing.assert_array_equal(np.isneginf(part_lse[2][0]),
                                      [True, True, True, False, False, False])
        self.assertTrue(np.isneginf(part_lse[3]).all())

    def test_query_rows_past_every_key(self):
        # Queries at 500.. see every key: the same as the non-causal problem.
        self.check_split((2, 5, 8), (2, 23, 8), (2, 23, 8), [0, 8, 23], query_position=500)

    def test_large_key_position(self):
        # The whole sequence starts at 2^40 + 3; queries mid-sequence.
        start = (1 << 40) + 3
        self.check_split((2, 7, 12), (1, 33, 12), (1, 33, 5), [0, 1, 16, 33],
                         key_position=start, query_position=start + 9)

    def test_non_causal_positions_change_nothing(self):
        q, k, v = self.uniform(3, 11, 14), self.uniform(3, 21, 14), self.uniform(3, 21, 9)
        plain = self.client.tiled(q, k, v, return_lse=True, block_k=5)
        ref, ref_lse = reference(q, k, v, causal=False)
        for key_position, query_position in ((7, 2), (0, 0), (MAX_POSITION, None),
                                             (3, MAX_POSITION)):
            for rpc in ("tiled", "naive"):
                with self.subTest(rpc=rpc, key_position=key_position,
                                  query_position=query_position):
                    result = getattr(self.client, rpc)(
                        q, k, v, key_position=key_position, query_position=query_position,
                        return_lse=True, block_k=5)
                    self.assertOutput(result.output, ref, rpc)
                    self.assertLse(result.lse, ref_lse, rpc)
                    self.assertLessEqual(output_miss(result.output,
                                                     plain.output.astype(np.float64)),
                                         OUTPUT_RTOL)
        # The non-causal split merges too (positions irrelevant).
        self.check_split((2, 5, 8), (2, 17, 8), (2, 17, 8), [0, 6, 17], causal=False)


class SinkSplitTest(ServerCase):
    """Attention sinks over a key split: only the part whose slice starts the sequence (at the
    whole problem's first key_position) carries the sinks, the others none, and merge_states
    gives the unsplit answer with sinks (attention.proto, AttentionOptions.sinks)."""

    def assertPerHead(self, out, ref, sinks, what):
        """Each head's output against its own max |ref|, so a head whose sink takes nearly all
        the weight (outputs near e^−47 for a sink of 50) is checked at its own scale: bound
        OUTPUT_RTOL · max(1, |sink| / 8), as attnd_harness.fp32_rtol scales with the largest
        logit (an exponent's fp32 rounding is relative to its size)."""
        out4, ref4 = as4(np.asarray(out, dtype=np.float64)), as4(ref)
        for h, sink in enumerate(np.asarray(sinks, dtype=np.float64)):
            miss = output_miss(out4[:, h], ref4[:, h])
            WORST["output"] = max(WORST["output"], miss / max(1.0, abs(sink) / 8))
            self.assertLessEqual(miss, OUTPUT_RTOL * max(1.0, abs(sink) / 8),
                                 "%s, head %d (sink %g): output relative error %.3g"
                                 % (what, h, sink, miss))

    def check_sink_split(self, q_shape, k_shape, v_shape, bounds, sinks, causal=True,
                         query_position=None, key_position=0, window_left=None, block_k=0,
                         rpcs=("tiled", "naive")):
        """bounds: the slice edges, 0 … key_len; sinks: one per query head (float32 values).
        → the parts' lse of the last rpc."""
        sinks = np.float32(sinks)
        q, k, v = self.uniform(*q_shape), self.uniform(*k_shape), self.uniform(*v_shape)
        query_len, key_len = q_shape[-2], k_shape[-2]
        self.assertEqual((bounds[0], bounds[-1]), (0, key_len))
        whole_query_position = (key_position + key_len - query_len if query_position is None
                                else query_position)
        options = dict(causal=causal, window_left=window_left, return_lse=True,
                       output_dtype="fp32", block_k=block_k)
        ref, ref_lse = reference(q, k, v, causal, key_position, whole_query_position,
                                 sinks=sinks, window_left=window_left)
        plain, _ = reference(q, k, v, causal, key_position, whole_query_position,
                             window_left=window_left)
        self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)  # the sinks matter
        unsplit = self.client.tiled(q, k, v, key_position=key_position,
                                    query_position=whole_query_position, sinks=sinks, **options)
        self.assertOutput(unsplit.output, ref, "unsplit tiled")
        self.assertPerHead(unsplit.output, ref, sinks, "unsplit tiled")
        self.assertLse(unsplit.lse, ref_lse, "unsplit tiled")
        part_lse = None
        for rpc in rpcs:
            parts, part_lse, every = [], [], []
            for index, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                first = index == 0
                what = "%s slice [%d, %d) of %d keys%s" % (rpc, a, b, key_len,
                                                          " (with the sinks)" if first else "")
                with self.subTest(part=what):
                    call = getattr(self.client, rpc)
                    slice_options = dict(options, key_position=key_position + a,
                                         query_position=whole_query_position)
                    result = call(q, k[..., a:b, :], v[..., a:b, :],
                                  sinks=sinks if first else None, **slice_options)
                    part_ref, part_ref_lse = reference(
                        q, k[..., a:b, :], v[..., a:b, :], causal, key_position + a,
                        whole_query_position, sinks=sinks if first else None,
                        window_left=window_left)
                    self.assertOutput(result.output, part_ref, what)
                    self.assertLse(result.lse, part_ref_lse, what)
                    parts.append((result.output, result.lse))
                    part_lse.append(result.lse)
                    # The same slice with the sinks, for the wrong merge below.
                    every.append(result if first else call(
                        q, k[..., a:b, :], v[..., a:b, :], sinks=sinks, **slice_options))
            with self.subTest(merged=rpc):
                output, lse = merge_states(parts)
                self.assertEqual((output.dtype, lse.dtype), (np.float32, np.float32))
                self.assertOutput(output, ref, "merged %s vs float64" % rpc)
                self.assertPerHead(output, ref, sinks, "merged %s vs float64" % rpc)
                self.assertLse(lse, ref_lse, "merged %s vs float64" % rpc)
                self.assertLessEqual(output_miss(output, unsplit.output.astype(np.float64)),
                                     OUTPUT_RTOL, "merged %s vs unsplit tiled" % rpc)
                self.assertLessEqual(lse_miss(lse, unsplit.lse.astype(np.float64)), LSE_ATOL,
                                     "merged %s lse vs unsplit tiled" % rpc)
                # Sinks on every part count the sink once per part: not the answer.
                wrong, _ = merge_states(every)
                self.assertGreater(output_miss(wrong, ref), 100 * OUTPUT_RTOL,
                                   "sinks on every part should not merge to the answer")
        return part_lse

    def test_three_slices_rank3(self):
        # 13 queries over 37 keys, causal bottom-right; a sink near the scores, one far above
        # them (it takes nearly all the weight) and one far below (none).
        self.check_sink_split((3, 13, 24), (3, 37, 24), (3, 37, 24), [0, 11, 25, 37],
                              [0.5, 50.0, -50.0], block_k=7)

    def test_gqa_value_dim_rank4(self):
        # 2 batches, 6 query heads over 2 kv heads (different sinks on the heads of one kv
        # head), head_dim 20, value_dim 13, two slices.
        self.check_sink_split((2, 6, 9, 20), (2, 2, 31, 20), (2, 2, 31, 13), [0, 13, 31],
                              [-50.0, 0.0, 1.0, 2.5, 50.0, -1.0], block_k=5)

    def test_window_hides_the_first_slice(self):
        # 30 queries at 10 … 39 over 40 keys, causal with window_left 9: a row at p sees
        # p − 9 … p, so rows at 24 … 39 see none of the first slice [0, 15): its part gives
        # them zeros and lse = the sink, and the merge still gives them the sink's weight.
        part_lse = self.check_sink_split((2, 30, 10), (1, 40, 10), (1, 40, 7), [0, 15, 28, 40],
                                         [1.0, 3.0], window_left=9, block_k=4)
        sees_first = 10 + np.arange(30) - 9 < 15
        self.assertTrue(sees_first.any() and not sees_first.all())
        np.testing.assert_array_equal(part_lse[0][:, ~sees_first],
                                      np.float32([[1.0], [3.0]]).repeat((~sees_first).sum(), 1))

    def test_rows_no_part_sees(self):
        # 19 queries over 11 keys at 10 … 20, bottom-right (query_position 2): rows 0 … 7 see
        # no key in any part: the merge gives them zeros and lse = the sink.
        sinks = [2.0, -3.0]
        q, k, v = self.uniform(2, 19, 9), self.uniform(2, 11, 9), self.uniform(2, 11, 9)
        parts = []
        for index, (a, b) in enumerate(((0, 4), (4, 11))):
            parts.append(self.client.tiled(
                q, k[:, a:b], v[:, a:b], causal=True, key_position=10 + a, query_position=2,
                return_lse=True, output_dtype="fp32", block_k=3,
                sinks=sinks if index == 0 else None))
        output, lse = merge_states(parts)
        ref, ref_lse = reference(q, k, v, True, 10, 2, sinks=np.float32(sinks))
        self.assertOutput(output, ref, "merged")
        self.assertLse(lse, ref_lse, "merged")
        self.assertTrue((output[:, :8] == 0).all())
        np.testing.assert_array_equal(lse[:, :8], np.float32(sinks)[:, None].repeat(8, 1))
        self.check_sink_split((2, 19, 9), (2, 11, 9), (2, 11, 9), [0, 4, 11], sinks,
                              key_position=10, block_k=3)

    def test_large_key_position_first_slice_one_key(self):
        # The sequence starts at 2^40 + 3; the first slice, the one with the sinks, is one key.
        start = (1 << 40) + 3
        self.check_sink_split((2, 7, 12), (1, 33, 12), (1, 33, 5), [0, 1, 16, 33],
                              [0.25, 4.0], key_position=start, query_position=start + 9)

    def test_not_causal(self):
        self.check_sink_split((2, 5, 8), (2, 17, 8), (2, 17, 8), [0, 6, 17], [1.5, 50.0],
                              causal=False)

    def test_one_sequence_in_two_caches(self):
        # One sequence's keys: [0, 23) in cache A, [23, 50) in cache B, and B's Decode step
        # appends 2 more (keys 50, 51); three query rows at 49 … 51. Decode options are the
        # batch's, so A's item (the first key's) is decoded with the sinks and B's in another
        # call without; merged, they are the unsplit answer with sinks.
        kv_heads, heads, head_dim, value_dim, nq = 2, 4, 12, 7, 3
        sinks = np.float32([0.5, 3.0, 50.0, -50.0])
        keys = self.uniform(kv_heads, 52, head_dim)
        values = self.uniform(kv_heads, 52, value_dim)
        query = self.uniform(heads, nq, head_dim)
        a = self.client.create_cache(kv_heads, head_dim, value_dim)
        b = self.client.create_cache(kv_heads, head_dim, value_dim)
        try:
            a.append(keys[:, :23], values[:, :23])
            b.append(keys[:, 23:50], values[:, 23:50])
            first = a.decode(query, key_position=0, query_position=49, causal=True,
                             return_lse=True, sinks=sinks)
            rest = b.decode(query, keys[:, 50:], values[:, 50:], key_position=23, causal=True,
                            return_lse=True)
            self.assertEqual((a.length, b.length), (23, 29))
            for name, part, (begin, end), part_sinks in (("A", first, (0, 23), sinks),
                                                         ("B", rest, (23, 52), None)):
                part_ref, part_lse = reference(query, keys[:, begin:end], values[:, begin:end],
                                               True, begin, 49, sinks=part_sinks)
                self.assertOutput(part.output, part_ref, "item %s" % name)
                self.assertLse(part.lse, part_lse, "item %s" % name)
            ref, ref_lse = reference(query, keys, values, True, sinks=sinks)
            output, lse = merge_states([first, rest])
            self.assertOutput(output, ref, "merged decode")
            self.assertPerHead(output, ref, sinks, "merged decode")
            self.assertLse(lse, ref_lse, "merged decode")
        finally:
            a.delete()
            b.delete()


class TraceTest(ServerCase):

    def test_trace_follows_positions(self):
        q, k, v = self.uniform(2, 9, 8), self.uniform(1, 14, 8), self.uniform(1, 14, 6)
        # A slice of keys at positions 30..43; rows at 25..33 (row r sees 30..25 + r).
        key_position, query_position, block_k = 30, 25, 4
        tiled = self.client.tiled(q, k, v, causal=True, key_position=key_position,
                                  query_position=query_position, return_lse=True,
                                  block_k=block_k)
        ref, ref_lse = reference(q, k, v, True, key_position, query_position)
        self.assertOutput(tiled.output, ref, "tiled")
        self.assertLse(tiled.lse, ref_lse, "tiled")
        rows = [(0, 0, 8), (0, 1, 6), (0, 0, 2), (0, 1, 5)]  # Row 2 (position 27) sees no key.
        events = list(self.client.trace(q, k, v, rows=rows, causal=True, block_k=block_k,
                                        key_position=key_position,
                                        query_position=query_position))
        start = events[0]
        self.assertEqual(start["kind"], "start")
        self.assertEqual((start["key_position"], start["query_position"]),
                         (key_position, query_position))
        done = [e for e in events if e["kind"] == "row_done"]
        self.assertEqual([e["row"] for e in done], rows)
        for event in done:
            _, h, r = event["row"]
            with self.subTest(row=event["row"]):
                np.testing.assert_allclose(event["output"], tiled.output[h, r], rtol=0,
                                           atol=1e-6)
                if math.isinf(ref_lse[h, r]):
                    self.assertEqual(event["lse"], -math.inf)
                    self.assertTrue((event["output"] == 0).all())
                else:
                    self.assertAlmostEqual(event["lse"], float(tiled.lse[h, r]), delta=1e-5)
        for step in (e for e in events if e["kind"] == "step"):
            _, _, r = step["row"]
            key_at = key_position + np.arange(step["key_begin"], step["key_end"])
            with self.subTest(step=(step["row"], step["tile"])):
                np.testing.assert_array_equal(np.isneginf(step["scores"]),
                                              key_at > query_position + r)
        # Default query_position: resolved bottom-right against this request's keys.
        start = next(iter(self.client.trace(q, k, v, rows=[0], causal=True, key_position=5)))
        self.assertEqual((start["key_position"], start["query_position"]), (5, 5 + 14 - 9))


class DecodeTest(ServerCase):

    def test_one_sequence_in_two_caches(self):
        # One sequence's keys: [0, 23) in cache A, [23, 50) in cache B, and the Decode step
        # appends 2 more tokens to B (keys 50, 51). Three query rows at the end (positions
        # 49..51). Item A needs query_position; item B's default (its key_position + its length
        # after the append − nq = 23 + 29 − 3) is already the whole's.
        kv_heads, heads, head_dim, value_dim, nq = 2, 4, 12, 7, 3
        keys = self.uniform(kv_heads, 52, head_dim)
        values = self.uniform(kv_heads, 52, value_dim)
        query = self.uniform(heads, nq, head_dim)
        a = self.client.create_cache(kv_heads, head_dim, value_dim)
        b = self.client.create_cache(kv_heads, head_dim, value_dim)
        try:
            a.append(keys[:, :23], values[:, :23])
            b.append(keys[:, 23:50], values[:, 23:50])
            result = self.client.decode(
                [{"cache": a, "query": query, "key_position": 0, "query_position": 49},
                 {"cache": b, "query": query, "key": keys[:, 50:], "value": values[:, 50:],
                  "key_position": 23}],
                causal=True, return_lse=True)
            self.assertEqual((a.length, b.length), (23, 29))
            ref, ref_lse = reference(query, keys, values, True)
            for index, (begin, end) in enumerate(((0, 23), (23, 52))):
                part_ref, part_lse = reference(query, keys[:, begin:end], values[:, begin:end],
                                               True, begin, 49)
                self.assertOutput(result.outputs[index], part_ref, "item %d" % index)
                self.assertLse(result.lse[index], part_lse, "item %d" % index)
            output, lse = merge_states(list(zip(result.outputs, result.lse)))
            self.assertOutput(output, ref, "merged decode")
            self.assertLse(lse, ref_lse, "merged decode")

            # Cache.decode with positions, and tiled over a cache with positions: B's keys at
            # 23..51 against queries placed at 30..32 (rows see 8, 9, 10 keys of B).
            step = b.decode(query, key_position=23, query_position=30, causal=True,
                            return_lse=True)
            part_ref, part_lse = reference(query, keys[:, 23:], values[:, 23:], True, 23, 30)
            self.assertOutput(step.output, part_ref, "Cache.decode")
            self.assertLse(step.lse, part_lse, "Cache.decode")
            over_cache = self.client.tiled(query, cache=b, causal=True, key_position=23,
                                           query_position=30, return_lse=True, block_k=3)
            self.assertOutput(over_cache.output, part_ref, "tiled over a cache")
            self.assertLse(over_cache.lse, part_lse, "tiled over a cache")
        finally:
            a.delete()
            b.delete()

    def test_decode_positions_errors(self):
        cache = self.client.create_cache(1, 4)
        try:
            cache.append(self.uniform(1, 3, 4), self.uniform(1, 3, 4))
            query = self.uniform(1, 1, 4)
            # The client refuses batch-wide positions itself, before any RPC.
            for name in ("key_position", "query_position"):
                with self.subTest(option=name):
                    with self.assertRaises(ValueError) as raised:
                        self.client.decode([(cache, query)], **{name: 2})
                    self.assertIn("per item", str(raised.exception))
            with self.assertRaises(ValueError) as raised:
                cache.decode(query, key_position=-1)
            self.assertIn("items[0].key_position", str(raised.exception))
            # The server: positions in DecodeRequest.options, and a negative item position.
            p = harness.pb()
            query_tensor = p.Tensor(shape=[1, 1, 4], dtype=p.DTYPE_FLOAT32,
                                    data=query.tobytes())
            for name, value in (("key_position", 3), ("query_position", 0)):
                with self.subTest(server_option=name):
                    request = p.DecodeRequest(options=p.AttentionOptions(**{name: value}))
                    request.items.add(cache_id=cache.id, query=query_tensor, expected_length=3)
                    message = self.assertInvalid(self.stub.Decode, request)
                    self.assertIn("options." + name, message)
            for name in ("key_position", "query_position"):
                with self.subTest(server_item=name):
                    request = p.DecodeRequest()
                    request.items.add(cache_id=cache.id, query=query_tensor, expected_length=3,
                                      **{name: -1})
                    message = self.assertInvalid(self.stub.Decode, request)
                    self.assertIn("items[0]." + name, message)
            self.assertEqual(cache.refresh()["length"], 3)
        finally:
            cache.delete()

    def assertInvalid(self, method, request):
        with self.assertRaises(grpc.RpcError) as raised:
            method(request, timeout=RPC_TIMEOUT_S)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                         raised.exception.details())
        return raised.exception.details()


class PositionErrorsTest(ServerCase):

    def test_server_rejects_bad_positions(self):
        p = harness.pb()
        q, _ = harness.encode(self.uniform(2, 3, 4), p.DTYPE_FLOAT32)
        k, _ = harness.encode(self.uniform(2, 5, 4), p.DTYPE_FLOAT32)
        bad = (("key_position", -1), ("query_position", -7), ("key_position", MAX_POSITION + 1),
               ("query_position", MAX_POSITION + 1), ("key_position", -(1 << 63)))
        for name, value in bad:
            request = p.AttentionRequest(query=q, key=k, value=k, options=p.AttentionOptions(
                causal=True, **{name: value}))
            calls = {"Naive": lambda: self.stub.Naive(request, timeout=RPC_TIMEOUT_S),
                     "Tiled": lambda: self.stub.Tiled(request, timeout=RPC_TIMEOUT_S),
                     "Trace": lambda: list(self.stub.Trace(p.TraceRequest(attention=request),
                                                           timeout=RPC_TIMEOUT_S))}
            for rpc, call in calls.items():
                with self.subTest(rpc=rpc, field=name, value=value):
                    with self.assertRaises(grpc.RpcError) as raised:
                        call()
                    self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                                     raised.exception.details())
                    self.assertIn("options." + name, raised.exception.details())
        # The bounds themselves are accepted.
        for name in ("key_position", "query_position"):
            request = p.AttentionRequest(query=q, key=k, value=k, options=p.AttentionOptions(
                causal=True, **{name: MAX_POSITION}))
            self.assertEqual(list(self.stub.Tiled(request, timeout=RPC_TIMEOUT_S).output.shape),
                             [2, 3, 4])

    def test_client_rejects_bad_positions(self):
        q = self.uniform(3, 4)
        for rpc in ("naive", "tiled", "trace"):
            call = getattr(self.client, rpc)
            for name, value, error in (("key_position", -1, ValueError),
                                       ("query_position", -1, ValueError),
                                       ("key_position", MAX_POSITION + 1, ValueError),
                                       ("query_position", 2.0, TypeError),
                                       ("key_position", True, TypeError),
                                       ("key_position", None, TypeError)):
                with self.subTest(rpc=rpc, field=name, value=value):
                    with self.assertRaises(error) as raised:
                        call(q, q, q, **{name: value})
                    self.assertIn(name, str(raised.exception))


class MergeStatesTest(unittest.TestCase):
    """merge_states alone, no server."""

    def setUp(self):
        self.rng = np.random.default_rng()

    def test_one_part_is_itself(self):
        output = self.rng.standard_normal((3, 5, 7)).astype(np.float32)
        lse = self.rng.standard_normal((3, 5)).astype(np.float32)
        lse[1, 2] = -np.inf
        output[1, 2] = 0
        merged, merged_lse = merge_states([(output, lse)])
        np.testing.assert_array_equal(merged, output)
        np.testing.assert_array_equal(merged_lse, lse)
        self.assertEqual((merged.dtype, merged_lse.dtype), (np.float32, np.float32))

    def test_rows_no_part_saw(self):
        # All parts −inf on some rows: zeros and −inf there, never NaN, even when a part's
        # output holds garbage (NaN, inf) on a row its lse says it did not see.
        output = [self.rng.standard_normal((2, 4, 3)) for _ in range(3)]
        lse = [self.rng.standard_normal((2, 4)) for _ in range(3)]
        for part in range(3):
            lse[part][0, 1] = -np.inf
            output[part][0, 1] = (np.nan, np.inf, 5.0)[part]
        lse[1][1, 3] = -np.inf  # Only part 1 misses this row: parts 0 and 2 decide it.
        output[1][1, 3] = np.nan
        merged, merged_lse = merge_states(list(zip(output, lse)))
        self.assertFalse(np.isnan(merged).any())
        self.assertFalse(np.isnan(merged_lse).any())
        np.testing.assert_array_equal(merged[0, 1], 0)
        self.assertEqual(merged_lse[0, 1], -np.inf)
        self.assertEqual(int(np.isneginf(merged_lse).sum()), 1)
        expected, expected_lse = merge_states([(output[0][1:2, 3:4], lse[0][1:2, 3:4]),
                                               (output[2][1:2, 3:4], lse[2][1:2, 3:4])])
        np.testing.assert_array_equal(merged[1:2, 3:4], expected)
        np.testing.assert_array_equal(merged_lse[1:2, 3:4], expected_lse)
        everything_hidden = merge_states([(np.full((2, 3), np.nan), np.full(2, -np.inf))] * 2)
        np.testing.assert_array_equal(everything_hidden[0], np.zeros((2, 3)))
        np.testing.assert_array_equal(everything_hidden[1], [-np.inf, -np.inf])

    def test_float64_split_merges_back(self):
        # A float64 reference split by keys (causal, queries mid-sequence: some slices hidden
        # from some rows) merges to the unsplit reference to 1e-12, in any part order.
        q = self.rng.uniform(-1, 1, (2, 3, 6, 5))
        k = self.rng.uniform(-1, 1, (2, 1, 19, 5))
        v = self.rng.uniform(-1, 1, (2, 1, 19, 4))
        whole, whole_lse = reference(q, k, v, True, 0, 7)
        bounds = [0, 3, 4, 12, 15, 19]
        parts = [reference(q, k[..., a:b, :], v[..., a:b, :], True, a, 7)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        self.assertTrue(np.isneginf(parts[-1][1]).any())
        for order in (parts, parts[::-1], parts[2:] + parts[:2]):
            merged, merged_lse = merge_states(order)
            np.testing.assert_allclose(merged, whole, rtol=0, atol=1e-6)  # float32 result
            np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-6)
        # The arithmetic itself is float64: a float64 check of the same formula.
        lse = np.stack([p[1] for p in parts])
        m = lse.max(axis=0)
        total = np.exp(lse - m).sum(axis=0)
        formula = sum(np.exp(p[1] - m - np.log(total))[..., None] * p[0] for p in parts)
        self.assertLess(float(np.max(np.abs(formula - whole))), 1e-12)
        self.assertLess(float(np.max(np.abs(m + np.log(total) - whole_lse))), 1e-12)

    def test_float64_split_with_sinks_merges_back(self):
        # A float64 reference with sinks, split by keys with the sinks on the first slice
        # only (causal with a window, so some rows see none of the first slice: lse = sink
        # there), merges to the unsplit reference with sinks; in any part order.
        q = self.rng.uniform(-1, 1, (2, 3, 6, 5))
        k = self.rng.uniform(-1, 1, (2, 1, 19, 5))
        v = self.rng.uniform(-1, 1, (2, 1, 19, 4))
        sinks = [0.7, 50.0, -50.0]
        whole, whole_lse = reference(q, k, v, True, 0, 13, sinks=sinks, window_left=4)
        bounds = [0, 7, 12, 19]
        parts = [reference(q, k[..., a:b, :], v[..., a:b, :], True, a, 13,
                           sinks=sinks if a == 0 else None, window_left=4)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        self.assertTrue((parts[0][1] == np.float64(sinks)[None, :, None]).any())
        for order in (parts, parts[::-1], parts[1:] + parts[:1]):
            merged, merged_lse = merge_states(order)
            np.testing.assert_allclose(merged, whole, rtol=1e-6, atol=1e-7 * np.abs(whole).max())
            np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-6)
        # Per head in float64, the same formula: exact to 1e-12 relative.
        lse = np.stack([p[1] for p in parts])
        m = lse.max(axis=0)
        total = np.exp(lse - m).sum(axis=0)
        formula = sum(np.exp(p[1] - m - np.log(total))[..., None] * p[0] for p in parts)
        for h in range(3):
            scale = np.abs(whole[:, h]).max()
            self.assertLess(float(np.max(np.abs(formula[:, h] - whole[:, h]))), 1e-12 * scale)
        self.assertLess(float(np.max(np.abs(m + np.log(total) - whole_lse))), 1e-12)

    def test_huge_lse_is_stable(self):
        # exp(1000) overflows; the max is subtracted first.
        a = np.array([[[1.0, 2.0]]], dtype=np.float32)
        b = np.array([[[3.0, 6.0]]], dtype=np.float32)
        merged, lse = merge_states([(a, np.array([[1000.0]])), (b, np.array([[1000.0 +
                                                                              math.log(3)]]))])
        np.testing.assert_allclose(merged, [[[2.5, 5.0]]], rtol=1e-6)
        np.testing.assert_allclose(lse, [[1000.0 + math.log(4)]], rtol=1e-7)
        merged, lse = merge_states([(a, np.array([[-1e30]])), (b, np.array([[-np.inf]]))])
        np.testing.assert_array_equal(merged, a)
        self.assertEqual(float(lse[0, 0]), np.float32(-1e30))

    def test_errors_name_the_problem(self):
        output = np.zeros((2, 3, 4), dtype=np.float32)
        lse = np.zeros((2, 3), dtype=np.float32)
        cases = [
            ([], ValueError, "at least one"),
            ([(output, lse), (output[:, :2], lse[:, :2])], ValueError, "parts[1] output shape"),
            ([(output, lse[:, :2])], ValueError, "parts[0]: output shape"),
            ([(output, lse), (output, lse.T)], ValueError, "parts[1]: output shape"),
            ([(output, np.full((2, 3), np.nan))], ValueError, "NaN"),
            ([(output, np.full((2, 3), np.inf))], ValueError, "+inf"),
            ([(output, None)], ValueError, "return_lse"),
            ([(output.astype(np.uint16), lse)], TypeError, "parts[0] output"),
            ([(output, lse, lse)], TypeError, "parts[0]"),
            ([output], TypeError, "parts[0]"),
        ]
        for parts, error, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(error) as raised:
                    merge_states(parts)
                self.assertIn(text, str(raised.exception))
        with self.assertRaises(TypeError):
            merge_states(None)


def tearDownModule():
    sys.stderr.write("\nlargest errors seen: output %.3g (relative, bound %.0e), lse %.3g "
                     "(bound %.0e)\n" % (WORST["output"], OUTPUT_RTOL, WORST["lse"], LSE_ATOL))


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, verbosity=2)
