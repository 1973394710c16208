"""The engine's first token for a short prompt, back to back and after the engine idled.

    python benchmarks/first_token_idle.py [--gap-ms 25] [--rounds 8] [--requests 10]
                                          [--tokens 4] [--out FILE.json]

The engine in this process, built as the engine process builds it (``engine.process``:
the bundled checkpoints, compiled passes loaded, built first if there are none), on the
first core, one torch thread, its iterations run by this thread. A request of ``--tokens``
prompt tokens (``none``, greedy, 4 tokens) is submitted and iterations are run until its
first token is reported; the time from ``submit`` to that report is its first-token time,
and the request is then run to its end. Before each request the engine is left for one of:

- ``back-to-back``: 1 ms asleep;
- ``asleep``: ``--gap-ms`` asleep (``time.sleep``: the core may enter its idle states);
- ``spinning``: ``--gap-ms`` spinning on the clock (the core stays busy, touching little);
- ``napping``: ``--gap-ms`` in 0.5 ms sleeps (the core wakes every half millisecond).

Each round runs ``--requests`` requests of every case, the cases in turn (their order
reversed every other round). Reported per case: the median first-token time over all
requests, the median of the rounds' medians with their range, and the medians of the
parts the engine timed (building the request's sequence, and its first iteration's step:
the prefill and the head over the last row). If the idle states were what made a first
token slow after a pause, spinning would keep it as fast as back to back; where it does
not, the time is the data the pause let other work push out of the caches (on a shared
machine, other tenants of the last-level cache), which only less memory touched per
request shortens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

CASES = ("back-to-back", "asleep", "spinning", "napping")


def idle(case: str, gap: float) -> None:
    if case == "back-to-back":
        time.sleep(0.001)
    elif case == "asleep":
        time.sleep(gap)
    elif case == "spinning":
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
    else:  # napping
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            time.sleep(0.0005)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gap-ms", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--tokens", type=int, default=4, help="prompt tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from nodraft.engine.core import GenerationRequest
    from nodraft.engine.launch import EngineConfig
    from nodraft.engine.process import build_engine, start_warm_up
    from nodraft.engine.verify import SamplingParams
    from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_tokenizer

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    config = EngineConfig(str(CHECKPOINT_DIR), max_running=8, max_waiting=8, threads=1,
                          compile=True, log_level="warning")
    engine = build_engine(config)
    start_warm_up(engine, config)
    while not engine.compiled_ready:
        if engine.compiled_error is not None:
            raise SystemExit(f"compiled passes failed: {engine.compiled_error}")
        time.sleep(0.2)
    while engine.idle_work():  # the pass-cost tables, as an idle engine measures them
        engine.idle()

    parts: dict[str, list[float]] = {}

    def timed(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def g(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            parts.setdefault(label, []).append(time.perf_counter() - t)
            return out
        setattr(obj, name, g)

    timed(engine, "_sequence", "sequence built")
    timed(engine, "_step", "step")
    tok = load_tokenizer(CHECKPOINT_DIR / "tokenizer.json")
    prompt = tok.encode("import os\nimport sys\n" * 8)[:args.tokens]
    method, params = engine.registry.parse({"method": "none"})

    def one() -> tuple[float, float, float]:
        parts.clear()
        first: list[int] = []

        def report(ev) -> None:
            if ev.kind == "step" and not first:
                first.append(time.perf_counter_ns())

        t0 = time.perf_counter_ns()
        engine.submit(GenerationRequest("micro", list(prompt), 4, SamplingParams(), method,
                                        params, ()), report)
        while not first:
            engine.run_once()
        seconds = (first[0] - t0) / 1e9
        built, step = parts["sequence built"][0], parts["step"][0]  # the first iteration's
        while engine.running or engine.waiting:
            engine.run_once()
        return seconds, built, step

    gap = args.gap_ms / 1000
    for case in CASES:  # once each, untimed
        idle(case, gap)
        one()
    results = {c: {"first": [], "built": [], "step": [], "rounds": []} for c in CASES}
    for r in range(args.rounds):
        for case in (CASES if r % 2 == 0 else CASES[::-1]):
            firsts = []
            for _ in range(args.requests):
                idle(case, gap)
                s, b, st = one()
                firsts.append(s)
                results[case]["built"].append(b)
                results[case]["step"].append(st)
            results[case]["first"] += firsts
            results[case]["rounds"].append(statistics.median(firsts))
        print(f"round {r + 1}: " + ", ".join(
            f"{c} {1e3 * results[c]['rounds'][-1]:.2f} ms" for c in CASES), flush=True)

    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    us = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    print(f"\n{args.tokens}-token prompt, {args.gap_ms:g} ms gaps, {args.rounds} rounds x "
          f"{args.requests} requests\n")
    print("| engine idle before the request | first token, ms (median) | rounds' medians "
          "(range) | sequence built, us | first step, us |")
    print("|---|---|---|---|---|")
    summary = {}
    for c in CASES:
        d = results[c]
        summary[c] = {"first_ms": ms(d["first"]),
                      "rounds_ms": [round(1e3 * x, 3) for x in d["rounds"]],
                      "sequence_built_us": us(d["built"]), "first_step_us": us(d["step"])}
        print(f"| {c} | {ms(d['first'])} | {ms(d['rounds'])} ({1e3 * min(d['rounds']):.2f}-"
              f"{1e3 * max(d['rounds']):.2f}) | {us(d['built'])} | {us(d['step'])} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cases": summary,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    engine.stop()


if __name__ == "__main__":
    main()
