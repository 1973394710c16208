"""EAGLE (Li et al., 2024): a trained one-layer head on micro's features, drafting EAGLE-2's
dynamic tree over a reduced draft vocabulary.

- ``head``: the head module, its features, its cost model and its weights file;
- ``drafter``: the ``eagle`` drafter (``Eagle``): the head's own KV cache and the tree;
- ``compiled``: the draft step as one compiled graph, for targets with compiled passes;
- ``evaluation``, ``train``: held-out accuracy, draft-step timing and ``nodraft train
  eagle``; serving never imports them.
"""

from nodraft.drafters.eagle.compiled import CompiledDraft
from nodraft.drafters.eagle.drafter import Eagle, EagleState, LoadedHead, load_for
from nodraft.drafters.eagle.head import (EagleHead, features, forward_cost, load_head_state,
                                         save_head, weights_path, write_untrained)

__all__ = ["CompiledDraft", "Eagle", "EagleHead", "EagleState", "LoadedHead", "features",
           "forward_cost", "load_for", "load_head_state", "save_head", "weights_path",
           "write_untrained"]
