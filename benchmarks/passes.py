"""What a target pass costs by the rows it carries: eager against compiled, in one run.

    python benchmarks/passes.py [--model micro] [--rows 1,2,3,5,9,17] [--context 100]
                                [--threads 1] [--repeats 400] [--out FILE.json]

One sequence, ``--context`` cached rows, a verification pass (``Micro.verify_pass``) over
a block of each size: eager micro and the compiled graphs (micro/compiled.py, compiled
before timing). Runs of 20 identical passes alternate, size by size and mode by mode (a
decode loop repeats one kind of pass, so its weights stay in cache); each figure is the
median of ``--repeats`` passes. Reported: microseconds per pass, each size's cost in 1-row passes of
the same mode (the curve an adaptive draft length has to know), and compiled over eager.

Ratios in one run are what carry on a shared machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from micro.checkpoint import load_model
from micro.model import KVCache


RUN = 20  # consecutive passes of one kind: interleaving every pass with 11 others evicts
# each one's weights and code from the caches (1-row passes then cost 2.5x more, both modes)


def measure(model_name: str, rows: list[int], context: int, repeats: int) -> dict:
    eager = load_model(model_name)
    compiled = load_model(model_name).compile()
    cache = KVCache(eager.config, 1)
    prompt = torch.randint(0, eager.config.vocab_size, (context,),
                           generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eager(prompt[None], cache=cache, slot=0, start=0)
    cache.set_length(0, context)
    blocks = {r: torch.randint(0, eager.config.vocab_size, (r,),
                               generator=torch.Generator().manual_seed(r)) for r in rows}
    t0 = time.perf_counter()
    for r in rows:  # compile every family first (and warm both)
        eager.verify_pass(blocks[r], cache, 0, context)
        compiled.verify_pass(blocks[r], cache, 0, context)
    compile_s = time.perf_counter() - t0
    times: dict[str, dict[int, list[float]]] = {"eager": {r: [] for r in rows},
                                                "compiled": {r: [] for r in rows}}
    clock = time.perf_counter
    with torch.inference_mode():
        for _ in range(max(1, repeats // RUN)):
            for r in rows:
                for mode, m in (("eager", eager), ("compiled", compiled)):
                    for _ in range(RUN):  # a run of the same pass, as a decode loop makes
                        t = clock()
                        m.verify_pass(blocks[r], cache, 0, context)
                        times[mode][r].append(clock() - t)
    med = {mode: {r: statistics.median(v) for r, v in per.items()} for mode, per in times.items()}
    out = []
    for r in rows:
        e, c = med["eager"][r], med["compiled"][r]
        out.append({"rows": r, "eager_us": e * 1e6, "compiled_us": c * 1e6,
                    "eager_in_1row_passes": e / med["eager"][rows[0]],
                    "compiled_in_1row_passes": c / med["compiled"][rows[0]],
                    "compiled_over_eager": c / e})
    return {"compile_seconds": compile_s, "rows": out}


def render(result: dict) -> str:
    lines = [f"Command: `{result['command']}` ({result['machine']}; compiling took "
             f"{result['compile_seconds']:.0f} s, untimed)", "",
             "| rows | eager us | compiled us | eager, in 1-row passes | compiled, in 1-row passes | compiled / eager |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['rows']} | {r['eager_us']:.0f} | {r['compiled_us']:.0f} | "
                     f"{r['eager_in_1row_passes']:.2f} | {r['compiled_in_1row_passes']:.2f} | "
                     f"{r['compiled_over_eager']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--rows", default="1,2,3,5,9,17")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    rows = sorted({int(r) for r in args.rows.split(",")})
    if rows[0] != 1:
        p.error("--rows must include 1 (the unit of the curve)")
    torch.set_num_threads(args.threads)
    result = measure(args.model, rows, args.context, args.repeats)
    result.update(command="python benchmarks/passes.py " + " ".join(argv or sys.argv[1:]),
                  machine=f"{platform.machine()}, torch {torch.__version__}, "
                          f"{args.threads} thread(s), {args.context} cached rows, "
                          f"median of {args.repeats}")
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
