"""Early exit's ceiling on this machine: the best speed-up any (exit layer, draft length)
could reach, from its measured costs and its measured acceptance.

    python benchmarks/early_exit_bound.py [--model micro-layerskip] [--tokens 128]
                                          [--regimes greedy,t0.7] [--seeds 2] [--out FILE.json]

One process, one thread, the compiled passes loaded as the server loads them:

1. the pass-cost curve V(n): the engine's own table (``drafters.costs.measure``) of a
   verification pass of n rows, over a one-row pass;
2. c_E: one early-exit draft step (``Micro.exit_pass``: one row through layers [0, E) and
   the head), over a one-row verification pass, E = 1, 2, 3 -- runs of 20 calls of each,
   alternated, the median call;
3. a_E(i): the acceptance of the i-th draft token given that the ones before it were
   accepted, with early exit drafting 8 tokens at every step over the workload suite's
   prompts (``nodraft bench``'s: five categories, two prompts each), greedy and sampled
   (seeded; each seed decodes the same text under every drafter).

Then, for every E and draft length k = 1..8: a step's tokens T(k) = 1 + sum over i <= k of
prod over j <= i of a_E(j), its cost k c_E + V_E(k+1) in one-row passes -- verification
reuses the draft's layers below E, so V_E(n) = (1 - E/L) V(n) + (E/L) V(1), as the engine
prices it -- and the ceiling T(k) / cost. The ceiling leaves out what a real step pays
besides (the drafter's Python, accepting, committing): a real run measures below it. If no
ceiling reaches 1.0, no setting of early exit beats plain decoding on this model here.
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

from nodraft.clients.bench import REGIMES, SEED0, build_prompts
from nodraft.drafters import costs
from nodraft.drafters.base import DrafterEnv
from nodraft.drafters.registry import Registry
from nodraft.engine.sequence import Sequence
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from engine_load import compiled_engine  # noqa: E402

K = 8  # the longest draft considered (and drafted while measuring acceptance)


def step_costs(model, cache, runs: int = 40, run: int = 20) -> dict[int, float]:
    """c_E for E = 1..L-1: a one-row exit pass over a one-row verification pass."""
    L = model.config.n_layers
    start = costs.timing_start(cache.max_len)
    ids = torch.tensor([7])
    calls = {"verify": lambda: model.verify_pass(ids, cache, 0, start)}
    for E in range(1, L):
        calls[E] = lambda E=E: model.exit_pass(ids, cache, 0, start, E)
    times: dict = {k: [] for k in calls}
    with torch.inference_mode():
        cache.set_length(0, start)
        for fn in calls.values():
            fn()
        for r in range(runs):
            for k in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                for _ in range(run):
                    t0 = time.perf_counter()
                    calls[k]()
                    times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["verify"])
    return {E: statistics.median(times[E]) / base for E in range(1, L)}


def acceptance(model, cache, name: str, prompts: dict, regime: str, seeds: int, tokens: int,
               exit_layer: int) -> tuple[list[float], int]:
    """a_E(1..K): accepted at position i over drafted at i with every earlier one accepted;
    and how many steps drafted."""
    reg = Registry()
    num, den = [0] * (K + 1), [0] * (K + 1)
    steps = 0
    for seed in range(1 if regime == "greedy" else seeds):
        sp = REGIMES[regime]
        if not sp.greedy:
            sp = SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed=SEED0 + seed)
        for prompt in (p for ps in prompts.values() for p in ps):
            meth, params = reg.parse({"method": "early_exit", "exit_layer": exit_layer,
                                      "num_speculative_tokens": K})
            drafter = reg.build(meth, params, DrafterEnv(name, model, {}))
            seq = Sequence(model, cache, 1, prompt["ids"], drafter, tokens,
                           sp, frozenset(prompt.get("stop_ids", ())), meth)
            with torch.inference_mode():
                while not seq.done:
                    r = seq.step()
                    d = len(r.draft)
                    if not d:
                        continue
                    steps += 1
                    for i in range(1, d + 1):
                        if r.accepted >= i - 1:
                            den[i] += 1
                            num[i] += r.accepted >= i
    return [num[i] / den[i] if den[i] else 0.0 for i in range(1, K + 1)], steps


def ceilings(a: list[float], c: float, V, E: int, L: int) -> list[float]:
    """The ceiling T(k) / cost for k = 1..K (module docstring)."""
    out, reach, tokens = [], 1.0, 1.0
    for k in range(1, K + 1):
        reach *= a[k - 1]
        tokens += reach
        verify = (1 - E / L) * V(k + 1) + (E / L) * V(1)
        out.append(tokens / (k * c + verify))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro-layerskip")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--regimes", default="greedy,t0.7")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = compiled_engine(1)
    model, cache = engine.models[args.model], engine.caches[args.model]
    L = model.config.n_layers
    table = costs.measure(model, cache, 0, costs.timing_start(cache.max_len))
    V = lambda n: table(n) / table(1)  # noqa: E731
    c = step_costs(model, cache)
    prompts = build_prompts(load_tokenizer(), 2)
    rows = []
    for regime in args.regimes.split(","):
        for E in range(1, L):
            a, steps = acceptance(model, cache, args.model, prompts, regime, args.seeds,
                                  args.tokens, E)
            ceil = ceilings(a, c[E], V, E, L)
            best = max(range(K), key=ceil.__getitem__)
            rows.append({"regime": regime, "exit_layer": E, "step_cost": c[E],
                         "acceptance_by_position": a, "drafting_steps": steps,
                         "ceiling_by_k": ceil, "best_k": best + 1, "best_ceiling": ceil[best]})
    print("V(n) in one-row passes: " + ", ".join(f"{n}: {V(n):.2f}" for n in (2, 3, 5, 9)))
    print("| regime | exit layer | draft step (one-row passes) | a(1), a(2), a(3), a(4) | best k | ceiling |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a = ", ".join(f"{x:.2f}" for x in r["acceptance_by_position"][:4])
        print(f"| {r['regime']} | {r['exit_layer']} | {r['step_cost']:.2f} | {a} | "
              f"{r['best_k']} | **{r['best_ceiling']:.2f}x** |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/early_exit_bound.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "model": args.model, "tokens": args.tokens, "torch": torch.__version__,
            "machine": platform.machine(), "pass_cost_ratio": {n: V(n) for n in range(1, K + 2)},
            "rows": rows}, indent=1))
    engine.stop()


if __name__ == "__main__":
    main()
