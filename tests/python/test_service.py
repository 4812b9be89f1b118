#!/usr/bin/python3
"""End-to-end test of attnd from a Python gRPC client.

Starts its own attnd on 127.0.0.1 (port 0, read back from the startup line), calls all four
RPCs of attention.v1 and checks them against a float64 numpy reference; the server is always
killed at the end. Ragged batches (AttentionRequest.cu_seqlens_q / cu_seqlens_k) go through the
Python client module (client/python/attn_client.py): Naive and Tiled on packed sequences of
unequal query and key lengths (a length-1 one, empty ones, a sequence with more rows than keys),
GQA, odd head_dim, causal and not, ranks 3 and 4, against the float64 reference run on each
sequence alone; ALiBi ("standard", also with a softcap and a window) per sequence against
test_client_module.py's reference; a trace of rows in the middle sequence (HIDDEN_SEQUENCE for
the other sequences' keys, the start event repeating the cumulative lengths); every bad value
→ INVALID_ARGUMENT naming the field, on Naive, Tiled and Trace; the client's own ValueErrors and
cumulative_lengths(). Run by CTest as

  /usr/bin/python3 tests/python/test_service.py --attnd <attnd> --stubs <generated stubs dir>

Needs the Debian python3-grpcio and python3-numpy (hence /usr/bin/python3); stdlib unittest only.
"""

import math
import sys
import unittest

import attnd_harness as h  # tests/python is sys.path[0] for a script.

ARGS = h.parse_args(__doc__, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

import attn_client  # noqa: E402 (client/python, on the path through add_stubs_path)
# The float64 reference with softcap, window and ALiBi (the ALiBi tests' own); importing the
# module defines its tests without running them.
from test_client_module import softcap_reference  # noqa: E402

RPC_TIMEOUT_S = 30.0

SEED_OUT_ROW0 = h.SEED_OUT_ROW0  # noqa: E305


# --- Problems (tensor encoding, decoding and the float64 reference are attnd_harness's) ---------

def fp32_tensor(array):
    return h.encode(array, pb.DTYPE_FLOAT32)[0]


def relative_error(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def ragged_reference(q, k, v, cu_q, cu_k, reference):
    """A ragged batch's float64 reference, each sequence run alone: q [heads, total_q, d], k
    [kv_heads, total_k, d], v [kv_heads, total_k, dv] and cumulative lengths cu_q, cu_k →
    (out [heads, total_q, dv], lse [heads, total_q], score_max). reference(q4, k4, v4) →
    (out, lse, score_max) over one sequence as rank 4 with batch 1 (h.reference_attention or
    softcap_reference). A sequence without rows adds nothing; its rows without keys stay zeros
    with lse −inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full(q.shape[:2], -math.inf)
    score_max = 0.0
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s] == cu_q[s + 1] or cu_k[s] == cu_k[s + 1]:
            continue
        seq_out, seq_lse, seq_max = reference(q[None, :, rows], k[None, :, keys], v[None, :, keys])
        out[:, rows], lse[:, rows] = seq_out[0], seq_lse[0]
        score_max = max(score_max, seq_max)
    return out, lse, score_max


# --- Tests --------------------------------------------------------------------------------------

class AttentionServiceTest(unittest.TestCase):
    server = None
    channel = None
    stub = None

    @classmethod
    def setUpClass(cls):
        cls.server = h.AttndProcess(ARGS.attnd, extra_args=["--threads", "2"])
        try:
            cls.channel = h.open_channel(cls.server.address)
            cls.stub = pb_grpc.AttentionServiceStub(cls.channel)
        except Exception:
            cls._failed = True
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if cls.channel is not None:
            cls.channel.close()
        if cls.server is not None:
            cls.server.stop()
            if cls._failed:
                sys.stderr.write("\n--- attnd stderr ---\n%s--- end attnd stderr ---\n"
                                 % cls.server.stderr())
            cls.server.close()
            cls.server = None

    _failed = False

    def run(self, result=None):
        result = super().run(result)
        if result is not None and not result.wasSuccessful():
            type(self)._failed = True
        return result

    # Helpers.

    def seed_request(self, **options):
        q, k, v = h.seed_problem()
        return pb.AttentionRequest(query=fp32_tensor(q), key=fp32_tensor(k), value=fp32_tensor(v),
                                   options=pb.AttentionOptions(**options))

    def assert_invalid(self, call, request, mentions):
        with self.assertRaises(grpc.RpcError) as caught:
            response = call(request, timeout=RPC_TIMEOUT_S)
            if not isinstance(response, pb.AttentionResponse):
                list(response)  # a stream fails on its first read
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                         caught.exception.details())
        self.assertIn(mentions, caught.exception.details())

    # GetServerInfo.

    def test_server_info(self):
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=RPC_TIMEOUT_S)
        self.assertEqual(info.backend, "cpu")
        self.assertTrue(info.version)
        for dtype in (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16):
            self.assertIn(dtype, info.dtypes)
        self.assertGreater(info.default_block_k, 0)
        self.assertGreater(info.max_naive_bytes, 0)
        self.assertGreater(info.max_message_bytes, 0)

    # Naive and Tiled on the seed example.

    def test_seed_example(self):
        q, k, v = h.seed_problem()
        ref, _, _ = h.reference_attention(q[None, None], k[None, None], v[None, None])
        for name, call, intermediate in (("Naive", self.stub.Naive, 16 * 8 * 8),
                                         ("Tiled", self.stub.Tiled, 0)):
            with self.subTest(rpc=name):
                response = call(self.seed_request(), timeout=RPC_TIMEOUT_S)
                self.assertEqual(list(response.output.shape), [8, 4])
                self.assertEqual(response.output.dtype, pb.DTYPE_FLOAT32)
                out = h.decode(response.output)
                np.testing.assert_allclose(out[0], SEED_OUT_ROW0, rtol=0, atol=1e-6)
                np.testing.assert_allclose(out, ref[0, 0], rtol=0, atol=1e-5)
                self.assertFalse(response.HasField("lse") and response.lse.data)
                stats = response.stats
                self.assertEqual(stats.backend, "cpu")
                self.assertEqual(stats.intermediate_bytes, intermediate)
                self.assertEqual(stats.flops, 4 * 8 * 8 * 4)

    # Random odd-sized problem: rank 4, GQA, causal, key_len ≠ query_len.

    def random_problem(self):
        rng = np.random.default_rng()
        q = rng.uniform(-1, 1, size=(2, 4, 37, 33)).astype(np.float32)
        k = rng.uniform(-1, 1, size=(2, 2, 53, 33)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(2, 2, 53, 20)).astype(np.float32)
        return q, k, v

    def test_random_gqa_causal_fp32(self):
        q, k, v = self.random_problem()
        ref_out, ref_lse, _ = h.reference_attention(q, k, v, causal=True)
        request = pb.AttentionRequest(
            query=fp32_tensor(q), key=fp32_tensor(k), value=fp32_tensor(v),
            options=pb.AttentionOptions(causal=True, block_k=7, return_lse=True))
        # Visible keys per query row: i + key_len − query_len + 1 = i + 17. Each visible pair
        # costs a head_dim multiply-add (q·k) and a value_dim one (weight·v); the proto's
        # 4·…·head_dim is the same count when value_dim == head_dim.
        visible = sum(i + 17 for i in range(37))
        for name, call in (("Naive", self.stub.Naive), ("Tiled", self.stub.Tiled)):
            with self.subTest(rpc=name):
                response = call(request, timeout=RPC_TIMEOUT_S)
                self.assertEqual(list(response.output.shape), [2, 4, 37, 20])
                self.assertEqual(response.output.dtype, pb.DTYPE_FLOAT32)
                self.assertEqual(list(response.lse.shape), [2, 4, 37])
                self.assertEqual(response.lse.dtype, pb.DTYPE_FLOAT32)
                out = h.decode(response.output)
                lse = h.decode(response.lse)
                self.assertFalse(np.isnan(out).any() or np.isnan(lse).any())
                self.assertLessEqual(relative_error(out, ref_out), 1e-5)
                self.assertLessEqual(relative_error(lse, ref_lse), 1e-5)
                self.assertEqual(response.stats.flops, 2 * 2 * 4 * visible * (33 + 20))
                if name == "Tiled":
                    self.assertEqual(response.stats.block_k, 7)
                    self.assertEqual(response.stats.intermediate_bytes, 0)
                else:
                    self.assertEqual(response.stats.intermediate_bytes, 16 * 2 * 4 * 37 * 53)

    def test_random_gqa_causal_bf16(self):
        q, k, v = self.random_problem()
        # Each tensor rounded to bf16 (nearest even) and the values the server sees from it.
        (q16, q_seen), (k16, k_seen), (v16, v_seen) = (h.encode(x, pb.DTYPE_BFLOAT16)
                                                       for x in (q, k, v))
        ref_out, _, _ = h.reference_attention(q_seen, k_seen, v_seen, causal=True)
        request = pb.AttentionRequest(
            query=q16, key=k16, value=v16,
            options=pb.AttentionOptions(causal=True, block_k=7))
        for name, call in (("Naive", self.stub.Naive), ("Tiled", self.stub.Tiled)):
            with self.subTest(rpc=name):
                response = call(request, timeout=RPC_TIMEOUT_S)
                self.assertEqual(list(response.output.shape), [2, 4, 37, 20])
                self.assertEqual(response.output.dtype, pb.DTYPE_BFLOAT16)
                self.assertEqual(len(response.output.data), 2 * 4 * 37 * 20 * 2)
                out = h.decode(response.output)
                self.assertFalse(np.isnan(out).any())
                self.assertLessEqual(float(np.max(np.abs(out - ref_out))), 2e-2)

    # Trace.

    def test_trace_seed_example(self):
        request = pb.TraceRequest(attention=self.seed_request(block_k=3),
                                  rows=[pb.RowRef(batch=0, head=0, row=0)])
        events = list(self.stub.Trace(request, timeout=RPC_TIMEOUT_S))
        kinds = [event.WhichOneof("event") for event in events]
        self.assertEqual(kinds, ["start", "step", "step", "step", "row_done", "end"])

        start = events[0].start
        self.assertEqual((start.query_len, start.key_len, start.head_dim, start.value_dim),
                         (8, 8, 4, 4))
        self.assertEqual(start.block_k, 3)
        self.assertEqual(start.tiles_per_row, 3)
        self.assertEqual(start.naive_intermediate_bytes, 1024)
        self.assertEqual(start.tiled_scratch_floats_per_row, 3 + 4 + 2)
        self.assertAlmostEqual(start.scale, 0.5, places=7)
        self.assertFalse(start.causal)

        q, k, v = h.seed_problem()
        all_scores = 0.5 * (q[0].astype(np.float64) @ k.astype(np.float64).T)
        denominator = 0.0
        accumulator = np.zeros(4)
        for tile, event in enumerate(events[1:4]):
            step = event.step
            with self.subTest(tile=tile):
                self.assertEqual(step.tile, tile)
                self.assertEqual((step.row.batch, step.row.head, step.row.row), (0, 0, 0))
                self.assertEqual(step.key_begin, 3 * tile)
                self.assertEqual(step.key_end, min(3 * tile + 3, 8))
                scores = np.array(step.scores, dtype=np.float64)
                weights = np.array(step.weights, dtype=np.float64)
                self.assertEqual(len(scores), step.key_end - step.key_begin)
                self.assertEqual(len(weights), len(scores))
                np.testing.assert_allclose(scores, all_scores[step.key_begin:step.key_end],
                                           rtol=0, atol=1e-6)
                if tile == 0:
                    self.assertEqual(step.max_before, -math.inf)
                    self.assertEqual(step.rescale, 0.0)
                else:
                    self.assertEqual(step.max_before, events[tile].step.max_after)
                    self.assertAlmostEqual(step.rescale,
                                           math.exp(step.max_before - step.max_after), places=6)
                self.assertEqual(step.max_after, max(step.max_before, float(scores.max())))
                np.testing.assert_allclose(weights, np.exp(scores - step.max_after),
                                           rtol=1e-6, atol=1e-7)
                values = v[step.key_begin:step.key_end].astype(np.float64)
                denominator = denominator * step.rescale + weights.sum()
                accumulator = accumulator * step.rescale + weights @ values
                self.assertAlmostEqual(step.denominator, denominator, delta=1e-5 * denominator)
                np.testing.assert_allclose(step.accumulator, accumulator, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(
                    step.estimate, np.array(step.accumulator) / step.denominator,
                    rtol=1e-6, atol=1e-6)

        done = events[4].row_done
        self.assertEqual((done.row.batch, done.row.head, done.row.row), (0, 0, 0))
        np.testing.assert_allclose(done.output, SEED_OUT_ROW0, rtol=0, atol=1e-6)
        np.testing.assert_allclose(done.reference, SEED_OUT_ROW0, rtol=0, atol=1e-6)
        np.testing.assert_allclose(done.output, events[3].step.estimate, rtol=0, atol=1e-6)
        self.assertLess(done.max_abs_error, 1e-6)
        _, ref_lse, _ = h.reference_attention(q[None, None], k[None, None], v[None, None])
        self.assertAlmostEqual(done.lse, ref_lse[0, 0, 0], delta=1e-5)

        end = events[5].end
        self.assertEqual(end.rows, 1)
        self.assertEqual(end.steps, 3)
        self.assertEqual(end.stats.backend, "cpu")

    # Ragged batches (cu_seqlens_q, cu_seqlens_k), through the client module.

    def ragged_problem(self, q_lens, k_lens, heads=4, kv_heads=2, head_dim=33, value_dim=20):
        """Random float32 q [heads, Σ q_lens, head_dim], k [kv_heads, Σ k_lens, head_dim], v
        [kv_heads, Σ k_lens, value_dim] in [-1, 1] and the cumulative lengths."""
        rng = np.random.default_rng()
        cu_q = attn_client.cumulative_lengths(q_lens)
        cu_k = attn_client.cumulative_lengths(k_lens)
        q = rng.uniform(-1, 1, size=(heads, cu_q[-1], head_dim)).astype(np.float32)
        k = rng.uniform(-1, 1, size=(kv_heads, cu_k[-1], head_dim)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(kv_heads, cu_k[-1], value_dim)).astype(np.float32)
        return q, k, v, cu_q, cu_k

    def assert_matches(self, result, ref, ref_lse, score_max, blind_rows):
        out = result.output.astype(np.float64)
        lse = result.lse.astype(np.float64)
        self.assertEqual(out.shape, ref.shape)
        self.assertEqual(h.output_error(out, ref, 1, score_max), "")
        self.assertEqual(h.lse_error(lse, ref_lse), "")
        # Rows that see no key: zeros exactly, lse −inf.
        np.testing.assert_array_equal(out[..., blind_rows, :], 0.0)
        self.assertTrue(np.isneginf(lse[..., blind_rows]).all())

    def test_ragged_matches_each_sequence(self):
        cases = [
            # Unequal query and key lengths, a length-1 sequence, one with more rows than keys
            # (causal: its first 7 rows see no key).
            ([5, 1, 40], [7, 1, 33]),
            # Empty sequences: no rows, no keys, rows without keys (zeros, lse −inf).
            ([5, 0, 1, 3, 40, 2], [7, 4, 1, 0, 33, 0]),
        ]
        with attn_client.Client(self.server.address, timeout=RPC_TIMEOUT_S) as client:
            for q_lens, k_lens in cases:
                q, k, v, cu_q, cu_k = self.ragged_problem(q_lens, k_lens)
                for causal in (False, True):
                    ref, ref_lse, score_max = ragged_reference(
                        q, k, v, cu_q, cu_k,
                        lambda q4, k4, v4: h.reference_attention(q4, k4, v4, causal=causal))
                    blind = np.isneginf(ref_lse[0])
                    if causal and q_lens[-1] == 40:
                        self.assertTrue(blind[cu_q[2]:cu_q[2] + 7].all())
                    # The packed problem as one sequence differs: the sequences matter.
                    whole, _, _ = h.reference_attention(q[None], k[None], v[None], causal=causal)
                    self.assertGreater(float(np.max(np.abs(whole[0] - ref))), 1e-2)
                    for name in ("naive", "tiled"):
                        with self.subTest(q_lens=q_lens, k_lens=k_lens, causal=causal, rpc=name):
                            # block_k 7: tiles straddle the sequence starts.
                            result = getattr(client, name)(
                                q, k, v, causal=causal, block_k=7, return_lse=True,
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
                            self.assertEqual(result.output.shape, (4, cu_q[-1], 20))
                            self.assertEqual(result.lse.shape, (4, cu_q[-1]))
                            self.assertEqual(result.output.dtype, np.float32)
                            self.assertEqual(result.output_dtype, "fp32")
                            self.assertEqual(result.stats["backend"], "cpu")
                            self.assert_matches(result, ref, ref_lse, score_max, blind)
            # Rank 4 with batch 1, and the lengths as NumPy arrays: the same answer.
            q, k, v, cu_q, cu_k = self.ragged_problem([5, 1, 40], [7, 1, 33])
            ref, ref_lse, score_max = ragged_reference(
                q, k, v, cu_q, cu_k,
                lambda q4, k4, v4: h.reference_attention(q4, k4, v4, causal=True))
            for name in ("naive", "tiled"):
                with self.subTest(rank=4, rpc=name):
                    result = getattr(client, name)(
                        q[None], k[None], v[None], causal=True, return_lse=True,
                        cu_seqlens_q=np.array(cu_q, dtype=np.int64),
                        cu_seqlens_k=np.array(cu_k, dtype=np.int32))
                    self.assertEqual(result.output.shape, (1, 4, 46, 20))
                    self.assertEqual(result.lse.shape, (1, 4, 46))
                    self.assert_matches(result, ref[None], ref_lse[None], score_max,
                                        np.isneginf(ref_lse[0]))

    def test_ragged_alibi(self):
        q, k, v, cu_q, cu_k = self.ragged_problem([5, 1, 40], [7, 1, 33], head_dim=9,
                                                  value_dim=6)
        slopes = attn_client.standard_alibi_slopes(4)
        with attn_client.Client(self.server.address, timeout=RPC_TIMEOUT_S) as client:
            # ALiBi over each sequence's own positions; then with a softcap and a window too.
            for options in (dict(), dict(softcap=2.0, window_left=6)):
                softcap = options.get("softcap", 0.0)
                window_left = options.get("window_left")
                ref, ref_lse, score_max = ragged_reference(
                    q, k, v, cu_q, cu_k,
                    lambda q4, k4, v4: softcap_reference(q4, k4, v4, True, softcap,
                                                         window_left=window_left,
                                                         alibi_slopes=slopes))
                plain, _, _ = ragged_reference(
                    q, k, v, cu_q, cu_k,
                    lambda q4, k4, v4: softcap_reference(q4, k4, v4, True, softcap,
                                                         window_left=window_left))
                self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)  # it matters
                # Biased by packed indices instead (one sequence's positions): a different answer.
                packed, _, _ = softcap_reference(q[None], k[None], v[None], True, softcap,
                                                 window_left=window_left, alibi_slopes=slopes)
                self.assertGreater(float(np.max(np.abs(ref - packed[0]))), 1e-2)
                for name in ("naive", "tiled"):
                    with self.subTest(rpc=name, **options):
                        result = getattr(client, name)(
                            q, k, v, causal=True, block_k=7, return_lse=True,
                            alibi_slopes="standard", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            **options)
                        self.assert_matches(result, ref, ref_lse, score_max,
                                            np.isneginf(ref_lse[0]))

    def test_ragged_trace(self):
        # The middle sequence has rows 5 … 7 and keys 7 … 16; block_k 4 puts keys of the
        # sequences before and after it in its first and last tiles.
        q, k, v, cu_q, cu_k = self.ragged_problem([5, 3, 6], [7, 10, 5], head_dim=9,
                                                  value_dim=6)
        block_k = 4
        first_row, first_key, q_len, k_len = cu_q[1], cu_k[1], 3, 10
        rows = [(0, 1, first_row), (0, 3, first_row + 2)]
        scale = 1.0 / math.sqrt(9)
        with attn_client.Client(self.server.address, timeout=RPC_TIMEOUT_S) as client:
            for causal in (False, True):
                ref, ref_lse, _ = ragged_reference(
                    q, k, v, cu_q, cu_k,
                    lambda q4, k4, v4: h.reference_attention(q4, k4, v4, causal=causal))
                tiled = client.tiled(q, k, v, causal=causal, block_k=block_k,
                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
                events = list(client.trace(q, k, v, rows=rows, block_k=block_k, causal=causal,
                                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
                start = events[0]
                self.assertEqual(start["kind"], "start")
                self.assertEqual(start["cu_seqlens_q"], cu_q)
                self.assertEqual(start["cu_seqlens_k"], cu_k)
                self.assertIsInstance(start["cu_seqlens_q"], list)
                self.assertTrue(all(type(x) is int for x in start["cu_seqlens_q"]
                                    + start["cu_seqlens_k"]))
                self.assertEqual((start["query_len"], start["key_len"]), (cu_q[-1], cu_k[-1]))
                self.assertEqual((start["key_position"], start["query_position"]), (0, 0))
                self.assertEqual(start["causal"], causal)
                self.assertEqual(events[-1]["kind"], "end")
                self.assertEqual(events[-1]["rows"], len(rows))
                for b, head, row in rows:
                    with self.subTest(causal=causal, row=(b, head, row)):
                        # The row's position in its sequence: keys at 0 …, rows bottom-right.
                        p = k_len - q_len + (row - first_row)
                        steps = [e for e in events if e["kind"] == "step"
                                 and e["row"] == (b, head, row)]
                        seen_end = first_key + (p + 1 if causal else k_len)
                        self.assertEqual([e["tile"] for e in steps],
                                         list(range(first_key // block_k,
                                                    (seen_end - 1) // block_k + 1)))
                        names = set()
                        for step in steps:
                            keys = np.arange(step["key_begin"], step["key_end"])
                            outside = (keys < first_key) | (keys >= first_key + k_len)
                            causal_hidden = ~outside & causal & (keys - first_key > p)
                            want = np.where(outside, "HIDDEN_SEQUENCE",
                                            np.where(causal_hidden, "HIDDEN_CAUSAL",
                                                     "HIDDEN_NONE")).tolist()
                            self.assertEqual(step["hidden"], want)
                            names.update(want)
                            scores = step["scores"]
                            hidden = outside | causal_hidden
                            np.testing.assert_array_equal(np.isneginf(scores), hidden)
                            self.assertTrue((step["weights"][hidden] == 0).all())
                            products = (q[head, row].astype(np.float64)
                                        * k[head // 2, keys[~hidden]].astype(np.float64))
                            np.testing.assert_allclose(scores[~hidden],
                                                       scale * products.sum(axis=1),
                                                       rtol=0, atol=1e-5)
                        self.assertIn("HIDDEN_SEQUENCE", names)
                        self.assertEqual("HIDDEN_CAUSAL" in names, causal and row == first_row)
                        done = [e for e in events if e["kind"] == "row_done"
                                and e["row"] == (b, head, row)]
                        self.assertEqual(len(done), 1)
                        self.assertEqual(h.output_error(done[0]["output"].astype(np.float64),
                                                        ref[head, row], 1,
                                                        magnitude=float(np.max(np.abs(ref)))),
                                         "")
                        np.testing.assert_array_equal(done[0]["output"],
                                                      tiled.output[head, row])
                        self.assertLess(done[0]["max_abs_error"], 1e-5)
                        self.assertAlmostEqual(done[0]["lse"], ref_lse[head, row],
                                               delta=1e-5 * max(1.0, abs(ref_lse[head, row])))

    def ragged_request(self, cu_q=(0, 2, 6), cu_k=(0, 3, 8), q_shape=(2, 6, 4),
                       k_shape=(1, 8, 4), **options):
        """A raw AttentionRequest with the given cumulative lengths (valid as defaulted)."""
        rng = np.random.default_rng()
        q = rng.uniform(-1, 1, size=q_shape).astype(np.float32)
        k = rng.uniform(-1, 1, size=k_shape).astype(np.float32)
        return pb.AttentionRequest(query=fp32_tensor(q), key=fp32_tensor(k), value=fp32_tensor(k),
                                   options=pb.AttentionOptions(**options),
                                   cu_seqlens_q=list(cu_q), cu_seqlens_k=list(cu_k))

    def test_ragged_bad_values_are_invalid(self):
        # The defaults are valid.
        for call in (self.stub.Naive, self.stub.Tiled):
            call(self.ragged_request(), timeout=RPC_TIMEOUT_S)
        cases = [
            ("cu_seqlens_q[2]", dict(cu_q=(0, 4, 2, 6), cu_k=(0, 3, 5, 8))),   # decreasing
            ("cu_seqlens_k[2]", dict(cu_q=(0, 2, 4, 6), cu_k=(0, 5, 3, 8))),   # decreasing
            ("cu_seqlens_k[3]", dict(cu_q=(0, 2, 4, 6), cu_k=(0, 3, 5, 7))),   # not total_k
            ("cu_seqlens_q[3]", dict(cu_q=(0, 2, 4, 7), cu_k=(0, 3, 5, 8))),   # past total_q
            ("cu_seqlens_k", dict(cu_q=(0, 2, 6), cu_k=(0, 3, 5, 8))),         # counts differ
            ("cu_seqlens_k", dict(cu_q=(0, 2, 6), cu_k=())),                   # only one given
            ("cu_seqlens_q", dict(cu_q=(), cu_k=(0, 3, 8))),
            ("cu_seqlens_q", dict(cu_q=(0,), cu_k=(0,))),                      # one entry
            ("cu_seqlens_q[0]", dict(cu_q=(1, 2, 6), cu_k=(0, 3, 8))),         # not from 0
            ("cu_seqlens_k[0]", dict(cu_q=(0, 2, 6), cu_k=(-1, 3, 8))),
            ("query.shape[0]", dict(q_shape=(2, 2, 3, 4), k_shape=(2, 1, 4, 4),
                                    cu_q=(0, 1, 3), cu_k=(0, 2, 4))),          # batch 2
            ("options.key_position", dict(key_position=3)),
            ("options.query_position", dict(query_position=0)),
        ]
        for field, arguments in cases:
            request = self.ragged_request(**arguments)
            for name, call, message in (
                    ("Naive", self.stub.Naive, request),
                    ("Tiled", self.stub.Tiled, request),
                    ("Trace", self.stub.Trace, pb.TraceRequest(attention=request))):
                with self.subTest(field=field, rpc=name, **{a: str(b) for a, b in
                                                           arguments.items()}):
                    self.assert_invalid(call, message, field + ":")
        # With cache_id: a cache holds one sequence.
        cache = self.stub.CreateCache(pb.CreateCacheRequest(kv_heads=1, head_dim=4,
                                                            dtype=pb.DTYPE_FLOAT32),
                                      timeout=RPC_TIMEOUT_S)
        try:
            request = self.ragged_request()
            request.ClearField("key")
            request.ClearField("value")
            request.cache_id = cache.cache_id
            for name, call, message in (
                    ("Naive", self.stub.Naive, request),
                    ("Tiled", self.stub.Tiled, request),
                    ("Trace", self.stub.Trace, pb.TraceRequest(attention=request))):
                with self.subTest(field="cache_id", rpc=name):
                    self.assert_invalid(call, message, "cu_seqlens_q:")
        finally:
            self.stub.DeleteCache(pb.DeleteCacheRequest(cache_id=cache.cache_id),
                                  timeout=RPC_TIMEOUT_S)

    def test_ragged_client_arguments(self):
        self.assertIn("cumulative_lengths", attn_client.__all__)
        self.assertEqual(attn_client.cumulative_lengths([5, 1, 40]), [0, 5, 6, 46])
        self.assertEqual(attn_client.cumulative_lengths(np.array([3, 0, 2])), [0, 3, 3, 5])
        self.assertEqual(attn_client.cumulative_lengths([]), [0])
        for bad in ([1.5], [True], "5", np.array([[1, 2]]), np.array([1.0]), 5, [-1]):
            with self.subTest(lengths=repr(bad)):
                self.assertRaises(ValueError, attn_client.cumulative_lengths, bad)
        q, k, v, cu_q, cu_k = self.ragged_problem([2, 4], [3, 5], heads=2, kv_heads=1,
                                                  head_dim=4, value_dim=4)
        # A client whose calls would fail at once: nothing below may reach a server.
        with attn_client.Client("127.0.0.1:1", timeout=1) as offline:
            for name in ("naive", "tiled", "trace"):
                call = getattr(offline, name)
                for arguments in (dict(cu_seqlens_q=cu_q), dict(cu_seqlens_k=cu_k),
                                  dict(cu_seqlens_q=[0.0, 2.0, 6.0], cu_seqlens_k=cu_k),
                                  dict(cu_seqlens_q=cu_q, cu_seqlens_k=np.array([0., 3, 8])),
                                  dict(cu_seqlens_q=cu_q, cu_seqlens_k=np.array([cu_k])),
                                  dict(cu_seqlens_q=cu_q, cu_seqlens_k=[0, True, 8]),
                                  dict(cu_seqlens_q=cu_q, cu_seqlens_k="038"),
                                  dict(cu_seqlens_q=cu_q, cu_seqlens_k=[0, 3, 2 ** 63])):
                    with self.subTest(rpc=name, **{a: repr(b) for a, b in arguments.items()}):
                        with self.assertRaises(ValueError):
                            # trace() checks its arguments when called, before any next().
                            call(q, k, v, **arguments)
        # Ranges are the server's: sent as they are, refused naming the entry.
        with attn_client.Client(self.server.address, timeout=RPC_TIMEOUT_S) as client:
            for name in ("naive", "tiled", "trace"):
                with self.subTest(rpc=name):
                    with self.assertRaises(attn_client.AttnError) as caught:
                        result = getattr(client, name)(q, k, v, cu_seqlens_q=[0, 4, 2, 6],
                                                       cu_seqlens_k=[0, 3, 5, 8])
                        if name == "trace":
                            list(result)
                    self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn("cu_seqlens_q[2]:", caught.exception.message)
            # None for both (the default) is one sequence; so are two empty lists.
            one = client.tiled(q, k, v, causal=True, cu_seqlens_q=[], cu_seqlens_k=[])
            np.testing.assert_array_equal(one.output, client.tiled(q, k, v, causal=True).output)
            # cache= with a ragged batch is sent and refused by the server.
            cache = client.create_cache(kv_heads=1, head_dim=4)
            try:
                with self.assertRaises(attn_client.AttnError) as caught:
                    client.tiled(q, cache=cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
                self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("cu_seqlens_q:", caught.exception.message)
            finally:
                cache.delete()

    # Errors.

    def test_missing_query_is_invalid(self):
        request = self.seed_request()
        request.ClearField("query")
        self.assert_invalid(self.stub.Naive, request, "query")
        self.assert_invalid(self.stub.Tiled, request, "query")

    def test_mismatched_head_dim_is_invalid(self):
        q, k, v = h.seed_problem()
        request = pb.AttentionRequest(query=fp32_tensor(q), key=fp32_tensor(k[:, :3]),
                                      value=fp32_tensor(v))
        self.assert_invalid(self.stub.Naive, request, "key.shape")
        self.assert_invalid(self.stub.Tiled, request, "key.shape")

    def test_trace_row_out_of_range_is_invalid(self):
        request = pb.TraceRequest(attention=self.seed_request(block_k=3),
                                  rows=[pb.RowRef(batch=0, head=0, row=8)])
        self.assert_invalid(self.stub.Trace, request, "rows[0]")


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, exit=True)
