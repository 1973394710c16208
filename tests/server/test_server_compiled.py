"""The server with compiled passes (``--compile true``, the default outside the tests): a
process of its own builds the graphs once (engine/artifacts.py) while the engine serves
eager, /health says so, and once they are loaded the server answers greedy requests with
the same tokens as the eager server; a build stopped by SIGKILL never blocks the next
start, and a later start loads the graphs instead of building them. And the invariant on
those graphs: every drafter and parameter set, greedy, gives eager plain decoding's tokens
with every pass compiled as the server runs it. It serves
micro-layerskip alone (its trained exits make early exit's graphs matter): a model's
graphs are built the same way for each. (Saving and loading graph by graph is tested on
the engine itself: tests/engine/test_artifacts.py.)"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
from server_testing import LiveServer, alive, free_port, wait_for, wait_healthy

from nodraft.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MAX_RUNNING = 4
METHODS = ["none", "prompt_lookup", "suffix", {"method": "early_exit", "exit_layer": 2},
           "eagle", "auto"]
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"


# In a fresh interpreter (inductor's cache where the server's build put its kernels): an
# engine shaped as the server's loads the graphs the server built, and every drafter and
# parameter set (EAGLE in its default shape, whose graphs the build holds) decodes greedy
# exactly what eager plain decoding does -- the invariant with every pass run as the
# server runs it. Prints the mismatches and what dynamo traced meanwhile.
EVERY_DRAFTER = textwrap.dedent(r"""
    import json, sys
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from nodraft.engine import artifacts
    from nodraft.engine.core import GenerationRequest
    from nodraft.engine.process import build_engine
    from nodraft.micro.checkpoint import load_model, load_tokenizer
    from nodraft.server.settings import Settings
    from tests.engine.helpers import all_configs, generate, run_all
    checkpoints, cache, max_running = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    config = Settings(checkpoints=checkpoints, threads=1, compile=True, compile_cache=cache,
                      max_running=max_running).engine_config()
    store = artifacts.Store(config, cache)
    engine = build_engine(config)
    engine.warm_up(load=lambda: artifacts.load(engine, store.path)).join()
    assert engine.compiled_ready, engine.compiled_error
    trusted = engine.models["micro-layerskip"].compiled.precompiled._trusted
    trusted.clear()  # the warm-up ran each once: count those the requests run
    engine.start()
    eager, tok = load_model("micro-layerskip", checkpoints), load_tokenizer()
    configs = [(m, p) for m, p in all_configs() if m != "eagle" or not p]
    # the loop's 17 tokens: from its second request on, a cached block and one row past it
    texts = ["def fibonacci(n):\n    ",
             "import os\nimport sys\nimport os\nimport sys\nimport os\nimport sys",
             'class Queue:\n    \"\"\"A']
    wrong = []
    try:
        for text in texts:
            for max_tokens in (40, 13):
                prompt = tok.encode(text)
                want, _, _ = generate(eager, prompt, max_tokens)
                for method, params in configs:
                    _, parsed = engine.registry.parse({"method": method, **params})
                    request = GenerationRequest("micro-layerskip", prompt, max_tokens,
                                                method=method, params=parsed)
                    events = run_all(engine, [request])[0]
                    got = [t for e in events if e.kind == "step" for t in e.step.tokens]
                    errors = events[-1].stats.drafter_errors if events[-1].stats else -1
                    if got != want or errors:
                        wrong.append([text, max_tokens, method, params, errors])
        # all at once: packed passes of chains, trees and plain rows (the compiled packed
        # graphs), prompts prefilled in chunks of 8 rows beside the others' steps
        engine.prefill_tokens = 8
        batch, wants = [], []
        for text in texts:
            prompt = tok.encode(text)
            want = generate(eager, prompt, 24)[0]
            for method, params in configs:
                _, parsed = engine.registry.parse({"method": method, **params})
                batch.append(GenerationRequest("micro-layerskip", prompt, 24, method=method,
                                               params=parsed))
                wants.append((want, text, method, params))
        for (want, text, method, params), events in zip(wants, run_all(engine, batch)):
            got = [t for e in events if e.kind == "step" for t in e.step.tokens]
            if got != want:
                wrong.append([text, "batched", method, params])
        packed = engine.passes
    finally:
        engine.stop()
    model = engine.models["micro-layerskip"]
    print(json.dumps({"wrong": wrong, "frames": sum(counters["frames"].values()),
                      "packed": packed,
                      "graphs": len(model.compiled.precompiled.fns),
                      "ran": len(trusted), "block": model.compiled.block_serves()}))
""")


def every_drafter_matches_eager(checkpoints: Path, cache: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EVERY_DRAFTER, str(checkpoints), str(cache), str(MAX_RUNNING)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT),
             "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # all of them right, alone and batched, nothing traced. Where nodraft's kernels serve,
    # every target pass is nodraft::block's or nodraft::packed_block's and the build holds
    # no target graph (EAGLE's draft steps only); elsewhere the model's 16 target graphs,
    # loaded: 13 single-sequence passes -- two of them a prompt's rows past a cached block
    # or an earlier chunk --, the prefill and the two packed passes, each run by some request
    graphs = 0 if got["block"] else 16
    assert got["wrong"] == [] and got["frames"] == 0 and got["graphs"] == got["ran"] == graphs, got
    assert got["packed"] > 0


def _complete(url: str, speculation) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "micro-layerskip", "prompt": PROMPT, "max_tokens": 24,
                         "temperature": 0, "speculation": speculation})
    assert r.status_code == 200, r.text
    return r.json()


def one_model(checkpoints: Path, name: str, into: Path) -> Path:
    """A checkpoint folder with ``name`` alone (its weights, record and drafter heads) and
    the tokenizer, linked to ``checkpoints``'s files."""
    into.mkdir()
    for f in checkpoints.iterdir():
        if f.name == "tokenizer.json" or f.name.startswith(f"{name}.") or (
                f.name.startswith(f"{name}-") and f.suffix in (".safetensors", ".json")):
            (into / f.name).symlink_to(f)
    return into


def serve_process(checkpoints: Path, cache: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "nodraft.server.cli", "serve", "--port", str(port), "--checkpoints",
             str(checkpoints), "--compile", "true", "--compile-cache", str(cache),
             "--threads", "1", "--max-running", str(MAX_RUNNING), "--log-level", "info"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def builders(cache: Path) -> list[int]:
    """Processes building into ``cache`` (engine.artifacts' builder)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"nodraft.engine.artifacts" in cmd and str(cache).encode() in cmd and alive(int(proc.name)):
            out.append(int(proc.name))
    return out


def wait_ready(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while (health := httpx.get(url + "/health").json())["compiled"] != "ready":
        assert health["compiled"] in ("warming", "ready"), health
        assert time.monotonic() - t0 < timeout, f"compiled passes not ready after {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_compiled_passes_survive_a_killed_build_then_load_at_a_warm_start(
        serve_checkpoints, live, tmp_path, monkeypatch):
    """A server killed (SIGKILL) while a process of its own builds its compiled passes
    takes the builder with it and leaves nothing that blocks the next start; the next
    server builds them again, serving meanwhile, and then answers as the eager server
    does; a third one loads what the second built, builds nothing, and is ready soon.
    The builds compile in two processes side by side (the families claimed between them),
    whatever this machine's cores would give a server's build."""
    monkeypatch.setenv("NODRAFT_BUILD_WORKERS", "2")
    checkpoints = one_model(serve_checkpoints, "micro-layerskip", tmp_path / "checkpoints")
    cache = tmp_path / "cache"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = serve_process(checkpoints, cache, port, tmp_path / "serve.log")
    try:
        wait_healthy(url, 120, lambda: first.poll() is None)
        assert httpx.get(url + "/health").json()["compiled"] == "warming"
        early = _complete(url, "none")  # served at once, eager, while the build runs
        # killed once the builder has saved a graph: in the middle of the build
        assert wait_for(lambda: any((cache / "compiled").glob("*.building-*/**/*.pt2")),
                        timeout=600), "no graph built within 600 s"
        assert builders(cache)  # the build, and the processes compiling side by side
    finally:
        first.kill()
        first.wait(timeout=30)
    assert wait_for(lambda: not builders(cache), timeout=15), "the builder outlived its server"
    partial = list((cache / "compiled").glob("*.building-*"))
    assert partial and not list((cache / "compiled").glob("*/manifest.json"))

    settings = Settings(checkpoints=checkpoints, threads=1, compile=True, compile_cache=cache,
                        max_running=MAX_RUNNING)
    with LiveServer(settings) as server:
        assert _complete(server.url, "none")["choices"][0]["text"] == early["choices"][0]["text"]
        wait_ready(server.url, 900)
        for speculation in METHODS:
            got = _complete(server.url, speculation)
            want = _complete(live.url, speculation)
            assert got["choices"][0]["text"] == want["choices"][0]["text"], speculation
        assert early["choices"][0]["text"] == _complete(live.url, "none")["choices"][0]["text"]
    assert not any(p.exists() for p in partial)  # the stale build was found and removed
    (log,) = (cache / "compiled").glob("*.log")
    assert "stopped before it finished" in log.read_text()
    (manifest,) = (cache / "compiled").glob("*/manifest.json")
    built = manifest.stat().st_mtime, log.stat().st_size

    with LiveServer(settings) as server:  # a warm start: loaded, nothing built
        wait_ready(server.url, 120)
        for speculation in ("none", {"method": "early_exit", "exit_layer": 2}, "eagle"):
            got = _complete(server.url, speculation)
            assert got["choices"][0]["text"] == _complete(live.url, speculation)["choices"][0]["text"]
    assert (manifest.stat().st_mtime, log.stat().st_size) == built and not builders(cache)
    assert httpx.get(live.url + "/health").json()["compiled"] == "off"
    every_drafter_matches_eager(checkpoints, cache)
