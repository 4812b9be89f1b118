#!/usr/bin/python3
"""The explainer's 8×4 seed example through attnd, from Python.

Runs Naive and Tiled, prints out[0] of each, then streams the Trace of row 0 with block_k 2 and
prints every step of the online softmax: the tile's scores, the running max, the rescale factor,
the denominator and the current estimate of out[0].

    PYTHONPATH=build/release/python:client/python /usr/bin/python3 client/python/example.py \
        [--target 127.0.0.1:50051] [--token-file FILE] [--tls-ca ca.pem]
"""

import argparse
import sys

import numpy as np

from attn_client import AttnError, Client, seed_example


def fmt(values):
    return "[" + " ".join("%9.6f" % x for x in values) + "]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--token-file", help="file holding attnd's bearer token")
    parser.add_argument("--tls-ca", help="PEM CA bundle (TLS)")
    parser.add_argument("--block-k", type=int, default=2)
    args = parser.parse_args()
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()

    q, k, v = seed_example()
    with Client(args.target, token=token, tls_ca=args.tls_ca, timeout=30) as client:
        try:
            info = client.info()
            print("attnd %s on %s (%s)" % (info["version"], info["backend"], info["device"]))
            naive = client.naive(q, k, v, scale=0.5)
            tiled = client.tiled(q, k, v, scale=0.5, block_k=args.block_k)
            print("naive out[0] =", fmt(naive.output[0]),
                  " (%d intermediate bytes)" % naive.stats["intermediate_bytes"])
            print("tiled out[0] =", fmt(tiled.output[0]),
                  " (%d intermediate bytes, block_k %d)"
                  % (tiled.stats["intermediate_bytes"], tiled.stats["block_k"]))

            print("\ntrace of row 0, block_k %d:" % args.block_k)
            for event in client.trace(q, k, v, rows=[(0, 0, 0)], block_k=args.block_k,
                                      scale=0.5):
                kind = event["kind"]
                if kind == "start":
                    print("  %d tiles; naive would move %d bytes, tiled keeps %d floats per row"
                          % (event["tiles_per_row"], event["naive_intermediate_bytes"],
                             event["tiled_scratch_floats_per_row"]))
                elif kind == "step":
                    print("  tile %d keys %d..%d scores %s" % (
                        event["tile"], event["key_begin"], event["key_end"] - 1,
                        fmt(event["scores"])))
                    print("    max %9.6f -> %9.6f  rescale %.6f  denominator %.6f" % (
                        event["max_before"], event["max_after"], event["rescale"],
                        event["denominator"]))
                    print("    estimate %s" % fmt(event["estimate"]))
                elif kind == "row_done":
                    print("  row %s output    %s" % (event["row"], fmt(event["output"])))
                    print("  row %s reference %s  (max |error| %.3g)"
                          % (event["row"], fmt(event["reference"]), event["max_abs_error"]))
                elif kind == "end":
                    print("  %d rows, %d steps" % (event["rows"], event["steps"]))
        except AttnError as error:
            print("error: %s" % error, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
