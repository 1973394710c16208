"""Early exit's settings measured: exit layer, draft length, draft vocabulary and KV reuse,
each against ``none`` on the workload suite's prompts, greedy and sampled.

    python benchmarks/early_exit_settings.py [--model micro-layerskip] [--tokens 128]
        [--repeats 3] [--regimes greedy,t0.7] [--categories code,edit,rag,chat,long]
        [--settings "E,k,N,reuse;..."] [--out FILE.json]

One process, one thread, compiled passes (``Micro.compile``: each graph compiled at its
first pass, by an untimed warm-up decode). For every prompt (``nodraft bench``'s, two per
category) and regime, each setting and ``none`` decode the same prompt in turn, ``--repeats``
rounds, the settings' order reversed every other round (sampled: seed SEED0 + round, the
same text under every setting; every run is checked to give ``none``'s tokens). A
setting's speed-up on a prompt is the median over rounds of none's time over its time; a
category's, the median over its prompts. A setting is ``E,k,N,reuse``: ``exit_layer``,
``num_speculative_tokens``, ``draft_vocab`` (0: the full head) and ``reuse_kv`` (0 or 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from nodraft.clients.bench import CATEGORIES, build_prompts, regime_sampling
from nodraft.clients.measure import decode
from nodraft.drafters.registry import Registry
from nodraft.micro.checkpoint import load_model, load_tokenizer

DEFAULT_SETTINGS = "2,3,0,1;1,1,0,0;2,1,0,0;3,1,0,0;3,2,0,0;3,3,0,0;3,2,0,1;3,2,1024,0;3,2,2048,0"


def parse_settings(text: str) -> list[dict]:
    out = []
    for part in text.split(";"):
        E, k, N, reuse = (int(x) for x in part.split(","))
        out.append({"exit_layer": E, "num_speculative_tokens": k, "draft_vocab": N,
                    "reuse_kv": bool(reuse)})
    return out


def label(s: dict) -> str:
    return (f"E{s['exit_layer']} k{s['num_speculative_tokens']} "
            f"{'N' + str(s['draft_vocab']) if s['draft_vocab'] else 'full head'}"
            f"{' reuse' if s['reuse_kv'] else ''}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="micro-layerskip")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--regimes", default="greedy,t0.7")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--settings", default=DEFAULT_SETTINGS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model).compile(True)
    settings = parse_settings(args.settings)
    prompts = build_prompts(load_tokenizer(), 2)
    registry = Registry()
    cases = [("none", {})] + [("early_exit", s) for s in settings]
    rows = []
    for regime in args.regimes.split(","):
        for cat in args.categories.split(","):
            for prompt in prompts[cat]:
                stop = frozenset(prompt.get("stop_ids", ()))

                def run(method, params, r):
                    return decode(model, prompt["ids"], args.tokens, method, params,
                                  registry=registry, model_name=args.model,
                                  sampling=regime_sampling(regime, r), stop_ids=stop)

                for method, params in cases:  # untimed: what each compiles at first use
                    run(method, params, 0)
                times: list[list[float]] = [[] for _ in cases]
                passes = [0] * len(cases)
                for r in range(args.repeats):
                    order = list(range(len(cases)))[::1 if r % 2 == 0 else -1]
                    want = None
                    for i in order:
                        got = run(*cases[i], r)
                        want = want or got.tokens
                        if got.tokens != want:
                            raise AssertionError(f"{cases[i]} changed the output")
                        times[i].append(got.seconds)
                        passes[i] += got.stats.target_passes
                    n_tokens = len(want)
                for i, (method, params) in enumerate(cases[1:], start=1):
                    ratio = statistics.median(a / b for a, b in zip(times[0], times[i]))
                    rows.append({"regime": regime, "category": cat, "prompt": prompt["name"],
                                 "setting": params, "speedup": ratio,
                                 "tokens_per_pass": n_tokens * args.repeats / passes[i]})
                print(f"{regime} {cat} {prompt['name']}: " + ", ".join(
                    f"{label(r['setting'])} {r['speedup']:.2f}x" for r in rows[-len(settings):]),
                      flush=True)
    table = []
    for regime in args.regimes.split(","):
        for s in settings:
            line = {"regime": regime, "setting": s}
            for cat in args.categories.split(","):
                got = [r for r in rows if r["regime"] == regime and r["category"] == cat
                       and r["setting"] == s]
                line[cat] = (statistics.median(r["speedup"] for r in got),
                             statistics.median(r["tokens_per_pass"] for r in got))
            table.append(line)
    cats = args.categories.split(",")
    print("| regime | setting | " + " | ".join(cats) + " |")
    print("|---|---|" + "---|" * len(cats))
    for line in table:
        print(f"| {line['regime']} | {label(line['setting'])} | " + " | ".join(
            f"{line[c][0]:.2f}x ({line[c][1]:.2f})" for c in cats) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/early_exit_settings.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "model": args.model, "tokens": args.tokens, "repeats": args.repeats,
            "torch": torch.__version__, "machine": platform.machine(),
            "processor": platform.processor(), "rows": rows,
            "table": [{**t, "setting": label(t["setting"])} for t in table]}, indent=1))


if __name__ == "__main__":
    main()
