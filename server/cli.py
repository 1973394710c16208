"""``nodraft``: one command line for serving, training, evaluating and measuring.

    nodraft serve    [--host 127.0.0.1] [--port 8000] [--speculation METHOD] [--api-key KEY] ...
    nodraft compile  [--max-running N] [--compile-cache DIR]   the compiled passes, built ahead
    nodraft eval     [--json]          held-out loss of every checkpoint and variant
    nodraft workshop [--json] [--plot FILE] [--url URL]   the course's table, measured
    nodraft bench    [--models ...] [--regimes ...]       the workload suite, greedy and sampled
    nodraft train    tokenizer | micro | medusa | eagle | draft-vocab ...
    nodraft export-hf DIR [--model NAME]
    nodraft export-gguf FILE [--model NAME] [--type f32|q8_0]
    nodraft loadtest --url URL --concurrency N --requests M [--json]

Each subcommand lives with its package; this module only dispatches (imports are lazy, so
``nodraft --help`` does not load torch).
"""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS = {
    "serve": ("nodraft.server.main", "main", "run the OpenAI-compatible server"),
    "eval": ("nodraft.drafters.evaluation", "main", "held-out loss of every checkpoint and variant, and of trained drafters"),
    "compile": ("nodraft.engine.artifacts", "main", "build the compiled passes for this machine ahead of time"),
    "workshop": ("nodraft.clients.workshop", "main", "the course's table, measured"),
    "bench": ("nodraft.clients.bench", "main", "the workload suite: every drafter, greedy and sampled, by category"),
    "export-hf": ("nodraft.micro.export", "main", "write micro as a Hugging Face LlamaForCausalLM"),
    "export-gguf": ("nodraft.micro.gguf", "main", "write micro as a GGUF file (llama.cpp), f32 or q8_0"),
    "loadtest": ("nodraft.clients.loadtest", "main", "load-test a running server"),
}
TRAIN = {
    "tokenizer": ("nodraft.micro.train_tokenizer", "main", "the byte-level BPE on the train split"),
    "micro": ("nodraft.micro.train", "main", "micro or micro-layerskip (--layerskip)"),
    "medusa": ("nodraft.drafters.medusa_train", "main", "Medusa heads for a checkpoint"),
    "eagle": ("nodraft.drafters.eagle.train", "main", "the EAGLE head for a checkpoint"),
    "draft-vocab": ("nodraft.drafters.draft_vocab", "main", "token ids ranked by frequency (early exit's draft vocabulary)"),
}


def _usage() -> str:
    lines = ["usage: nodraft COMMAND [options]", "", "commands:"]
    for name, (_, _, doc) in COMMANDS.items():
        lines.append(f"  {name:10s} {doc}")
    lines.append(f"  {'train':10s} {' | '.join(TRAIN)}: train an artefact")
    return "\n".join(lines)


def _run(target: tuple[str, str, str], argv: list[str]) -> None:
    module, func, _ = target
    getattr(import_module(module), func)(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        if not rest or rest[0] not in TRAIN:
            sys.exit("usage: nodraft train {" + ",".join(TRAIN) + "} [options]")
        _run(TRAIN[rest[0]], rest[1:])
    elif cmd in COMMANDS:
        _run(COMMANDS[cmd], rest)
    else:
        sys.exit(f"nodraft: unknown command {cmd!r}\n\n{_usage()}")


if __name__ == "__main__":
    main()
