"""Fixtures for the server tests: checkpoints to serve, and one live server for the session.

The trained checkpoints are used when micro/checkpoints has both; otherwise a random-weight
pair of the same shape is written to a temporary folder.
"""

from __future__ import annotations

import httpx
import pytest
from server_testing import (MAX_RUNNING, MAX_WAITING, LiveServer, registry_with_slow,
                            serve_checkpoints)  # noqa: F401 - a fixture

from nodraft.server.settings import Settings


@pytest.fixture(scope="session")
def live(serve_checkpoints) -> LiveServer:
    """The session's server: small admission limits, the ``slow`` test drafter added."""
    settings = Settings(checkpoints=serve_checkpoints, max_running=MAX_RUNNING,
                        max_waiting=MAX_WAITING)
    with LiveServer(settings, registry_with_slow()) as server:
        yield server


@pytest.fixture()
def http(live) -> httpx.Client:
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client
