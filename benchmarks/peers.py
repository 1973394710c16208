"""Peers: nodraft against llama.cpp and transformers on micro, greedy and sampled.

    python benchmarks/peers.py [--llama-server PATH] [--tokens 128] [--rounds 5]
                               [--threads 1] [--ttft-requests 15] [--out docs/peers.json]

Needs the ``peers`` extra (``pip install -e '.[peers]'``: llama-cpp-python with its server,
transformers); never a CI dependency. Without llama-cpp-python its two systems are left
out (the run says so, and the JSON's ``llama_cpp_python`` is null). micro is exported once to GGUF (``nodraft
export-gguf``, f32 and q8_0) and to Hugging Face (``nodraft export-hf``, micro and
micro-layerskip), and every system runs the same weights, ``--threads`` threads each:

    nodraft served       ``nodraft serve`` (compiled passes, waited for), /v1/completions
    nodraft in process   ``engine.core.Engine`` in a worker process (compiled alike)
    llama-server         native, when ``--llama-server PATH`` is given: plain (f32 and
                         q8_0) and its n-gram speculation (``--spec-type ngram-simple``,
                         ``ngram-mod``), ``/completion`` with token ids
    llama-cpp-python     in a worker process (``Llama.generate``; plain and its
                         ``LlamaPromptLookupDecoding``), and its OpenAI server
                         (``python -m llama_cpp.server``)
    transformers         ``generate()`` in a worker process: plain, prompt lookup
                         (``prompt_lookup_num_tokens``) and, on micro-layerskip, early exit
                         (``assistant_early_exit``)

Four parts, each alternated over ``--rounds`` rounds (odd rounds in reverse order, so
drift on a shared machine hits every system alike); medians over rounds, and ratios
taken within a round, reported as median and range:

1. **plain**: ``none`` and every peer's plain decoding, ``--tokens`` tokens, 1 stream
   (one prompt) and 8 (eight prompts at once; the in-process llama-cpp-python and
   transformers decode one sequence at a time and have 1-stream rows only), greedy and
   sampled (temperature 0.8, top-k and top-p off, the round's seed): generated tokens/s
   over the wall time of all streams, and each stream's time to first token; every
   server streams (as a chat client would), and nodraft served and llama-server (f32) are
   also asked for the whole response at once (not streamed: no per-token chunks for the
   client to read);
2. **ttft**: time to first streamed token on the three servers, median of
   ``--ttft-requests`` for a 4-token prompt and for prompts of 60-160 tokens, and beside
   them the time of a ``GET /health`` on nodraft and llama-server, sent first in each
   server's turn (no model in it: what the HTTP side alone costs each server, from the
   same client, after the same idle);
3. **drafters**: 1 stream on the workshop's two prompts (``clients.measure``: *fresh* and
   *repeating*), greedy and sampled (temperature 0.8, seeded): every nodraft drafter,
   served and in process, beside llama-server's n-gram speculation, llama-cpp-python's
   prompt lookup and transformers' prompt lookup and early exit; each over its own plain
   decoding (same system, same round) and tokens/s;
4. **suite** (not in the default ``--parts``; needs ``--llama-server``): 1 stream on the
   workload suite's prompts (``nodraft bench``'s: two per category), micro and
   micro-layerskip (each with llama-servers of its own), greedy and at the suite's
   temperature 0.7 (``top_p`` 0.95, the round's seed): nodraft's served ``none`` over
   llama-server's plain decoding, and llama-server's n-gram speculation
   (``ngram-simple``) over its plain decoding, every response asked for whole; per
   category, the ratios of both prompts over all rounds pooled -- the peer columns of the
   README's results table.

Greedy, every system's tokens are checked against nodraft's in-process ``none`` (token ids
where the system returns them, else the text), and reported, not asserted: a peer whose
greedy text differs is a finding. Sampled, nodraft served and in process, every drafter,
are checked against nodraft's in-process ``none`` for the same seed (the seed a served
request's first choice samples with: drafter invariance, and served = in process); the
peers' samplers draw other numbers and are not compared. llama-cpp-python's server returns
text only: its tokens are counted by encoding the text again. In-process nodraft drafters start every request from a
fresh server's state; the served ones keep what the server learnt in earlier requests
(suffix decoding's store of responses, ``auto``'s estimates), as a server asked the same
thing again would. llama-server is sent ``cache_prompt: false``, llama-cpp-python's
in-process ``Llama`` is reset before each request, and nodraft runs without its prefix
cache (``--prefix-cache-mb 0``), so every system prefills each prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import LONG_PROMPTS, PROMPT, SHORT_PROMPT, free_port, wait_ready  # noqa: E402

from nodraft.clients.measure import default_prompts  # noqa: E402
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_tokenizer  # noqa: E402

TEMPERATURE = 0.8
STREAMS = (1, 8)
# the workload suite's regimes (``nodraft bench``): (temperature, top_p)
SUITE_MODES = {"greedy": (0.0, 1.0), "t0.7": (0.7, 0.95)}
SUITE_MODELS = ("micro", "micro-layerskip")
# the suite part's systems, each asked for the whole response (``*-unstreamed``): name ->
# (system, method); llama-server's for micro-layerskip are its servers ``...@micro-layerskip``.
# (No served nodraft drafter: its store of responses would hold each prompt's earlier
# answers, which a greedy decode repeats -- the suite's drafters are measured in process.)
SUITE_SYSTEMS = {"nodraft none": ("nodraft-unstreamed", "none"),
                 "llama-server": ("llama-server-unstreamed", "none"),
                 "llama-server ngram-simple": ("llama-server-ngram-simple-unstreamed", "none")}
NODRAFT_DRAFTERS = [("micro", "prompt_lookup"), ("micro", "suffix"), ("micro", "lookahead"),
                    ("micro", "medusa"), ("micro", "eagle"), ("micro", "auto"),
                    ("micro-layerskip", "early_exit")]
LLAMA_SPEC = {"ngram-simple": ["--spec-type", "ngram-simple"],
              "ngram-mod": ["--spec-type", "ngram-mod"]}
PROMPT_LOOKUP_TOKENS = 10  # transformers' and llama-cpp-python's documented example value
EARLY_EXIT_LAYER = 2  # nodraft's early_exit default
LCP_SERVER = "llama-cpp-python-server"


def eight_prompts() -> list[str]:
    p = default_prompts()
    return [PROMPT, *LONG_PROMPTS, p["fresh"], p["repeating"], SHORT_PROMPT + "\n", PROMPT + "    "]


# -- systems ---------------------------------------------------------------------------------
class Result(dict):
    """seconds (wall, all streams), tokens (per stream: ids, or None), texts (per stream),
    ttft (per stream, seconds, or None)."""

    @property
    def n_tokens(self) -> int:
        return sum(self["counts"])


class Worker:
    """A system in a process of its own: ``python benchmarks/peers.py --worker KIND`` reads
    one JSON request a line and answers each with a JSON ``Result``."""

    def __init__(self, kind: str, args: argparse.Namespace, extra: dict):
        cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(args.threads),
               "--worker-config", json.dumps(extra)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"worker {kind} did not start: {line!r}")

    def run(self, **request) -> Result:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if "error" in out:
            raise RuntimeError(out["error"])
        return Result(out)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def sampling_fields(temperature: float, seed: int, top_p: float = 1.0) -> dict:
    return {"temperature": temperature, "top_p": top_p, "seed": seed}


async def _stream(client: httpx.AsyncClient, path: str, body: dict, parse) -> tuple:
    t0 = time.perf_counter()
    first, ids, text = None, [], []
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            got_ids, got_text = parse(json.loads(line[6:]))
            if got_ids or got_text:
                first = first or time.perf_counter() - t0
            ids += got_ids or []
            text.append(got_text or "")
    return first, ids, "".join(text)


class NodraftServer:
    """``/v1/completions`` with token ids; streamed (the tokens' ids from nodraft's chunk
    extension) or not (the text, and ``usage``'s count)."""

    def __init__(self, url: str, stream: bool = True):
        self.stream = stream
        self.client = httpx.AsyncClient(base_url=url, timeout=600,
                                        limits=httpx.Limits(max_connections=16))

    @staticmethod
    def _parse(chunk: dict):
        toks = [t["id"] for t in chunk.get("nodraft", {}).get("tokens", [])]  # {id, text, origin}
        return toks, "".join(c.get("text", "") for c in chunk.get("choices", []))

    async def one(self, model, prompt_ids, prompt_text, tokens, temperature, seed, method,
                  top_p=1.0):
        body = {"model": model, "prompt": prompt_ids, "max_tokens": tokens,
                "stream": self.stream, "speculation": method,
                **sampling_fields(temperature, seed, top_p)}
        if self.stream:
            return await _stream(self.client, "/v1/completions", body, self._parse) + (None,)
        r = (await self.client.post("/v1/completions", json=body)).json()
        return None, None, r["choices"][0]["text"], r["usage"]["completion_tokens"]


class LlamaServer:
    """Native llama-server's own ``/completion``: token ids in, token ids out."""

    def __init__(self, url: str, stream: bool = True):
        self.stream = stream
        self.client = httpx.AsyncClient(base_url=url, timeout=600,
                                        limits=httpx.Limits(max_connections=16))

    @staticmethod
    def _parse(chunk: dict):
        return chunk.get("tokens", []), chunk.get("content", "")

    async def one(self, model, prompt_ids, prompt_text, tokens, temperature, seed, method,
                  top_p=1.0):
        body = {"prompt": prompt_ids, "n_predict": tokens, "stream": self.stream,
                "cache_prompt": False, "return_tokens": True, "min_p": 0.0,
                "top_k": 1 if temperature == 0 else 0,
                **sampling_fields(temperature, seed, top_p)}
        if self.stream:
            return await _stream(self.client, "/completion", body, self._parse) + (None,)
        r = (await self.client.post("/completion", json=body)).json()
        return None, r["tokens"], r["content"], None


class LlamaCppPythonServer:
    """llama-cpp-python's OpenAI server: text in, text out (one chunk per token)."""

    def __init__(self, url: str):
        self.client = httpx.AsyncClient(base_url=url, timeout=600,
                                        limits=httpx.Limits(max_connections=16))

    @staticmethod
    def _parse(chunk: dict):
        texts = [c.get("text") for c in chunk.get("choices", []) if c.get("finish_reason") is None]
        return [], "".join(t for t in texts if t)

    async def one(self, model, prompt_ids, prompt_text, tokens, temperature, seed, method,
                  top_p=1.0):
        body = {"prompt": prompt_text, "max_tokens": tokens, "stream": True, "min_p": 0.0,
                "top_k": 1 if temperature == 0 else 0, "repeat_penalty": 1.0,
                **sampling_fields(temperature, seed, top_p)}
        first, _, text = await _stream(self.client, "/v1/completions", body, self._parse)
        return first, None, text, None


RETRIES = {"stale_connections": 0}


async def retried(call):
    """``await call()``, called again once if the server had closed the kept-alive
    connection (llama.cpp's HTTP server closes one idle for a few seconds; httpx finds out
    on use)."""
    try:
        return await call()
    except httpx.RemoteProtocolError:
        RETRIES["stale_connections"] += 1
        return await call()


async def one_retried(system, *args):
    """``system.one``, sent again on a stale connection (``retried``)."""
    return await retried(lambda: system.one(*args))


async def served_run(system, model: str, prompts: list[tuple[list[int], str]], tokens: int,
                     temperature: float, seed: int, method: str, tok,
                     top_p: float = 1.0) -> Result:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one_retried(system, model, ids, text, tokens, temperature,
                                              seed + i, method, top_p)
                                  for i, (ids, text) in enumerate(prompts)))
    seconds = time.perf_counter() - t0
    # the count: the ids, else the server's own count, else the text encoded again
    counts = [n if n is not None else len(ids) if ids is not None else len(tok.encode(text))
              for _, ids, text, n in outs]
    return Result(seconds=seconds, tokens=[o[1] for o in outs], texts=[o[2] for o in outs],
                  ttft=[o[0] for o in outs], counts=counts)


def start(cmd: list[str], name: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"peers-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=env or os.environ.copy())
    return proc, log.name


def wait_http(proc: subprocess.Popen, log: str, url: str, path: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    with httpx.Client() as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited: " + Path(log).read_text()[-3000:])
            try:
                if c.get(url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{url}{path}: not up after {timeout} s")


# -- workers -----------------------------------------------------------------------------------
def worker(kind: str, threads: int, config: dict) -> None:
    """``engine``: nodraft in process (micro and micro-layerskip); ``llamacpp``:
    llama-cpp-python's ``Llama`` on a GGUF file; ``hf``: transformers' ``generate()``."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:threads])  # the first cores, as the served engine's
    if kind == "engine":
        run = _engine_worker(threads, config)
    elif kind == "llamacpp":
        run = _llamacpp_worker(threads, config)
    else:
        run = _hf_worker(threads, config)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = run(**req)
        except Exception as e:  # reported to the driver, which stops
            out = {"error": f"{kind}: {type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


def _engine_worker(threads: int, config: dict):
    """The engine as the server builds it (engine.process): its checkpoints, 8 slots, the
    compiled passes built for this machine loaded (built first if there are none)."""
    import torch

    from nodraft.engine.launch import EngineConfig
    from nodraft.engine.process import build_engine, start_warm_up
    from nodraft.engine.sampling import derive_seed
    from nodraft.engine.verify import SamplingParams
    from nodraft.engine.core import GenerationRequest

    torch.set_num_threads(threads)
    ck = Path(config["checkpoints"])
    tok = load_tokenizer(ck / "tokenizer.json")
    cfg = EngineConfig(str(ck), max_running=8, max_waiting=8, threads=threads, compile=True,
                       log_level="warning", prefix_cache_bytes=0)  # every prompt prefilled
    engine = build_engine(cfg)
    registry = engine.registry
    engine.start()
    start_warm_up(engine, cfg)
    while not engine.compiled_ready:
        if engine.compiled_error is not None:
            raise RuntimeError(engine.compiled_error)
        time.sleep(0.5)

    def run(model, prompts, tokens, temperature, seed, method, top_p=1.0):
        engine.shared.clear()  # a fresh server's drafter state for every request
        meth, params = registry.parse({"method": method})
        done = [threading.Event() for _ in prompts]
        ids: list[list[int]] = [[] for _ in prompts]
        ttft: list[float | None] = [None] * len(prompts)
        errors: list[str] = []

        def callback(i):
            def cb(ev):
                if ev.kind == "step":
                    if ttft[i] is None:
                        ttft[i] = time.perf_counter() - t0
                    ids[i].extend(ev.step.tokens)
                elif ev.kind in ("finish", "error"):
                    if ev.kind == "error":
                        errors.append(ev.error)
                    done[i].set()
            return cb

        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            # the seed a served request's first choice samples with (server.api)
            engine.submit(GenerationRequest(model, p, tokens,
                                            SamplingParams(temperature, top_p=top_p,
                                                           seed=derive_seed(seed + i, 0)),
                                            method=meth, params=params), callback(i))
        for d in done:
            d.wait()
        seconds = time.perf_counter() - t0
        if errors:
            raise RuntimeError(errors[0])
        return {"seconds": seconds, "tokens": ids, "texts": [tok.decode(x) for x in ids],
                "ttft": ttft, "counts": [len(x) for x in ids]}
    return run


def _llamacpp_worker(threads: int, config: dict):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    kw = dict(model_path=config["gguf"], n_ctx=1024, n_batch=512, n_threads=threads,
              n_threads_batch=threads, verbose=False)
    llms = {"none": llama_cpp.Llama(**kw),
            "prompt_lookup": llama_cpp.Llama(**kw, draft_model=LlamaPromptLookupDecoding(
                num_pred_tokens=PROMPT_LOOKUP_TOKENS))}
    eos = llms["none"].token_eos()
    atexit.register(lambda: [llm.close() for llm in llms.values()])

    def run(model, prompts, tokens, temperature, seed, method, top_p=1.0):
        assert len(prompts) == 1, "llama-cpp-python's Llama decodes one sequence"
        llm = llms[method]
        llm.reset()  # prefill the whole prompt, as every other system here
        llm.set_seed(seed)
        sample = ({"temp": 0.0, "top_k": 1} if temperature == 0 else
                  {"temp": temperature, "top_k": 0})
        out, ttft = [], None
        t0 = time.perf_counter()
        for t in llm.generate(prompts[0], top_p=top_p, min_p=0.0, repeat_penalty=1.0,
                              reset=True, **sample):
            ttft = ttft or time.perf_counter() - t0
            if t == eos:
                break
            out.append(t)
            if len(out) == tokens:
                break
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": [out],
                "texts": [llm.detokenize(out).decode("utf-8", "replace")], "ttft": [ttft],
                "counts": [len(out)]}
    return run


def _hf_worker(threads: int, config: dict):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    tok = load_tokenizer(Path(config["checkpoints"]) / "tokenizer.json")
    models = {name: AutoModelForCausalLM.from_pretrained(path).eval()
              for name, path in config["hf"].items()}

    def run(model, prompts, tokens, temperature, seed, method, top_p=1.0):
        assert len(prompts) == 1, "one sequence: generate() pads a batch"
        hf = models[model]
        ids = torch.tensor([prompts[0]])
        kw = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": top_p}
              if temperature else {"do_sample": False})
        if method == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif method == "early_exit":
            kw["assistant_early_exit"] = EARLY_EXIT_LAYER
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=tokens, pad_token_id=tok.eot_id, **kw)
        seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        if new and new[-1] == tok.eot_id:
            new = new[:-1]
        return {"seconds": seconds, "tokens": [new], "texts": [tok.decode(new)],
                "ttft": [None], "counts": [len(new)]}
    return run


# -- checks and figures ------------------------------------------------------------------------
def agreement(res: Result, ref: list[list[int]], tok) -> dict:
    """How many of each stream's tokens equal the reference's, from the start (the text's
    characters where the system returns no ids)."""
    if all(t is not None for t in res["tokens"]):
        same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r)))
                for t, r in zip(res["tokens"], ref)]
        return {"equal": all(s == len(r) == len(t) for s, t, r in zip(same, res["tokens"], ref)),
                "tokens_equal_from_start": same, "of": [len(r) for r in ref], "by": "ids"}
    texts = [tok.decode(r) for r in ref]
    same = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r)))
            for t, r in zip(res["texts"], texts)]
    return {"equal": all(t == r for t, r in zip(res["texts"], texts)),
            "chars_equal_from_start": same, "of": [len(r) for r in texts], "by": "text"}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio_rows(runs: dict, pairs: dict[str, tuple[str, str]]) -> dict:
    """name -> (numerator key, denominator key): per-round tokens/s ratios with spread."""
    out = {}
    for name, (a, b) in pairs.items():
        if a in runs and b in runs:
            xs = [x / y for x, y in zip(runs[a], runs[b]) if y > 0]
            if xs:
                out[name] = spread(xs)
    return out


def case_key(c: tuple, mode: str) -> str:
    """A case's key in the results: (part, system, model, method, prompt set) in ``mode``."""
    part, system, model, method, key = c
    return f"{part}/{mode}/{key}/{system}/{model}/{method}"


SUITE_RATIOS = {"none_over_llama_server": ("nodraft none", "llama-server"),
                "llama_server_ngram_over_plain": ("llama-server ngram-simple", "llama-server")}


def suite_ratios(runs: dict, suite_keys: dict[str, list[str]]) -> dict:
    """The suite part's ratios: "model/category/mode" -> name -> the spread of one system's
    tokens/s over another's, per round and prompt (the category's prompts pooled)."""
    out = {}
    for model in SUITE_MODELS:
        for cat, keys in suite_keys.items():
            for mode in SUITE_MODES:
                row = {}
                for name, (a, b) in SUITE_RATIOS.items():
                    xs = []
                    for key in keys:
                        ka, kb = (case_key(("suite", SUITE_SYSTEMS[x][0], model,
                                            SUITE_SYSTEMS[x][1], key), mode) for x in (a, b))
                        xs += [x / y for x, y in zip(runs.get(ka, []), runs.get(kb, [])) if y > 0]
                    if xs:
                        row[name] = spread(xs)
                if row:
                    out[f"{model}/{cat}/{mode}"] = row
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", help="path of a native llama-server binary")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="compute threads of every system")
    p.add_argument("--ttft-requests", type=int, default=15)
    p.add_argument("--parts", default="plain,ttft,drafters")
    p.add_argument("--out")
    p.add_argument("--md-out", help="the results as docs/BENCHMARKS.md's tables (markdown)")
    p.add_argument("--render", metavar="JSON",
                   help="only write a finished run's JSON as those tables (to --md-out or "
                        "standard output)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads, json.loads(args.worker_config))
        return
    if args.render:
        text = markdown(json.loads(Path(args.render).read_text()))
        if args.md_out:
            Path(args.md_out).write_text(text)
        else:
            print(text)
        return
    asyncio.run(driver(args, argv))


# -- the results as tables ---------------------------------------------------------------------
PLAIN_ROWS = [("nodraft", "nodraft served"), ("nodraft-unstreamed", "nodraft served, not streamed"),
              ("nodraft-in-process", "nodraft in process"), ("llama-server", "llama-server f32"),
              ("llama-server-unstreamed", "llama-server f32, not streamed"),
              ("llama-server-q8_0", "llama-server q8_0"),
              ("llama-cpp-python-server", "llama-cpp-python server"),
              ("llama-cpp-python", "llama-cpp-python in process"),
              ("transformers", "transformers generate()")]
NODRAFT_DRAFTERS = [("micro", m) for m in ("none", "prompt_lookup", "suffix", "lookahead",
                                           "medusa", "eagle", "auto")] + \
    [("micro-layerskip", "none"), ("micro-layerskip", "early_exit")]
PEER_DRAFTERS = [("llama-server", "micro", "none", "none"),
                 ("llama-server-ngram-simple", "micro", "none", "`--spec-type ngram-simple`"),
                 ("llama-server-ngram-mod", "micro", "none", "`--spec-type ngram-mod`"),
                 ("llama-cpp-python", "micro", "none", "none"),
                 ("llama-cpp-python", "micro", "prompt_lookup", "`LlamaPromptLookupDecoding`"),
                 ("transformers", "micro", "none", "none"),
                 ("transformers", "micro", "prompt_lookup", "`prompt_lookup_num_tokens=10`"),
                 ("transformers", "micro-layerskip", "none", "none"),
                 ("transformers", "micro-layerskip", "early_exit", "`assistant_early_exit=2`")]
MODES = [("greedy", "greedy"), ("sampled", f"t={TEMPERATURE}")]


def _ratio(r: dict | None) -> str:
    return "--" if not r else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def _checked(check: dict | None) -> str:
    if check is None:
        return "--"
    if check["all_equal"]:
        return "yes"
    last = check["last"]
    same = sum(a == b for a, b in zip(last["tokens_equal_from_start"], last["of"]))
    return f"{same} of {len(last['of'])}"


def markdown(d: dict) -> str:
    """A run's JSON (``--out``) as the tables docs/BENCHMARKS.md shows: plain decoding, its
    ratios, time to first token, the drafters and the copying drafters against the peers'.
    Parts the run left out are left out."""
    tps, ratios, checks = d.get("tokens_per_s", {}), d.get("ratios", {}), d.get("greedy_checks", {})
    ttft_runs = d.get("ttft_ms_in_runs", {})
    out: list[str] = []

    def num(key: str) -> str:
        v = tps.get(key)
        return "--" if v is None else f"{v['median']:.0f}"

    def ttft(key: str) -> str:
        v = ttft_runs.get(key)
        return "--" if v is None else f"{v:.1f}"

    if any(k.startswith("plain/") for k in tps):
        out += ["| system | greedy, 1 stream | greedy, 8 streams | sampled, 1 stream | "
                "sampled, 8 streams | greedy tokens = nodraft's (1 / 8 streams) | "
                "TTFT, greedy, 1 / 8 streams |", "|---|---|---|---|---|---|---|"]
        for sys_, label in PLAIN_ROWS:
            keys = {(m, n): f"plain/{m}/{n}/{sys_}/micro/none"
                    for m in ("greedy", "sampled") for n in (1, 8)}
            if not any(k in tps for k in keys.values()):
                continue
            out.append(f"| {label} | " + " | ".join(num(keys[(m, n)]) for m in ("greedy", "sampled")
                                                     for n in (1, 8))
                       + f" | {_checked(checks.get(keys[('greedy', 1)]))} / "
                       f"{_checked(checks.get(keys[('greedy', 8)]))} | "
                       f"{ttft(keys[('greedy', 1)])} / {ttft(keys[('greedy', 8)])} ms |")
        names = list(dict.fromkeys(k.split(": ", 1)[1] for k in ratios if k.startswith("plain/")))
        out += ["", "| ratio (per round, median (range)) | greedy, 1 stream | greedy, 8 streams "
                "| sampled, 1 stream | sampled, 8 streams |", "|---|---|---|---|---|"]
        for name in names:
            out.append(f"| {name} | " + " | ".join(
                _ratio(ratios.get(f"plain/{m}/{n}: {name}"))
                for m in ("greedy", "sampled") for n in (1, 8)) + " |")
    if d.get("ttft_ms"):
        long = d.get("long_prompt_tokens") or []
        span = f"{min(long)}-{max(long)}" if long else "long"
        out += ["", f"| server | 4-token prompt | {span}-token prompts | `GET /health` |",
                "|---|---|---|---|"]
        for server in ("nodraft", "llama-server", "llama-cpp-python-server"):
            cells = []
            for label in ("short", "long", "health"):
                v = d["ttft_ms"].get(f"{server}/{label}")
                cells.append("--" if v is None else
                             f"{v['median']:.1f} ms ({v['min']:.1f}-{v['max']:.1f})")
            if any(c != "--" for c in cells):
                out.append(f"| {server.replace('nodraft', 'nodraft served')} | "
                           + " | ".join(cells) + " |")
    if any(k.startswith("drafters/") for k in tps):
        prompts = ("fresh", "repeating")
        head = " | ".join(f"{p}, {mode}" for _, mode in MODES for p in prompts)
        out += ["", f"| system | model | method | {head} | tokens checked |",
                "|---|---|---|" + "---|" * (2 * len(prompts)) + "---|"]
        rows = [(s, label, model, method, method) for s, label in
                (("nodraft", "nodraft served"), ("nodraft-in-process", "nodraft in process"))
                for model, method in NODRAFT_DRAFTERS]
        rows += [(s, s.split("-ngram")[0] if "ngram" in s else s, model, method, shown)
                 for s, model, method, shown in PEER_DRAFTERS]
        for sys_, label, model, method, shown in rows:
            cells, checked = [], []
            for m, _ in MODES:
                for p in prompts:
                    key = f"drafters/{m}/{p}/{sys_}/{model}/{method}"
                    if key not in tps:
                        cells.append("--")
                        continue
                    cell = num(key)
                    if "ngram" in sys_:
                        name = f"drafters/{m}/{p}: llama-server {sys_.split('-', 2)[2]} / llama-server"
                    elif method != "none":
                        name = f"drafters/{m}/{p}: {sys_} {method} / its none"
                    else:
                        name = None
                    if name and ratios.get(name):
                        cell += f", **{ratios[name]['median']:.2f}x** " \
                                f"({ratios[name]['min']:.2f}-{ratios[name]['max']:.2f})"
                    cells.append(cell)
                    if key in checks:
                        checked.append(checks[key]["all_equal"])
            if all(c == "--" for c in cells):
                continue
            check = "--" if not checked else ("all equal" if all(checked) else
                                               f"{sum(checked)} of {len(checked)} equal")
            out.append(f"| {label} | {model} | {shown} | " + " | ".join(cells) + f" | {check} |")
        peers = ("llama-server-ngram-simple", "llama-server-ngram-mod", "transformers prompt_lookup")
        out += ["", f"| nodraft drafter / peer | {head} |", "|---|" + "---|" * (2 * len(prompts))]
        for who, label in (("nodraft", "nodraft served"), ("nodraft-in-process", "nodraft in process")):
            for method in ("prompt_lookup", "suffix", "auto"):
                for peer in peers:
                    cells = [_ratio(ratios.get(f"drafters/{m}/{p}: {who} {method} / {peer}"))
                             for m, _ in MODES for p in prompts]
                    if any(c != "--" for c in cells):
                        shown = peer.replace("llama-server-", "llama-server ")
                        out.append(f"| {label} {method} / {shown} | " + " | ".join(cells) + " |")
    if d.get("suite"):
        out += ["", "| model | category | served `none` / llama-server, t=0.7 | greedy | "
                "llama-server ngram-simple / its plain, t=0.7 | greedy |", "|---|---|---|---|---|---|"]
        for key, row in d["suite"].items():
            model, cat, mode = key.split("/")
            if mode != "greedy":
                continue
            sampled = d["suite"].get(f"{model}/{cat}/t0.7", {})
            out.append(f"| {model} | {cat} | " + " | ".join(
                _ratio(r.get(name)) for name in SUITE_RATIOS for r in (sampled, row)) + " |")
    return "\n".join(out) + "\n"


async def driver(args: argparse.Namespace, argv: list[str] | None) -> None:
    try:  # optional: without it, its two systems are left out and the run says so
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("llama-cpp-python is not installed: its in-process and server runs are left "
              "out", file=sys.stderr, flush=True)

    from nodraft.micro.export import export as export_hf
    from nodraft.micro.gguf import export as export_gguf

    parts = set(args.parts.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="nodraft-peers-"))
    ck = CHECKPOINT_DIR
    tok = load_tokenizer(ck / "tokenizer.json")
    gguf = {ft: export_gguf(tmp / f"micro-{ft}.gguf", "micro", ck, ft) for ft in ("f32", "q8_0")}
    if "suite" in parts:
        gguf["micro-layerskip"] = export_gguf(tmp / "micro-layerskip-f32.gguf", "micro-layerskip",
                                              ck, "f32")
    hf = {name: str(export_hf(tmp / f"hf-{name}", name, ck)) for name in ("micro", "micro-layerskip")}
    cores = sorted(os.sched_getaffinity(0))
    results: dict = {
        "command": "python benchmarks/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "cpus": len(cores), "machine": platform.machine(),
        "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
        "temperature_sampled": TEMPERATURE,
        "llama_cpp_python": llama_cpp.__version__ if llama_cpp is not None else None}
    procs: list[subprocess.Popen] = []
    workers: dict[str, Worker] = {}
    try:
        # servers
        port = free_port()
        nd_cmd = [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port),
                  "--threads", str(args.threads), "--max-running", "8", "--checkpoints", str(ck),
                  "--compile", "true", "--log-level", "warning", "--prefix-cache-mb", "0"]
        nd_proc, nd_log = start(nd_cmd, "nodraft")
        procs.append(nd_proc)
        systems: dict = {"nodraft": NodraftServer(f"http://127.0.0.1:{port}"),
                         "nodraft-unstreamed": NodraftServer(f"http://127.0.0.1:{port}", False)}
        waits = [("nodraft", nd_proc, nd_log, f"http://127.0.0.1:{port}", None)]
        llama_servers = {}
        if args.llama_server:
            version = subprocess.run([args.llama_server, "--version"], capture_output=True,
                                     text=True).stderr.strip().splitlines()
            results["llama_server_version"] = version[-2:] if version else None
            configs = {"llama-server": ("f32", []), "llama-server-q8_0": ("q8_0", []),
                       **{f"llama-server-{k}": ("f32", v) for k, v in LLAMA_SPEC.items()}}
            if "suite" in parts:  # micro-layerskip's, plain and with n-gram speculation
                configs["llama-server@micro-layerskip"] = ("micro-layerskip", [])
                configs["llama-server-ngram-simple@micro-layerskip"] = (
                    "micro-layerskip", LLAMA_SPEC["ngram-simple"])
            for name, (ft, extra) in configs.items():
                lport = free_port()
                cmd = [args.llama_server, "-m", str(gguf[ft]), "--host", "127.0.0.1",
                       "--port", str(lport), "-t", str(args.threads), "-tb", str(args.threads),
                       "-c", str(8 * 1024), "-np", "8", "--no-ui", *extra]
                proc, log = start(cmd, name)
                procs.append(proc)
                llama_servers[name] = cmd
                systems[name] = LlamaServer(f"http://127.0.0.1:{lport}")
                base, _, model = name.partition("@")
                if base in ("llama-server", "llama-server-ngram-simple"):  # and not streamed
                    systems[f"{base}-unstreamed" + (f"@{model}" if model else "")] = \
                        LlamaServer(f"http://127.0.0.1:{lport}", False)
                waits.append((name, proc, log, f"http://127.0.0.1:{lport}", "/health"))
        results["llama_server_commands"] = llama_servers
        if llama_cpp is not None:
            lport = free_port()
            lcp_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf["f32"]),
                       "--host", "127.0.0.1", "--port", str(lport), "--n_threads",
                       str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx",
                       "1024", "--interrupt_requests", "False"]  # queue concurrent requests
            proc, log = start(lcp_cmd, LCP_SERVER)
            procs.append(proc)
            systems[LCP_SERVER] = LlamaCppPythonServer(f"http://127.0.0.1:{lport}")
            waits.append((LCP_SERVER, proc, log, f"http://127.0.0.1:{lport}", "/v1/models"))
        # workers (in process)
        workers["nodraft-in-process"] = Worker("engine", args, {"checkpoints": str(ck)})
        if llama_cpp is not None:
            workers["llama-cpp-python"] = Worker("llamacpp", args, {"gguf": str(gguf["f32"])})
        workers["transformers"] = Worker("hf", args, {"checkpoints": str(ck), "hf": hf})
        for name, proc, log, url, path in waits:
            if path is None:
                wait_ready({name: (proc, url, log)})
            else:
                wait_http(proc, log, url, path)
            print(f"{name} up", file=sys.stderr, flush=True)
        os.sched_setaffinity(0, cores[-1:])  # the client: on the core the API process keeps

        async def run(system: str, model: str, prompts: list[tuple[list[int], str]],
                      temperature: float, seed: int, method: str, top_p: float = 1.0) -> Result:
            if system in workers:
                return workers[system].run(model=model, prompts=[i for i, _ in prompts],
                                           tokens=args.tokens, temperature=temperature,
                                           seed=seed, method=method, top_p=top_p)
            if system.startswith("llama-server") and model != "micro":  # its own server
                system = f"{system}@{model}"
            return await served_run(systems[system], model, prompts, args.tokens, temperature,
                                    seed, method, tok, top_p)

        # the greedy reference: nodraft in process, none
        texts8 = eight_prompts()
        workshop = default_prompts()
        prompt_sets = {"1": [PROMPT], "8": texts8, "fresh": [workshop["fresh"]],
                       "repeating": [workshop["repeating"]]}
        encoded = {k: [(tok.encode(t), t) for t in v] for k, v in prompt_sets.items()}
        suite_keys: dict[str, list[str]] = {}  # category -> its prompts' keys
        if "suite" in parts:
            from nodraft.clients.bench import build_prompts

            for cat, ps in build_prompts(tok, 2).items():
                for i, pr in enumerate(ps):
                    encoded[f"{cat}{i}"] = [(pr["ids"], tok.decode(pr["ids"]))]
                    suite_keys.setdefault(cat, []).append(f"{cat}{i}")
        results["prompt_tokens"] = {k: [len(i) for i, _ in v] for k, v in encoded.items()}
        refs: dict = {}

        async def reference(model: str, key: str, temperature: float, seed: int,
                            top_p: float = 1.0) -> list:
            k = (model, key, temperature, seed, top_p)
            if k not in refs:
                refs[k] = (await run("nodraft-in-process", model, encoded[key], temperature,
                                     seed, "none", top_p))["tokens"]
            return refs[k]

        # every case: (part, system, model, method, prompt set), in each of its part's modes
        modes = {"greedy": (0.0, 1.0), "sampled": (TEMPERATURE, 1.0)}

        def case_modes(c) -> dict[str, tuple[float, float]]:
            return SUITE_MODES if c[0] == "suite" else modes
        cases = []
        if "plain" in parts:
            for streams in STREAMS:
                key = str(streams)
                cases += [("plain", "nodraft", "micro", "none", key),
                          ("plain", "nodraft-in-process", "micro", "none", key),
                          ("plain", LCP_SERVER, "micro", "none", key)]
                cases += [("plain", s, "micro", "none", key) for s in ("llama-server", "llama-server-q8_0")
                          if s in systems]
                cases += [("plain", s, "micro", "none", key) for s in ("nodraft-unstreamed",
                                                                      "llama-server-unstreamed")
                          if s in systems]
                if streams == 1:
                    cases += [("plain", "llama-cpp-python", "micro", "none", key),
                              ("plain", "transformers", "micro", "none", key)]
        if "drafters" in parts:
            for key in ("fresh", "repeating"):
                for sysname in ("nodraft", "nodraft-in-process"):
                    cases += [("drafters", sysname, "micro", "none", key),
                              ("drafters", sysname, "micro-layerskip", "none", key)]
                    cases += [("drafters", sysname, m, d, key) for m, d in NODRAFT_DRAFTERS]
                cases += [("drafters", s, "micro", "none", key) for s in
                          ["llama-server", *(f"llama-server-{k}" for k in LLAMA_SPEC)] if s in systems]
                cases += [("drafters", "llama-cpp-python", "micro", m, key)
                          for m in ("none", "prompt_lookup")]
                cases += [("drafters", "transformers", "micro", "none", key),
                          ("drafters", "transformers", "micro", "prompt_lookup", key),
                          ("drafters", "transformers", "micro-layerskip", "none", key),
                          ("drafters", "transformers", "micro-layerskip", "early_exit", key)]

        if "suite" in parts:
            for model in SUITE_MODELS:
                for keys in suite_keys.values():
                    cases += [("suite", system, model, method, key) for key in keys
                              for system, method in SUITE_SYSTEMS.values()]
        cases = [c for c in cases if c[1] in systems or c[1] in workers]  # what is installed

        # warm every path once (compiles, first requests), untimed
        for c in cases:
            for mode, (temp, top_p) in case_modes(c).items():
                await run(c[1], c[2], encoded[c[4]], temp, 0, c[3], top_p)
        print("warmed", file=sys.stderr, flush=True)
        runs: dict[str, list[float]] = {}
        ttfts: dict[str, list[float]] = {}
        checks: dict[str, list[dict]] = {}
        for r in range(args.rounds):
            order = [(c, m) for c in cases for m in case_modes(c)]
            if r % 2:
                order.reverse()
            for c, mode in order:
                part, system, model, method, key = c
                seed = 1000 + r
                temp, top_p = case_modes(c)[mode]
                res = await run(system, model, encoded[key], temp, seed, method, top_p)
                k = case_key(c, mode)
                runs.setdefault(k, []).append(res.n_tokens / res["seconds"])
                ttfts.setdefault(k, []).extend(t for t in res["ttft"] if t is not None)
                if mode == "greedy":
                    ref = await reference(model, key, 0.0, 0)
                    checks.setdefault(k, []).append(agreement(res, ref, tok))
                elif system.startswith("nodraft"):
                    ref = await reference(model, key, temp, seed, top_p)
                    checks.setdefault(k, []).append(agreement(res, ref, tok))
            print(f"round {r + 1} done", file=sys.stderr, flush=True)
        results["tokens_per_s"] = {k: spread(v) for k, v in runs.items()}
        results["ttft_ms_in_runs"] = {k: 1e3 * statistics.median(v) for k, v in ttfts.items() if v}
        results["runs"] = runs
        results["greedy_checks"] = {
            k: {"all_equal": all(x["equal"] for x in v), "last": v[-1]} for k, v in checks.items()}
        pairs = {}
        for mode in modes:
            for streams in STREAMS:
                base = f"plain/{mode}/{streams}"
                nd = f"{base}/nodraft/micro/none"
                for peer in ("llama-server", "llama-server-q8_0", LCP_SERVER):
                    pairs[f"{base}: nodraft served / {peer}"] = (nd, f"{base}/{peer}/micro/none")
                pairs[f"{base}: nodraft in process / served"] = (f"{base}/nodraft-in-process/micro/none", nd)
                pairs[f"{base}: nodraft served / llama-server, not streamed"] = (
                    f"{base}/nodraft-unstreamed/micro/none", f"{base}/llama-server-unstreamed/micro/none")
                if streams == 1:
                    ip = f"{base}/nodraft-in-process/micro/none"
                    pairs[f"{base}: nodraft in process / llama-cpp-python in process"] = (
                        ip, f"{base}/llama-cpp-python/micro/none")
                    pairs[f"{base}: nodraft in process / transformers"] = (
                        ip, f"{base}/transformers/micro/none")
            for key in ("fresh", "repeating"):
                base = f"drafters/{mode}/{key}"
                for sysname in ("nodraft", "nodraft-in-process"):
                    for model, d in NODRAFT_DRAFTERS:
                        pairs[f"{base}: {sysname} {d} / its none"] = (
                            f"{base}/{sysname}/{model}/{d}", f"{base}/{sysname}/{model}/none")
                        for peer in ("llama-server-ngram-simple", "llama-server-ngram-mod"):
                            pairs[f"{base}: {sysname} {d} / {peer}"] = (
                                f"{base}/{sysname}/{model}/{d}", f"{base}/{peer}/micro/none")
                        pairs[f"{base}: {sysname} {d} / transformers prompt_lookup"] = (
                            f"{base}/{sysname}/{model}/{d}", f"{base}/transformers/micro/prompt_lookup")
                for peer in LLAMA_SPEC:
                    pairs[f"{base}: llama-server {peer} / llama-server"] = (
                        f"{base}/llama-server-{peer}/micro/none", f"{base}/llama-server/micro/none")
                pairs[f"{base}: llama-cpp-python prompt_lookup / its none"] = (
                    f"{base}/llama-cpp-python/micro/prompt_lookup", f"{base}/llama-cpp-python/micro/none")
                pairs[f"{base}: transformers prompt_lookup / its none"] = (
                    f"{base}/transformers/micro/prompt_lookup", f"{base}/transformers/micro/none")
                pairs[f"{base}: transformers early_exit / its none"] = (
                    f"{base}/transformers/micro-layerskip/early_exit",
                    f"{base}/transformers/micro-layerskip/none")
        results["ratios"] = ratio_rows(runs, pairs)
        if suite_keys:
            results["suite"] = suite_ratios(runs, suite_keys)
        if "ttft" in parts:
            servers = ["nodraft", *(s for s in ("llama-server", LCP_SERVER) if s in systems)]
            ttft: dict[str, list[float]] = {}
            longs = [(tok.encode(t), t) for t in LONG_PROMPTS]
            short = [(tok.encode(SHORT_PROMPT), SHORT_PROMPT)]
            for i in range(args.ttft_requests):
                for name in (servers if i % 2 == 0 else servers[::-1]):
                    if name in ("nodraft", "llama-server"):  # first: after the other's turn,
                        client = systems[name].client  # as the short prompt's request is

                        async def health():
                            t0 = time.perf_counter()
                            r = await client.get("/health")
                            return r, time.perf_counter() - t0

                        r, seconds = await retried(health)
                        if r.status_code == 200:
                            ttft.setdefault(f"{name}/health", []).append(seconds)
                        await asyncio.sleep(0.02)  # the server idle again, as between turns
                    for label, prompt in (("short", short), ("long", [longs[i % len(longs)]])):
                        first = (await one_retried(systems[name], "micro", *prompt[0], 4, 0.0,
                                                   0, "none"))[0]
                        ttft.setdefault(f"{name}/{label}", []).append(first)
            results["ttft_ms"] = {k: {**{m: 1e3 * v for m, v in spread(x).items() if m != "n"},
                                      "n": len(x)} for k, x in ttft.items()}
            results["long_prompt_tokens"] = [len(i) for i, _ in longs]
        results["requests_sent_again"] = RETRIES["stale_connections"]
    finally:
        for w in workers.values():
            w.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps({k: results.get(k) for k in ("ratios", "ttft_ms")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(markdown(results))


if __name__ == "__main__":
    main()
