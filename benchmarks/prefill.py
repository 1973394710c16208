"""What a prompt's prefill costs: the eager pass with and without the head, and the compiled
prefill graph, in one run.

    python benchmarks/prefill.py [--model micro] [--rows 1,3,20,100,256] [--threads 1]
                                 [--repeats 30] [--out FILE.json]

One empty KV slot; a prompt of each size through every layer, three ways:

    eager+head   ``model(ids, hidden=...)``: what ``Sequence.prefill`` ran before, which
                 also computed the 4096-way logits of every prompt row and dropped them
    eager        ``Micro.prefill_pass`` on an eager model: the layers only
    compiled     ``Micro.prefill_pass`` on a compiled model: ``CompiledPasses.prefill``
                 (compiled before timing)

The three alternate pass by pass, size by size, each pass after a pause of ``--pause``
seconds (a prefill starts a request, after the engine has waited for it: its weights are
not in the caches then), and again back to back (``hot``). Each figure is the median of
``--repeats`` passes, in milliseconds; ratios in one run are what carry on a shared
machine.
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

MODES = ("eager+head", "eager", "compiled")


def measure(model_name: str, rows: list[int], repeats: int, pause: float) -> dict:
    eager = load_model(model_name)
    compiled = load_model(model_name).compile(lazy=False)
    cache = KVCache(eager.config, 1)
    ids = {r: torch.randint(0, eager.config.vocab_size, (r,),
                            generator=torch.Generator().manual_seed(r)) for r in rows}

    def run(mode: str, r: int) -> None:
        if mode == "eager+head":
            eager(ids[r][None], cache=cache, slot=0, start=0, hidden=[])
        else:
            (eager if mode == "eager" else compiled).prefill_pass(ids[r], cache, 0, 0)

    with torch.inference_mode():
        t0 = time.perf_counter()
        compiled.compiled.prefill(torch.zeros(5, eager.config.dim), cache, 0, compile=True)
        compile_s = time.perf_counter() - t0
        for r in rows:  # every path once before timing
            for m in MODES:
                run(m, r)
        times = {kind: {m: {r: [] for r in rows} for m in MODES} for kind in ("cold", "hot")}
        clock = time.perf_counter
        for i in range(repeats):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for r in rows:
                for m in order:
                    time.sleep(pause)
                    t = clock()
                    run(m, r)
                    times["cold"][m][r].append(clock() - t)
                    t = clock()
                    run(m, r)
                    times["hot"][m][r].append(clock() - t)
    ms = {kind: {m: {r: 1e3 * statistics.median(v) for r, v in by.items()}
                 for m, by in modes.items()} for kind, modes in times.items()}
    return {"model": model_name, "rows": rows, "repeats": repeats, "pause_s": pause,
            "compile_s": compile_s, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine(), "ms": ms}


def render(result: dict) -> str:
    lines = []
    for kind in ("cold", "hot"):
        lines += [f"{kind} (ms per prefill; compiled over eager)", "",
                  "| rows | eager+head | eager | compiled | compiled / eager |",
                  "|---|---|---|---|---|"]
        ms = result["ms"][kind]
        for r in result["rows"]:
            e, c = ms["eager"][r], ms["compiled"][r]
            lines.append(f"| {r} | {ms['eager+head'][r]:.2f} | {e:.2f} | {c:.2f} | "
                         f"{c / e:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro")
    p.add_argument("--rows", default="1,3,20,100,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.model, [int(r) for r in args.rows.split(",")], args.repeats,
                     args.pause)
    result["command"] = "python benchmarks/prefill.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(render(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
