"""Drafters: one module each, behind the protocol in ``drafters.base``, found by name
through ``drafters.registry`` (built-ins and the ``nodraft.drafters`` entry points)."""

from nodraft.drafters.base import (AuxRows, Draft, DraftContext, Drafter, DrafterBase, DrafterEnv,
                                  Reuse, SpeculationError)
from nodraft.drafters.registry import Registry

__all__ = ["AuxRows", "Draft", "DraftContext", "Drafter", "DrafterBase", "DrafterEnv", "Registry", "Reuse",
           "SpeculationError"]
