"""nodraft's one-call pass with its weights as (K, N) matrices against packed in 16-column
blocks (``micro.gemm.pack``), in one run.

    python benchmarks/weight_layout.py [--model micro] [--repeats 11] [--threads 1]
                                       [--out FILE.json]

``nodraft::packed_block`` (micro/csrc/block.cpp) over micro's trained weights, the same
inputs and cache both ways, on shapes a server's passes take: a lone decode step at 50
and 300 cached rows, a 5-row verification block, and 8 and 32 sequences' one-row steps
at 100 cached rows each. Warm: runs of 20 identical passes, the layouts alternated run
by run, ``--repeats`` runs each; the median microseconds per pass. Cold: a lone decode
step after 25 ms asleep, what an idle server's first pass finds (on a shared machine
its caches have been refilled by others meanwhile), alternated pass by pass. Both
layouts give the same bits (checked for every shape before timing).

Ratios in one run are what carry on a shared machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model
from nodraft.micro.model import KVCache

RUN = 20  # passes per timed run
SHAPES = [  # (label, sequences, rows each, cached rows each)
    ("decode, 50 cached", 1, 1, 50),
    ("decode, 300 cached", 1, 1, 300),
    ("5-row block, 100 cached", 1, 5, 100),
    ("8 x decode, 100 cached", 8, 1, 100),
    ("32 x decode, 100 cached", 32, 1, 100),
]


def weights(model, packed: bool) -> tuple[list, list]:
    """The operator's norms and (in, out) matrices for every layer and the head."""
    norms, mats = [], []
    lay_out = gemm.pack if packed else (lambda w: w)
    for layer in model.layers:
        norms += [layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()]
        mats += [lay_out(w.weight.detach().t().contiguous())
                 for w in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13,
                           layer.feed_forward.w2)]
    norms.append(model.norm.weight.detach())
    mats.append(lay_out(model.tok_embeddings.weight.detach().t().contiguous()))  # tied head
    return norms, mats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not gemm.load():
        sys.exit(f"nodraft's kernels are unavailable here: {gemm.why()}")
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    c = model.config
    cache = KVCache(c, 64)
    layouts = {"(K, N)": weights(model, False), "packed": weights(model, True)}
    op = torch.ops.nodraft.packed_block.default
    g = torch.Generator().manual_seed(0)
    for name in ("k", "v"):  # cached rows: any values, the same for both layouts
        getattr(cache, name).normal_(generator=g)

    def pass_fn(seqs: int, rows: int, ctx: int, layout: str):
        h = torch.randn(seqs * rows, c.dim, generator=torch.Generator().manual_seed(seqs + ctx))
        pos = torch.tensor([ctx + r for _ in range(seqs) for r in range(rows)])
        norms, mats = layouts[layout]
        slots = list(range(0, 2 * seqs, 2))
        return lambda: op(h, pos, model.rope_cos, model.rope_sin, norms, mats, cache.k, cache.v,
                          [rows] * seqs, slots, [ctx] * seqs, [None] * seqs, [1] * seqs, 0,
                          c.norm_eps)

    results = {"model": args.model, "threads": args.threads, "machine": platform.machine(),
               "torch": torch.__version__, "unit": gemm.unit(), "date": time.strftime("%Y-%m-%d"),
               "warm": [], "cold": None}
    with torch.inference_mode():
        for label, seqs, rows, ctx in SHAPES:
            fns = {k: pass_fn(seqs, rows, ctx, k) for k in layouts}
            a, b = (f() for f in fns.values())
            if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
                sys.exit(f"{label}: the two layouts gave different bits")
            times: dict[str, list[float]] = {k: [] for k in fns}
            for i in range(args.repeats):
                for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                    fns[k]()
                    t0 = time.perf_counter()
                    for _ in range(RUN):
                        fns[k]()
                    times[k].append((time.perf_counter() - t0) / RUN * 1e6)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"shape": label, "us": med,
                   "spread_us": {k: [min(v), max(v)] for k, v in times.items()},
                   "packed_over_kn": med["packed"] / med["(K, N)"]}
            results["warm"].append(row)
            print(f"{label}: (K, N) {med['(K, N)']:.0f} us, packed {med['packed']:.0f} us, "
                  f"packed / (K, N) {row['packed_over_kn']:.2f}", flush=True)
        fns = {k: pass_fn(1, 1, 50, k) for k in layouts}
        cold: dict[str, list[float]] = {k: [] for k in fns}
        for i in range(4 * args.repeats):
            for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                time.sleep(0.025)
                t0 = time.perf_counter()
                fns[k]()
                cold[k].append((time.perf_counter() - t0) * 1e6)
        med = {k: statistics.median(v) for k, v in cold.items()}
        results["cold"] = {"shape": "decode, 50 cached, after 25 ms asleep", "us": med,
                           "n": len(cold["packed"]),
                           "packed_over_kn": med["packed"] / med["(K, N)"]}
        print(f"cold decode: (K, N) {med['(K, N)']:.0f} us, packed {med['packed']:.0f} us, "
              f"packed / (K, N) {med['packed'] / med['(K, N)']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
