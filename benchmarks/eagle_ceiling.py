"""What EAGLE could reach under sampling on this machine: its measured acceptance by draft
position, divided by the measured cost of the passes that verify it.

    python benchmarks/eagle_ceiling.py [--models micro,micro-layerskip] [--checkpoints DIR]
                                       [--temperature 0.8]
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
  draft step: (1 + P) / pass(2) = target;
- the same ceilings for an **oracle** top-1 chain, the target's own most likely token at
  each position (what a perfect head drafting its argmax would propose): under seeded
  sampling a draft token is kept exactly when it equals the token ``none`` samples there,
  so its ``P(accepted >= j)`` is read off ``none``'s texts -- the share of its steps (each
  step ending at the first position where the sampled token is not the target's argmax,
  or after ``--depth`` drafted tokens) with at least j kept. No head that drafts its top-1
  choice, however trained, keeps more; a head whose draft is drawn from a distribution
  (coupled to the request's noise) is not bounded by it.

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


def oracle_hits(model, prompt: list[int], tokens: list[int], depth: int
                ) -> tuple[list[int], int]:
    """Steps of an oracle top-1 chain of ``depth`` over ``none``'s sampled ``tokens``:
    (steps with at least j draft tokens kept, for j = 1..depth; steps). A position's draft
    is the target's argmax given the text so far (one eager forward over the whole text);
    a step keeps its drafts while they equal the sampled tokens, then emits one more."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        top = model(ids)[0, len(prompt) - 1:-1].argmax(-1).tolist()
    match = [a == b for a, b in zip(top, tokens)]
    hits, steps, pos = [0] * depth, 0, 0
    while pos < len(tokens):
        kept = 0
        while kept < depth and pos + kept < len(tokens) - 1 and match[pos + kept]:
            kept += 1
        for j in range(kept):
            hits[j] += 1
        steps += 1
        pos += kept + 1
    return hits, steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="micro,micro-layerskip")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR),
                   help="where the models and their heads are")
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

    heads = Path(args.checkpoints)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = load_model(name, heads).compile(True)
        cache = KVCache(model.config, 1)
        table = costs.measure(model, cache, 0, costs.timing_start(cache.max_len))
        one = table.table(1)
        pass_rows = lambda r: table.table(r) / one  # noqa: E731
        # compiled at its first use: EAGLE's draft step, untimed
        decode(model, prompts[0]["ids"], 16, "eagle", chain, registry, {}, name, heads,
               sampling(0))
        hits, steps, draft_s, ratios = [0] * depth, 0, 0.0, []
        o_hits, o_steps = [0] * depth, 0
        for prompt in prompts:
            for k in range(args.seeds):
                sp = sampling(1000 + k)
                base = decode(model, prompt["ids"], args.tokens, "none", None, registry, None,
                              name, None, sp)
                run = decode(model, prompt["ids"], args.tokens, "eagle", chain, registry, {},
                             name, heads, sp)
                if run.tokens != base.tokens:
                    raise SystemExit(f"{name}: EAGLE changed the text (seed {sp.seed})")
                s = run.stats
                oh, os_ = oracle_hits(model, prompt["ids"], base.tokens, depth)
                o_hits = [a + b for a, b in zip(o_hits, oh)]
                o_steps += os_
                for j, n in enumerate(s.accepted_by_position[:depth]):
                    hits[j] += n
                steps += s.target_passes
                draft_s += s.draft_seconds
                ratios.append(base.seconds / run.seconds)
        p_at_least = [h / steps for h in hits]
        level = draft_s / steps / depth / one
        rows = ceilings(p_at_least, pass_rows, level)
        need = args.target * pass_rows(2) - 1.0
        o_p = [h / o_steps for h in o_hits]
        o_rows = ceilings(o_p, pass_rows, level)
        results["models"][name] = {
            "oracle": {"P(accepted >= j)": o_p, "by_depth": o_rows},
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
        print("  oracle top-1 chain: P(accepted >= j) " + " ".join(f"{x:.2f}" for x in o_p)
              + "; ceilings with a free draft by depth "
              + " ".join(f"{r['free_draft']:.2f}x" for r in o_rows))
        print(f"  {args.target}x with a free one-token draft needs first-token acceptance "
              f">= {need:.2f} (measured {p_at_least[0]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
