"""What a batch's iteration costs each sequence besides its pass: this checkout against
another, in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/step_overhead.py --before /tmp/before [--streams 32] [--rounds 6]
                                       [--method none] [--temperature 0] [--top-p 1]
                                       [--out FILE.json]

The engine measures it itself: a packed iteration's seconds outside its pass and its
drafters (planning, segments, verification, commits, events), per stepping sequence
(``DraftScheduler.observe_overhead``, which the batch's goodput counts). Two worker
processes, one per checkout (``checkouts.checkout_env``), each on the first core with its
engine built as the engine process builds it, compiled passes ready; rounds alternate the
workers (after, before; then before, after). In a round a worker decodes ``--streams``
requests of 64 tokens at once (the loadtest's built-in prompts, in turn; sampled requests
at ``--temperature`` and ``--top-p``, seeded by index) and reports the median of its
iterations' per-sequence overhead (none with one stream: a lone sequence's steps are not
packed) and its tokens/s. Reported: the median over rounds of each, and after / before.

Ratios in one run are what carry on a shared machine; absolute times do not.
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
except ImportError:  # imported as benchmarks.step_overhead
    from benchmarks.checkouts import alternate


def worker(args: argparse.Namespace) -> None:
    import torch

    from nodraft.clients.loadtest import PROMPTS
    from nodraft.engine.core import GenerationRequest
    from nodraft.engine.launch import EngineConfig
    from nodraft.engine.process import build_engine, start_warm_up
    from nodraft.engine.verify import SamplingParams
    from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS.values()]
    cfg = EngineConfig(str(CHECKPOINT_DIR), max_running=args.streams, max_waiting=args.streams,
                       threads=1, compile=True, log_level="warning")
    engine = build_engine(cfg)
    start_warm_up(engine, cfg)
    while not engine.compiled_ready:
        if engine.compiled_error is not None:
            print(json.dumps({"error": engine.compiled_error}), flush=True)
            return
        time.sleep(0.5)
    while engine.idle_work():
        engine.idle()
    seen: list[float] = []
    observe = engine.scheduler.observe_overhead

    def record(seconds: float) -> None:
        seen.append(seconds)
        observe(seconds)

    engine.scheduler.observe_overhead = record
    method, params = engine.registry.parse({"method": args.method})
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        seen.clear()
        tokens = [0]

        def count(ev) -> None:
            if ev.kind == "step":
                tokens[0] += len(ev.step.tokens)

        t0 = time.perf_counter()
        for i in range(args.streams):
            sampling = (SamplingParams(args.temperature, args.top_p, seed=i) if args.temperature
                        else SamplingParams())
            engine.submit(GenerationRequest("micro", prompts[i % len(prompts)], 64, sampling,
                                            method=method, params=params), count)
        while engine.busy:
            engine.run_once()
        seconds = time.perf_counter() - t0
        # a lone sequence runs no packed iteration: no overhead of that kind to report
        print(json.dumps({"overhead_us": 1e6 * statistics.median(seen) if seen else None,
                          "tokens_per_s": tokens[0] / seconds}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="the other checkout (git worktree add)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--method", default="none")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    first = min(os.sched_getaffinity(0))
    cmd = ["taskset", "-c", str(first), sys.executable, os.path.abspath(__file__), "--worker",
           "--before", args.before, "--streams", str(args.streams), "--method", args.method,
           "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rounds = alternate(cmd, {"after": here, "before": args.before}, args.rounds)
    out = {"streams": args.streams, "method": args.method, "temperature": args.temperature,
           "top_p": args.top_p,
           "rounds": rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "before": args.before}
    for key in ("overhead_us", "tokens_per_s"):
        a = [x[key] for x in rounds["after"] if x[key] is not None]
        b = [x[key] for x in rounds["before"] if x[key] is not None]
        if not a or not b:
            continue
        out[key] = {"after": statistics.median(a), "before": statistics.median(b),
                    "after_range": [min(a), max(a)], "before_range": [min(b), max(b)],
                    "after_over_before": statistics.median(a) / statistics.median(b)}
        print(f"{key}: after {out[key]['after']:.1f} ({min(a):.1f}-{max(a):.1f}), before "
              f"{out[key]['before']:.1f} ({min(b):.1f}-{max(b):.1f}), after / before "
              f"{out[key]['after_over_before']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
