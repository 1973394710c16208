"""The drafter protocol, the draft it returns, and the read-only context it sees.

Glossary (the words used everywhere in nodraft):

- **draft token**: a token a drafter proposes.
- **accepted token**: a draft token that verification kept.
- **bonus token**: the token the target itself emits at the end of each verification pass
  (the correction at the first rejection, or the next token after a fully accepted draft).
- **target pass**: one forward of the full target over the current token plus the step's
  draft tokens. The prompt's prefill is not a target pass.
- **draft cost**: the drafter's own compute for one step, in target-pass units (modelled
  from FLOPs; each drafter states its model in its docstring).

A draft is a *chain* (``parents is None``: token i follows token i-1, token 0 follows the
current token) or a *tree* (``parents[i]`` is the index of node i's parent, -1 for the
current token; parents come before children). Worked example, a tree of 4 nodes::

    current token c
    ├── node 0 "def"   parents[0] = -1
    │   └── node 2 "f" parents[2] = 0
    └── node 1 "class" parents[1] = -1
        └── node 3 "A" parents[3] = 1

is verified in one pass over [c, def, class, f, A] at positions n, n+1, n+1, n+2, n+2.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from nodraft.micro.checkpoint import CHECKPOINT_DIR
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.ops import longs


class SpeculationError(ValueError):
    """A speculation request that names an unknown method or parameter, or a bad value."""

    def __init__(self, message: str, param: str = "speculation"):
        super().__init__(message)
        self.param = param


@dataclass
class DrafterEnv:
    model_name: str
    model: Micro | None  # None only for ``Registry.check``, which the API runs without weights
    shared: dict = field(default_factory=dict)
    # where the target's checkpoint lives; trained drafters (Medusa, EAGLE) find their
    # weights beside it as ``<model_name>-<drafter>.safetensors``
    checkpoint_dir: Path = CHECKPOINT_DIR


T = TypeVar("T")


def loaded_weights(model: Micro, path: Path, tag: str, load: Callable[[], T]) -> T:
    """A trained drafter's weights for ``model``, loaded by ``load()`` once per model object
    and weights file, then shared by every request and every server state. Weights are not
    what a server learns (``DrafterEnv.shared``: ``auto``'s estimates, suffix decoding's
    store), so a fresh state does not reload them, and ``auto``'s candidates use the very
    tensors the server's own drafters loaded. ``tag`` names the kind (with anything else the
    loaded form depends on, such as the dtype); the file's size and modification time are part
    of the key, so a retrained file is loaded afresh. ``load`` may raise (a missing file is
    ``load``'s to report); nothing is kept then."""
    try:
        st = path.stat()
    except OSError:
        return load()
    key = (tag, str(path), st.st_size, st.st_mtime_ns)
    per_model = _WEIGHTS.setdefault(model, {})
    got = per_model.get(key)
    if got is None:
        for old in [k for k in per_model if k[:2] == key[:2]]:  # a replaced file's copy
            del per_model[old]
        got = per_model[key] = load()
    return got


_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Reuse:
    """Work of the drafter's that verification takes over (early exit's KV reuse): the
    first n rows of the verification block ([current, draft[:-1]]) already have their
    layers < ``layer`` in the cache, and ``hidden`` is their residual stream after layer
    ``layer``; verification runs those layers only for the last draft token."""

    layer: int
    hidden: Tensor  # (n, dim)


@dataclass(frozen=True)
class AuxRows:
    """Rows run in the same target pass but verified by no one (lookahead decoding's Jacobi
    window). They follow the draft nodes in the block, at positions n + ``pos`` (n = the
    current token's position, so offsets start at 1); ``mask`` (m, 1+m) says which of
    [current, *aux] each row attends to, besides the committed context. Aux rows never see
    draft nodes and draft nodes never see them. Their logits reach the drafter as
    ``ctx.aux_logits`` before ``observe``."""

    tokens: Tensor  # (m,)
    pos: Tensor  # (m,) int64 offsets >= 1
    mask: Tensor  # (m, 1+m) bool


@dataclass(frozen=True)
class Draft:
    tokens: Tensor  # (n,) int64 proposed ids: a chain, or the nodes of a tree
    parents: Tensor | None = None  # (n,) parent index per node, -1 = the current token
    probs: Tensor | None = None  # (n, V) draft distribution q per node; None = deterministic
    cost: float = 0.0  # the drafter's compute for this step, in target-pass units
    method: str | None = None  # set by ``auto``: the drafter that actually proposed
    # The evidence behind a match-based draft: prompt lookup's n-gram length, suffix
    # decoding's matched suffix length (0: not a match). ``auto`` keys its acceptance
    # estimates on it: a 3-gram match is accepted far more often than a 1-gram one.
    match_len: int = 0
    reuse: Reuse | None = None  # lower layers the drafter already ran for these rows
    aux: AuxRows | None = None  # rows the pass runs for the drafter, verified by no one

    def __len__(self) -> int:
        return self._size

    @functools.cached_property
    def _size(self) -> int:  # asked many times a step: the tensor's count, once
        return int(self.tokens.numel())

    @functools.cached_property
    def token_list(self) -> list[int]:
        """``tokens`` as a list, made once (a step reads it several times); not to be
        changed in place."""
        return self.tokens.tolist()

    @property
    def n_aux(self) -> int:
        return 0 if self.aux is None else int(self.aux.tokens.numel())

    def prefix(self, keep: int, **changes) -> "Draft":
        """The first ``keep`` nodes (parents precede children: any prefix is a valid tree),
        with any other fields ``changes`` names."""
        if keep >= len(self):
            return dataclasses.replace(self, **changes) if changes else self
        return dataclasses.replace(
            self, tokens=self.tokens[:keep],
            parents=None if self.parents is None else self.parents[:keep],
            probs=None if self.probs is None else self.probs[:keep],
            reuse=None if self.reuse is None else Reuse(self.reuse.layer, self.reuse.hidden[:keep]),
            **changes)

    @staticmethod
    def empty() -> "Draft":
        return Draft(torch.empty(0, dtype=torch.long))

    @staticmethod
    def not_looked() -> "Draft":
        """An empty draft from a drafter that chose not to look this step (``auto``
        resting): to the engine the drafter was not asked -- the step neither counts as a
        draft refused nor times the drafter."""
        return NOT_LOOKED

    @staticmethod
    def of(tokens: list[int], parents: list[int] | None = None, match_len: int = 0,
           **fields) -> "Draft":
        """A deterministic draft from lists: a chain when ``parents`` is None. Its
        ``tokens`` tensor is made when first read (``_Listed``)."""
        draft = _Listed(None, None if parents is None else longs(parents),
                        match_len=match_len, **fields)
        # what a step reads of it, from the lists at hand (the cached properties' slots)
        draft.__dict__["token_list"], draft.__dict__["_size"] = list(tokens), len(tokens)
        return draft

    def depths(self) -> list[int]:
        """Depth of each node (1 = child of the current token)."""
        if self.parents is None:
            return list(range(1, len(self) + 1))
        return tree_depths(self.parents.tolist())


class _Listed(Draft):
    """A draft made from lists (``Draft.of``) whose ``tokens`` tensor is made from its list
    when first read: a step reads the list -- a chain's pass takes its ids, acceptance and
    the commit read ``token_list`` -- so a copying drafter's step need not make it."""

    @property
    def tokens(self) -> Tensor:
        got = self.__dict__.get("_tokens")
        if got is None:
            got = self.__dict__["_tokens"] = longs(self.token_list)
        return got

    @tokens.setter
    def tokens(self, value: Tensor | None) -> None:  # the dataclass's __init__, replace
        self.__dict__["_tokens"] = value


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree given by its parents (-1: the current token; parents
    precede children), 1 for a child of the current token."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@dataclass
class DraftContext:
    """What a drafter may read. Drafters never write the target's KV cache, except early
    exit, which writes layers < E of rows past the committed length (scratch rows)."""

    tokens: list[int]  # prompt + output so far; tokens[-1] is the current token (not cached)
    prompt_len: int
    model: Micro  # the target: early exit runs its first layers, heads share its LM head
    cache: KVCache
    slot: int
    last_hidden: Tensor | None = None  # (m, dim) final-layer residual stream of the tokens
    # committed by the last step ([previous current token, *accepted]); row -1 predicted
    # the current token. None before the first target pass.
    state: dict = field(default_factory=dict)  # per-sequence scratch for the drafter
    temperature: float = 0.0  # the request's sampling temperature (0 = greedy)
    generator: torch.Generator | None = None  # the request's random stream (sampled drafts)
    # Seeded sampling: ``draw(logits, t)`` is the token the request's noise picks at sequence
    # position t from these logits (its temperature, top-k, top-p applied). A drafter that
    # samples its own proposal draws it this way, so it agrees with the target as often as
    # possible. None: unseeded, or greedy.
    draw: Callable[[Tensor, int], int] | None = None
    aux_logits: Tensor | None = None  # (m, V) the last pass's logits of Draft.aux.tokens
    # the request's n-gram index over ``tokens`` (drafters.ngrams.request_index), shared
    # by the match-based drafters
    ngrams: object | None = None
    # the wall time of the sequence's previous step, from its draft's proposal to its
    # commit, when the sequence stepped alone; None after a step in a packed pass (shared
    # with other sequences: no one sequence's time) and before the first
    step_seconds: float | None = None
    # ... and of that step's target pass alone (None as ``step_seconds`` is)
    pass_seconds: float | None = None

    @property
    def n_cached(self) -> int:
        return self.cache.lengths[self.slot]


@runtime_checkable
class Drafter(Protocol):
    """What the engine calls. ``propose`` and ``observe`` are required; the rest are
    optional hooks, declared here and given no-op defaults by ``DrafterBase`` (which every
    built-in drafter subclasses; a plugin may, or may define only what it uses):

    - ``Params``: a frozen dataclass of the request parameters, defaults and checks in
      ``__post_init__`` (the registry parses a request's ``speculation`` into it);
    - ``check(params, env)`` (static): cheap checks before the request is queued, in the API
      process, without weights (``env.model`` is None); raises ``SpeculationError``;
    - ``warm_up(cache, compile=True) -> seconds``: build the drafter's own compiled graphs,
      after the target's (EAGLE's draft step); ``compile=False`` only loads saved ones;
    - ``close(ctx)``: the sequence ended (suffix decoding adds the response to its tree);
      the engine calls it after the request's end was sent, at its next iteration's
      start, before it admits anything waiting; the KV slot is not yet reused then;
    - ``idle_method``: the method a pass the engine runs without consulting the drafter
      belongs to (``auto``'s undrafted passes are ``none``'s); None: the drafter's own.
    - ``resting``: read right after ``propose`` returned ``Draft.not_looked()``: how many
      of the sequence's next steps the drafter declines as well, needing neither
      ``propose`` nor ``observe`` for them nor for that step. The sequence runs them as
      plain decoding's (a budget of 0: a batch's plan leaves them out) without calling it
      (``auto`` resting: steps nothing can change, at ``none``'s cost); each emits exactly
      one token. 0 (the default): asked, and told of every step, as usual.
    """

    name: str

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        """At most ``budget`` draft tokens (tree nodes) following ``ctx.tokens``."""
        ...

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        """After verification: ``accepted`` draft tokens, then the bonus token, were
        appended to ``ctx.tokens``. Update pools and per-sequence state."""
        ...


class DrafterBase:
    """No-op defaults for the ``Drafter`` protocol's optional hooks."""

    name: str = ""
    idle_method: str | None = None
    resting: int = 0

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params, env: DrafterEnv):
        self.params = params

    @staticmethod
    def check(params, env: DrafterEnv) -> None:
        pass

    def warm_up(self, cache: KVCache, compile: bool = True) -> float:
        return 0.0

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass

    def close(self, ctx: DraftContext) -> None:
        pass


def has_hook(drafter_or_class, hook: str) -> bool:
    """Whether a drafter (or its class) implements ``hook`` itself, not as
    ``DrafterBase``'s no-op (the engine builds a drafter to warm it up only if it does)."""
    cls = drafter_or_class if isinstance(drafter_or_class, type) else type(drafter_or_class)
    own = getattr(cls, hook, None)
    return own is not None and own is not getattr(DrafterBase, hook, None)


def hook(drafter, name: str, default=None):
    """An optional hook of a drafter that may not subclass ``DrafterBase`` (a plugin)."""
    return getattr(drafter, name, default)


def close_drafter(drafter: Drafter, ctx: DraftContext) -> None:
    """Tell a drafter its sequence ended (its optional ``close``)."""
    close = hook(drafter, "close")
    if close is not None:
        close(ctx)


NOT_LOOKED = Draft(torch.empty(0, dtype=torch.long))  # ``Draft.not_looked``
