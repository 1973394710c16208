"""micro: the four-layer target model, its tokenizer, corpus, training and evaluation."""

from pathlib import Path

# where the committed checkpoints live (here, so that reading the path imports no torch)
CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
