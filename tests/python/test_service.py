#!/usr/bin/python3
"""End-to-end test of attnd from a Python gRPC client.

Starts its own attnd on 127.0.0.1 (port 0, read back from the startup line), calls all four
RPCs of attention.v1 and checks them against a float64 numpy reference; the server is always
killed at the end. Run by CTest as

  /usr/bin/python3 tests/python/test_service.py --attnd <attnd> --stubs <generated stubs dir>

Needs the Debian python3-grpcio and python3-numpy (hence /usr/bin/python3); stdlib unittest only.
"""

import argparse
import math
import os
import sys
import unittest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_parser = argparse.ArgumentParser(add_help=False)
_parser.add_argument("--attnd", default=os.path.join(REPO_ROOT, "build", "release", "attnd"))
_parser.add_argument("--stubs", default=os.path.join(REPO_ROOT, "build", "release", "python"))
ARGS, _UNITTEST_ARGV = _parser.parse_known_args()

import attnd_harness as h  # noqa: E402

h.add_stubs_path(ARGS.stubs)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

RPC_TIMEOUT_S = 30.0

SEED_OUT_ROW0 = [-0.593223, 0.406777, -1.332858, -0.371937]


# --- Problems (tensor encoding, decoding and the float64 reference are attnd_harness's) ---------

def fp32_tensor(array):
    return h.encode(array, pb.DTYPE_FLOAT32)[0]


def relative_error(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


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
    unittest.main(argv=[sys.argv[0]] + _UNITTEST_ARGV, exit=True)
