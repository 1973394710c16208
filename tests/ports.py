"""Loopback ports for the processes the tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where it can't be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range, never handed out before
    in this process.

    A port from ``bind(("127.0.0.1", 0))`` is free only until the kernel picks it again --
    for an outgoing connection's local end, or another ``bind(0)`` -- and a listener started
    on it a moment later then fails with "address already in use" (seen in CI: Prometheus,
    while the test polled the servers it had just started). The kernel never picks a port
    below its ephemeral range by itself.
    """
    low = ephemeral_range()[0]
    candidates = range(max(1024, low - 12000), low)
    for _ in range(200):
        port = random.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {candidates.start}-{candidates.stop - 1}")
