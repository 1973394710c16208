"""Choosing lookahead decoding's defaults by measurement, and the cost of a pass's extra rows.

1. The cost curve: micro's time for one pass over T rows (a causal block after a 200-token
   context), relative to a 1-row pass, and the least-squares slope of
   ``t(T) / t(1) = 1 + ROW_COST * (T - 1)`` -- the per-row cost ``drafters.lookahead`` uses.
2. window W, n-gram size N, guesses G (and pool seeding) against ``none`` on the workshop's
   fresh and repeating prompts: tokens per target pass, modelled draft cost per pass,
   estimated and measured speed-up (``clients.measure.measured_speedup``: runs alternated,
   median of ``--repeats``, each checked to give plain greedy's tokens).

    python benchmarks/lookahead.py [--tokens 128] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nodraft.clients.measure import default_prompts, encode_prompts, measured_speedup
from nodraft.micro.checkpoint import load_model, load_tokenizer
from nodraft.micro.model import KVCache, Micro

SETTINGS = [  # (window, ngram, guesses, seed_from_prompt)
    (2, 5, 4, True), (1, 5, 4, True), (2, 4, 4, True), (2, 6, 4, True), (3, 5, 7, True),
    (4, 4, 4, True), (7, 5, 7, True), (15, 5, 15, True), (2, 5, 4, False), (7, 5, 7, False),
]
ROWS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


@torch.inference_mode()
def row_costs(model: Micro, context: int = 200, repeats: int = 7, calls: int = 20) -> dict[int, float]:
    """Median time of a pass over T rows, relative to a 1-row pass."""
    cache = KVCache(model.config, 1)
    model(torch.randint(0, model.config.vocab_size, (1, context)), cache=cache, slot=0, start=0)
    cache.advance(0, context)
    times: dict[int, list[float]] = {T: [] for T in ROWS}
    for _ in range(repeats):
        for T in ROWS:  # interleaved, so drift on a shared machine hits every T alike
            ids = torch.randint(0, model.config.vocab_size, (1, T))
            mask = torch.ones(T, T, dtype=torch.bool).tril() if T > 1 else None
            pos = torch.arange(context, context + T)[None] if T > 1 else None
            t0 = time.perf_counter()
            for _ in range(calls):
                model(ids, pos, cache=cache, slot=0, start=context, tree_mask=mask)
            times[T].append((time.perf_counter() - t0) / calls)
    one = statistics.median(times[1])
    return {T: statistics.median(ts) / one for T, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model("micro")
    print(f"Command: `python benchmarks/lookahead.py {' '.join(argv or sys.argv[1:])}`\n")
    rel = row_costs(model)
    slope = sum((T - 1) * (r - 1) for T, r in rel.items()) / sum((T - 1) ** 2 for T in rel)
    print("| rows T | " + " | ".join(str(T) for T in rel) + " |")
    print("|---|" + "---|" * len(rel))
    print("| t(T) / t(1) | " + " | ".join(f"{r:.2f}" for r in rel.values()) + " |")
    print(f"\nleast-squares ROW_COST = {slope:.3f} per extra row\n")
    prompts = encode_prompts(load_tokenizer(), default_prompts())
    cols = " | ".join(f"{k} tok/pass | {k} cost/pass | {k} est. | {k} measured" for k in prompts)
    print(f"| W | N | G | seed_from_prompt | {cols} |")
    print("|---|---|---|---|" + "---|---|---|---|" * len(prompts))
    for W, N, G, seed in SETTINGS:
        params = {"window": W, "ngram": N, "guesses": G, "seed_from_prompt": seed}
        cells = []
        for prompt in prompts.values():
            s, run, _ = measured_speedup(model, prompt, args.tokens, "lookahead", params, args.repeats)
            st = run.stats
            cells += [f"{st.tokens_per_pass:.2f}", f"{st.draft_cost / st.target_passes:.2f}",
                      f"{st.estimated_speedup:.2f}", f"{s:.2f}x"]
        print(f"| {W} | {N} | {G} | {seed} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
