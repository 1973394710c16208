"""Drafters: one module each, behind the protocol in ``drafters.base``, found by name
through ``drafters.registry`` (built-ins and the ``nodraft.drafters`` entry points)."""

from nodraft.drafters.base import Draft, DraftContext, Drafter
from nodraft.drafters.registry import DrafterEnv, Registry, SpeculationError

__all__ = ["Draft", "DraftContext", "Drafter", "DrafterEnv", "Registry", "SpeculationError"]
