"""Fixtures for the client tests: the checkpoints and one live server for the session,
built with the server tests' helpers (``tests/server/server_testing.py``) rather than a
second copy of them.

The trained checkpoints are used when micro/checkpoints has both; otherwise a random-weight
pair of the same shape. The server runs the engine on one torch thread: micro is small,
and more threads only contend on a busy machine.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_testing import live, serve_checkpoints  # noqa: E402,F401 - fixtures


