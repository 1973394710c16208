"""The EAGLE head: its module, its features, the unrolled training forward, its files.

The head is one decoder layer that predicts the target's next *feature* from the features
it has seen::

    x_t      = fc(concat(embed(token_{t+1}), f_t))       # 2·dim -> dim, with bias
    f^_{t+1} = Block(x_0 .. x_t)                          # micro's decoder layer, causal
    q(token_{t+2}) = softmax(f^_{t+1} · E_draft^T)        # the target's frozen tied head

``f_t`` is the target's final-normed hidden state at position t (``features``), ``embed``
the target's frozen embedding and ``E_draft`` the rows of its tied embedding for the draft
vocabulary (``EagleHead.draft_vocab``).

**Fused features** (EAGLE-3's low, middle and top layers; optional, ``fuse_layers``): a
committed row's input also reads the target's earlier layers, through their *value rows* --
the rows the target's KV cache holds anyway, so drafting needs nothing from the passes
that they do not already write::

    x_t = fc(concat(embed(token_{t+1}), f_t)) + fuse(concat(v^l_t for l in fuse_layers))

``v^l_t`` is layer l's value projection of its normed input at position t (the output of
layer l - 1: a full-rank linear map of it), heads side by side (``values``,
``cached_values``). Drafted rows deeper in the tree have no target rows: there the head's
own predicted feature stands in for f_t and the fused term is absent, as EAGLE-3 feeds a
draft's deeper levels its own outputs (and training-time test trains the head so fed).
``fuse`` starts at zero, so a head extended with it drafts as before until trained.

File: ``<checkpoint_dir>/<model_name>-eagle.safetensors`` holds ``fc.weight`` (dim, 2·dim),
``fc.bias``, ``layer.*`` (a micro ``Block``), ``draft_vocab`` (N,) int64 target ids, most
frequent first, and with fused features ``fuse.weight`` (dim, len(fuse_layers)·dim) and
``fuse_layers`` (int64 target layer indices); its metadata ``config`` is the target's
MicroConfig as JSON. Beside it, ``<model_name>-eagle.json`` is the training record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nodraft.drafters.base import SpeculationError
from nodraft.micro.model import Block, Micro, MicroConfig, layer_macs
from nodraft.micro.ops import apply_rope


def forward_cost(c: MicroConfig, draft_vocab: int, fused: int = 0) -> float:
    """One forward of the EAGLE layer + fc's feature half + the N-way head, in target
    passes (FLOPs)::

        cost = (layer + dim^2 + N * dim) / (L * layer + V * dim)

    with layer = ``micro.model.layer_macs``: a 1-token pass reads every weight once, and so
    does each batched forward of the layer; the token half of fc is a precomputed table.
    ``fused`` target layers add their ``fuse`` product (fused · dim^2: it runs on the
    catch-up's committed rows only, so counting it in every forward of a step is an upper
    bound)."""
    return ((layer_macs(c) + c.dim * c.dim + draft_vocab * c.dim + fused * c.dim * c.dim)
            / (c.n_layers * layer_macs(c) + c.vocab_size * c.dim))


# -- the head ---------------------------------------------------------------------------------
class EagleHead(nn.Module):
    """fc over [token embedding, feature], one micro decoder layer; the draft vocabulary.

    The embedding and the LM head are the target's (frozen, not stored here). With
    ``fuse_layers`` (target layer indices, each >= 1), ``fuse`` reads those layers' value
    rows (module docstring), starting at zero."""

    def __init__(self, config: MicroConfig, draft_vocab: Tensor,
                 fuse_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        if any(not 1 <= l < config.n_layers for l in fuse_layers) \
                or len(set(fuse_layers)) != len(fuse_layers):
            raise ValueError(f"fused layers must be distinct, in 1..{config.n_layers - 1}")
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layer = Block(config)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone())
        self.fuse = (nn.Linear(len(fuse_layers) * config.dim, config.dim, bias=False)
                     if fuse_layers else None)
        if fuse_layers:
            self.register_buffer("fuse_layers", torch.tensor(fuse_layers, dtype=torch.long))
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)
        nn.init.zeros_(self.fc.bias)
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)

    @property
    def fused(self) -> tuple[int, ...]:
        """The target layers whose value rows the head reads (empty: none)."""
        return tuple(self.fuse_layers.tolist()) if self.fuse is not None else ()

    @classmethod
    def from_state(cls, config: MicroConfig, state: dict[str, Tensor]) -> "EagleHead":
        fuse = state.get("fuse_layers")
        head = cls(config, state["draft_vocab"], () if fuse is None else tuple(fuse.tolist()))
        head.load_state_dict(state)
        return head.eval().requires_grad_(False)

    def with_fused(self, fuse_layers: tuple[int, ...]) -> "EagleHead":
        """This head with fused features of ``fuse_layers`` added (``fuse`` at zero: it
        drafts as this one until trained); itself if it has them already."""
        if self.fused == tuple(fuse_layers):
            return self
        if self.fused:
            raise ValueError(f"the head fuses layers {self.fused}, not {tuple(fuse_layers)}")
        head = EagleHead(self.config, self.draft_vocab, tuple(fuse_layers))
        head.load_state_dict({**self.state_dict(), "fuse.weight": head.fuse.weight.detach(),
                              "fuse_layers": head.fuse_layers})
        return head

    def inputs(self, model: Micro, tokens: Tensor, feats: Tensor,
               values: Tensor | None = None) -> Tensor:
        """fc(concat(embed(tokens), feats)) [+ fuse(values)]: (..., dim)."""
        x = self.fc(torch.cat([model.embed(tokens), feats], dim=-1))
        return x if values is None or self.fuse is None else x + self.fuse(values)

    def draft_weight(self, model: Micro) -> Tensor:
        """The draft head: the target's tied embedding rows of the draft vocabulary (N, dim)."""
        return model.tok_embeddings.weight[self.draft_vocab]


def features(model: Micro, hidden: Tensor) -> Tensor:
    """EAGLE's feature: the final-normed hidden state (what the LM head reads)."""
    return model.norm(hidden)


def values(model: Micro, hidden: list[Tensor], layers: tuple[int, ...]) -> Tensor:
    """(B, T, len(layers)·dim): each layer l's value rows, from ``hidden[l - 1]`` (the
    output of layer l - 1: ``hidden`` as ``Micro.run_layers`` collects it, one entry per
    layer; ``Micro.forward``'s list starts with the embedding), heads side by side --
    what the target's pass writes to its KV cache's values for layer l."""
    dim = model.config.dim
    out = []
    for l in layers:
        block = model.layers[l]
        an = block.attention_norm
        x = F.rms_norm(hidden[l - 1], an.weight.shape, an.weight, an.eps)
        out.append(F.linear(x, block.attention.wqkv.weight[2 * dim:3 * dim]))
    return torch.cat(out, dim=-1)


def cached_values(cache, slot: int, layers: tuple[int, ...], a: int, n: int) -> Tensor:
    """(n - a, len(layers)·dim): the value rows of committed positions [a, n) of ``slot``
    in the target's KV cache, laid out as ``values`` -- a copy at storage offset 0 (what a
    compiled graph takes), made in one operation where the layers are a range."""
    lo = layers[0]
    if layers == tuple(range(lo, lo + len(layers))):
        v = cache.v[lo:lo + len(layers), slot, :, a:n]  # a view: (L, H, T, D)
    else:
        v = cache.v[list(layers), slot, :, a:n]  # a gather
    return v.permute(2, 0, 1, 3).reshape(n - a, -1)


def _layer_over_steps(block: Block, x: Tensor, cos: Tensor, sin: Tensor,
                      past: list[tuple[Tensor, Tensor]], mask: Tensor) -> tuple[Tensor, tuple]:
    """micro's Block on x (B, T, dim) whose queries also see the keys and values of earlier
    unrolled steps (``past``, each (B, H, T, D)); mask (T, (len(past)+1)·T) bool. Used to
    train and evaluate the head as it drafts (predicted features fed back); the drafter
    itself runs ``Block.forward`` with its KV cache (tests check the two agree)."""
    att, an, fn = block.attention, block.attention_norm, block.ffn_norm
    B, T, C = x.shape
    h = F.rms_norm(x, an.weight.shape, an.weight, an.eps)
    qkv = F.linear(h, att.wqkv.weight).view(B, T, 3, att.n_heads, att.head_dim)
    qkv = qkv.permute(2, 0, 3, 1, 4)
    q, k = apply_rope(qkv[:2], cos, sin).unbind(0)  # (B, H, T, D)
    v = qkv[2]
    keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
    values = torch.cat([pv for _, pv in past] + [v], dim=2)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), att.wo.weight)
    x = x + block.feed_forward.forward(F.rms_norm(x, fn.weight.shape, fn.weight, fn.eps))
    return x, (k, v)


def unroll_mask(T: int, step: int) -> Tensor:
    """(T, step·T) bool for unrolled step ``step`` (1-based): row p sees step 1's rows at
    positions <= p - step + 1 (real features) and, of each later step i, only its row at
    p - step + i -- the chain of its own predictions, as a tree node at depth step - 1 sees
    the committed rows and its ancestors."""
    p = torch.arange(T)[:, None]
    q = torch.arange(T)[None, :]
    parts = [q <= p - step + 1] + [q == p - step + i for i in range(2, step + 1)]
    return torch.cat(parts, dim=1)


def unroll(head: EagleHead, model: Micro, next_tokens: Tensor, feats: Tensor, steps: int,
           noise: float = 0.0, vals: Tensor | None = None) -> list[Tensor]:
    """Predicted features of ``steps`` unrolled draft steps, as at run time.

    next_tokens (B, T): token_{t+1} for rows t = 0..T-1; feats (B, T, dim): f_t; vals
    (B, T, fused·dim): the fused layers' value rows (``values``) for a head with them.
    Step 1 reads the real features (plus uniform noise of width ``noise``) and the value
    rows; step j > 1 reads step j-1's prediction for its row (row p: step j-1's output of
    row p-1) and no value rows, as a drafted row has none. Returns one
    (B, T, dim) tensor per step: out[j-1][:, p] predicts f_{p+1} after j-1 drafted tokens
    (rows p < j-1 have no valid input and are to be ignored)."""
    B, T, _ = feats.shape
    pos = torch.arange(T)
    cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
    past: list[tuple[Tensor, Tensor]] = []
    outs: list[Tensor] = []
    f_in = feats
    if noise:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise
    for j in range(1, steps + 1):
        if j > 1:
            f_in = torch.cat([feats[:, :1], outs[-1][:, :-1]], dim=1)
        x = head.inputs(model, next_tokens, f_in, vals if j == 1 else None)
        mask = unroll_mask(T, j)
        out, kv = _layer_over_steps(head.layer, x, cos, sin, past, mask)
        past.append(kv)
        outs.append(out)
    return outs



# -- files ------------------------------------------------------------------------------------
def weights_path(directory: Path, model_name: str) -> Path:
    return Path(directory) / f"{model_name}-eagle.safetensors"


def save_head(head: EagleHead, model_name: str, directory: Path, record: dict) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    path = weights_path(directory, model_name)
    save_file(state, path, metadata={"config": json.dumps(head.config.to_dict())})
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_head_state(directory: Path, model_name: str) -> tuple[MicroConfig, dict[str, Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = weights_path(directory, model_name)
    if not path.exists():
        raise SpeculationError(
            f"no EAGLE head for model {model_name!r} (looked for {path}); train one with "
            f"`nodraft train eagle --model {model_name}`", "speculation.method")
    with safe_open(str(path), "pt") as f:
        config = MicroConfig(**json.loads(f.metadata()["config"]))
    return config, load_file(str(path))


def write_untrained(model: Micro, model_name: str, directory: Path,
                    fuse_layers: tuple[int, ...] = ()) -> Path:
    """Random, non-zero weights and a record, for tiny test models: real trees, real
    drafting, nothing learnt. The draft vocabulary is a random 3/4 of the target's, so the
    mapping back to target ids is exercised."""
    c = model.config
    gen = torch.Generator().manual_seed(c.dim * 7919 + c.vocab_size)
    vocab = torch.randperm(c.vocab_size, generator=gen)[:max(2, 3 * c.vocab_size // 4)]
    head = EagleHead(c, vocab, fuse_layers)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() >= 2 else 0.1))
            if "norm" in name:
                p.add_(1.0)
    return save_head(head, model_name, directory, {"name": f"{model_name}-eagle",
                                                    "untrained": True})

