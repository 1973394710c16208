"""What sampling one token costs: top-p's nucleus from a full sort of the vocabulary
against the nucleus looked for in the top-k first (``engine.verify.target_probs``).

    python benchmarks/nucleus.py [--model micro] [--top-p 0.95] [--repeats 200] [--out FILE.json]

Rows of real logits: micro over held-out text of the standard library (``clients.bench``'s
code prompts), at temperature 0.7 and 1.0. For each row, both ways are timed alternately
(one thread, median per row, then the median over rows) and checked to keep the same
tokens; reported with how often the top-k sizes sufficed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from nodraft.clients.bench import build_prompts
from nodraft.engine import verify
from nodraft.engine.verify import SamplingParams, target_probs
from nodraft.micro.checkpoint import load_model, load_tokenizer


def full_sort(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The reference: every token ranked (what ``target_probs`` did before)."""
    probs = (logits.float() / sp.temperature).softmax(-1)
    vals, order = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < sp.top_p
    keep[..., 0] = True
    probs = probs.masked_fill(~keep.scatter(-1, order, keep), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--rows", type=int, default=64, help="logit rows per temperature")
    p.add_argument("--repeats", type=int, default=50, help="timings per row and way")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_model(args.model), load_tokenizer()
    ids = [t for prompt in build_prompts(tok, 2)["code"] for t in prompt["ids"]]
    with torch.inference_mode():
        out = model(torch.tensor([ids[:1000]]))
    logits = (out[0] if isinstance(out, tuple) else out)[0]
    step = max(1, logits.shape[0] // args.rows)
    rows = logits[::step][:args.rows]
    result = {"command": "python benchmarks/nucleus.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "top_p": args.top_p, "rows": len(rows), "temperatures": {}}
    for temperature in (0.7, 1.0):
        sp = SamplingParams(temperature=temperature, top_p=args.top_p)
        old, new, sizes = [], [], []
        for row in rows:
            assert torch.equal(full_sort(row, sp) > 0, target_probs(row, sp) > 0)
            a, b = [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                full_sort(row, sp)
                a.append(time.perf_counter() - t)
                t = time.perf_counter()
                target_probs(row, sp)
                b.append(time.perf_counter() - t)
            old.append(statistics.median(a))
            new.append(statistics.median(b))
            n = int((full_sort(row, sp) > 0).sum())
            sizes.append(next((k for k in verify.NUCLEUS_TOPK if n < k), "sort"))
        result["temperatures"][str(temperature)] = {
            "full_sort_us": statistics.median(old) * 1e6,
            "target_probs_us": statistics.median(new) * 1e6,
            "ratio": statistics.median(b / a for a, b in zip(old, new)),
            "found_in": {str(k): sizes.count(k) for k in (*verify.NUCLEUS_TOPK, "sort")}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
