"""``nodraft loadtest``: concurrent requests against a running server, measured.

    nodraft loadtest --url URL [--concurrency 8] [--requests 100] [--duration S]
                     [--methods none,prompt_lookup,early_exit:exit_layer=2]
                     [--prompts FILE.json] [--stream | --no-stream] [--max-tokens 64]
                     [--model micro] [--api-key KEY] [--endpoint completions|chat]
                     [--temperature 0] [--seed N] [--timeout 120] [--json] [--quiet]

These flags are stable: the compose ``loadgen`` service and the batching work call them.

- ``--url``: the server's root (``http://127.0.0.1:8000``; a trailing ``/v1`` is fine).
- ``--concurrency N`` requests in flight at once, until ``--requests M`` have been sent or
  ``--duration S`` seconds have passed, whichever comes first; requests in flight then run
  to their end (each bounded by ``--timeout``), and the test stops by itself. Each of the
  N is a user of its own: one client, one kept-alive connection, its next request sent
  when its last response has ended.
- ``--methods``: the ``speculation`` of each request, taken in turn from this list. An item
  is a method name, or a name with parameters: ``early_exit:exit_layer=2:num_speculative_tokens=4``
  (values read as JSON when they parse, else as strings).
- ``--prompts FILE``: a JSON object ``{"name": "text", ...}`` (the workshop's prompt file
  fits) or a list of strings. The built-in set holds fresh prompts (micro continues them
  with new text) and repeating ones (a passage, then its start again, so the continuation
  copies the context). Request i uses method i mod #methods and prompt (i div #methods)
  mod #prompts: every method meets every prompt.
- ``--seed N`` (with ``--temperature``): request i is sampled with seed N + (i div
  #methods), so every method meets each prompt with the same seed -- and, the server's
  seeded sampling being drafter-invariant, generates the same text for it: the methods are
  compared on identical work. Without it, requests are sampled unseeded.
- ``--stream`` (default) measures time to first token and inter-token latency from the
  SSE chunks; ``--no-stream`` sends plain requests (end-to-end latency only).

Live progress goes to stderr (``--quiet``: none). The report -- text, or ``--json`` --
gives throughput (requests/s, generated tokens/s over all requests, and -- streaming --
the tokens/s while every user still had a request in flight, ``sustained_rate``), p50/p90/p99 of time
to first token, inter-token latency and end-to-end latency, errors by status (HTTP status,
``timeout``, ``transport``, ``stream_error``, ``bad_response``), and per method the
speculation figures summed over its responses' ``speculation`` objects:

    acceptance rate     = accepted / drafted                        (null if drafted = 0)
    tokens per pass     = (accepted + target passes) / target passes
    estimated speed-up  = (accepted + target passes) / (target passes + draft cost)

Inter-token latency is counted per token, as the server's histogram does: a chunk that
carries n tokens (an accepted draft and its bonus token arrive together) after a gap of
t seconds counts n latencies of t / n. The exit status is 1 when no request succeeded.

In code: ``await run_loadtest(LoadConfig(url=..., ...))`` returns the report as a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

_FUNCS = [
    "def moving_average(values, window):\n"
    "    \"\"\"Return the averages of each run of `window` values.\"\"\"\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n",
    "class Stack:\n"
    "    def __init__(self):\n"
    "        self._items = []\n\n"
    "    def push(self, item):\n"
    "        self._items.append(item)\n\n"
    "    def pop(self):\n"
    "        if not self._items:\n"
    "            raise IndexError('pop from an empty stack')\n"
    "        return self._items.pop()\n",
    "def parse_header(line):\n"
    "    key, sep, value = line.partition(':')\n"
    "    if not sep:\n"
    "        raise ValueError(f'not a header line: {line!r}')\n"
    "    return key.strip().lower(), value.strip()\n",
]
PROMPTS = {
    "fresh-1": "import os\nimport sys\n\n\ndef main(argv):\n",
    "fresh-2": ("class Config:\n    \"\"\"Settings read from a file.\"\"\"\n\n"
                "    def __init__(self, path):\n"),
    "fresh-3": "def read_lines(path, encoding='utf-8'):\n",
    **{f"repeating-{i + 1}": f + "\n\n" + f[:len(f) // 3] for i, f in enumerate(_FUNCS)},
}
DEFAULT_METHODS = ("none", "prompt_lookup", "suffix", "early_exit")


@dataclass
class LoadConfig:
    url: str
    concurrency: int = 8
    requests: int = 100
    duration: float | None = None  # seconds; None: bounded by the request count only
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompts: dict[str, str] = field(default_factory=lambda: dict(PROMPTS))
    stream: bool = True
    max_tokens: int = 64
    model: str = "micro"
    api_key: str | None = None
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    seed: int | None = None  # request i: seed + i // len(methods); None: unseeded
    timeout: float = 120.0

    def __post_init__(self):
        if self.concurrency < 1 or self.requests < 1 or self.max_tokens < 1:
            raise ValueError("concurrency, requests and max_tokens must be at least 1")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        if not self.methods or not self.prompts:
            raise ValueError("give at least one method and one prompt")
        for m in self.methods:
            speculation(m)  # fail early on a malformed item


@dataclass
class Outcome:
    """One request, as the client saw it."""

    method: str
    status: int | str  # 200, another HTTP status, or one of the names in the docstring
    e2e: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    spec: dict | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) a chunk


def speculation(item: str) -> dict:
    """``"early_exit:exit_layer=2"`` -> ``{"method": "early_exit", "exit_layer": 2}``."""
    name, *pairs = item.split(":")
    spec: dict = {"method": name.strip()}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--methods item {item!r}: parameters are key=value")
        try:
            spec[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            spec[key.strip()] = value
    if not spec["method"]:
        raise ValueError(f"--methods item {item!r} has no method name")
    return spec


def load_prompts(path: str) -> dict[str, str]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        data = {f"prompt-{i + 1}": p for i, p in enumerate(data)}
    if (not isinstance(data, dict) or not data
            or not all(isinstance(v, str) and v for v in data.values())):
        raise ValueError(f"{path}: want a JSON object of name -> prompt, or a list of prompts")
    return data


# -- one request ---------------------------------------------------------------------------
def _body(config: LoadConfig, method: str, prompt: str, seed: int | None = None
          ) -> tuple[str, dict]:
    body = {"model": config.model, "max_tokens": config.max_tokens,
            "temperature": config.temperature, "speculation": speculation(method),
            "stream": config.stream}
    if seed is not None:
        body["seed"] = seed
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _tokens_in(chunk: dict) -> int:
    """Tokens a stream chunk carries: its ``nodraft`` token list, else 1 if it has text."""
    if chunk.get("nodraft"):
        return len(chunk["nodraft"]["tokens"])
    for c in chunk.get("choices", []):
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return 1
    return 0


async def _streamed(client: httpx.AsyncClient, path: str, body: dict, out: Outcome,
                    t0: float) -> None:
    async with client.stream("POST", path, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            return
        last = None
        counted = 0
        # read to the stream's end, past ``[DONE]``: a response left unread closes its
        # connection, and every request would open a new one
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                out.status = "stream_error"
                return
            n = _tokens_in(chunk)
            if n:
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - t0
                else:
                    out.itl += [(now - last) / n] * n
                last, counted = now, counted + n
                out.arrivals.append((now, n))
            if chunk.get("speculation"):
                out.spec = chunk["speculation"]
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
        out.tokens = out.tokens or counted


async def one_request(client: httpx.AsyncClient, config: LoadConfig, method: str,
                      prompt: str, seed: int | None = None) -> Outcome:
    path, body = _body(config, method, prompt, seed)
    out = Outcome(method, 0, 0.0)
    t0 = time.perf_counter()
    try:
        if config.stream:
            await _streamed(client, path, body, out, t0)
        else:
            r = await client.post(path, json=body)
            out.status = r.status_code
            if r.status_code == 200:
                data = r.json()
                out.spec, out.tokens = data.get("speculation"), data["usage"]["completion_tokens"]
    except httpx.TimeoutException:
        out.status = "timeout"
    except httpx.TransportError:
        out.status = "transport"
    except (ValueError, KeyError, TypeError):  # a body that is not the API's JSON
        out.status = "bad_response"
    out.e2e = time.perf_counter() - t0
    return out


# -- the run -------------------------------------------------------------------------------
async def run_loadtest(config: LoadConfig, progress: TextIO | None = None,
                       interval: float = 1.0) -> dict:
    """Send the requests, ``config.concurrency`` at a time; return the report."""
    prompts = list(config.prompts.values())
    deadline = None if config.duration is None else time.monotonic() + config.duration
    outcomes: list[Outcome] = []
    issued = 0
    idle_from: list[float] = []  # when the first user found nothing more to send

    def next_request() -> tuple[str, str, int | None] | None:
        nonlocal issued
        if issued >= config.requests or (deadline is not None and time.monotonic() >= deadline):
            if not idle_from:
                idle_from.append(time.perf_counter())
            return None
        i, issued = issued, issued + 1
        m = len(config.methods)
        seed = None if config.seed is None else config.seed + i // m
        return config.methods[i % m], prompts[(i // m) % len(prompts)], seed

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # each worker a client of its own, its one connection kept alive between its requests:
    # as many users as ``concurrency``. (One pool shared by all of them handed a freed
    # connection to several waiting requests at once, and all but one waited again --
    # httpcore 1.0 -- so requests queued in the client for up to seconds.) Made before the
    # clock starts, with one TLS context: each client would load the CA bundle (~25 ms)
    tls = httpx.create_ssl_context()
    clients = [httpx.AsyncClient(base_url=server_root(config.url), headers=headers,
                                 limits=httpx.Limits(max_connections=1), verify=tls,
                                 timeout=config.timeout) for _ in range(config.concurrency)]

    async def worker(client: httpx.AsyncClient) -> None:
        while (job := next_request()) is not None:
            outcomes.append(await one_request(client, config, *job))

    start = time.perf_counter()
    workers = [asyncio.create_task(worker(client)) for client in clients]
    reporter = (asyncio.create_task(_progress(progress, outcomes, lambda: issued, config,
                                              start, interval))
                if progress is not None else None)
    try:
        await asyncio.gather(*workers)
    finally:
        elapsed = time.perf_counter() - start
        for w in workers:
            w.cancel()
        if reporter is not None:
            reporter.cancel()
        for client in clients:
            await client.aclose()
    if progress is not None:
        _progress_line(progress, outcomes, issued, config, elapsed, final=True)
    sustained = (sustained_rate(outcomes, start, idle_from[0])
                 if idle_from and idle_from[0] > start else None)
    return report(config, outcomes, elapsed, sustained)


def sustained_rate(outcomes: list[Outcome], start: float, end: float) -> float | None:
    """Generated tokens/s of the streamed chunks that arrived from ``start`` until ``end``,
    when the first user found no request left to send: until then every user had one in
    flight. The run's own figure is over its whole time, the last requests' tail included,
    where users fall idle one by one; with equal requests a method that ends some of them
    early (a drafter whose copies come sporadically) frees users only there, so its saved
    steps count only in this one. None when nothing streamed arrived."""
    got = [n for o in outcomes if o.status == 200 for t, n in o.arrivals if t <= end]
    return sum(got) / (end - start) if got else None


def server_root(url: str) -> str:
    """The server's root, whether given with or without the trailing ``/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _progress(out: TextIO, outcomes: list[Outcome], issued, config: LoadConfig,
                    start: float, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        _progress_line(out, outcomes, issued(), config, time.perf_counter() - start)


def _progress_line(out: TextIO, outcomes: list[Outcome], issued: int, config: LoadConfig,
                   elapsed: float, final: bool = False) -> None:
    done = len(outcomes)
    errors = sum(o.status != 200 for o in outcomes)
    tokens = sum(o.tokens for o in outcomes)
    line = (f"loadtest: {done}/{config.requests} done, {issued - done} in flight, "
            f"{errors} errors, {done / elapsed:.1f} req/s, {tokens / elapsed:.0f} tokens/s, "
            f"{elapsed:.0f} s")
    tty = out.isatty()
    out.write(("\r" + line + ("\n" if final else "")) if tty else line + "\n")
    out.flush()


# -- the report ----------------------------------------------------------------------------
def percentiles(xs: list[float]) -> dict | None:
    """p50/p90/p99 (linear interpolation between order statistics), mean and count."""
    if not xs:
        return None
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "mean": statistics.fmean(s),
            "n": len(s)}


def method_figures(outcomes: list[Outcome]) -> dict:
    """The speculation figures of one method, summed over its responses."""
    specs = [o.spec for o in outcomes if o.spec]
    drafted = sum(s["drafted"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    passes = sum(s["target_passes"] for s in specs)
    cost = sum(s["draft_cost"] for s in specs)
    ok = [o for o in outcomes if o.status == 200]
    return {
        "requests": len(outcomes), "errors": len(outcomes) - len(ok),
        "generated_tokens": sum(o.tokens for o in ok),
        "drafted": drafted, "accepted": accepted, "target_passes": passes,
        "draft_cost": round(cost, 4),
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_pass": (accepted + passes) / passes if passes else None,
        "estimated_speedup": (accepted + passes) / (passes + cost) if passes else None,
        "e2e_p50": (percentiles([o.e2e for o in ok]) or {}).get("p50"),
    }


def report(config: LoadConfig, outcomes: list[Outcome], elapsed: float,
           sustained: float | None = None) -> dict:
    ok = [o for o in outcomes if o.status == 200]
    tokens = sum(o.tokens for o in ok)
    config_out = {k: v for k, v in asdict(config).items() if k not in ("api_key", "prompts")}
    return {
        "config": {**config_out, "prompts": list(config.prompts)},
        "requests": {"sent": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok)},
        "duration_s": elapsed,
        "throughput": {"requests_per_s": len(ok) / elapsed if elapsed else 0.0,
                       "generated_tokens": tokens,
                       "generated_tokens_per_s": tokens / elapsed if elapsed else 0.0,
                       "sustained_tokens_per_s": sustained},
        "latency_s": {"ttft": percentiles([o.ttft for o in ok if o.ttft is not None]),
                      "inter_token": percentiles([t for o in ok for t in o.itl]),
                      "e2e": percentiles([o.e2e for o in ok])},
        "errors": dict(Counter(str(o.status) for o in outcomes if o.status != 200)),
        "methods": {m: method_figures([o for o in outcomes if o.method == m])
                    for m in config.methods},
    }


def _ms(p: dict | None, missing: str) -> str:
    if p is None:
        return missing
    return (f"p50 {p['p50'] * 1e3:.1f} ms, p90 {p['p90'] * 1e3:.1f} ms, "
            f"p99 {p['p99'] * 1e3:.1f} ms (n={p['n']})")


def render(r: dict) -> str:
    c, t, lat = r["config"], r["throughput"], r["latency_s"]
    missing = ("no request succeeded" if not r["requests"]["ok"]
               else "measured only when streaming" if not c["stream"] else "no tokens")
    lines = [
        f"nodraft loadtest: {c['url']}, {c['model']}, {c['endpoint']}, "
        f"{'streaming' if c['stream'] else 'not streaming'}, concurrency {c['concurrency']}, "
        f"max_tokens {c['max_tokens']}",
        f"requests: {r['requests']['ok']} ok, {r['requests']['failed']} failed in "
        f"{r['duration_s']:.1f} s",
        f"throughput: {t['requests_per_s']:.2f} requests/s, "
        f"{t['generated_tokens_per_s']:.1f} generated tokens/s ({t['generated_tokens']} tokens)"
        + ("" if t.get("sustained_tokens_per_s") is None else
           f"; {t['sustained_tokens_per_s']:.1f} while every user was busy"),
        f"time to first token: {_ms(lat['ttft'], missing)}",
        f"inter-token latency: {_ms(lat['inter_token'], missing)}",
        f"end-to-end latency:  {_ms(lat['e2e'], 'no request succeeded')}",
        "errors: " + (", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "none"),
        "",
        f"{'method':32s} {'requests':>8s} {'errors':>6s} {'acceptance':>10s} "
        f"{'tokens/pass':>11s} {'est. speed-up':>13s} {'e2e p50':>9s}",
    ]
    for name, m in r["methods"].items():
        acc = ("-" if m["target_passes"] == 0 else "0 drafted" if m["drafted"] == 0
               else f"{m['acceptance_rate']:.0%}")
        tpp = "-" if m["tokens_per_pass"] is None else f"{m['tokens_per_pass']:.2f}"
        est = "-" if m["estimated_speedup"] is None else f"{m['estimated_speedup']:.2f}"
        e2e = "-" if m["e2e_p50"] is None else f"{m['e2e_p50'] * 1e3:.0f} ms"
        lines.append(f"{name:32s} {m['requests']:8d} {m['errors']:6d} {acc:>10s} {tpp:>11s} "
                     f"{est:>13s} {e2e:>9s}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[LoadConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="nodraft loadtest",
                                description="Load-test a running nodraft server.")
    p.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=100, help="requests to send in all")
    p.add_argument("--duration", type=float, help="stop sending after this many seconds")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="speculation per request, in turn: name or name:key=value[:...]")
    p.add_argument("--prompts", help="JSON object name -> prompt, or a list of prompts")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the responses (TTFT and inter-token latency need it)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="micro")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="request i sampled with seed N + i div #methods")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no live progress on stderr")
    a = p.parse_args(argv)
    try:
        config = LoadConfig(
            url=a.url, concurrency=a.concurrency, requests=a.requests, duration=a.duration,
            methods=[m.strip() for m in a.methods.split(",") if m.strip()],
            prompts=load_prompts(a.prompts) if a.prompts else dict(PROMPTS), stream=a.stream,
            max_tokens=a.max_tokens, model=a.model, api_key=a.api_key, endpoint=a.endpoint,
            temperature=a.temperature, seed=a.seed, timeout=a.timeout)
    except (ValueError, OSError) as e:
        p.error(str(e))
    return config, a


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    result = asyncio.run(run_loadtest(config, None if args.quiet else sys.stderr))
    print(json.dumps(result, indent=1) if args.json else render(result))
    if result["requests"]["ok"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
