"""The EAGLE head: its module, its features, the unrolled training forward, its files.

The head is one decoder layer that predicts the target's next *feature* from the features
it has seen::

    x_t      = fc(concat(embed(token_{t+1}), f_t))       # 2·dim -> dim, with bias
    f^_{t+1} = Block(x_0 .. x_t)                          # micro's decoder layer, causal
    q(token_{t+2}) = softmax(f^_{t+1} · E_draft^T)        # the target's frozen tied head

``f_t`` is the target's final-normed hidden state at position t (``features``), ``embed``
the target's frozen embedding and ``E_draft`` the rows of its tied embedding for the draft
vocabulary (``EagleHead.draft_vocab``).

File: ``<checkpoint_dir>/<model_name>-eagle.safetensors`` holds ``fc.weight`` (dim, 2·dim),
``fc.bias``, ``layer.*`` (a micro ``Block``) and ``draft_vocab`` (N,) int64 target ids, most
frequent first; its metadata ``config`` is the target's MicroConfig as JSON. Beside it,
``<model_name>-eagle.json`` is the training record.
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


def forward_cost(c: MicroConfig, draft_vocab: int) -> float:
    """One forward of the EAGLE layer + fc's feature half + the N-way head, in target
    passes (FLOPs)::

        cost = (layer + dim^2 + N * dim) / (L * layer + V * dim)

    with layer = ``micro.model.layer_macs``: a 1-token pass reads every weight once, and so
    does each batched forward of the layer; the token half of fc is a precomputed table."""
    return ((layer_macs(c) + c.dim * c.dim + draft_vocab * c.dim)
            / (c.n_layers * layer_macs(c) + c.vocab_size * c.dim))


# -- the head ---------------------------------------------------------------------------------
class EagleHead(nn.Module):
    """fc over [token embedding, feature], one micro decoder layer; the draft vocabulary.

    The embedding and the LM head are the target's (frozen, not stored here)."""

    def __init__(self, config: MicroConfig, draft_vocab: Tensor):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layer = Block(config)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long).clone())
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)
        nn.init.zeros_(self.fc.bias)

    @classmethod
    def from_state(cls, config: MicroConfig, state: dict[str, Tensor]) -> "EagleHead":
        head = cls(config, state["draft_vocab"])
        head.load_state_dict(state)
        return head.eval().requires_grad_(False)

    def inputs(self, model: Micro, tokens: Tensor, feats: Tensor) -> Tensor:
        """fc(concat(embed(tokens), feats)): (..., dim)."""
        return self.fc(torch.cat([model.embed(tokens), feats], dim=-1))

    def draft_weight(self, model: Micro) -> Tensor:
        """The draft head: the target's tied embedding rows of the draft vocabulary (N, dim)."""
        return model.tok_embeddings.weight[self.draft_vocab]


def features(model: Micro, hidden: Tensor) -> Tensor:
    """EAGLE's feature: the final-normed hidden state (what the LM head reads)."""
    return model.norm(hidden)


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
           noise: float = 0.0) -> list[Tensor]:
    """Predicted features of ``steps`` unrolled draft steps, as at run time.

    next_tokens (B, T): token_{t+1} for rows t = 0..T-1; feats (B, T, dim): f_t.
    Step 1 reads the real features (plus uniform noise of width ``noise``); step j > 1 reads
    step j-1's prediction for its row (row p: step j-1's output of row p-1). Returns one
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
        x = head.inputs(model, next_tokens, f_in)
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


def write_untrained(model: Micro, model_name: str, directory: Path) -> Path:
    """Random, non-zero weights and a record, for tiny test models: real trees, real
    drafting, nothing learnt. The draft vocabulary is a random 3/4 of the target's, so the
    mapping back to target ids is exercised."""
    c = model.config
    gen = torch.Generator().manual_seed(c.dim * 7919 + c.vocab_size)
    vocab = torch.randperm(c.vocab_size, generator=gen)[:max(2, 3 * c.vocab_size // 4)]
    head = EagleHead(c, vocab)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() >= 2 else 0.1))
            if "norm" in name:
                p.add_(1.0)
    return save_head(head, model_name, directory, {"name": f"{model_name}-eagle",
                                                    "untrained": True})

