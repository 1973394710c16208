"""The server around the engine: what one stream gets served, against the engine in process.

    python benchmarks/serving.py [--tokens 256] [--rounds 5] [--ttft-requests 15]
                                 [--loadtest 1,8,32] [--loadtest-rounds 1] [--eager]
                                 [--before CHECKOUT] [--out FILE.json]

Four ``nodraft serve`` processes side by side on micro (a checkpoint folder with micro and
its trained drafters only, so that each compiles half as much), idle but for the one being
measured:

    process-1   the engine in a process of its own (the default), 1 torch thread
    process-2   the same, 2 torch threads
    thread-1    the engine on a thread of the API process (``--engine-process false``), 1
    thread-2    the same, 2 threads
    before-1    with ``--before CHECKOUT`` (``git worktree add /tmp/before <commit>``): that
                checkout's code, as process-1 (``checkouts.checkout_env``)

and, each in a worker process of its own, the reference points: ``engine.core.Engine``
itself (compiled like the servers; 1 thread pinned to the first core as the served
engine is, and 2 threads on both cores) and transformers' ``generate()`` on the exported
weights (``nodraft export-hf``), 1 thread on the first core. This process, the client, runs
on the last core, the one the servers' API processes keep. Everything runs in alternation,
``--rounds`` times, and medians are reported (tokens/s: the median of the rounds; a
ratio: the median, and the range, of the rounds' own ratios), for greedy decoding and for
sampling (temperature 0.8, the round's seed: every nodraft configuration generates the
same tokens for a seed).

1. one stream of ``none``, ``--tokens`` tokens, streamed and not: tokens/s, and each over
   the in-process engine's best (the faster of 1 and 2 threads) and over ``generate()``;
2. time to first token, streaming, for a 4-token prompt and for prompts of 60-160 tokens
   (median of ``--ttft-requests`` each, one token generated... until the first chunk); each
   long prompt starts with a line of its own (``# request i``), so no server's prefix cache
   holds a block of it and every request times its whole prefill;
3. ``nodraft loadtest`` at ``--loadtest`` concurrencies, ``none`` and ``auto``, greedy
   and sampled, on process-1, process-2 and thread-1 in alternation (each warmed with a
   short load test of each method first): tokens/s, TTFT and ITL p50/p99, errors.

Servers are compiled (``--compile true``) and measured once ``/health`` says ``ready``;
``--eager`` serves eager passes instead. The load generator and this process share the
machine with the servers: on 2 cores, as a user's client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

try:
    from checkouts import checkout_env, imported_from  # run as a script
except ImportError:  # imported as benchmarks.<name> (the tests)
    from benchmarks.checkouts import checkout_env, imported_from
from nodraft.clients.loadtest import LoadConfig, run_loadtest
from nodraft.drafters.registry import Registry
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
SHORT_PROMPT = "import os, sys"  # 4 tokens
LONG_PROMPTS = [  # 60-160 tokens each (checked at run time)
    "class LRUCache:\n    \"\"\"A mapping that forgets the least recently used key.\"\"\"\n\n"
    "    def __init__(self, capacity):\n        self.capacity = capacity\n"
    "        self.data = {}\n\n    def get(self, key, default=None):\n",
    "def parse_header(line):\n    key, sep, value = line.partition(':')\n    if not sep:\n"
    "        raise ValueError(f'not a header line: {line!r}')\n    return key.strip().lower(), "
    "value.strip()\n\n\ndef parse_headers(lines):\n    headers = {}\n    for line in lines:\n",
    "import json\nimport logging\nfrom pathlib import Path\n\nlog = logging.getLogger(__name__)"
    "\n\n\ndef load_settings(path):\n    \"\"\"Read the JSON settings at `path`; missing keys "
    "take their defaults.\"\"\"\n    text = Path(path).read_text(encoding='utf-8')\n",
]
SERVERS = {"process-1": (True, 1), "process-2": (True, 2), "thread-1": (False, 1),
           "thread-2": (False, 2)}
TEMPERATURE = 0.8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def micro_only(tmp: Path) -> Path:
    """A checkpoint folder with micro, its trained drafters and the tokenizer (links)."""
    for f in CHECKPOINT_DIR.iterdir():
        if f.name == "tokenizer.json" or f.name.startswith(("micro.", "micro-eagle",
                                                            "micro-medusa")):
            (tmp / f.name).symlink_to(f)
    return tmp


def start_server(name: str, checkpoints: Path, compile: bool, max_running: int,
                 env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    process, threads = SERVERS.get(name, (True, 1))
    port = free_port()
    cmd = [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port),
           "--threads", str(threads), "--engine-process", str(process).lower(),
           "--max-running", str(max_running), "--checkpoints", str(checkpoints),
           "--compile", str(compile).lower(), "--log-level", "warning"]
    # its log goes to a file: a pipe nobody reads would fill up and block it
    log = tempfile.NamedTemporaryFile("w+", prefix=f"nodraft-{name}-", suffix=".log",
                                      delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}", log.name


def wait_ready(servers: dict, timeout: float = 3600) -> None:
    """Every server answers and has its compiled passes ready (or off)."""
    end = time.monotonic() + timeout
    pending = set(servers)
    client = httpx.Client()  # one for the polls: a fresh one costs ~60 ms of CPU a call
    while pending:
        for name in list(pending):
            proc, url, log = servers[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: " + Path(log).read_text()[-2000:])
            try:
                r = client.get(url + "/health", timeout=2)
            except httpx.HTTPError:
                continue
            compiled = r.json().get("compiled") if r.status_code == 200 else None
            if compiled in ("ready", "off"):
                pending.discard(name)
                print(f"{name} ready", file=sys.stderr, flush=True)
            elif compiled == "failed":
                raise RuntimeError(f"{name}: compiling failed: {Path(log).read_text()}")
        if time.monotonic() > end:
            raise RuntimeError(f"not ready after {timeout} s: {sorted(pending)}")
        time.sleep(1)


# -- one stream --------------------------------------------------------------------------------
def served(client: httpx.Client, tokens: int, stream: bool, temperature: float,
           seed: int) -> float:
    """Generated tokens/s of one request of ``none``, timed by the client (a kept-alive
    connection, as any client that sends more than one request has)."""
    body = {"model": "micro", "prompt": PROMPT, "max_tokens": tokens, "stream": stream,
            "temperature": temperature, "seed": seed, "speculation": "none"}
    t0 = time.perf_counter()
    if stream:
        n = 0
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    n += len(json.loads(line[6:]).get("nodraft", {}).get("tokens", []))
    else:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        n = r.json()["usage"]["completion_tokens"]
    return n / (time.perf_counter() - t0)


class Worker:
    """A reference point in a process of its own: ``python benchmarks/serving.py --worker
    KIND`` reads ``tokens temperature seed`` lines and answers each with tokens/s."""

    def __init__(self, kind: str, checkpoints: Path, compile: bool, cores: list[int],
                 tmp: Path):
        cmd = [sys.executable, __file__, "--worker", kind, "--checkpoints", str(checkpoints),
               "--cores", ",".join(map(str, cores)), "--tmp", str(tmp)]
        if not compile:
            cmd.append("--eager")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "ready", kind

    def run(self, tokens: int, temperature: float, seed: int) -> float:
        self.proc.stdin.write(f"{tokens} {temperature} {seed}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def worker(kind: str, checkpoints: Path, compile: bool, cores: list[int], tmp: Path) -> None:
    """``engine-N``: the engine in process, N torch threads; ``generate-1``: transformers."""
    os.sched_setaffinity(0, cores)
    name, threads = kind.rsplit("-", 1)
    torch.set_num_threads(int(threads))
    tokenizer = load_tokenizer(checkpoints / "tokenizer.json")
    prompt = tokenizer.encode(PROMPT)
    if name == "engine":
        model = load_model("micro", checkpoints)
        if compile:
            model.compile(lazy=False)
        engine = Engine({"micro": model}, Registry(), tokenizer.eot_id, 1, 1,
                        threads=int(threads))
        engine.start()
        if compile:
            engine.warm_up().join()
            assert engine.compiled_ready, engine.compiled_error

        def run(tokens: int, temperature: float, seed: int) -> float:
            done, count = threading.Event(), [0]

            def cb(ev):
                if ev.kind == "step":
                    count[0] += len(ev.step.tokens)
                elif ev.kind in ("finish", "error"):
                    done.set()

            t0 = time.perf_counter()
            engine.submit(GenerationRequest("micro", prompt, tokens,
                                            SamplingParams(temperature, seed=seed)), cb)
            done.wait()
            return count[0] / (time.perf_counter() - t0)
    else:
        from transformers import AutoModelForCausalLM

        from nodraft.micro.export import export

        export(tmp / "hf", "micro", checkpoints)
        hf = AutoModelForCausalLM.from_pretrained(tmp / "hf").eval()
        ids = torch.tensor([prompt])

        def run(tokens: int, temperature: float, seed: int) -> float:
            torch.manual_seed(seed)
            sample = {"do_sample": True, "temperature": temperature, "top_k": 0,
                      "top_p": 1.0} if temperature else {"do_sample": False}
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                                  pad_token_id=0, **sample)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
    print("ready", flush=True)
    for line in sys.stdin:
        tokens, temperature, seed = line.split()
        print(run(int(tokens), float(temperature), int(seed)), flush=True)


def ttft(client: httpx.Client, prompt: str) -> float:
    """Seconds from sending a streamed request to its first generated token."""
    body = {"model": "micro", "prompt": prompt, "max_tokens": 4, "stream": True,
            "temperature": 0, "speculation": "none"}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("nodraft"):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def loadtest(url: str, concurrency: int, method: str, temperature: float, n: int) -> dict:
    cfg = LoadConfig(url=url, concurrency=concurrency, requests=n, methods=[method],
                     max_tokens=64, stream=True, timeout=300, temperature=temperature)
    r = asyncio.run(run_loadtest(cfg))
    lat = r["latency_s"]
    return {"tokens_per_s": r["throughput"]["generated_tokens_per_s"],
            "ttft_p50_ms": 1e3 * lat["ttft"]["p50"], "ttft_p99_ms": 1e3 * lat["ttft"]["p99"],
            "itl_p50_ms": 1e3 * lat["inter_token"]["p50"],
            "itl_p99_ms": 1e3 * lat["inter_token"]["p99"],
            "errors": sum(r["errors"].values())}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def paired(a: list[float], b: list[float]) -> dict:
    """a over b round by round: the median ratio, its range and the rounds counted (a
    round where either side generated nothing -- a sampled text that ended at once --
    measured nothing)."""
    r = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
    return {"median": median(r), "min": min(r), "max": max(r), "rounds": len(r)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ttft-requests", type=int, default=15)
    p.add_argument("--loadtest", default="1,8,32", help="concurrencies ('' for none)")
    p.add_argument("--loadtest-rounds", type=int, default=1)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--before", help="a checkout of this repository served beside, as "
                   "process-1 (before-1): before and after in one run")
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--checkpoints", help=argparse.SUPPRESS)
    p.add_argument("--cores", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    compile = not args.eager
    if args.worker:
        worker(args.worker, Path(args.checkpoints), compile,
               [int(c) for c in args.cores.split(",")], Path(args.tmp))
        return
    cores = sorted(os.sched_getaffinity(0))
    levels = [int(c) for c in args.loadtest.split(",") if c]
    tmp = Path(tempfile.mkdtemp(prefix="nodraft-serving-"))
    (tmp / "checkpoints").mkdir()
    checkpoints = micro_only(tmp / "checkpoints")
    servers = {name: start_server(name, checkpoints, compile, max(levels + [1]))
               for name in SERVERS}
    if args.before:
        env = checkout_env(args.before)
        where = imported_from(env)
        assert where.is_relative_to(Path(args.before).resolve()), where
        servers["before-1"] = start_server("before-1", checkpoints, compile,
                                           max(levels + [1]), env)
    workers: dict[str, Worker] = {}
    results: dict = {"command": "python benchmarks/serving.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "cpus": len(cores),
        "compiled": compile, "tokens": args.tokens}
    try:
        workers = {"engine-1": Worker("engine-1", checkpoints, compile, cores[:1], tmp),
                   "engine-2": Worker("engine-2", checkpoints, compile, cores, tmp),
                   "generate-1": Worker("generate-1", checkpoints, compile, cores[:1], tmp)}
        tok = load_tokenizer(checkpoints / "tokenizer.json")
        lengths = [len(tok.encode(x)) for x in LONG_PROMPTS]
        assert all(60 <= n <= 160 for n in lengths), lengths
        results["long_prompt_tokens"] = lengths
        results["short_prompt_tokens"] = len(tok.encode(SHORT_PROMPT))
        assert results["short_prompt_tokens"] == 4
        wait_ready(servers)
        os.sched_setaffinity(0, cores[-1:])  # the client: on the API processes' core
        clients = {name: httpx.Client(base_url=url, timeout=300)
                   for name, (_, url, _) in servers.items()}
        modes = {"greedy": 0.0, "sampled": TEMPERATURE}
        for mode, temp in modes.items():  # warm every path once
            for w in workers.values():
                w.run(16, temp, 0)
            for c in clients.values():
                served(c, 16, True, temp, 0)
                served(c, 16, False, temp, 0)
        runs: dict[str, list[float]] = {}
        for r in range(args.rounds):
            order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
            for mode, temp in order:
                seed = 1000 + r
                cases = [(k, lambda w=w: w.run(args.tokens, temp, seed))
                         for k, w in workers.items()]
                for name, c in clients.items():
                    for stream in (True, False):
                        key = f"{name}-{'stream' if stream else 'plain'}"
                        cases.append((key, lambda c=c, stream=stream:
                                      served(c, args.tokens, stream, temp, seed)))
                if r % 2:
                    cases.reverse()
                for key, fn in cases:
                    runs.setdefault(f"{mode}/{key}", []).append(fn())
            print(f"round {r + 1} done", file=sys.stderr, flush=True)
        one = {k: median([x for x in v if x > 0] or [0.0]) for k, v in runs.items()}
        results["one_stream_tokens_per_s"] = one
        results["one_stream_runs"] = runs
        ratios = {}
        for mode in modes:
            # each round's ratio (its runs were minutes apart at most), then their median
            # and range: this machine's speed drifts by 2x between rounds
            best = [max(a, b) for a, b in zip(runs[f"{mode}/engine-1"], runs[f"{mode}/engine-2"])]
            for name in servers:
                for kind in ("stream", "plain"):
                    v = runs[f"{mode}/{name}-{kind}"]
                    ratios[f"{mode}/{name}-{kind}"] = {
                        "x_engine_best": paired(v, best),
                        "x_generate_1": paired(v, runs[f"{mode}/generate-1"])}
            for kind in ("stream", "plain"):
                if "before-1" in servers:
                    ratios[f"{mode}/process-1_over_before-1-{kind}"] = paired(
                        runs[f"{mode}/process-1-{kind}"], runs[f"{mode}/before-1-{kind}"])
                for prefix in ("process", "thread"):
                    ratios[f"{mode}/{prefix}-2_over_1-{kind}"] = paired(
                        runs[f"{mode}/{prefix}-2-{kind}"], runs[f"{mode}/{prefix}-1-{kind}"])
        results["ratios"] = ratios
        save(args.out, results)  # what is measured so far, should a later stage fail
        ttfts: dict[str, list[float]] = {}  # time to first token
        for i in range(args.ttft_requests):
            names = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in names:
                ttfts.setdefault(f"{name}/short", []).append(ttft(clients[name], SHORT_PROMPT))
                fresh = f"# request {i} {name}\n" + LONG_PROMPTS[i % len(LONG_PROMPTS)]
                ttfts.setdefault(f"{name}/long", []).append(ttft(clients[name], fresh))
        results["ttft_ms_median"] = {k: 1e3 * median(v) for k, v in ttfts.items()}
        print(json.dumps(results["ttft_ms_median"]), file=sys.stderr, flush=True)
        save(args.out, results)
        loaded = ["process-1", "process-2", "thread-1"] + (["before-1"] if args.before else [])
        for name in loaded:  # every code path of every drafter auto may pick, once
            for method in ("none", "auto"):
                for temp in modes.values():
                    loadtest(servers[name][1], 2, method, temp, 12)
        rows = []
        for c in levels:
            for rr in range(args.loadtest_rounds):
                for temp in modes.values():
                    for method in ("none", "auto"):
                        for name in (loaded if rr % 2 == 0 else list(reversed(loaded))):
                            row = {"server": name, "concurrency": c, "method": method,
                                   "temperature": temp,
                                   **loadtest(servers[name][1], c, method, temp, 4 * c)}
                            rows.append(row)
                            print(json.dumps(row), file=sys.stderr, flush=True)
        results["loadtest"] = rows
    finally:
        for w in workers.values():
            w.close()
        for proc, _, _ in servers.values():
            proc.terminate()
        for proc, _, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps({k: results[k] for k in ("one_stream_tokens_per_s", "ratios",
                                               "ttft_ms_median")}, indent=1))
    save(args.out, results)


def save(out: str | None, results: dict) -> None:
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
