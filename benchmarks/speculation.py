"""Single-stream speculative decoding, measured in one run on this machine.

1. ``none`` (nodraft's plain greedy loop) against Hugging Face transformers' ``generate()``
   on the same weights (the ``nodraft export-hf`` export), greedy, tokens/s, runs
   alternated, median of ``--repeats``.
2. Each drafter's measured speed-up over ``none`` (``clients.measure``) on the workshop's
   fresh and repeating prompts, with its figures; ``auto`` twice, on a fresh server and on
   one warmed by a request on the other prompt.

Passes run as the server runs them: compiled (``Micro.compile``, micro/compiled.py; graphs
compiled by an untimed warm-up decode first), or eager with ``--eager``. transformers runs
eager, as ``generate()`` does by default.

    python benchmarks/speculation.py [--tokens 128] [--repeats 5] [--threads 2] [--eager]
                                     [--models micro,micro-layerskip] [--no-hf]
                                     [--out FILE.md] [--json-out FILE.json]

Ratios, not absolute times, are what carry from one run to the next on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nodraft.clients.measure import (decode, default_prompts, encode_prompts, measured_speedup,
                             warmed_server)
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

# (method, params, server): "fresh" -- every run on a fresh server, as for every drafter;
# "warmed" -- on a server that has served one request on the other prompt, so auto starts
# from the acceptance it measured there (its state in use), not from its 0.5 prior
METHODS = [
    ("prompt_lookup", {}, "fresh"),
    ("suffix", {}, "fresh"),
    ("early_exit", {"exit_layer": 1}, "fresh"),
    ("early_exit", {"exit_layer": 2}, "fresh"),
    ("early_exit", {"exit_layer": 3}, "fresh"),
    ("medusa", {}, "fresh"),
    ("eagle", {}, "fresh"),
    ("lookahead", {}, "fresh"),
    ("auto", {}, "fresh"),
    ("auto", {}, "warmed"),
]


def hf_vs_none(prompt: list[int], n_tokens: int, repeats: int, compiled: bool = True) -> dict:
    from transformers import AutoModelForCausalLM

    from nodraft.micro.export import export

    model = load_model("micro").compile(compiled)
    with tempfile.TemporaryDirectory() as d:
        hf = AutoModelForCausalLM.from_pretrained(export(Path(d), "micro")).eval()
    ids = torch.tensor([prompt])
    ours, theirs = [], []
    for i in range(repeats + 1):
        run = decode(model, prompt, n_tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        t_hf = time.perf_counter() - t0
        if i == 0:  # warm-up
            continue
        ours.append(len(run.tokens) / run.seconds)
        theirs.append((out.shape[1] - ids.shape[1]) / t_hf)
    same = out[0, ids.shape[1]:].tolist() == run.tokens
    return {"none_tokens_per_s": statistics.median(ours),
            "hf_generate_tokens_per_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs),
            "same_tokens": same}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads, for nodraft and transformers alike (2: this machine's cores)")
    p.add_argument("--eager", action="store_true", help="eager passes (default: compiled)")
    p.add_argument("--out", default=None, help="write a markdown report here")
    p.add_argument("--json", action="store_true", help="print the JSON too")
    p.add_argument("--json-out", default=None, help="write the JSON here")
    p.add_argument("--models", default="micro,micro-layerskip",
                   help="comma-separated checkpoints whose drafters are measured")
    p.add_argument("--no-hf", action="store_true",
                   help="skip `none` against transformers (part 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    prompts = encode_prompts(tok, default_prompts())
    head = None if args.no_hf else hf_vs_none(prompts["fresh"], args.tokens, args.repeats,
                                              not args.eager)
    rows = []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        model = load_model(name, CHECKPOINT_DIR).compile(not args.eager)
        for pname, prompt in prompts.items():
            other = next(p for k, p in prompts.items() if k != pname)
            for method, params, server in METHODS:
                shared = None if server == "fresh" else warmed_server(model, other, args.tokens,
                                                                      method, name)
                speedup, run, base_s = measured_speedup(model, prompt, args.tokens, method, params,
                                                        args.repeats, name, shared)
                s = run.stats
                rows.append({"model": name, "prompt": pname, "method": method, "params": params,
                             "server": server,
                             "acceptance_rate": s.acceptance_rate, "tokens_per_pass": s.tokens_per_pass,
                             "draft_cost": s.draft_cost / s.target_passes,
                             "estimated_speedup": s.estimated_speedup,
                             "measured_speedup": speedup,
                             "none_tokens_per_s": len(run.tokens) / base_s})
                print(f"{name:16s} {pname:9s} {method:13s} {json.dumps(params):18s} {server:6s} "
                      f"tok/pass {s.tokens_per_pass:.2f} measured {speedup:.2f}x", file=sys.stderr)
    result = {"machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                         f"{args.threads} thread(s), {'eager' if args.eager else 'compiled'} passes",
              "command": "python benchmarks/speculation.py " + " ".join(argv or sys.argv[1:]),
              "tokens": args.tokens, "repeats": args.repeats, "none_vs_hf": head, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def render(r: dict) -> str:
    h = r["none_vs_hf"]
    lines = [f"Command: `{r['command']}` ({r['tokens']} greedy tokens, median of {r['repeats']}, {r['machine']})",
             ""]
    if h is not None:
        lines += [f"`none`: {h['none_tokens_per_s']:.0f} tokens/s; transformers `generate()`: "
                  f"{h['hf_generate_tokens_per_s']:.0f} tokens/s on the same weights: "
                  f"**{h['ratio']:.2f}x** (same tokens: {h['same_tokens']}).", ""]
    # tokens/s: none's median tokens/s times the median speed-up, with none's in brackets
    # (a faster `none` lowers every speed-up: the absolute figures show who got faster)
    lines += ["| model | prompt | method | params | acceptance | tokens/pass | draft cost/pass | est. speed-up | measured speed-up | tokens/s (none) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        params = ", ".join(f"{k}={v}" for k, v in row["params"].items())
        if row.get("server") == "warmed":
            params = ", ".join(filter(None, [params, "server warmed on the other prompt"]))
        lines.append(f"| {row['model']} | {row['prompt']} | {row['method']} | {params} | "
                     f"{_f(row['acceptance_rate'], '{:.0%}')} | {_f(row['tokens_per_pass'])} | "
                     f"{_f(row['draft_cost'])} | {_f(row['estimated_speedup'])} | "
                     f"**{row['measured_speedup']:.2f}x** | "
                     f"{row['none_tokens_per_s'] * row['measured_speedup']:.0f} "
                     f"({row['none_tokens_per_s']:.0f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
