"""``medusa``: extra decoding heads on the target's last hidden state (Cai et al., 2024).

Heads. K small heads read the target's final-layer residual stream h_j (before the final
norm) at position j. Head i (0-based) is one residual block and the target's own output::

    logits_i(h_j) = target.head(h_j + SiLU(W_i h_j + b_i))      # predicts token j + 2 + i

``target.head`` is micro's final RMSNorm and tied embedding LM head, frozen and shared, so
a head is only its (dim x dim) block: 25.8k parameters for micro. W_i and b_i start at
zero, so every head starts as the target's next-token prediction, which training shifts
to 2 + i tokens ahead (Medusa-1: frozen target, an unweighted sum of the heads' cross-
entropies, a cosine schedule; see ``drafters.medusa_train``).

Drafting. ``ctx.last_hidden[-1]`` is the hidden state that predicted the current token c
(at position t), so from it head 0 predicts the token after c (draft depth 1), head 1 the
one after that (depth 2), and so on. In the Medusa paper the root is the target's own
next token, read from the same pass that produced h; here the verifier has already turned
that prediction into the current token c, so the root is c and the first level is head
0's. Worked example, K = 2, tokens ``... x y c`` (c current)::

    last_hidden[-1] = h(y)       target.head(h(y)) predicted c
    head 0 top-k of h(y)   ->    candidates for the token after c   (depth 1)
    head 1 top-k of h(y)   ->    candidates for the token after that (depth 2)

The tree. A node is a path of ranks (r_1, ..., r_d): its token is the r_d-th most likely
token of head d - 1, its parent the path (r_1, ..., r_{d-1}). Siblings are distinct ranks
of one head, hence distinct tokens. Which paths to verify comes from the heads' measured
held-out top-k accuracies, stored in the weights' record: with a_i(r) = top-(r+1) minus
top-r accuracy of head i (the chance that its rank-r token is the right one), a path is
accepted whole with probability about prod_d a_{d-1}(r_d) (heads taken as independent), and
the tree's expected accepted length is the sum of that over its nodes. Medusa's greedy
construction maximises it for a node budget: start from the root, repeatedly add the
frontier node (a child of a node already in) with the largest path probability, until
``total_tokens`` nodes (a path of probability 0 is never drafted). Path probabilities
shrink along a path, so parents always come before children, and the first n nodes are
the greedy tree for budget n: a smaller step budget simply takes a prefix. The tree
depends only on the record, ``num_heads``, ``top_k`` (ranks per head, at most the
measured k and the vocabulary) and ``total_tokens``; it is built once per such key and
cached (``build_tree``).

Each step runs only the heads the (possibly truncated) tree reaches, takes their top-k
tokens and reads each node's token off them. It ranks a head's output y by ``y @ rows.T``
with rows the tied LM head's rows times the final norm's weight (``ranking_rows``): the
target's logits over those rows divided by RMS(y), so the same ranks without the norm.
With ``draft_vocab`` N the rows are the N most frequent ids' only (FR-Spec's draft
vocabulary, ``drafters.draft_vocab``, as early exit reads it): a head then reads N rows
of the head instead of 4096 -- at one row a step the head's weights, not its arithmetic,
bound it -- and a token outside them is never drafted (the tree's shape still comes from
the full head's held-out rank accuracies: over a subset a token outside it is never right,
and one inside ranks no lower). The proposal is deterministic (q = None):
greedy verification keeps exactly plain greedy's output, and sampling verifies the tree
with the sibling rule (``engine.verify``), which keeps the target's distribution exactly.

Draft cost model (FLOPs, in target-pass units, per verification pass): each head run
costs its block and one application of the 4096-way LM head, against one token through
the whole target (``early_exit``'s unit)::

    cost = d * (dim^2 + N * dim) / (L * layer_macs + V * dim)

with d the tree's depth this step and N the rows read (``draft_vocab``, or V). For micro
(dim 160, V 4096, L 4, layer_macs 286,720) a head over the full vocabulary is 680,960 of
1,802,240 multiply-adds, 0.378 of a pass: the 4096-way head dominates, so four heads cost
1.51 passes and the tree must earn it back in accepted tokens; over 512 ids a head is
0.06. Medusa heads are cheap on large models, where the head is a sliver of a pass; on
micro only a draft vocabulary makes them so.

Files. ``<checkpoint_dir>/<model>-medusa.safetensors`` holds ``weight`` (K, dim, dim) and
``bias`` (K, dim) in float32 (the shared LM head is not stored; metadata: num_heads, dim,
target); ``<model>-medusa.json`` is the record: command, minutes, steps, tokens, the
training settings, and ``heldout`` = {tokens, top_k, accuracy: per head the cumulative
top-1..top-k accuracy on the held-out split, target_top1}. Weights load once per model and
weights file (``drafters.base.loaded_weights``) and are cast to the target's dtype.

Training: ``nodraft train medusa --model micro [--minutes 10] [--threads 1]``
(``drafters.medusa_train``; held-out accuracies of any weights: its ``evaluate_heads``).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from nodraft.drafters.base import (Draft, DraftContext, DrafterBase, DrafterEnv, SpeculationError,
                                  loaded_weights)
from nodraft.drafters.draft_vocab import check as check_vocab, head_rows as vocab_rows
from nodraft.drafters.draft_vocab import weights_path as vocab_path
from nodraft.micro.model import Micro, MicroConfig, layer_macs

SUFFIX = "medusa"


# -- the heads --------------------------------------------------------------------------------
class MedusaHeads(nn.Module):
    """K residual SiLU blocks; the target's ``head`` turns their outputs into logits."""

    def __init__(self, num_heads: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, dim, dim))  # (K, out, in), zero init
        self.bias = nn.Parameter(torch.zeros(num_heads, dim))  # (K, dim)

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def block(self, h: Tensor, i: int) -> Tensor:
        """Head i's residual block on h (..., dim) -> (..., dim)."""
        return h + F.silu(F.linear(h, self.weight[i], self.bias[i]))

    def forward(self, h: Tensor, heads: int | None = None) -> Tensor:
        """The first ``heads`` blocks on h (..., dim) -> (..., heads, dim)."""
        k = self.num_heads if heads is None else heads
        y = torch.einsum("...d,ked->...ke", h, self.weight[:k]) + self.bias[:k]
        return h.unsqueeze(-2) + F.silu(y)

    def draft(self, h: Tensor, heads: int) -> Tensor:
        """``forward`` on one hidden state h (dim,) -> (heads, dim), as a drafting step runs
        it: a matrix-vector product per head, without einsum's planning."""
        if heads == 1:
            return (h + F.silu(F.linear(h, self.weight[0], self.bias[0])))[None]
        return h + F.silu(torch.matmul(self.weight[:heads], h) + self.bias[:heads])



def head_cost(c: MicroConfig, draft_vocab: int = 0) -> float:
    """One head's FLOPs (block + LM head over ``draft_vocab`` rows; 0: all of them) over one
    token through the target."""
    head = c.vocab_size * c.dim
    return (c.dim * c.dim + (draft_vocab or c.vocab_size) * c.dim) / (
        c.n_layers * layer_macs(c) + head)


# -- files ------------------------------------------------------------------------------------
def weights_path(directory: Path, model_name: str) -> Path:
    return Path(directory) / f"{model_name}-{SUFFIX}.safetensors"


def save_heads(heads: MedusaHeads, model_name: str, record: dict, directory: Path) -> Path:
    """``<model>-medusa.safetensors`` (float32) and ``<model>-medusa.json`` (the record)."""
    path = weights_path(directory, model_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"weight": heads.weight.detach().float().contiguous(),
             "bias": heads.bias.detach().float().contiguous()}
    save_file(state, path, metadata={"num_heads": str(heads.num_heads),
                                     "dim": str(heads.weight.shape[-1]), "target": model_name})
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return path


def heads_from_state(state: dict[str, Tensor]) -> MedusaHeads:
    K, dim, _ = state["weight"].shape
    heads = MedusaHeads(K, dim)
    heads.load_state_dict(state)
    return heads.eval().requires_grad_(False)


def load_heads(env: DrafterEnv) -> tuple[MedusaHeads, dict]:
    """The model's heads (cast to the target's dtype) and record, loaded once per model and
    weights file and shared by every request and server state
    (``drafters.base.loaded_weights``). Missing weights are a SpeculationError that says how
    to train them."""
    path = weights_path(env.checkpoint_dir, env.model_name)
    dtype = env.model.tok_embeddings.weight.dtype
    return loaded_weights(env.model, path, f"medusa {dtype}", lambda: _load(env, path, dtype))


def _load(env: DrafterEnv, path: Path, dtype: torch.dtype) -> tuple[MedusaHeads, dict]:
    record_path = path.with_suffix(".json")
    if not path.exists() or not record_path.exists():
        raise SpeculationError(
            f"no Medusa heads for {env.model_name!r} (looked for {path.name} and "
            f"{record_path.name} in {path.parent}); train them with "
            f"`nodraft train medusa --model {env.model_name}`", "speculation.method")
    heads = heads_from_state(load_file(str(path))).to(dtype)
    record = json.loads(record_path.read_text())
    accuracy = record.get("heldout", {}).get("accuracy")
    if not accuracy or len(accuracy) < heads.num_heads:
        raise SpeculationError(
            f"{record_path.name} lacks the heads' held-out accuracies (heldout.accuracy, one "
            f"row per head) the tree is built from; retrain them with "
            f"`nodraft train medusa --model {env.model_name}`", "speculation.method")
    if heads.weight.shape[-1] != env.model.config.dim:
        raise SpeculationError(
            f"the Medusa heads in {path.name} have width {heads.weight.shape[-1]}, but "
            f"{env.model_name!r} has width {env.model.config.dim}; retrain them with "
            f"`nodraft train medusa --model {env.model_name}`", "speculation.method")
    return heads, record


def _heldout_accuracy(record_path: Path) -> list[list[float]]:
    """The record's held-out accuracies, read once per version of the file (every request
    that names Medusa, or ``auto`` with it as a candidate, is checked against them)."""
    st = record_path.stat()
    return _read_accuracy(str(record_path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read_accuracy(path: str, size: int, mtime_ns: int) -> list[list[float]]:
    return json.loads(Path(path).read_text()).get("heldout", {}).get("accuracy", [])


# -- the tree ---------------------------------------------------------------------------------
def rank_accuracies(topk_accuracy: list[list[float]]) -> list[list[float]]:
    """Cumulative top-1..top-k accuracy per head -> P(the rank-r token is the right one)."""
    return [[max(0.0, c - (row[r - 1] if r else 0.0)) for r, c in enumerate(row)]
            for row in topk_accuracy]


@dataclass(frozen=True)
class MedusaTree:
    """Nodes in greedy order (parents first): the ranks' path, its parent node, and the
    path's acceptance probability."""

    paths: tuple[tuple[int, ...], ...]
    parents: Tensor  # (n,) parent node index, -1 = the current token
    depth: Tensor  # (n,) 1 = child of the current token; node's token comes from head depth-1
    rank: Tensor  # (n,) rank of the node's token in its head's top-k
    value: tuple[float, ...]  # (n,) prod of the rank accuracies along the path

    def __len__(self) -> int:
        return len(self.paths)

    def expected_accepted(self, n: int | None = None) -> float:
        """Expected accepted draft tokens per pass of the first n nodes (independent heads)."""
        return float(sum(self.value[:n]))


@lru_cache(maxsize=256)
def build_tree(rank_acc: tuple[tuple[float, ...], ...], total_tokens: int) -> MedusaTree:
    """Medusa's sparse tree: greedy expansion by expected accepted length.

    rank_acc[i][r] is the chance that head i's rank-r token is right. Repeatedly add the
    frontier node with the largest product of rank accuracies along its path (ties: the
    lexicographically smaller path), until ``total_tokens`` nodes or nothing left worth
    a draft token (a zero product)."""
    frontier = [(-a, (r,)) for r, a in enumerate(rank_acc[0])] if rank_acc else []
    heapq.heapify(frontier)
    paths: list[tuple[int, ...]] = []
    values: list[float] = []
    index: dict[tuple[int, ...], int] = {}
    while frontier and len(paths) < total_tokens:
        neg, path = heapq.heappop(frontier)
        if -neg <= 0.0:
            break
        index[path] = len(paths)
        paths.append(path)
        values.append(-neg)
        if len(path) < len(rank_acc):
            for r, a in enumerate(rank_acc[len(path)]):
                heapq.heappush(frontier, (neg * a, path + (r,)))
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    return MedusaTree(tuple(paths), torch.tensor(parents, dtype=torch.long),
                      torch.tensor([len(p) for p in paths], dtype=torch.long),
                      torch.tensor([p[-1] for p in paths], dtype=torch.long), tuple(values))


# -- the drafter ------------------------------------------------------------------------------
class Medusa(DrafterBase):
    name = "medusa"

    @dataclass(frozen=True)
    class Params:
        # chosen on the workload suite (docs/BENCHMARKS.md, "Medusa's, EAGLE's and early
        # exit's settings on the workload suite"): one head, one token, over the 256 most
        # frequent ids
        num_heads: int = 1  # heads used = the tree's depth limit; at most the trained K
        total_tokens: int = 1  # the tree's size: draft tokens per step
        top_k: int = 10  # ranks per head the tree may use (at most the ranks measured at
        # training, the record's heldout.top_k: a larger value is a 400)
        # the heads' LM head rows: the most frequent ids (the model's whole vocabulary at
        # or above its size); 0: all of them
        draft_vocab: int = 256

        def __post_init__(self):
            if not 1 <= self.num_heads <= 16:
                raise ValueError("num_heads must be in 1..16 (and at most the trained heads)")
            if not 1 <= self.total_tokens <= 64:
                raise ValueError("total_tokens must be in 1..64")
            if not 1 <= self.top_k <= 64:
                raise ValueError("top_k must be in 1..64")
            if self.draft_vocab < 0:
                raise ValueError("draft_vocab must be 0 (the full head) or a number of ids")

    @staticmethod
    def check(params: Params, env: DrafterEnv) -> None:
        """Before the request is queued: the heads exist and are enough for num_heads."""
        path = weights_path(env.checkpoint_dir, env.model_name)
        record_path = path.with_suffix(".json")
        if not path.exists() or not record_path.exists():
            raise SpeculationError(
                f"no Medusa heads for {env.model_name!r}; train them with "
                f"`nodraft train medusa --model {env.model_name}`", "speculation.method")
        accuracy = _heldout_accuracy(record_path)
        trained = len(accuracy)
        if params.num_heads > trained:
            raise SpeculationError(
                f"num_heads={params.num_heads}, but {env.model_name!r} has {trained} trained "
                "Medusa heads", "speculation.num_heads")
        measured = min((len(row) for row in accuracy), default=0)
        if params.top_k > measured:  # the tree is built from measured rank accuracies only
            raise SpeculationError(
                f"top_k={params.top_k}, but the Medusa heads of {env.model_name!r} were "
                f"measured for ranks up to {measured}; top_k may be at most {measured}",
                "speculation.top_k")
        if params.draft_vocab:  # a ranking exists (its size is the model's, known later)
            check_vocab(env, 1)

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        self.model = env.model
        self.heads, self.record = load_heads(env)
        if params.num_heads > self.heads.num_heads:
            raise SpeculationError(
                f"num_heads={params.num_heads}, but {env.model_name!r} has "
                f"{self.heads.num_heads} trained Medusa heads", "speculation.num_heads")
        accuracy = self.record["heldout"]["accuracy"]
        k = min(params.top_k, env.model.config.vocab_size)
        rank_acc = tuple(tuple(row[:k]) for row in rank_accuracies(accuracy)[:params.num_heads])
        self.tree = build_tree(rank_acc, params.total_tokens)
        self.top_k = int(self.tree.rank.max()) + 1 if len(self.tree) else 1  # ranks used
        c = env.model.config
        vocab = 0 if params.draft_vocab >= c.vocab_size else params.draft_vocab
        if vocab and self.top_k > vocab:
            raise ValueError(f"top_k={self.top_k} is more than draft_vocab={vocab} ids")
        # the ids the heads rank (None: all of them, in order) and their ranking rows
        self.ids, self.rows = ranking_rows(env, vocab)
        self.cost_per_head = head_cost(c, vocab)
        # each node's place in the heads' (depth, top_k) ranks, flattened, and whether the
        # first n nodes are a chain (verified with the plain causal mask)
        self.flat = (self.tree.depth - 1) * self.top_k + self.tree.rank
        parents = self.tree.parents.tolist()
        self.chain = [all(p == i - 1 for i, p in enumerate(parents[:n]))
                      for n in range(len(parents) + 1)]
        # the deepest node among the first n, for every n: the heads a truncated tree needs
        self.depth_of_prefix = [0, *np.maximum.accumulate(self.tree.depth.numpy()).tolist()]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        n = min(budget, len(self.tree))
        if n == 0 or ctx.last_hidden is None:
            return Draft.empty()
        depth = self.depth_of_prefix[n]
        y = self.heads.draft(ctx.last_hidden[-1], depth)  # (depth, dim)
        top = F.linear(y, self.rows).topk(self.top_k, dim=-1).indices  # (depth, top_k)
        if self.ids is not None:  # ranks among the draft vocabulary's ids, mapped back
            top = self.ids[top]
        tokens = top.view(-1)[self.flat[:n]]
        parents = None if self.chain[n] else self.tree.parents[:n]
        return Draft(tokens, parents, cost=depth * self.cost_per_head)


def ranking_rows(env: DrafterEnv, draft_vocab: int) -> tuple[Tensor | None, Tensor]:
    """What a head's block output y (dim,) is ranked with: the ids (n,) of the draft
    vocabulary's first ``draft_vocab`` (None for 0: every id, in order) and their rows of
    the tied LM head times the final norm's weight, (n, dim). ``y @ rows.T`` is the
    target's logits ``head(y)`` over those ids divided by RMS(y) > 0, so its ranks are the
    logits' ranks -- the norm is never computed. Built once per model, weights file and
    size (``loaded_weights``)."""
    m = env.model
    dtype = m.tok_embeddings.weight.dtype

    def build() -> tuple[Tensor | None, Tensor]:
        ids, rows = vocab_rows(env, draft_vocab) if draft_vocab else (None, m.tok_embeddings.weight)
        with torch.inference_mode(False), torch.no_grad():
            return ids, (rows * m.norm.weight).contiguous()

    # keyed by the file the rows come from: the ranking's, or (the full head) the heads'
    path = (vocab_path(env.checkpoint_dir, env.model_name) if draft_vocab
            else weights_path(env.checkpoint_dir, env.model_name))
    return loaded_weights(m, path, f"medusa ranking rows {draft_vocab} {dtype}", build)


# -- untrained heads for tests ----------------------------------------------------------------
def write_untrained(model: Micro, model_name: str, directory: Path, num_heads: int = 4,
                    top_k: int = 5) -> Path:
    """Random, non-zero heads for ``model`` and a plausible record (accuracies falling with
    the head and the rank), so tests on tiny random models draft real trees."""
    dim = model.config.dim
    seed = int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:4], "big")
    gen = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(num_heads, dim)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(num_heads, dim, dim, generator=gen) / dim ** 0.5)
        heads.bias.copy_(0.1 * torch.randn(num_heads, dim, generator=gen))
    accuracy = []
    for i in range(num_heads):
        top1 = 0.6 * 0.7 ** i
        marginal = [top1 * 0.4 ** r for r in range(top_k)]
        accuracy.append([round(float(c), 4) for c in np.cumsum(marginal)])
    record = {"name": f"{model_name}-{SUFFIX}", "target": model_name,
              "command": "drafters.medusa.write_untrained (random heads for tests)",
              "untrained": True, "minutes": 0.0, "steps": 0, "tokens": 0,
              "num_heads": num_heads,
              "heldout": {"tokens": 0, "top_k": top_k, "accuracy": accuracy,
                          "top1": [row[0] for row in accuracy], "target_top1": 0.0}}
    return save_heads(heads, model_name, record, directory)
