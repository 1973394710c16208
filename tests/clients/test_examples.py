"""Each example script runs against the live server and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "clients" / "examples"


@pytest.mark.parametrize("script, expect", [
    ("openai_completions.py", "tokens per target pass"),
    ("openai_chat.py", "tokens per target pass"),
    ("httpx_sse.py", '"tokens_per_pass"'),
])
def test_example_runs(live, script, expect):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--base-url",
                           live.url + "/v1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout
