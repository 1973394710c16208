"""The server's settings: defaults, then ``NODRAFT_*`` environment variables, then flags.

    nodraft serve --port 8000 --speculation prompt_lookup
    NODRAFT_PORT=8000 NODRAFT_SPECULATION='{"method": "early_exit", "exit_layer": 2}' nodraft serve

Every field is also a command-line flag (``max_running`` -> ``--max-running``); a flag given
on the command line wins over the environment. The object is passed explicitly to
``server.app.create_app``; nothing reads the environment after start-up.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from nodraft.engine.launch import KV_CACHE_DTYPES, EngineConfig
from nodraft.micro import CHECKPOINT_DIR


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NODRAFT_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    speculation: str | dict = Field(
        "auto", description="the default drafter for requests without `speculation`: a "
        "method name or a JSON object such as '{\"method\": \"early_exit\", \"exit_layer\": 2}'")
    api_key: SecretStr | None = Field(
        None, description="if set, /v1/* requires `Authorization: Bearer KEY`")
    max_running: int = Field(
        32, ge=1, le=256, description="KV slots per model: each model decodes at most this "
        "many sequences at once (two models: up to twice this many in all, within the "
        "max-running + max-waiting sequences the server holds)")
    max_waiting: int = Field(
        64, ge=0, description="the server holds at most max-running + max-waiting sequences "
        "in flight, all models together (running, queued for a slot, or being prepared); a "
        "request beyond that gets a 429 at once")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="request body limit (then 413)")
    chat_max_tokens_default: int = Field(
        256, ge=1, description="a chat request without max_tokens or max_completion_tokens "
        "generates at most this many tokens per choice (and at most the room left in the "
        "context); completions keep OpenAI's default of 16")
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="a request's headers must arrive within this many seconds "
        "of its connection opening or of the previous response's end (else the connection "
        "is closed, after a 408)")
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="a request's body must arrive within this many seconds of "
        "its headers (else 408)")
    keep_alive_seconds: int = Field(
        5, ge=1, description="an idle keep-alive connection is closed after this many "
        "seconds")
    max_connections: int = Field(
        512, ge=1, description="open HTTP connections the server serves at once; a "
        "request on a connection beyond them gets a 503")
    http_parser: Literal["httptools", "h11"] = Field(
        "httptools", description="the HTTP/1.1 parser: httptools (llhttp, in C) or h11 (pure "
        "Python); the same guards either way")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins allowed by CORS, comma-separated (default: "
        "none, CORS off)")
    checkpoints: Path = Field(CHECKPOINT_DIR, description="directory holding micro.safetensors, "
                              "micro-layerskip.safetensors and tokenizer.json")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight "
                                 "requests may run before they are cancelled")
    threads: int | None = Field(None, ge=1, description="torch threads of the engine "
                                "(default: one per CPU core but one, at least one: the HTTP "
                                "side keeps a core of its own)")
    engine_process: bool = Field(True, description="run the engine core in a process of "
                                 "its own (false: a thread of the API process, sharing its "
                                 "GIL)")
    stream_interval_ms: float = Field(
        5.0, ge=0, le=100, description="while sequences run, their steps reach the HTTP "
        "side at most every this many ms, several at a time, instead of waking it for every "
        "engine step (a request's first token, its end and any error are never held; the "
        "figures keep each step's own time); 0: every step at once")
    prefix_cache_mb: float = Field(
        64.0, ge=0, description="per model, MiB of prompt blocks kept after their prefill: a "
        "prompt that starts with kept blocks (a system prompt, the turns of a conversation "
        "so far, a repeated request) copies their rows instead of computing them; 0: off")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(
        "float32", description="the KV cache's element type: float32 (the model's own) or "
        "float16, which halves the bytes a batch's attention reads from memory and rounds "
        "every cached key and value to half precision, so outputs may differ from "
        "float32's where two tokens nearly tie; under either, speculative and batched "
        "decoding give what plain decoding gives (docs/ARCHITECTURE.md)")
    compile: bool = Field(True, description="compiled single-sequence passes: built once "
                          "per machine by a process of their own (or ahead of time by "
                          "`nodraft compile`) and loaded at start; served eager until "
                          "loaded; false: eager only")
    compile_cache: Path | None = Field(None, description="where the compiled passes are "
                                       "kept (default: $NODRAFT_COMPILE_CACHE, else "
                                       "$XDG_CACHE_HOME/nodraft, else ~/.cache/nodraft)")
    gemm: Literal["auto", "torch"] = Field(
        "auto", description="the compiled passes' matrix product: auto (nodraft's few-row "
        "kernel, built at the first compile, where the CPU has AVX-512 or AVX2; else "
        "torch.mm) or torch (torch.mm, i.e. MKL, everywhere); micro/gemm.py")
    log_level: str = Field("info", description="uvicorn's log level")

    @property
    def engine_threads(self) -> int:
        """``threads``, or by default every core but one (at least one): micro's kernels
        are small, a second engine thread gains a pass little (docs/BENCHMARKS.md), and
        the API process keeps a core for the event loop that streams responses."""
        return self.threads or max(1, len(_usable_cores()) - 1)

    def engine_config(self, drafters: dict[str, str] | None = None) -> EngineConfig:
        """The engine's settings (plain data, for the engine process). ``drafters``: the
        API registry's ``targets()``; None: the built-ins and installed plugins, which a
        default ``Registry()`` holds on both sides."""
        engine_cores, api_cores = self.cores()
        return EngineConfig(
            str(self.checkpoints), dict(drafters or {}), max_running=self.max_running,
            max_waiting=self.max_waiting, threads=self.engine_threads, compile=self.compile,
            gemm=self.gemm, cores=engine_cores, io_cores=api_cores, log_level=self.log_level,
            compile_cache=str(self.compile_cache) if self.compile_cache else None,
            stream_interval=self.stream_interval_ms / 1000,
            prefix_cache_bytes=int(self.prefix_cache_mb * (1 << 20)),
            kv_cache_dtype=self.kv_cache_dtype)

    def cores(self) -> tuple[list[int] | None, list[int] | None]:
        """CPU affinity (engine process, API process). With two or more usable cores and
        an engine process: the engine gets the first ``engine_threads`` cores (every core
        when it asks for all of them), the API the last one -- shared, when the engine has
        every core, with the engine's pass threads but not its loop, which keeps the first
        (``engine.process.keep_first_core``). (None, None) otherwise: nothing is pinned."""
        cores = _usable_cores()
        if not self.engine_process or len(cores) < 2:
            return None, None
        return cores[:self.engine_threads], cores[-1:]

    @field_validator("speculation", mode="before")
    @classmethod
    def _speculation_json(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lstrip().startswith("{"):
            return json.loads(v)
        return v

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [o.strip() for o in v.split(",") if o.strip()]
        return v

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> "Settings":
        """Parse ``nodraft serve`` flags; flags left out fall back to env, then defaults."""
        parser = argparse.ArgumentParser(
            prog="nodraft serve", description="Run the OpenAI-compatible nodraft server.",
            argument_default=argparse.SUPPRESS)
        for name, info in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            default = info.get_default(call_default_factory=True)
            parser.add_argument(flag, dest=name, metavar=name.upper(),
                                help=f"{info.description} (env NODRAFT_{name.upper()}; "
                                     f"default: {default})")
        given = vars(parser.parse_args(argv))
        return cls(**given)


def _usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, not every core of the machine)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
