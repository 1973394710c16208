"""Where the committed artefacts live, and how they load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nodraft.micro import CHECKPOINT_DIR  # re-exported: where the committed artefacts live
from nodraft.micro.model import Micro, MicroConfig
from nodraft.micro.tokenizer import Tokenizer

MODEL_NAMES = ("micro", "micro-layerskip")


def tokenizer_path() -> Path:
    return CHECKPOINT_DIR / "tokenizer.json"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    return Tokenizer.from_file(path or tokenizer_path())


def save_model(model: Micro, name: str, record: dict, directory: Path = CHECKPOINT_DIR) -> None:
    """``name.safetensors`` (weights, config in the metadata) and ``name.json`` (the record)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, directory / f"{name}.safetensors",
              metadata={"config": json.dumps(model.config.to_dict())})
    (directory / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


def available_models(directory: Path = CHECKPOINT_DIR) -> list[str]:
    return [n for n in MODEL_NAMES if (directory / f"{n}.safetensors").exists()]


def load_config(name: str, directory: Path = CHECKPOINT_DIR) -> MicroConfig:
    """A checkpoint's config, from its metadata (the weights are not read)."""
    from safetensors import safe_open

    with safe_open(str(directory / f"{name}.safetensors"), "pt") as f:
        return MicroConfig(**json.loads(f.metadata()["config"]))


def load_model(name: str, directory: Path = CHECKPOINT_DIR) -> Micro:
    path = directory / f"{name}.safetensors"
    model = Micro(load_config(name, directory))
    model.load_state_dict(load_file(path))
    model.eval().requires_grad_(False)
    return model


def load_record(name: str, directory: Path = CHECKPOINT_DIR) -> dict:
    return json.loads((directory / f"{name}.json").read_text())


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
