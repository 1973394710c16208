"""Shared fixtures: tiny random models for speed, and the committed checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nodraft.micro.checkpoint import CHECKPOINT_DIR, MODEL_NAMES, available_models
from nodraft.micro.model import Micro, MicroConfig

# Servers started by the tests run eager unless a test asks for compiled passes: their
# background compile would cost every test server ~20-40 s of CPU on this 2-core machine.
# tests/server/test_server_compiled.py and tests/engine/test_compiled.py cover them.
os.environ.setdefault("NODRAFT_COMPILE", "false")

# One torch thread in the test process: the tests decode tiny models one sequence at a time,
# where every op is microseconds and a second OpenMP thread only adds its fork and join
# (3x slower on 2 cores). Tests about threads set their own; servers they start are
# processes of their own, with their own settings.
torch.set_num_threads(1)

# With pytest-xdist (the README's test command runs one worker per core, ``--dist
# loadgroup``), the tests that start servers, browsers and Prometheus -- and time what they
# answer -- run in one worker, one after another, as they would alone; the in-process tests
# (the invariants over tiny models, the compiled passes, training) share out over the others.
PROCESS_DIRS = ("server", "deploy", "playground", "clients")


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:  # the session's items: a path named beside tests/ is left alone
        if item.path.is_relative_to(root) and item.path.relative_to(root).parts[0] in PROCESS_DIRS:
            item.add_marker(pytest.mark.xdist_group("processes"))


TINY = MicroConfig(vocab_size=64, dim=32, n_layers=4, n_heads=2, ffn_dim=64, max_positions=128)


def tiny_model(seed: int = 0, dtype=torch.float64, config: MicroConfig = TINY) -> Micro:
    """A random micro-shaped model; norms perturbed so every weight matters."""
    torch.manual_seed(seed)
    m = Micro(config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            else:
                p.mul_(8.0)  # sharper distributions: drafts get accepted and rejected
    return m.to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny() -> Micro:
    return tiny_model()


def have_checkpoints() -> bool:
    return set(available_models(CHECKPOINT_DIR)) == set(MODEL_NAMES)


@pytest.fixture(scope="session")
def checkpoint_dir() -> Path:
    if not have_checkpoints():
        pytest.fail("the trained checkpoints are missing from micro/checkpoints")
    return CHECKPOINT_DIR
