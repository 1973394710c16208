"""``nodraft::packed_block`` in this checkout against another, in one run: for changes to the
operator's C++ (micro/csrc), which two builds of one library cannot share a process to
compare.

    git worktree add /tmp/before <commit>
    python benchmarks/block_ab.py --before /tmp/before [--model micro] [--rounds 6]
                                  [--out FILE.json]

Two worker processes, one per checkout (``checkouts.checkout_env``: each its own code and
build folder), each on the last core, hold micro's trained weights laid out by their own
``gemm.pack``, a 64-slot cache filled from one seed, and the same inputs. Rounds alternate
the workers (after, before; then before, after); in a round a worker times every shape:
runs of 10 passes, the median of 9 runs. Shapes: a lone sequence's decode step and its 2-,
3- and 5-row blocks (a draft's verification) at 300 cached rows, 8 and 32 sequences'
decode steps at 100 and 300 cached rows each, and 8 sequences' 5-row blocks at 100.
Reported per shape: the median over rounds of each checkout's microseconds per pass, their
range, and after / before.

Ratios in one run are what carry on a shared machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

try:
    from checkouts import alternate  # run as a script
    from weight_layout import weights
except ImportError:  # imported as benchmarks.block_ab
    from benchmarks.checkouts import alternate
    from benchmarks.weight_layout import weights

SHAPES = [(1, 1, 300), (1, 2, 300), (1, 3, 300), (1, 5, 300), (8, 1, 100), (8, 1, 300),
          (32, 1, 100), (32, 1, 300), (8, 5, 100)]
RUN, RUNS = 10, 9


def label(shape: tuple[int, int, int]) -> str:
    seqs, rows, ctx = shape
    return f"{seqs} x {rows} row{'s' if rows > 1 else ''}, {ctx} cached"


def worker(model_name: str) -> None:
    """Read a line per round; answer each with the round's JSON {label: microseconds}."""
    import torch

    from nodraft.micro import gemm
    from nodraft.micro.checkpoint import load_model
    from nodraft.micro.model import KVCache

    torch.set_num_threads(1)
    if not gemm.load():
        print(json.dumps({"error": f"nodraft's kernels are unavailable: {gemm.why()}"}),
              flush=True)
        return
    model = load_model(model_name)
    c = model.config
    norms, mats = weights(model, packed=True)
    cache = KVCache(c, 64)
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    op = torch.ops.nodraft.packed_block.default
    passes = {}
    for seqs, rows, ctx in SHAPES:
        h = torch.randn(seqs * rows, c.dim, generator=torch.Generator().manual_seed(seqs + ctx))
        pos = torch.tensor([ctx + r for _ in range(seqs) for r in range(rows)])
        slots = list(range(0, 2 * seqs, 2))
        passes[label((seqs, rows, ctx))] = (
            lambda h=h, pos=pos, slots=slots, seqs=seqs, rows=rows, ctx=ctx:
            op(h, pos, model.rope_cos, model.rope_sin, norms, mats, cache.k, cache.v,
               [rows] * seqs, slots, [ctx] * seqs, [None] * seqs, [1] * seqs, 0, c.norm_eps))
    print(json.dumps({"ready": True}), flush=True)
    with torch.inference_mode():
        for _ in sys.stdin:
            out = {}
            for name, f in passes.items():
                f()
                runs = []
                for _ in range(RUNS):
                    t0 = time.perf_counter()
                    for _ in range(RUN):
                        f()
                    runs.append((time.perf_counter() - t0) / RUN * 1e6)
                out[name] = statistics.median(runs)
            print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="the other checkout (git worktree add)")
    p.add_argument("--model", default="micro")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.model)
        return
    last = max(os.sched_getaffinity(0))
    cmd = ["taskset", "-c", str(last), sys.executable, os.path.abspath(__file__), "--worker",
           "--before", args.before, "--model", args.model]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    answers = alternate(cmd, {"after": here, "before": args.before}, args.rounds)
    times: dict[str, dict[str, list[float]]] = {n: {} for n in answers}
    for name, rounds in answers.items():
        for got in rounds:
            for shape, us in got.items():
                times[name].setdefault(shape, []).append(us)
    rows = []
    print("| pass | after us | before us | after / before |\n|---|---|---|---|")
    for shape in times["after"]:
        a, b = times["after"][shape], times["before"][shape]
        row = {"shape": shape, "after_us": statistics.median(a), "before_us": statistics.median(b),
               "after_range": [min(a), max(a)], "before_range": [min(b), max(b)]}
        row["after_over_before"] = row["after_us"] / row["before_us"]
        rows.append(row)
        print(f"| {shape} | {row['after_us']:.0f} ({min(a):.0f}-{max(a):.0f}) | "
              f"{row['before_us']:.0f} ({min(b):.0f}-{max(b):.0f}) | "
              f"{row['after_over_before']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "before": args.before,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
