"""Compiled passes built once and loaded (micro/compiled.py ``Precompiled``,
engine/artifacts.py): a saved graph loads in another process and runs there at once --
nothing traced, nothing compiled -- with the numbers of the graph that was saved; the
artifacts' key changes with what invalidates them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nodraft.engine import artifacts
from nodraft.engine.launch import EngineConfig
from nodraft.micro.model import KVCache, MicroConfig
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SMALL = MicroConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, ffn_dim=64,
                    max_positions=64)

# In a fresh interpreter: the same model (same seed), its saved families loaded, one pass of
# each size run, and what dynamo traced meanwhile.
LOAD = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from nodraft.micro.model import KVCache
    from tests.conftest import tiny_model
    from tests.engine.test_artifacts import SLOTS, SMALL, passes
    torch.set_num_threads(1)
    model = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    n = model.compiled.load(sys.argv[1])
    out = passes(model)
    # a saved graph keeps its tensor guards: loaded afresh, its first call with a tensor
    # of another dtype is refused (and that family runs eager)
    other = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    other.compiled.load(sys.argv[1])
    pre = other.compiled.precompiled
    row = next(f for f in pre.fns if f[0] not in ("prefill", "packed") and not f[3])
    cache = KVCache(SMALL, SLOTS)
    k, v = cache.k[0:2, 0][:, :, :9], cache.v[0:2, 0][:, :, :9]
    with torch.inference_mode():
        refused = pre(row, (torch.zeros(1, SMALL.dim, dtype=torch.float64), torch.tensor([9]),
                            k, v, None)) is None
    print(json.dumps({"loaded": n, "frames": sum(counters["frames"].values()),
                      "running": len(model.compiled.precompiled.fns), "out": out,
                      "ran": len(model.compiled.precompiled._trusted),
                      "refused": refused and row not in pre.fns}))
""")


SLOTS = 5  # the engine cache's slots: graphs are built per cache shape


def passes(model) -> list[list[float]]:
    """Logits of a 1-row and a 5-row pass after 9 cached rows (and a 3-row one after 20),
    after a 20-row prefill; the last hidden row of a prompt's 1 and 4 rows past 6 cached
    ones (the full pass without a head); then packed passes (``forward_packed``): one row in every slot
    (the whole cache, where the warm-up's batch spanned less of it), one row in a sparse
    range of slots, then chains and a tree beside a one-row block (the mixed family)."""
    from nodraft.engine.sequence import tree_attention_mask
    from nodraft.micro.packed import Segment, forward_packed

    cache = KVCache(model.config, SLOTS)
    out = []
    with torch.inference_mode():
        ids = torch.arange(30) % model.config.vocab_size
        model.prefill_pass(ids[:20], cache, 1, 0)
        for T, start in ((1, 9), (5, 9), (3, 20)):
            logits, _ = model.verify_pass(ids[start:start + T], cache, 1, start)
            out.append(logits[-1, :8].tolist())
        for T in (1, 4):
            out.append(model.prefill_pass(ids[6:6 + T], cache, 2, 6)[-1, :8].tolist())
        starts = [11, 20, 7, 15, 3]
        for s, n in enumerate(starts):  # each slot a prefix of its own
            model.prefill_pass((ids[:n] + 3 * s) % model.config.vocab_size, cache, s, 0)
        one = [Segment(s, n, ids[n:n + 1], torch.tensor([n])) for s, n in enumerate(starts)]
        tree = tree_attention_mask(torch.tensor([-1, -1, 0]))  # two branches, one deeper
        rows = [Segment(0, 11, ids[:3], torch.arange(11, 14)),
                Segment(3, 15, ids[4:8], torch.tensor([15, 16, 16, 17]), tree),
                Segment(4, 3, ids[9:10], torch.tensor([3]))]
        sparse = [one[1], one[4]]
        for batch in (one, sparse, rows):
            out.extend(lg[-1, :8].tolist() for lg, _ in forward_packed(model, batch, cache))
    return out


def test_saved_graphs_load_elsewhere_and_run_without_tracing(tmp_path):
    torch.set_num_threads(1)
    model = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    model.compiled.export_to = tmp_path / "tiny"
    model.compiled.warm_up(KVCache(SMALL, SLOTS), 0, early_exit=False)
    saved = sorted(p.name.split("-")[0] + p.suffix for p in (tmp_path / "tiny").iterdir())
    assert saved == ["packed_mixed.json", "packed_mixed.pt2", "packed_row.json",
                     "packed_row.pt2", "passes_0_2_head_row.json", "passes_0_2_head_row.pt2",
                     "passes_0_2_head_rows.json", "passes_0_2_head_rows.pt2",
                     "passes_0_2_row.json", "passes_0_2_row.pt2",
                     "passes_0_2_rows.json", "passes_0_2_rows.pt2",
                     "prefill.json", "prefill.pt2"]
    want = passes(model)  # the saved graphs, run in this process
    eager = passes(tiny_model(dtype=torch.float32, config=SMALL))
    done = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # loaded, run (none refused by its guards: it would have run eager) and nothing traced
    assert got["loaded"] == got["running"] == got["ran"] == 7 and got["frames"] == 0
    assert got["refused"]
    torch.testing.assert_close(torch.tensor(got["out"]), torch.tensor(want), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["out"]), torch.tensor(eager), rtol=1e-4,
                               atol=1e-4)


def test_a_load_trusts_the_builds_vector_unit_only_where_inductor_picks_it():
    """A warm start skips inductor's probe of the vector unit (a compile and a process)
    when told the ISA the build used and inductor, trusting it, picks the same one."""
    from torch._inductor import config, cpu_vec_isa

    before = config.cpp.vec_isa_ok  # (pytest's monkeypatch deletes it from inductor's config)
    config.cpp.vec_isa_ok = None
    try:
        built = artifacts._vec_isa()  # probed, as the build does
        artifacts.trust_the_build({"vec_isa": built})
        assert config.cpp.vec_isa_ok is (built != str(cpu_vec_isa.invalid_vec_isa))
        assert str(cpu_vec_isa.pick_vec_isa()) == built
        config.cpp.vec_isa_ok = None
        artifacts.trust_the_build({"vec_isa": "an ISA this machine lacks"})
        assert config.cpp.vec_isa_ok is None  # probed as before
        artifacts.trust_the_build({})  # a store without the record
        assert config.cpp.vec_isa_ok is None
    finally:
        config.cpp.vec_isa_ok = before
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_the_key_changes_with_what_invalidates_the_graphs(tmp_path):
    (tmp_path / "micro.safetensors").write_bytes(b"weights")
    config = EngineConfig(str(tmp_path), max_running=4, gemm="torch")
    a = artifacts.Store(config, tmp_path / "cache")
    assert artifacts.Store(config, tmp_path / "cache").key == a.key  # stable
    assert artifacts.Store(dataclasses.replace(config, max_running=8), tmp_path / "cache").key != a.key
    (tmp_path / "micro.safetensors").write_bytes(b"other weights")
    assert artifacts.Store(config, tmp_path / "cache").key != a.key
    assert a.path == tmp_path / "cache" / "compiled" / a.key
    assert set(a.parts) >= {"torch", "python", "cpu", "cpu_flags", "product", "max_running",
                            "checkpoints", "code"}


def test_reading_the_key_never_builds_the_product(tmp_path, monkeypatch):
    """A first start reads the key before it serves: it must not wait on a compiler (the
    kernel is built by the artifact build, in a process of its own)."""
    from nodraft.micro import gemm

    def no_build():
        raise AssertionError("the key built nodraft::mm")

    monkeypatch.setattr(gemm, "load", no_build)
    for asked in ("auto", "torch"):
        parts = artifacts.key_parts(EngineConfig(str(tmp_path), max_running=4, gemm=asked))
        unit = torch.backends.cpu.get_cpu_capability()
        assert parts["product"] == ("nodraft" if asked == "auto" and unit in gemm.BUILDS
                                    else "torch")


def test_a_stale_partial_build_is_removed_under_the_lock(tmp_path, caplog, monkeypatch):
    (tmp_path / "micro.safetensors").write_bytes(b"weights")
    store = artifacts.Store(EngineConfig(str(tmp_path), gemm="torch"), tmp_path / "cache")
    stale = store.root / f"{store.key}.building-12345"
    (stale / "micro").mkdir(parents=True)

    def fake_compile(folder: Path) -> int:  # what a build leaves: graphs in its folder
        (folder / "micro").mkdir(parents=True)
        (folder / "micro" / "g.pt2").write_bytes(b"")
        return 1
    monkeypatch.setattr(store, "_compile_into", fake_compile)
    with caplog.at_level("INFO"):
        assert store.build(workers=1) == store.path
    assert "stopped before it finished" in caplog.text and not stale.exists()
    assert store.complete() and json.loads((store.path / "manifest.json").read_text())["graphs"] == 1

    def failing(folder: Path) -> int:
        raise RuntimeError("no C++ compiler")
    other = artifacts.Store(EngineConfig(str(tmp_path), max_running=2, gemm="torch"),
                            tmp_path / "cache")
    monkeypatch.setattr(other, "_compile_into", failing)
    with pytest.raises(RuntimeError):
        other.build(workers=1)
    assert other.failure() == "RuntimeError: no C++ compiler" and not other.complete()
    assert not list(other.root.glob(f"{other.key}.building-*"))


def test_workers_share_the_families_by_claims(tmp_path):
    """Each family is claimed by one worker of a build (the first to ask), which keeps it."""
    one, two = artifacts.claimer(tmp_path), artifacts.claimer(tmp_path)
    assert one("passes_0_4_head_row-1") and not two("passes_0_4_head_row-1")
    assert two("draft_6_1_6_row-2") and not one("draft_6_1_6_row-2")
    assert one("passes_0_4_head_row-1") and two("draft_6_1_6_row-2")  # their own, again
    assert sorted(p.name for p in (tmp_path / "claims").iterdir()) == [
        "draft_6_1_6_row-2", "passes_0_4_head_row-1"]


def test_a_failed_worker_fails_the_build(tmp_path, monkeypatch):
    (tmp_path / "micro.safetensors").write_bytes(b"not a checkpoint")
    store = artifacts.Store(EngineConfig(str(tmp_path), gemm="torch"), tmp_path / "cache")
    with pytest.raises(RuntimeError, match="a compiling process failed"):
        store.build(workers=2)
    assert "compiling process failed" in store.failure() and not store.complete()
    assert not list(store.root.glob(f"{store.key}.building-*"))


def test_a_failed_build_leaves_the_engine_serving_eager():
    from nodraft.drafters.registry import Registry
    from nodraft.engine.core import Engine, GenerationRequest
    from tests.engine.helpers import run_all

    model = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)

    def build():
        raise RuntimeError("building the compiled passes failed (no C++ compiler)")
    engine.warm_up(load=build).join(timeout=60)
    assert not engine.compiled_ready and "no C++ compiler" in engine.compiled_error
    assert model.compiled is None  # eager from now on
    engine.start()
    try:
        (events,) = run_all(engine, [GenerationRequest("tiny", [1, 2, 3], 5)])
        assert events[-1].kind == "finish" and sum(len(e.step.tokens) for e in events
                                                   if e.kind == "step") == 5
    finally:
        engine.stop()


def test_a_load_that_breaks_after_the_build_leaves_the_engine_serving_eager(monkeypatch):
    """Whatever fails while the loaded graphs are run once (here: the warm-up itself), the
    engine says so and serves eager -- never "warming" for ever."""
    from nodraft.drafters.registry import Registry
    from nodraft.engine.core import Engine

    model = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)

    def broken(*args, **kwargs):
        raise ValueError("a graph that would not run")
    monkeypatch.setattr(model.compiled, "warm_up", broken)
    engine.warm_up(load=lambda: None).join(timeout=60)
    assert not engine.compiled_ready and "would not run" in engine.compiled_error
    assert model.compiled is None and not engine._warming


def test_build_niceness_is_the_settings_and_clamped(monkeypatch):
    monkeypatch.delenv("NODRAFT_BUILD_NICE", raising=False)
    assert artifacts.build_niceness() == artifacts.BUILD_NICE
    for value, expected in (("5", 5), ("0", 0), ("40", 19), ("-3", 0),
                            ("low", artifacts.BUILD_NICE), (" ", artifacts.BUILD_NICE)):
        monkeypatch.setenv("NODRAFT_BUILD_NICE", value)
        assert artifacts.build_niceness() == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_servers_build_runs_on_every_core_below_the_requests(monkeypatch):
    """The engine's loop keeps its own core; the build its warm-up thread starts -- the
    kernels' compilers, the build process -- gets every core at the build's niceness
    (pinned beside the loop, it waited on the requests while the other core idled), and
    the pass-cost table is still timed on the engine's core."""
    import threading

    from nodraft.drafters import costs
    from nodraft.drafters.registry import Registry
    from nodraft.engine.core import Engine

    monkeypatch.setenv("NODRAFT_BUILD_NICE", "7")
    model = tiny_model(dtype=torch.float32, config=SMALL).compile(lazy=False, gemm="torch")
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)
    seen = {}

    def build():  # in the warm-up thread, as the server's load is
        me = threading.get_native_id()
        seen["thread"] = (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, me))
        child = subprocess.run([sys.executable, "-c", "import os; print(len("
                                "os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))"],
                               capture_output=True, text=True, check=True)
        seen["child"] = [int(x) for x in child.stdout.split()]

    def measure(*args, **kwargs):
        seen["measured on"] = os.sched_getaffinity(0)
    monkeypatch.setattr(costs, "measure", measure)
    loop_core = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {loop_core})  # this thread as the engine's loop: one core
    try:
        engine.warm_up(load=build).join(timeout=120)
    finally:
        os.sched_setaffinity(0, mine)
    assert engine.compiled_ready, engine.compiled_error
    cores, nice = seen["thread"]
    assert cores >= mine and nice == 7  # every core, not the loop's alone
    assert seen["child"] == [len(cores), 7]  # and so what it starts
    assert seen["measured on"] == {loop_core}
