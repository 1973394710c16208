"""What a target pass costs by the rows it carries: eager against compiled, in one run.

    python benchmarks/passes.py [--model micro] [--rows 1,2,3,5,9,17] [--context 100]
                                [--threads 1] [--repeats 400] [--out FILE.json]

One sequence, ``--context`` cached rows, a verification pass (``Micro.verify_pass``) over
a block of each size: eager micro and the compiled graphs (micro/compiled.py, compiled
before timing), these twice where nodraft's product builds: multiplying with ``torch.mm``
and with ``nodraft::mm`` (micro/gemm.py); and there the pass in one call,
``nodraft::block`` (micro/csrc/block.cpp), what a lone sequence runs where it serves.
Runs of 20 identical passes alternate, size by size and mode by mode (a decode loop
repeats one kind of pass, so its weights stay in cache); each figure is the median of ``--repeats`` passes. Reported: microseconds per
pass, each size's cost in 1-row passes of the same mode (the curve an adaptive draft
length has to know), compiled over eager, nodraft::mm over torch.mm, and nodraft::block
over the graph with nodraft::mm.

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

from nodraft.micro.checkpoint import load_model
from nodraft.micro.model import KVCache


RUN = 20  # consecutive passes of one kind: interleaving every pass with 11 others evicts
# each one's weights and code from the caches (1-row passes then cost 2.5x more, both modes)


def measure(model_name: str, rows: list[int], context: int, repeats: int) -> dict:
    from nodraft.micro import gemm

    models = {"eager": load_model(model_name),
              "compiled": load_model(model_name).compile(gemm="torch")}
    if gemm.load():  # nodraft's product, where it builds (micro/gemm.py)
        models["compiled_nodraft_mm"] = load_model(model_name).compile(gemm="auto", block=False)
        models["block"] = load_model(model_name).compile(gemm="auto")
    eager = models["eager"]
    cache = KVCache(eager.config, 1)
    prompt = torch.randint(0, eager.config.vocab_size, (context,),
                           generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eager(prompt[None], cache=cache, slot=0, start=0)
    cache.set_length(0, context)
    blocks = {r: torch.randint(0, eager.config.vocab_size, (r,),
                               generator=torch.Generator().manual_seed(r)) for r in rows}
    t0 = time.perf_counter()
    for r in rows:  # compile every family first (and warm each)
        for m in models.values():
            m.verify_pass(blocks[r], cache, 0, context)
    compile_s = time.perf_counter() - t0
    times: dict[str, dict[int, list[float]]] = {mode: {r: [] for r in rows} for mode in models}
    clock = time.perf_counter
    with torch.inference_mode():
        for _ in range(max(1, repeats // RUN)):
            for r in rows:
                for mode, m in models.items():
                    for _ in range(RUN):  # a run of the same pass, as a decode loop makes
                        t = clock()
                        m.verify_pass(blocks[r], cache, 0, context)
                        times[mode][r].append(clock() - t)
    med = {mode: {r: statistics.median(v) for r, v in per.items()} for mode, per in times.items()}
    out = []
    for r in rows:
        row = {"rows": r}
        for mode in models:
            row[f"{mode}_us"] = med[mode][r] * 1e6
            row[f"{mode}_in_1row_passes"] = med[mode][r] / med[mode][rows[0]]
        row["compiled_over_eager"] = med["compiled"][r] / med["eager"][r]
        if "compiled_nodraft_mm" in models:
            row["nodraft_mm_over_torch_mm"] = med["compiled_nodraft_mm"][r] / med["compiled"][r]
        if "block" in models:
            row["block_over_graph"] = med["block"][r] / med["compiled_nodraft_mm"][r]
        out.append(row)
    return {"compile_seconds": compile_s, "modes": list(models), "rows": out}


LABELS = {"eager": "eager", "compiled": "compiled (torch.mm)",
          "compiled_nodraft_mm": "compiled (nodraft::mm)", "block": "nodraft::block"}


def render(result: dict) -> str:
    modes = result.get("modes", ["eager", "compiled"])
    head = (["rows"] + [f"{LABELS[m]} us" for m in modes]
            + [f"{LABELS[m]}, in 1-row passes" for m in modes] + ["compiled (torch.mm) / eager"])
    if "compiled_nodraft_mm" in modes:
        head.append("nodraft::mm / torch.mm")
    if "block" in modes:
        head.append("nodraft::block / compiled (nodraft::mm)")
    lines = [f"Command: `{result['command']}` ({result['machine']}; compiling took "
             f"{result['compile_seconds']:.0f} s, untimed)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = ([str(r["rows"])] + [f"{r[f'{m}_us']:.0f}" for m in modes]
                 + [f"{r[f'{m}_in_1row_passes']:.2f}" for m in modes]
                 + [f"{r['compiled_over_eager']:.2f}"])
        if "compiled_nodraft_mm" in modes:
            cells.append(f"{r['nodraft_mm_over_torch_mm']:.2f}")
        if "block" in modes:
            cells.append(f"{r['block_over_graph']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
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
