"""Choosing prompt lookup's defaults by measurement: draft length and first versus most
recent match, on the workshop's prompts and on an edited copy (a passage repeated with one
identifier renamed, where the two choices can differ).

    python benchmarks/prompt_lookup.py [--tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys

import torch

from nodraft.clients.measure import default_prompts, encode_prompts, measured_speedup
from nodraft.micro.checkpoint import load_model, load_tokenizer


def edited_copy(text: str) -> str:
    """The passage, then the passage again with its first identifier renamed, cut short."""
    words = [w for w in text.replace("(", " ").replace(")", " ").split() if w.isidentifier() and len(w) > 3]
    old = words[0] if words else "self"
    edited = text.replace(old, old + "_v2")
    return text + "\n\n" + edited + "\n\n" + edited[:100]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    texts = default_prompts()
    texts["edited"] = edited_copy(texts["repeating"].split("\n\n")[0])
    prompts = encode_prompts(tok, texts)
    model = load_model("micro")
    print(f"Command: `python benchmarks/prompt_lookup.py {' '.join(argv or sys.argv[1:])}`\n")
    print("| match | num_speculative_tokens | " + " | ".join(f"{k} tok/pass | {k} speed-up" for k in prompts) + " |")
    print("|---|---|" + "---|---|" * len(prompts))
    for match in ("recent", "first"):
        for k in (4, 8, 12, 16, 24):
            cells = []
            for name, prompt in prompts.items():
                s, run, _ = measured_speedup(model, prompt, args.tokens, "prompt_lookup",
                                             {"num_speculative_tokens": k, "match": match}, args.repeats)
                cells += [f"{run.stats.tokens_per_pass:.2f}", f"{s:.2f}x"]
            print(f"| {match} | {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
