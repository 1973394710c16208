"""What ``auto`` costs a lone request where it sends (almost) no draft: sampled decoding
of the workload suite's prompts, ``auto`` against ``none``, in process; optionally this
checkout against another, in one run.

    python benchmarks/auto_idle.py [--regime t1.0] [--model micro] [--repeats 5]
                                   [--tokens 128] [--rounds 4] [--before CHECKOUT]
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

``--regime greedy`` measures the same pairs greedy, where ``auto`` asks at every step and
drafts where copies pay: its speed-up over ``none`` on the whole suite, what its own work
per step costs or gains there.

``--before CHECKOUT`` (``git worktree add /tmp/before <commit>``): a worker per checkout
(``checkouts.checkout_env``), ``--rounds`` rounds, the order alternated round by round;
reported per checkout: the median over rounds and its range, and after / before.
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
except ImportError:  # imported as benchmarks.auto_idle
    from benchmarks.checkouts import alternate


def pairs(model, prompts: list[dict], regime: str, repeats: int, tokens: int,
          name: str = "micro") -> list[float]:
    """For each prompt and repeat, ``none``'s decode seconds over ``auto``'s (a fresh
    server's state), the same seeded sampling: ``clients.measure.alternated``'s pairs, as
    ``nodraft bench`` makes them (it raises if their texts differ)."""
    from nodraft.clients.bench import regime_sampling
    from nodraft.clients.measure import alternated

    out = []
    for p in prompts:
        runs = alternated(model, p["ids"], tokens, "auto", repeats=repeats, model_name=name,
                          sampling=lambda r: regime_sampling(regime, r),
                          stop_ids=frozenset(p.get("stop_ids", ())))
        out += [base.seconds / run.seconds for base, run in runs]
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    from nodraft.clients.bench import build_prompts, regime_sampling
    from nodraft.clients.measure import decode
    from nodraft.engine.process import freeze_heap
    from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

    torch.set_num_threads(1)
    model = load_model(args.model, CHECKPOINT_DIR).compile(True)
    prompts = [p for ps in build_prompts(load_tokenizer(), 2).values() for p in ps]
    for p in prompts:  # what each method compiles and builds at its first use: untimed
        for method in ("none", "auto"):
            decode(model, p["ids"], args.tokens, method, shared={}, model_name=args.model,
                   sampling=regime_sampling(args.regime, 0),
                   stop_ids=frozenset(p.get("stop_ids", ())))
    freeze_heap()
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        ratios = pairs(model, prompts, args.regime, args.repeats, args.tokens, args.model)
        print(json.dumps({"median": statistics.median(ratios), "mean": statistics.fmean(ratios),
                          "pairs": len(ratios)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", default="t1.0", help="a regime of nodraft bench")
    p.add_argument("--model", default="micro", help="a bundled model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--before", help="another checkout (git worktree add) to compare with")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from nodraft.clients.bench import REGIMES

    if args.regime not in REGIMES:
        p.error(f"--regime must be one of {list(REGIMES)}")
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--regime", args.regime,
           "--model", args.model,
           "--repeats", str(args.repeats), "--tokens", str(args.tokens)]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = {"after": here, **({"before": args.before} if args.before else {})}
    rounds = alternate(cmd, checkouts, args.rounds)
    out = {"regime": args.regime, "model": args.model, "repeats": args.repeats,
           "tokens": args.tokens,
           "rounds": rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/auto_idle.py " + " ".join(argv or sys.argv[1:])}
    for name, got in rounds.items():
        med = [r["median"] for r in got]
        out[name] = {"median": statistics.median(med), "range": [min(med), max(med)]}
        print(f"{name}: auto over none {out[name]['median']:.3f} "
              f"({min(med):.3f}-{max(med):.3f}) over {len(got)} rounds of {got[0]['pairs']} pairs")
    if args.before:
        out["after_over_before"] = out["after"]["median"] / out["before"]["median"]
        print(f"after / before: {out['after_over_before']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
