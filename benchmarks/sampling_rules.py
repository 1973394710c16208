"""What drafter-invariant sampling costs: the seeded rule against the unseeded one, per drafter.

Two verification rules run under sampling (engine/verify.py):

- **seeded** (a request with a ``seed``): the Gumbel-max race over per-position noise; the
  text is the same under every drafter;
- **unseeded**: for drafts that carry their distribution q (early exit's, EAGLE's sampled
  chain), Leviathan/Chen rejection (min(1, p/q)); for every other step -- point-mass drafts
  and no draft -- the same race over noise of the request's own (``Sequence.race_noise``),
  which accepts a point-mass child with the probability the sibling rule did, p(x).
  (Results recorded before 2026-12-04 ran the sibling rule for point-mass drafts.)

For every drafter, model and prompt, the same requests are decoded under both rules, runs
alternated (seeded, unseeded, seeded, ...) so a shared machine's drift hits both, with
seeds 0..N-1 (an unseeded run draws from torch's global stream, seeded with the same
number). Reported per rule: acceptance rate (accepted / drafted), tokens per target pass
and decoding tokens/s, summed over the seeds and prompts; and their ratios.

Prompts: held-out text (never trained on) -- the openings of held-out functions, which
micro continues with new text, and the workshop's repeating passage, which it copies.

    python benchmarks/sampling_rules.py [--seeds 10] [--tokens 96] [--temperature 0.8]
                                        [--top-p 1.0] [--models micro,micro-layerskip]
                                        [--methods none,eagle] [--eager]
                                        [--json-out FILE.json] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from nodraft.clients.measure import default_prompts
from nodraft.drafters.registry import DrafterEnv, Registry
from nodraft.engine.sequence import Sequence
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.corpus import split_documents
from nodraft.micro.model import KVCache

METHODS = [("none", {}), ("prompt_lookup", {}), ("suffix", {}),
           ("early_exit", {"exit_layer": 1}), ("early_exit", {"exit_layer": 2}),
           ("early_exit", {"exit_layer": 3}), ("medusa", {}), ("eagle", {}),
           ("lookahead", {}), ("auto", {})]


def heldout_prompts(n: int, chars: int = 200) -> dict[str, str]:
    """The openings of the first ``n`` held-out functions (one per module), and the
    workshop's repeating prompt."""
    out: dict[str, str] = {}
    for d in split_documents("heldout"):
        i = d.text.find("\ndef ")
        if i >= 0 and len(out) < n:
            out[f"fresh:{d.unit}"] = d.text[i + 1:i + 1 + chars]
    out["repeating"] = default_prompts()["repeating"]
    return out


def decode(model, name, prompt, tokens, method, params, sp, reg, shared):
    meth, p = reg.parse({"method": method, **params})
    drafter = reg.build(meth, p, DrafterEnv(name, model, shared))
    seq = Sequence(model, KVCache(model.config, 1), 0, prompt, drafter, tokens, sp, method=meth)
    n = 0
    with torch.inference_mode():
        seq.prefill()
        t0 = time.perf_counter()
        while not seq.done:
            n += len(seq.step().tokens)
        seconds = time.perf_counter() - t0
    return seq.stats, n, seconds


def measure(model, name, prompts, method, params, args, reg) -> dict:
    totals = {rule: {"stats": SpecStats(method), "tokens": 0, "seconds": 0.0}
              for rule in ("seeded", "unseeded")}
    for seed in range(args.seeds):
        for prompt in prompts:
            for rule in ("seeded", "unseeded") if seed % 2 == 0 else ("unseeded", "seeded"):
                if rule == "unseeded":
                    torch.manual_seed(seed)
                sp = SamplingParams(args.temperature, args.top_p, 0,
                                    seed if rule == "seeded" else None)
                stats, n, s = decode(model, name, prompt, args.tokens, method, params, sp, reg, {})
                t = totals[rule]
                t["stats"].merge(stats)
                t["tokens"] += n
                t["seconds"] += s
    row = {"model": name, "method": method, "params": params}
    for rule, t in totals.items():
        s = t["stats"]
        row[rule] = {"acceptance_rate": s.acceptance_rate, "tokens_per_pass": s.tokens_per_pass,
                     "tokens_per_s": t["tokens"] / t["seconds"], "drafted": s.drafted,
                     "accepted": s.accepted, "passes": s.target_passes}
    row["tokens_per_s_ratio"] = row["seeded"]["tokens_per_s"] / row["unseeded"]["tokens_per_s"]
    return row


@torch.inference_mode()
def paired_exit_acceptance(model, prompts, tokens, sp_args: dict, exit_layer: int,
                           draws: int = 256, seed: int = 0) -> dict:
    """The two rules' acceptance of an early-exit draft token on the same contexts: each
    prompt continued by plain seeded sampling, then at every generated position p (the
    target's distribution) and q (the exit's): the unseeded rule accepts with probability
    sum_v min(p(v), q(v)) (q at the request's temperature, as early exit sends it); the
    seeded rule's draft and target tokens are the race's (``engine.sampling.race``) over q
    and over p with the same noise, so it accepts with P(they agree), estimated over
    ``draws`` noises (seeds). Paired, so the figures differ only by the rule, not by which
    texts were sampled."""
    from nodraft.engine.sampling import PositionNoise, race
    from nodraft.engine.verify import scaled_logits, target_probs

    sp = SamplingParams(seed=None, **sp_args)
    noises = [PositionNoise(seed + k, model.config.vocab_size) for k in range(draws)]
    rejection, coupled = [], []
    reg = Registry()
    for i, prompt in enumerate(prompts):
        meth, p = reg.parse("none")
        seq = Sequence(model, KVCache(model.config, 1), 0, prompt,
                       reg.build(meth, p, DrafterEnv("micro", model, {})), tokens,
                       SamplingParams(seed=seed + i, **sp_args))
        while not seq.done:
            seq.step()
        ids = torch.tensor(seq.tokens)
        hidden: list = []
        logits = model(ids[None], hidden=hidden)[0]
        rows = slice(len(prompt) - 1, len(ids) - 1)
        pt = target_probs(logits[rows], sp).double()
        exit_logits = model.head(hidden[exit_layer - 1][0])[rows]
        q_sent = (exit_logits.float() / sp.temperature).softmax(-1).double()
        rejection += torch.minimum(pt, q_sent).sum(-1).tolist()
        st, sq = scaled_logits(logits[rows], sp), scaled_logits(exit_logits, sp)
        for r in range(pt.shape[0]):
            at = [len(prompt) + r] * draws
            agree = [a == b for a, b in zip(race(st[r].expand(draws, -1), noises, at),
                                            race(sq[r].expand(draws, -1), noises, at))]
            coupled.append(sum(agree) / draws)
    return {"exit_layer": exit_layer, "positions": len(rejection),
            "unseeded": sum(rejection) / len(rejection), "seeded": sum(coupled) / len(coupled)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=4, help="held-out fresh prompts (plus one repeating)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="micro,micro-layerskip")
    p.add_argument("--methods", default=None,
                   help="methods to measure, comma-separated (default: all; `none` always)")
    p.add_argument("--eager", action="store_true", help="eager passes (default: compiled)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    texts = heldout_prompts(args.prompts)
    prompts = [tok.encode(t) for t in texts.values()]
    reg = Registry()
    wanted = None if args.methods is None else {"none", *args.methods.split(",")}
    methods = [(m, p) for m, p in METHODS if wanted is None or m in wanted]
    rows, paired = [], []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        model = load_model(name, CHECKPOINT_DIR).compile(not args.eager)
        for method, params in methods:  # an untimed warm-up decode compiles its graphs
            decode(model, name, prompts[0], 16, method, params,
                   SamplingParams(args.temperature, seed=0), reg, {})
        for method, params in methods:
            row = measure(model, name, prompts, method, params, args, reg)
            rows.append(row)
            a, b = row["seeded"], row["unseeded"]
            print(f"{name:16s} {method:13s} {json.dumps(params):18s} "
                  f"acc {_f(a['acceptance_rate'], '{:.3f}')}/{_f(b['acceptance_rate'], '{:.3f}')} "
                  f"tok/pass {_f(a['tokens_per_pass'])}/{_f(b['tokens_per_pass'])} "
                  f"tok/s x{row['tokens_per_s_ratio']:.3f}", file=sys.stderr)
        model.compile(False)  # the paired figures need eager passes with hidden states
        for E in (1, 2, 3) if any(m == "early_exit" for m, _ in methods) else ():
            r = paired_exit_acceptance(model, prompts, args.tokens,
                                       {"temperature": args.temperature, "top_p": args.top_p}, E)
            paired.append({"model": name, **r})
            print(f"{name:16s} early_exit E={E} paired acceptance seeded {r['seeded']:.3f} "
                  f"unseeded {r['unseeded']:.3f}", file=sys.stderr)
    result = {"machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                         f"{args.threads} thread(s), {'eager' if args.eager else 'compiled'} passes",
              "command": "python benchmarks/sampling_rules.py " + " ".join(argv or sys.argv[1:]),
              "seeds": args.seeds, "tokens": args.tokens, "temperature": args.temperature,
              "top_p": args.top_p, "prompts": list(texts), "rows": rows, "paired_early_exit": paired}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def render(r: dict) -> str:
    lines = [f"Command: `{r['command']}` ({r['tokens']} tokens x {r['seeds']} seeds x "
             f"{len(r['prompts'])} prompts per rule, temperature {r['temperature']}, top_p "
             f"{r['top_p']}, {r['machine']})", "",
             "| model | method | params | acceptance seeded / unseeded | tokens/pass seeded / unseeded | tokens/s seeded / unseeded |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        a, b = row["seeded"], row["unseeded"]
        params = ", ".join(f"{k}={v}" for k, v in row["params"].items())
        lines.append(f"| {row['model']} | {row['method']} | {params} | "
                     f"{_f(a['acceptance_rate'], '{:.1%}')} / {_f(b['acceptance_rate'], '{:.1%}')} | "
                     f"{_f(a['tokens_per_pass'])} / {_f(b['tokens_per_pass'])} | "
                     f"**{row['tokens_per_s_ratio']:.2f}x** |")
    if r.get("paired_early_exit"):
        lines += ["", "Early exit's first draft token, both rules on the same contexts (paired):",
                  "", "| model | exit layer | positions | acceptance seeded | acceptance unseeded |",
                  "|---|---|---|---|---|"]
        for row in r["paired_early_exit"]:
            lines.append(f"| {row['model']} | {row['exit_layer']} | {row['positions']} | "
                         f"{row['seeded']:.1%} | {row['unseeded']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
