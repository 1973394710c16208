"""What ``auto`` costs a lone request where it sends (almost) no draft: sampled decoding
of the workload suite's prompts, ``auto`` against ``none``, in process; optionally this
checkout against another, in one run.

    python benchmarks/auto_idle.py [--regime t1.0] [--model micro] [--repeats 5]
                                   [--tokens 128] [--rounds 4] [--before CHECKOUT]
                                   [--own-costs] [--method auto] [--ask-every-step]
                                   [--out FILE.json]

At temperature 1.0 no cheap drafter pays on the suite, so ``auto`` rests from a fresh
server's first step and asks now and then (``drafters.auto``): what it costs there is its
own work and the sequence's besides plain decoding's, a per cent or two -- below what the
suite's rows resolve (each row's ratio spreads several per cent). Here each worker process
decodes every prompt of the suite (``nodraft.clients.bench.build_prompts``, two per
category) ``--repeats`` times at ``--regime``, each repeat a pair -- ``none``, then
``auto`` from a fresh server state, the same seed (the same text, checked) -- and reports
the median of all pairs' ``none`` seconds over ``auto`` seconds, and their mean
(``clients.measure.alternated``'s pairs, prompt by prompt). Compiled
passes (``Micro.compile``), one thread, each method's first decode of a prompt untimed,
then the heap frozen (``freeze_heap``), as ``nodraft bench`` runs them.

``--regime greedy`` measures the same pairs greedy, where ``auto`` drafts where copies pay
and rests at most 8 steps after an ask that found nothing worth sending: its speed-up over
``none`` on the whole suite, what its own work per step costs or gains there.

``--method``: another drafter measured the same way in place of ``auto`` (``suffix``: what
a change to the searches it shares with ``auto`` does to it alone).

``--ask-every-step``: what an ask costs. ``auto`` is made to ask at every step (no rest)
and its choice is discarded (plain decoding's pass, its proposals judged as drafts not
sent): the ratio is then plain decoding's step over a step with auto's whole ask in it --
both candidates' searches, the pricing, the judging and the bookkeeping -- and
``1 / ratio - 1`` is an ask's cost in plain steps. A probe of the ask, not a way to run.

``--before CHECKOUT`` (``git worktree add /tmp/before <commit>``): a worker per checkout
(``checkouts.checkout_env``), ``--rounds`` rounds, the order alternated round by round;
reported per checkout: the median over rounds and its range, and after / before.

Every worker prices passes with one table (``drafters.costs.PassCost``), timed before the
workers start by a process of this checkout (the median of ``COST_TABLES`` tables, each
timed as the engine times it) and given to each worker after its warm-up; ``--own-costs``
lets each worker time its own, as a server would. ``auto``'s drafts follow the table it
is given for every round its worker runs, so two workers' own tables make a difference
between the checkouts that is the tables', not the code's (docs/LOG.md, 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

try:
    from checkouts import alternate  # run as a script
except ImportError:  # imported as benchmarks.auto_idle
    from benchmarks.checkouts import alternate


def pairs(model, prompts: list[dict], regime: str, repeats: int, tokens: int,
          name: str = "micro", method: str = "auto") -> list[float]:
    """For each prompt and repeat, ``none``'s decode seconds over ``method``'s (a fresh
    server's state), the same seeded sampling: ``clients.measure.alternated``'s pairs, as
    ``nodraft bench`` makes them (it raises if their texts differ)."""
    from nodraft.clients.bench import regime_sampling
    from nodraft.clients.measure import alternated

    out = []
    for p in prompts:
        runs = alternated(model, p["ids"], tokens, method, repeats=repeats, model_name=name,
                          sampling=lambda r: regime_sampling(regime, r),
                          stop_ids=frozenset(p.get("stop_ids", ())))
        out += [base.seconds / run.seconds for base, run in runs]
    return out


COST_TABLES = 5  # tables timed for the workers' shared one: the median per size


def warmed(args: argparse.Namespace):
    """The model compiled, and every prompt decoded once by each method (what each
    compiles and builds at its first use): (model, prompts)."""
    import torch

    from nodraft.clients.bench import build_prompts, regime_sampling
    from nodraft.clients.measure import decode
    from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

    torch.set_num_threads(1)
    model = load_model(args.model, CHECKPOINT_DIR).compile(True)
    prompts = [p for ps in build_prompts(load_tokenizer(), 2).values() for p in ps]
    for p in prompts:
        for method in ("none", args.method):
            decode(model, p["ids"], args.tokens, method, shared={}, model_name=args.model,
                   sampling=regime_sampling(args.regime, 0),
                   stop_ids=frozenset(p.get("stop_ids", ())))
    return model, prompts


def time_costs(args: argparse.Namespace) -> None:
    """Print the pass-cost table the workers share: ``COST_TABLES`` timed as the engine
    times one, the median of each size."""
    from nodraft.drafters import costs
    from nodraft.micro.model import KVCache

    model, _ = warmed(args)
    cache = KVCache(model.config, 1)
    tables = [costs.measure(model, cache, 0, costs.timing_start(cache.max_len))
              for _ in range(COST_TABLES)]
    print(json.dumps({r: statistics.median(t.table(r) for t in tables) for r in costs.ROWS}))


def use_costs(model, table: dict[int, float]) -> None:
    """Price ``model``'s passes with ``table`` ({rows: seconds}) from now on, for its
    present compiled state (after the warm-up: no graph compiles later), as if timed here
    -- through the dicts ``costs.measure`` fills, which an older checkout has too."""
    from nodraft.drafters import costs

    cost = costs.PassCost(table)
    costs._COSTS[model] = {costs.compiled_state(model): cost}
    costs._LATEST[model] = (costs.compiled_state(model), cost)


def ask_every_step() -> None:
    """``auto`` asked at every step, its choice discarded (``--ask-every-step``)."""
    from nodraft.drafters import auto
    from nodraft.drafters.base import NOT_LOOKED

    propose = auto.Auto.propose

    def asking(self, ctx, budget):
        self.rest = 0
        draft = propose(self, ctx, budget)
        if draft is NOT_LOOKED:  # its first step chose a rest: asked now all the same
            self.rest = self.resting = 0
            self._quiet_from, self._rested = None, False
            propose(self, ctx, budget)
        self.last = None  # nothing sent: its proposals are judged as unsent ones
        return auto._NONE

    auto.Auto.propose = asking


def worker(args: argparse.Namespace) -> None:
    from nodraft.engine.process import freeze_heap

    if args.ask_every_step:
        ask_every_step()
    model, prompts = warmed(args)
    if args.costs:
        use_costs(model, {int(r): s for r, s in json.loads(args.costs).items()})
    freeze_heap()
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        ratios = pairs(model, prompts, args.regime, args.repeats, args.tokens, args.model,
                       args.method)
        print(json.dumps({"median": statistics.median(ratios), "mean": statistics.fmean(ratios),
                          "pairs": len(ratios)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", default="t1.0", help="a regime of nodraft bench")
    p.add_argument("--model", default="micro", help="a bundled model")
    p.add_argument("--method", default="auto", help="the drafter measured against none")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--before", help="another checkout (git worktree add) to compare with")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--own-costs", action="store_true",
                   help="each worker times its own pass-cost table (default: one shared)")
    p.add_argument("--ask-every-step", action="store_true",
                   help="auto asks at every step and sends nothing: what an ask costs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--time-costs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--costs", help=argparse.SUPPRESS)  # the shared table, JSON
    args = p.parse_args(argv)
    from nodraft.clients.bench import REGIMES

    if args.regime not in REGIMES:
        p.error(f"--regime must be one of {list(REGIMES)}")
    if args.worker:
        worker(args)
        return
    if args.time_costs:
        time_costs(args)
        return
    base = [sys.executable, os.path.abspath(__file__), "--regime", args.regime,
            "--model", args.model, "--repeats", str(args.repeats), "--tokens", str(args.tokens),
            "--method", args.method] + (["--ask-every-step"] if args.ask_every_step else [])
    table = None
    if not args.own_costs:  # timed by this checkout, before the workers start
        done = subprocess.run(base + ["--time-costs"], capture_output=True, text=True,
                              check=True)
        table = json.loads(done.stdout.strip().splitlines()[-1])
        print("pass costs (us): " + ", ".join(f"{r} rows {1e6 * s:.0f}"
                                              for r, s in table.items()))
    cmd = base + ["--worker"] + ([] if table is None else ["--costs", json.dumps(table)])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"after": here, **({"before": args.before} if args.before else {})}
    rounds = alternate(cmd, checkouts, args.rounds)
    out = {"regime": args.regime, "model": args.model, "method": args.method,
           "ask_every_step": args.ask_every_step, "repeats": args.repeats,
           "tokens": args.tokens, "pass_costs": table,
           "rounds": rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/auto_idle.py " + " ".join(argv or sys.argv[1:])}
    for name, got in rounds.items():
        med = [r["median"] for r in got]
        out[name] = {"median": statistics.median(med), "range": [min(med), max(med)]}
        print(f"{name}: {args.method} over none {out[name]['median']:.3f} "
              f"({min(med):.3f}-{max(med):.3f}) over {len(got)} rounds of {got[0]['pairs']} pairs")
    if args.before:
        out["after_over_before"] = out["after"]["median"] / out["before"]["median"]
        print(f"after / before: {out['after_over_before']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
