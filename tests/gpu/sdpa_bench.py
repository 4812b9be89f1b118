#!/usr/bin/env python3
"""torch.nn.functional.scaled_dot_product_attention on the shapes gpu_bench times.

The reference column of tests/gpu/device_check.sh: the same sweep as gpu_bench (dtype, head
dim, sequence, causal; batch·heads = tokens / seq, split as gpu_bench splits it), fresh
uniform(-1, 1) inputs, SDPA's default dispatch (the backend it picks is recorded in the note
column), timed with torch.cuda.Event. Each sample times a run of back-to-back calls between two
events (at least ~2 ms of work), so Python's dispatch overhead is hidden as it is in a model;
the median sample is reported. Prints CSV lines in gpu_bench's format:

  attn,sdpa,<dtype>,<d>,<seq>,<bh>,<causal>,<reps>,<ms_median>,<ms_min>,<tflops>,<rel_err>,
      <status>,<note>

with TFLOP/s = 4·B·H·N²·d (halved when causal) / median time, and rel_err = max |out − float64
reference| / max |reference| over a few sampled rows. Without torch, SDPA or a CUDA device it
prints "SKIPPED: ..." and exits 0.
"""

import argparse
import math
import statistics
import sys
import time

BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-3}


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16,fp16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--dim", type=int_list, default=[64, 128])
    p.add_argument("--seq", type=int_list, default=[1024, 4096, 16384])
    p.add_argument("--causal", type=int_list, default=[0, 1])
    p.add_argument("--tokens", type=int, default=256 * 1024, help="batch·heads·seq")
    p.add_argument("--bh", type=int, default=0, help="batch·heads for every seq (0: tokens/seq)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sample_ms", type=float, default=2.0, help="GPU time per timed sample")
    p.add_argument("--deadline_s", type=float, default=0, help="0: none")
    p.add_argument("--check", type=int, default=1)
    args = p.parse_args(argv)
    args.dtype = [x for x in args.dtype.split(",") if x]
    for name in args.dtype:
        if name not in TOLERANCE:
            p.error(f"unknown dtype {name}")
    return args


def line(text):
    print(text, flush=True)


def clean(text):
    return str(text).replace(",", ";").replace("\n", " ")[:300]


def backend_name(torch, q, k, v, causal):
    """The backend SDPA's default dispatch picks for these inputs, or 'unknown'."""
    try:
        index = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))
    except Exception:  # A private function: absent or changed in some versions.
        return "unknown"
    try:
        from torch.nn.attention import SDPBackend

        for member in SDPBackend.__members__.values():
            if int(member.value) == index:
                return member.name.lower().replace("_attention", "")
    except Exception:
        pass
    return BACKEND_NAMES.get(index, f"backend{index}")


def check_rows(torch, q, k, v, out, causal):
    """max |out − float64 reference| / max |reference| over sampled rows; inf on any NaN."""
    if bool(torch.isnan(out).any()):
        return math.inf
    batch, heads, seq, d = q.shape
    bh = batch * heads
    q3, k3, v3, o3 = (t.reshape(bh, seq, d) for t in (q, k, v, out))
    worst, largest = 0.0, 0.0
    for head, row in ((0, 0), (0, seq - 1), (bh // 2, seq // 2), (bh - 1, seq - 1),
                      (bh - 1, (seq * 3) // 7)):
        visible = row + 1 if causal else seq
        scores = (k3[head, :visible].double() @ q3[head, row].double()) / math.sqrt(d)
        weights = torch.softmax(scores, dim=0)
        expected = weights @ v3[head, :visible].double()
        worst = max(worst, float((o3[head, row].double() - expected).abs().max()))
        largest = max(largest, float(expected.abs().max()))
    return worst / max(largest, 1e-30)


def main(argv):
    args = parse_args(argv)
    begin = time.monotonic()
    try:
        import torch
        import torch.nn.functional as F
    except Exception as error:  # ImportError, or a broken install.
        line(f"SKIPPED: no torch ({clean(error)}): the SDPA column is left out")
        return 0
    if not hasattr(F, "scaled_dot_product_attention"):
        line(f"SKIPPED: torch {torch.__version__} has no scaled_dot_product_attention")
        return 0
    if not torch.cuda.is_available():
        line(f"SKIPPED: no CUDA device for torch {torch.__version__} (CUDA {torch.version.cuda})")
        return 0
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    device = torch.device("cuda")
    line(f"# torch {torch.__version__} (CUDA {torch.version.cuda}) on "
         f"{clean(torch.cuda.get_device_name(0))}")
    line("#attn,method,dtype,d,seq,bh,causal,reps,ms_median,ms_min,tflops,rel_err,status,note")
    failed = False
    seed = 1
    for dtype_name in args.dtype:
        dtype = dtypes[dtype_name]
        for d in args.dim:
            for seq in args.seq:
                bh = args.bh if args.bh > 0 else max(1, args.tokens // seq)
                heads = 16 if bh % 16 == 0 else bh
                batch = bh // heads
                tensors = None
                for causal in args.causal:
                    causal = bool(causal)
                    cell = f"attn,sdpa,{dtype_name},{d},{seq},{bh},{int(causal)}"
                    if args.deadline_s > 0 and time.monotonic() - begin > args.deadline_s:
                        line(cell + ",0,,,,,timeout,deadline passed")
                        continue
                    try:
                        if tensors is None:
                            generator = torch.Generator(device=device)
                            tensors = []
                            for _ in range(3):
                                seed += 1
                                generator.manual_seed(seed)
                                x = torch.rand(batch, heads, seq, d, device=device,
                                               dtype=torch.float32, generator=generator)
                                tensors.append((x * 2 - 1).to(dtype))
                                del x
                        q, k, v = tensors
                        backend = backend_name(torch, q, k, v, causal)

                        def call():
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        for _ in range(max(1, args.warmup)):
                            out = call()
                        torch.cuda.synchronize()
                        start = torch.cuda.Event(enable_timing=True)
                        stop = torch.cuda.Event(enable_timing=True)
                        start.record()
                        out = call()
                        stop.record()
                        stop.synchronize()
                        first_ms = start.elapsed_time(stop)
                        inner = max(1, min(50, math.ceil(args.sample_ms / max(first_ms, 1e-3))))
                        samples = []
                        for _ in range(args.reps):
                            start.record()
                            for _ in range(inner):
                                out = call()
                            stop.record()
                            stop.synchronize()
                            samples.append(start.elapsed_time(stop) / inner)
                        rel_err = check_rows(torch, q, k, v, out, causal) if args.check else 0.0
                        del out
                    except Exception as error:  # torch.cuda.OutOfMemoryError is a RuntimeError.
                        oom = "out of memory" in str(error).lower()
                        failed = failed or not oom
                        line(cell + ",0,,,,," + ("oom," if oom else "error,") + clean(error))
                        tensors = None
                        torch.cuda.empty_cache()
                        continue
                    status = "ok" if rel_err <= TOLERANCE[dtype_name] else "bad"
                    failed = failed or status != "ok"
                    median = statistics.median(samples)
                    flops = 4.0 * bh * seq * seq * d * (0.5 if causal else 1.0)
                    line(cell + f",{len(samples)},{median:.4f},{min(samples):.4f},"
                         f"{flops / (median * 1e-3) / 1e12:.2f},{rel_err:.2e},{status},"
                         f"backend={backend} calls_per_sample={inner}")
                del tensors
    line(f"# sdpa_bench done in {time.monotonic() - begin:.1f} s"
         + (" (with failures)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
