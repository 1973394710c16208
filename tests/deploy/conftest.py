"""Fixtures for the deploy tests (helpers in ``stack.py``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.stack import ROOT, Processes, find_tool


@pytest.fixture(scope="session")
def tool():
    """``tool(name, source)``: the binary's path, or a skip that says where it comes from."""

    def need(name: str, source: str) -> str:
        path = find_tool(name)
        if path is None:
            pytest.skip(f"{name} is not installed (it comes from {source}; .ci/run installs it)")
        return path

    return need


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("logs"))
    yield procs
    procs.stop_all()


@pytest.fixture(scope="session")
def serving_checkpoints(tmp_path_factory) -> Path:
    """micro/checkpoints when both trained models are there; otherwise a throwaway pair
    trained for 3 steps (the server and the dashboard need checkpoints, not good ones)."""
    from nodraft.micro.checkpoint import CHECKPOINT_DIR, MODEL_NAMES

    if all((CHECKPOINT_DIR / f"{m}.safetensors").exists() for m in MODEL_NAMES):
        return CHECKPOINT_DIR
    out, runs = tmp_path_factory.mktemp("checkpoints"), tmp_path_factory.mktemp("runs")
    trainings = []  # both at once, one thread each: loading the corpus is most of the time
    for extra in ([], ["--layerskip"]):
        argv = [sys.executable, "-m", "nodraft.micro.train", "--steps", "3", "--no-compile",
                "--batch-size", "2", "--seq-len", "64", "--threads", "1",
                "--checkpoints", str(out), "--out", str(runs), *extra]
        trainings.append((argv, subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.PIPE, text=True)))
    for argv, proc in trainings:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{err[-3000:]}"
    shutil.copy(CHECKPOINT_DIR / "tokenizer.json", out / "tokenizer.json")
    return out
