"""What crosses the boundary between the API process and the engine process.

Plain data only, encoded with msgspec's MessagePack (as vLLM's V1 engine core does):

    API -> engine   Add(rid, request) | Abort(rids) | Shutdown()
    engine -> API   Outputs(events, running, waiting, compiled, compiled_error)

A request travels as its method name and a parameters dict, never as objects: the engine
process parses the dict with its own drafter registry (``Registry.parse``), exactly as the
API validated it. The engine sends one ``Outputs`` per iteration, carrying every event of
that iteration for every request, so the API wakes once per engine iteration however many
streams are running; an idle engine sends one when its compile status changes.
"""

from __future__ import annotations

import dataclasses

import msgspec

from nodraft.engine.core import Event, GenerationRequest
from nodraft.engine.verify import SamplingParams


class Request(msgspec.Struct, array_like=True):
    """A ``GenerationRequest`` as data (its drafter's ``Params`` as a dict)."""

    model: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    method: str
    params: dict
    stop_token_ids: list[int]
    logprobs: int | None = None
    prompt_logprobs: bool = False

    @classmethod
    def of(cls, r: GenerationRequest) -> "Request":
        params = dataclasses.asdict(r.params) if dataclasses.is_dataclass(r.params) else {}
        return cls(r.model, r.prompt, r.max_tokens, r.sampling, r.method, params,
                   list(r.stop_token_ids), r.logprobs, r.prompt_logprobs)


class Add(msgspec.Struct, array_like=True, tag="add"):
    rid: int
    request: Request


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    rids: list[int]


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


class Outputs(msgspec.Struct, array_like=True):
    events: list[tuple[int, Event]]  # (rid, event), in the order the engine reported them
    running: int
    waiting: int
    compiled: str  # "off" | "warming" | "ready" | "failed"
    compiled_error: str | None = None


Input = Add | Abort | Shutdown

encode = msgspec.msgpack.Encoder().encode
decode_input = msgspec.msgpack.Decoder(Input).decode
decode_outputs = msgspec.msgpack.Decoder(Outputs).decode
