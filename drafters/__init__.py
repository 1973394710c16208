"""Drafters: one module each, behind the protocol in ``drafters.base``, found by name
through ``drafters.registry`` (built-ins and the ``nodraft.drafters`` entry points)."""

from drafters.base import Draft, DraftContext, Drafter
from drafters.registry import DrafterEnv, Registry, SpeculationError

__all__ = ["Draft", "DraftContext", "Drafter", "DrafterEnv", "Registry", "SpeculationError"]
