"""How well the pass prices predict the passes requests run: the table alone against the
table with what a longer context adds (``drafters.costs.PassCost.at``).

    python benchmarks/pass_prices.py [--models micro,micro-layerskip] [--repeats 2]
                                     [--out FILE.json]

Per model (compiled passes, one thread): the pass-cost table is measured as the engine
measures it (``costs.measure`` past ``costs.CONTEXT`` cached rows, and past longer
contexts), then the workload suite's prompts of the categories with long contexts
(``long``, ``rag``, ``chat``, ``edit``; ``clients.bench.build_prompts``) are decoded
greedy, 128 tokens, with ``suffix``, ``prompt_lookup``, ``auto`` and ``none``, and every
whole verification pass is recorded: its rows, the cached rows it read, its seconds.
Both pricings are then replayed over the same passes in order, each learning its scales
from them as a request's would (``PassCost.observe``), and each pass's price is compared
with its time before the pass is learnt from: per size of pass and context, the median of
log(price / seconds) (above 0: priced dearer than it ran) and of its absolute value.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

from nodraft.clients import bench
from nodraft.clients import measure as M
from nodraft.drafters import costs
from nodraft.micro.checkpoint import load_model, load_tokenizer
from nodraft.micro.model import KVCache

CATEGORIES = ("long", "rag", "chat", "edit")
METHODS = ("suffix", "prompt_lookup", "auto", "none")


def size(rows: int) -> str:
    return "1 row" if rows == 1 else ("2-3" if rows <= 3 else "4-9" if rows <= 9 else "10+") + " rows"


def span(context: int) -> str:
    return "<200" if context < 200 else "200-399" if context < 400 else "400+"


def replay(passes: list[tuple[int, float, int]], table: costs.PassCost,
           with_context: bool) -> dict[str, dict]:
    """Each pass priced before it is learnt from, by a fresh copy of ``table``'s figures
    (with or without its context reads)."""
    reads = dict(zip(table.contexts[1:], table.extra[1:])) if with_context else None
    cost = costs.PassCost(dict(zip(table.rows, table.secs)), table.start, reads)
    errors: dict[str, list[float]] = {}
    for rows, seconds, context in passes:
        errors.setdefault(f"{size(rows)}, {span(context)} cached",
                          []).append(math.log(cost(rows, context) / seconds))
        cost.observe(rows, seconds, context)
    return {k: {"passes": len(v), "median_log_error": statistics.median(v),
                "median_abs_log_error": statistics.median(abs(x) for x in v)}
            for k, v in sorted(errors.items())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="micro,micro-layerskip")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer()
    prompts = bench.build_prompts(tok, 2)
    result = {"command": "python benchmarks/pass_prices.py " + " ".join(argv or []),
              "machine": platform.machine(), "torch": torch.__version__, "models": {}}
    for name in args.models.split(","):
        model = load_model(name).compile(True)
        cache = KVCache(model.config, 1)
        table = costs.measure(model, cache, 0, costs.timing_start(cache.max_len))
        passes: list[tuple[int, float, int]] = []

        class Recording(costs.PassCost):
            def observe(self, rows, seconds, context=None):
                passes.append((rows, seconds, context))
                super().observe(rows, seconds, context)

        t0 = time.perf_counter()
        for category in CATEGORIES:
            for prompt in prompts[category]:
                for method in METHODS:
                    for _ in range(args.repeats):
                        # each decode prices and learns from a fresh copy, as a fresh server
                        fresh = Recording(dict(zip(table.rows, table.secs)), table.start,
                                          dict(zip(table.contexts[1:], table.extra[1:])))
                        costs._COSTS[model] = {costs.compiled_state(model): fresh}
                        M.decode(model, prompt["ids"], 128, method, model_name=name,
                                 stop_ids=frozenset(prompt.get("stop_ids", ())))
        result["models"][name] = {
            "table_us": {r: s * 1e6 for r, s in zip(table.rows, table.secs)},
            "context_reads_us": {c: [a * 1e6, b * 1e6]
                                 for c, (a, b) in zip(table.contexts, table.extra)},
            "passes": len(passes), "decode_seconds": time.perf_counter() - t0,
            "table_only": replay(passes, table, False),
            "with_context": replay(passes, table, True)}
        m = result["models"][name]
        print(f"{name}: {len(passes)} passes; context reads (one row us, a row of 17 us): "
              + ", ".join(f"{c}: {a:.0f}/{b:.1f}" for c, (a, b) in m["context_reads_us"].items()))
        print("| passes | n | table only: median log(price/time), abs | with context |")
        print("|---|---|---|---|")
        for k, old in m["table_only"].items():
            new = m["with_context"][k]
            print(f"| {k} | {old['passes']} | {old['median_log_error']:+.2f}, "
                  f"{old['median_abs_log_error']:.2f} | {new['median_log_error']:+.2f}, "
                  f"{new['median_abs_log_error']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
