"""EAGLE's tree parameters, measured: how ``depth``, ``top_k`` and ``total_tokens`` trade
tokens per target pass against draft and verification cost on this machine.

    python benchmarks/eagle_sweep.py [--model micro] [--prompt fresh,repeating] [--tokens 128]
                                     [--repeats 5] [--grid 1,1,2 2,1,3 3,2,6 ...] [--threads 2]
                                     [--eager] [--heads DIR]

Each grid point is ``depth,top_k,total_tokens``; each row is ``clients.measure``'s measured
speed-up over ``none`` (same prompt, same tokens, runs alternated, median), with the run's
figures. Passes and the draft step are compiled, as the server runs them (``--eager``: not).
The head is the committed one (``micro/checkpoints/<model>-eagle.safetensors``) or the one
in ``--heads``; re-run this after retraining it, and set ``Eagle.Params``' defaults from the
table.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nodraft.clients.measure import default_prompts, encode_prompts, measured_speedup
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

GRID = ["3,1,4", "5,1,6", "6,1,7", "7,1,8", "8,1,9", "10,1,11", "3,3,8", "5,2,8", "6,2,10"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--prompt", default="fresh,repeating",
                   help="comma-separated: fresh, repeating")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="eager passes and draft step")
    p.add_argument("--heads", default=None,
                   help="where the EAGLE head is (default: beside the checkpoints)")
    p.add_argument("--grid", nargs="*", default=GRID, help="depth,top_k,total_tokens ...")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, CHECKPOINT_DIR).compile(not args.eager)
    prompts = encode_prompts(load_tokenizer(), default_prompts())
    print(f"{args.model}, {args.tokens} greedy tokens, median of {args.repeats}, "
          f"{torch.get_num_threads()} thread(s), {'eager' if args.eager else 'compiled'}, "
          f"head {args.heads or CHECKPOINT_DIR}")
    print("| prompt | depth | top_k | total_tokens | acceptance | tokens/pass "
          "| draft cost/pass | est. speed-up | measured speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.prompt.split(","):
        for point in args.grid:
            depth, top_k, total = (int(v) for v in point.split(","))
            params = {"depth": depth, "top_k": top_k, "total_tokens": total}
            speedup, run, _ = measured_speedup(model, prompts[name], args.tokens, "eagle",
                                               params, args.repeats, args.model,
                                               heads=args.heads)
            s = run.stats
            print(f"| {name} | {depth} | {top_k} | {total} | {s.acceptance_rate:.0%} | "
                  f"{s.tokens_per_pass:.2f} | {s.draft_cost / s.target_passes:.2f} | "
                  f"{s.estimated_speedup:.2f} | **{speedup:.2f}x** |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
