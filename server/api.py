"""The routes: validate, hand the sequences to the engine, stream the text back.

Context rule (OpenAI's): a prompt gets a 400 when it leaves no room for one generated
token (at most ``context - 1`` = 1023 prompt tokens for micro), and so does an explicit
``max_tokens`` larger than the room left (prompt + max_tokens > context). Without
``max_tokens``, completions generate up to 16 tokens and chat up to the room left, each
clamped to the room left. Generation is never cut short silently.

A temperature below ``engine.verify.GREEDY_BELOW`` (1e-5, vLLM's threshold) decodes
greedily, and however small ``top_p`` is, the most likely token is kept (``SamplingParams``).

An empty completion prompt starts from ``<|endoftext|>``, the document boundary micro was
trained on. ``n`` choices per prompt are independent sequences; with a ``seed``,
choice k samples with ``seed + k``. ``usage.prompt_tokens`` counts each prompt once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from drafters.registry import DrafterEnv
from server import chat
from engine.core import EngineStopped, GenerationRequest
from server.errors import APIError, error_body
from server.generation import Delta, GenerationFailed, Run
from server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                             CompletionResponse, ErrorResponse, ModelCard, ModelList)
from engine.verify import SamplingParams

ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}
DISCONNECT_POLL_SECONDS = 0.25

router = APIRouter()


@router.get("/health", summary="liveness: answers while generation runs",
            responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """``compiled``: ``off`` (eager only), ``warming`` (compiling in the background;
    served eager meanwhile), ``ready``, or ``failed`` (served eager; the log says why).
    503 once the engine process has died (the server is exiting)."""
    client = request.app.state.service.client
    if client is not None and not client.alive:
        return JSONResponse(error_body(client.death, "service_unavailable", code="engine_dead"),
                            status_code=503)
    return JSONResponse({"status": "ok", "compiled": client.compiled if client else "warming"})


@router.get("/ready", summary="readiness: models loaded and not draining",
            responses={503: {"model": ErrorResponse}})
async def ready(request: Request) -> Response:
    service = request.app.state.service
    if not service.ready:
        return JSONResponse(error_body("not ready: " + service.status, "service_unavailable",
                                       code="not_ready"), status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", summary="Prometheus exposition", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.service.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(request: Request) -> ModelList:
    s = request.app.state.service
    methods = s.registry.describe()
    return ModelList(data=[ModelCard(id=name, created=s.created[name], max_model_len=s.context,
                                     speculation_methods=methods) for name in s.models])


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Response:
    service = request.app.state.service
    prompts = _completion_prompts(body, service)
    explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
    run = _start(request, body, prompts, explicit, body.max_tokens or 16, ())
    return await _respond(request, body, run, prompts, chat_format=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service = request.app.state.service
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both",
                       param="max_completion_tokens")
    prompt = chat.render([(m.role, m.text()) for m in body.messages], service.tokenizer)
    explicit = body.max_tokens or body.max_completion_tokens
    run = _start(request, body, [prompt], explicit, service.context,
                 chat.stop_token_ids(service.tokenizer))
    return await _respond(request, body, run, [prompt], chat_format=True)


# -- from a request to sequences -------------------------------------------------------------
def _completion_prompts(body: CompletionRequest, service) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    prompts = []
    for item in p:
        ids = service.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if any(not 0 <= t < service.tokenizer.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {service.tokenizer.vocab_size})",
                           param="prompt")
        prompts.append(ids or [service.tokenizer.eot_id])
    return prompts


def _start(request: Request, body: Any, prompts: list[list[int]], explicit: int | None,
           default: int, stop_ids: tuple[int, ...]) -> Run:
    """Check the request against the models and the context, then submit its sequences."""
    service = request.app.state.service
    if body.model not in service.models:
        raise APIError(404, f"the model {body.model!r} does not exist; available: "
                       + ", ".join(service.models), param="model", code="model_not_found")
    method, params = service.registry.parse(body.speculation, service.settings.speculation)
    request.state.speculation_method = method
    service.registry.check(method, params, DrafterEnv(
        body.model, None, checkpoint_dir=service.checkpoint_dir))
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")
    limits = _max_tokens(body, prompts, explicit, default, service.context)
    total = len(prompts) * body.n
    capacity = service.settings.max_running + service.settings.max_waiting
    if total > capacity:
        raise APIError(400, f"{total} sequences (n x prompts) is more than this server holds "
                       f"at once ({capacity})", param="n")
    requests = []
    for ids, max_tokens in zip(prompts, limits):
        for k in range(body.n):
            seed = None if body.seed is None else (body.seed + k) % 2**64
            sampling = SamplingParams(body.temperature, body.top_p, body.top_k, seed)
            requests.append(GenerationRequest(body.model, ids, max_tokens, sampling, method,
                                              params, stop_ids))
    if service.draining:
        raise EngineStopped("draining")
    run = Run(service.client, service.tokenizer, requests, body.stop or [])
    run.start()
    return run


def _max_tokens(body: Any, prompts: list[list[int]], explicit: int | None, default: int,
                ctx: int) -> list[int]:
    """Each prompt's generation limit under the context rule (module docstring)."""
    chat_format = isinstance(body, ChatCompletionRequest)
    name = ("max_completion_tokens" if chat_format and body.max_completion_tokens is not None
            else "max_tokens")
    limits = []
    for ids in prompts:
        room = ctx - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(ids)} tokens; the context holds {ctx} "
                           f"positions and needs room for at least one generated token, so a "
                           f"prompt may have at most {ctx - 1} tokens",
                           param="messages" if chat_format else "prompt",
                           code="context_length_exceeded")
        if explicit is not None and explicit > room:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus {name} ({explicit}) "
                           f"exceeds the context of {ctx} positions: {name} may be at most "
                           f"{room}", param=name, code="context_length_exceeded")
        limits.append(explicit if explicit is not None else min(default, room))
    return limits


# -- back to the client ----------------------------------------------------------------------
async def _respond(request: Request, body: Any, run: Run, prompts: list[list[int]],
                   chat_format: bool) -> Response:
    head = {"id": ("chatcmpl-" if chat_format else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()), "model": body.model}
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return EventSourceResponse(_events(request, body, run, head, prompt_tokens,
                                           chat_format), sep="\n", ping=15)
    texts = [""] * len(run.choices)
    reasons: list[str | None] = [None] * len(run.choices)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, run))
    try:
        async for d in run.deltas():
            texts[d.index] += d.text
            reasons[d.index] = d.finish_reason or reasons[d.index]
    except GenerationFailed as e:
        raise APIError(500, f"generation failed: {e}", code="generation_failed") from None
    finally:
        watcher.cancel()
        run.cancel()
    usage = _usage(prompt_tokens, run.completion_tokens)
    spec = run.stats().to_dict()
    if chat_format:
        choices = [{"index": i, "message": {"role": "assistant", "content": t},
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        resp = ChatCompletionResponse(**head, choices=choices, usage=usage, speculation=spec)
    else:
        choices = [{"index": i, "text": t, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        resp = CompletionResponse(**head, choices=choices, usage=usage, speculation=spec)
    return JSONResponse(resp.model_dump())


async def _cancel_on_disconnect(request: Request, run: Run) -> None:
    """A non-streaming client that goes away cancels its sequences."""
    while not run.finished:
        if await request.is_disconnected():
            request.state.client_gone = True
            run.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


async def _events(request: Request, body: Any, run: Run, head: dict, prompt_tokens: int,
                  chat_format: bool):
    """SSE ``data:`` payloads: a chunk per step, each choice's finish, a final chunk with the
    speculation figures (and usage, if asked), then ``[DONE]``."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    kind = "chat.completion.chunk" if chat_format else "text_completion"

    def chunk(choices: list[dict], **more: Any) -> str:
        return json.dumps({**head, "object": kind, "choices": choices, **extra, **more})

    try:
        if chat_format:  # OpenAI opens each choice with the assistant's role
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None} for c in run.choices])
        async for d in run.deltas():
            yield chunk([_choice(d, chat_format)], **_origins(d))
        spec = run.stats().to_dict()
        final = {"usage": _usage(prompt_tokens, run.completion_tokens)} if include_usage else {}
        yield chunk([], speculation=spec, **final)
    except GenerationFailed as e:  # OpenAI clients raise on a chunk that carries "error"
        yield json.dumps(error_body(f"generation failed: {e}", "server_error",
                                    code="generation_failed"))
    except BaseException:  # cancelled: the client went away (or the server is stopping)
        request.state.client_gone = True
        run.cancel()
        raise
    yield "[DONE]"


def _choice(d: Delta, chat_format: bool) -> dict:
    if chat_format:
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        return {"index": d.index, "delta": delta, "finish_reason": d.finish_reason,
                "logprobs": None}
    return {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
            "logprobs": None}


def _origins(d: Delta) -> dict:
    return {"nodraft": {"tokens": d.tokens, "rejected": d.rejected}} if d.tokens else {}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
