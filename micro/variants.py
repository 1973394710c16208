"""micro made smaller: weight-only int8 quantisation and magnitude pruning.

Every variant is a plain ``Micro`` again (so the engine and every drafter run it as is),
plus the number of bytes its weights take in the variant's own storage format:

- ``fp32``: 4 bytes a parameter.
- ``int8``: every matrix (the linear layers and the tied embedding/head) quantised
  symmetrically per output row to int8, with one fp32 scale per row; norms stay fp32.
  Weights are dequantised when loaded, so compute is fp32 (on this CPU PyTorch's
  int8 weight-only matmul kernel is far slower than fp32 at micro's sizes); the loss
  measured is the quantised model's.
- ``pruned30`` / ``pruned50``: the smallest-magnitude 30% / 50% of each linear layer's
  weights set to zero (the embedding is kept: it is also the LM head). Storage: fp32
  non-zeros plus a one-bit mask.
- ``2:4``: in every group of 4 consecutive input weights of a linear layer, the 2 smallest
  are zeroed (the pattern sparse tensor cores accelerate). Storage: fp32 non-zeros plus
  2-bit indices.
Dense kernels run the pruned variants, so their tokens/s is fp32's; they buy size only.
"""

from __future__ import annotations

import copy

import torch

from nodraft.micro.model import Micro

VARIANTS = ("fp32", "int8", "pruned30", "pruned50", "2:4")


def _matrices(model: Micro, include_embedding: bool) -> list[torch.nn.Parameter]:
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if include_embedding:
        mats.append(model.tok_embeddings.weight)
    return mats


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (q int8 (out, in), scale fp32 (out,)), w ~= q * scale."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def make_variant(model: Micro, variant: str) -> tuple[Micro, int]:
    """(a copy of model as ``variant``, bytes of its weights in that variant's storage)."""
    m = copy.deepcopy(model)
    n_params = m.num_params()
    if variant == "fp32":
        return m, 4 * n_params
    with torch.no_grad():
        if variant == "int8":
            mats = _matrices(m, include_embedding=True)
            for w in mats:
                q, scale = quantize_int8(w)
                w.copy_(q.float() * scale[:, None])
            matrix_elems = sum(w.numel() for w in mats)
            rows = sum(w.shape[0] for w in mats)
            return m, matrix_elems + 4 * rows + 4 * (n_params - matrix_elems)
        mats = _matrices(m, include_embedding=False)
        pruned = sum(w.numel() for w in mats)
        if variant in ("pruned30", "pruned50"):
            frac = 0.3 if variant == "pruned30" else 0.5
            for w in mats:
                k = int(w.numel() * frac)
                threshold = w.abs().flatten().kthvalue(k).values
                w.masked_fill_(w.abs() <= threshold, 0.0)
            nnz = sum(int((w != 0).sum()) for w in mats)
            return m, 4 * nnz + pruned // 8 + 4 * (n_params - pruned)
        if variant == "2:4":
            for w in mats:
                groups = w.view(w.shape[0], -1, 4)
                drop = groups.abs().argsort(dim=-1)[..., :2]
                groups.scatter_(-1, drop, 0.0)
            return m, 4 * (pruned // 2) + (pruned // 2) // 4 + 4 * (n_params - pruned)
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
