"""What EAGLE could reach under sampling on this machine: its measured acceptance by draft
position, divided by the measured cost of the passes that verify it.

    python benchmarks/eagle_ceiling.py [--models micro,micro-layerskip] [--temperature 0.8]
                                       [--top-p 0.95] [--seeds 5] [--tokens 128]
                                       [--category code] [--prompts 2] [--depth 6]
                                       [--out FILE.json]

For each model: the workload suite's prompts of ``--category`` (``clients.bench``), each
decoded with ``none`` and with an EAGLE top-1 chain of ``--depth`` draft tokens (6 by
default, the chain docs/BENCHMARKS.md's figures read; EAGLE's own default is one token) in
turn per seed (compiled passes, one thread, seeded sampling: both decode the same text,
which is checked), and

- ``P(accepted >= j)``: the share of EAGLE's steps whose draft had at least j tokens
  accepted, j = 1..depth. A top-1 chain cut to depth d
  proposes the same first d tokens and keeps the same ones: 1 + sum_{j<=d} P(>= j) is the
  tokens per pass a depth-d chain would make;
- the pass-cost table ``auto`` prices drafts with (``drafters.costs.measure``: passes of
  1, 2, 3, 5, 9, 17 rows, interpolated), in one-row passes;
- the measured speed-up over ``none`` (median over the seeds and prompts), and EAGLE's
  drafting time per step in one-row passes;
- per depth d, the speed-up a depth-d chain would make were its draft step free, and with
  EAGLE's measured drafting time per level: tokens per pass / (pass of d + 1 rows [+ d
  levels]). These leave out what a step costs besides its pass and draft (sampling,
  commit), which a drafted step has more of: they are ceilings;
- the first-position acceptance a one-token draft would need for ``--target`` with a free
  draft step: (1 + P) / pass(2) = target.

Ratios in one run are what carry on a shared machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from nodraft.clients import bench
from nodraft.clients.measure import decode
from nodraft.drafters import costs
from nodraft.drafters.registry import Registry
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.model import KVCache


def ceilings(p_at_least: list[float], pass_rows, level: float) -> list[dict]:
    """Per chain depth d: tokens per pass and the two speed-up ceilings (``pass_rows(r)``:
    a pass of r rows in one-row passes; ``level``: a draft level, in one-row passes)."""
    out = []
    for d in range(1, len(p_at_least) + 1):
        tokens = 1.0 + sum(p_at_least[:d])
        out.append({"depth": d, "tokens_per_pass": tokens,
                    "free_draft": tokens / pass_rows(d + 1),
                    "measured_draft": tokens / (pass_rows(d + 1) + d * level)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="micro,micro-layerskip")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--category", default="code", choices=bench.CATEGORIES)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--target", type=float, default=1.5)
    p.add_argument("--depth", type=int, default=6, help="the top-1 chain's draft tokens")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts = bench.build_prompts(load_tokenizer(), args.prompts)[args.category]
    registry = Registry()
    given = sys.argv[1:] if argv is None else argv
    results = {"command": " ".join(["python benchmarks/eagle_ceiling.py", *given]),
               "machine": platform.machine(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "temperature": args.temperature, "top_p": args.top_p, "models": {}}
    depth = args.depth
    chain = {"depth": depth, "top_k": 1, "total_tokens": depth + 1}

    def sampling(seed: int) -> SamplingParams:
        return SamplingParams(args.temperature, args.top_p, seed=seed)

    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = load_model(name, CHECKPOINT_DIR).compile(True)
        cache = KVCache(model.config, 1)
        table = costs.measure(model, cache, 0, costs.timing_start(cache.max_len))
        one = table.table(1)
        pass_rows = lambda r: table.table(r) / one  # noqa: E731
        # compiled at its first use: EAGLE's draft step, untimed
        decode(model, prompts[0]["ids"], 16, "eagle", chain, registry, {}, name, None,
               sampling(0))
        hits, steps, draft_s, ratios = [0] * depth, 0, 0.0, []
        for prompt in prompts:
            for k in range(args.seeds):
                sp = sampling(1000 + k)
                base = decode(model, prompt["ids"], args.tokens, "none", None, registry, None,
                              name, None, sp)
                run = decode(model, prompt["ids"], args.tokens, "eagle", chain, registry, {},
                             name, None, sp)
                if run.tokens != base.tokens:
                    raise SystemExit(f"{name}: EAGLE changed the text (seed {sp.seed})")
                s = run.stats
                for j, n in enumerate(s.accepted_by_position[:depth]):
                    hits[j] += n
                steps += s.target_passes
                draft_s += s.draft_seconds
                ratios.append(base.seconds / run.seconds)
        p_at_least = [h / steps for h in hits]
        level = draft_s / steps / depth / one
        rows = ceilings(p_at_least, pass_rows, level)
        need = args.target * pass_rows(2) - 1.0
        results["models"][name] = {
            "P(accepted >= j)": p_at_least, "tokens_per_pass": 1.0 + sum(p_at_least),
            "measured_speedup": statistics.median(ratios),
            "measured_speedup_range": [min(ratios), max(ratios)],
            "pass_rows": {r: pass_rows(r) for r in range(1, depth + 2)},
            "draft_level_in_passes": level, "by_depth": rows,
            "first_acceptance_needed_for_target_free_draft": need}
        print(f"{name}: P(accepted >= j) " + " ".join(f"{x:.2f}" for x in p_at_least)
              + f"; measured {statistics.median(ratios):.2f}x; a draft level "
              f"{level:.2f} passes; passes of 2..{depth + 1} rows "
              + " ".join(f"{pass_rows(r):.2f}" for r in range(2, depth + 2)))
        for r in rows:
            print(f"  depth {r['depth']}: {r['tokens_per_pass']:.2f} tokens/pass, ceiling "
                  f"{r['free_draft']:.2f}x with a free draft, {r['measured_draft']:.2f}x "
                  "with its measured draft time")
        print(f"  {args.target}x with a free one-token draft needs first-token acceptance "
              f">= {need:.2f} (measured {p_at_least[0]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
