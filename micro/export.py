"""``nodraft export-hf DIR [--model micro]``: micro as a Hugging Face ``LlamaForCausalLM``.

micro *is* a Llama: RMSNorm, rotate-half RoPE, SwiGLU, tied embeddings, no biases. The
export splits the stacked projections (``wqkv`` -> q/k/v_proj, ``w13`` -> gate/up_proj),
writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer, so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it with no custom code.
Written as plain JSON and safetensors: exporting does not need ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model, load_tokenizer
from nodraft.micro.model import Micro


def hf_state_dict(model: Micro) -> dict:
    c = model.config
    d, f = c.dim, c.ffn_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight,
          "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wqkv = layer.attention.wqkv.weight
        w13 = layer.feed_forward.w13.weight
        sd |= {
            p + "self_attn.q_proj.weight": wqkv[:d], p + "self_attn.k_proj.weight": wqkv[d:2 * d],
            p + "self_attn.v_proj.weight": wqkv[2 * d:], p + "self_attn.o_proj.weight": layer.attention.wo.weight,
            p + "mlp.gate_proj.weight": w13[:f], p + "mlp.up_proj.weight": w13[f:],
            p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        }
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def hf_config(model: Micro, eot_id: int) -> dict:
    c = model.config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_positions, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "hidden_act": "silu", "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "torch_dtype": "float32",
        "initializer_range": 0.02, "use_cache": True,
    }


def export(out: Path, name: str = "micro", directory: Path = CHECKPOINT_DIR) -> Path:
    model = load_model(name, directory)
    tok = load_tokenizer(directory / "tokenizer.json")
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model, tok.eot_id), indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id, "do_sample": False}, indent=1))
    shutil.copy(directory / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "unk_token": None, "model_max_length": model.config.max_positions,
        "clean_up_tokenization_spaces": False}, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft export-hf")
    p.add_argument("dir")
    p.add_argument("--model", default="micro")
    p.add_argument("--checkpoints", default=str(CHECKPOINT_DIR))
    args = p.parse_args(argv)
    out = export(Path(args.dir), args.model, Path(args.checkpoints))
    print(f"wrote {args.model} to {out} (LlamaForCausalLM)")
