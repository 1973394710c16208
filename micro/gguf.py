"""``nodraft export-gguf FILE [--model micro] [--type f32|q8_0]``: micro as a GGUF file.

The file is what llama.cpp, and what is built on it (llama-cpp-python, ``llama-server``),
loads as its ``llama`` architecture, written with the ``gguf`` package straight from the
checkpoint (no Hugging Face export in between, no ``transformers``):

- hyper-parameters from the checkpoint's ``MicroConfig``: layers, width, heads (as many
  key/value heads as query heads), feed-forward width, context, RMSNorm epsilon, RoPE base
  and dimension;
- tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ...): the stacked
  ``wqkv`` and ``w13`` split, no ``output.weight`` (the embeddings are tied, and llama.cpp
  uses ``token_embd`` as the head when the file has none), and the query and key rows of
  every head reordered from the rotate-half layout micro (and Hugging Face) rotates by to
  the adjacent pairs llama.cpp's ``llama`` RoPE rotates (``rope_rows``);
- the tokenizer: the byte-level BPE's vocabulary in id order and its merges, the
  pre-tokenizer llama.cpp calls ``gpt-2`` (GPT-2's split expression, the one micro's
  ``ByteLevel`` pre-tokenizer uses), special tokens as control tokens, end-of-text as
  both BOS and EOS, and no BOS added to a prompt (nodraft adds none either).

``--type f32`` writes every tensor in float32, micro's weights bit for bit (llama.cpp's
greedy tokens are then nodraft's: tests/micro/test_gguf.py). ``--type q8_0`` stores the
2-D weights (embeddings included) in llama.cpp's Q8_0 (blocks of 32 weights, one float16
scale each; each weight within its rounding) and the norms in float32; its greedy text
may leave nodraft's where micro's two likeliest tokens are close.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
import torch

from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model
from nodraft.micro.model import Micro
from nodraft.micro.tokenizer import EOT, SPECIAL_TOKENS

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]  # "llama"


def rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A query or key projection's rows (out, in) reordered per head from rotate-half
    order (dimension i pairs with i + D/2) to adjacent pairs (2i with 2i + 1): head row
    2i + j is rotate-half row i + j * D/2 (what llama.cpp's converter does to Hugging
    Face's q_proj and k_proj)."""
    out, dim_in = w.shape
    d = out // n_heads
    return w.reshape(n_heads, 2, d // 2, dim_in).transpose(1, 2).reshape(out, dim_in)


def _name(t: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
    return gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"


def gguf_tensors(model: Micro) -> dict[str, np.ndarray]:
    """Every tensor of the file, float32, (rows, columns) as torch holds them, by GGUF name."""
    c = model.config
    d, f = c.dim, c.ffn_dim
    T = gguf.MODEL_TENSOR
    sd = {_name(T.TOKEN_EMBD): model.tok_embeddings.weight, _name(T.OUTPUT_NORM): model.norm.weight}
    for i, layer in enumerate(model.layers):
        wqkv, w13 = layer.attention.wqkv.weight, layer.feed_forward.w13.weight
        sd |= {
            _name(T.ATTN_NORM, i): layer.attention_norm.weight,
            _name(T.ATTN_Q, i): rope_rows(wqkv[:d], c.n_heads),
            _name(T.ATTN_K, i): rope_rows(wqkv[d:2 * d], c.n_heads),
            _name(T.ATTN_V, i): wqkv[2 * d:],
            _name(T.ATTN_OUT, i): layer.attention.wo.weight,
            _name(T.FFN_NORM, i): layer.ffn_norm.weight,
            _name(T.FFN_GATE, i): w13[:f],
            _name(T.FFN_UP, i): w13[f:],
            _name(T.FFN_DOWN, i): layer.feed_forward.w2.weight,
        }
    return {k: v.detach().float().contiguous().numpy().copy() for k, v in sd.items()}


def vocabulary(tokenizer_json: Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, their GGUF token types, merges as "left right") from a
    ``tokenizers`` byte-level BPE file."""
    t = json.loads(Path(tokenizer_json).read_text())
    model, pre = t["model"], t["pre_tokenizer"]
    if model["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError("not a byte-level BPE with GPT-2's pre-tokenizer: "
                         f"{model['type']}, {pre}")
    by_id = {i: s for s, i in model["vocab"].items()}
    by_id |= {a["id"]: a["content"] for a in t.get("added_tokens", [])}
    special = {a["content"] for a in t.get("added_tokens", []) if a.get("special")}
    special |= set(SPECIAL_TOKENS)
    n = max(by_id) + 1
    if sorted(by_id) != list(range(n)):
        raise ValueError("the vocabulary's ids are not 0..n-1")
    tokens = [by_id[i] for i in range(n)]
    types = [int(gguf.TokenType.CONTROL if s in special else gguf.TokenType.NORMAL)
             for s in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def export(out: Path, name: str = "micro", directory: Path = CHECKPOINT_DIR,
           file_type: str = "f32") -> Path:
    """Write checkpoint ``name`` of ``directory`` (and its tokenizer) to the GGUF file ``out``."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type {file_type!r}: one of {sorted(FILE_TYPES)}")
    model = load_model(name, directory)
    c = model.config
    tokens, types, merges = vocabulary(directory / "tokenizer.json")
    if len(tokens) != c.vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, {name} {c.vocab_size}")
    eot = tokens.index(EOT)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, ARCH)
    w.add_name(name)
    w.add_file_type(FILE_TYPES[file_type])
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_positions)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_heads)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for tname, arr in gguf_tensors(model).items():
        if file_type == "q8_0" and arr.ndim == 2:
            w.add_tensor(tname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft export-gguf")
    p.add_argument("file")
    p.add_argument("--model", default="micro")
    p.add_argument("--type", default="f32", choices=sorted(FILE_TYPES),
                   help="tensor type of the 2-D weights (norms stay f32)")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))
    args = p.parse_args(argv)
    out = export(Path(args.file), args.model, Path(args.checkpoints), args.type)
    print(f"wrote {args.model} to {out} (GGUF, llama, {args.type})")
