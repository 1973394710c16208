"""``nodraft train tokenizer``: the byte-level BPE (vocabulary 4096) on the train split."""

from __future__ import annotations

import argparse
import time

from nodraft.micro.checkpoint import tokenizer_path
from nodraft.micro.corpus import split_documents
from nodraft.micro.tokenizer import VOCAB_SIZE, train_tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodraft train tokenizer")
    p.add_argument("--out", default=str(tokenizer_path()))
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = p.parse_args(argv)
    t0 = time.time()
    tok = train_tokenizer([d.text for d in split_documents("train")], args.vocab_size)
    tok.save(args.out)
    print(f"wrote {args.out}: {tok.vocab_size} tokens in {time.time() - t0:.1f}s")
