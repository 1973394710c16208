"""The routes: validate, admit, tokenise off the event loop, submit, stream the text back.

Order of work, cheapest first, so that nothing slow runs before a request is known to be
served: the body is parsed and validated (strict JSON types: ``server.protocol``; a valid
body by ``server.app.DirectGeneration``, which calls the route without FastAPI's request
handling, and any other by FastAPI, whose error the client gets: ``direct_body``); the
model, ``speculation`` and the other parameters are checked; a prompt text is measured
against the context; the request is *admitted* (``server.admission``: a 429 with
``Retry-After`` at once when its sequences do not fit); only then is its text tokenised
and, for chat, templated -- on the text worker thread, off the event loop, unless the
text is so short that the hop to the worker would cost more (``Service.text_work``) -- and
its sequences submitted to the engine.

Prompt text limit: a prompt text (a completion prompt, or all of a chat's message contents
together) of more than ``(context - 1) x L`` bytes of UTF-8, L being the longest token's
length in bytes (41 for micro's tokenizer, so 41,943 bytes), is a 400
``context_length_exceeded`` before it is tokenised: every token covers at most L bytes, so
it would be more than ``context - 1`` tokens. A text under that limit is tokenised, then
held to the context rule.

Context rule (OpenAI's): a prompt gets a 400 when it leaves no room for one generated
token (at most ``context - 1`` = 1023 prompt tokens for micro), and so does an explicit
``max_tokens`` larger than the room left (prompt + max_tokens > context). Without
``max_tokens``, completions generate up to 16 tokens (OpenAI's default) and chat up to
``--chat-max-tokens-default`` (256), each clamped to the room left. Generation is never
cut short silently.

A temperature below ``engine.verify.GREEDY_BELOW`` (1e-5, vLLM's threshold) decodes
greedily, and however small ``top_p`` is, the most likely token is kept (``SamplingParams``).

An empty completion prompt starts from ``<|endoftext|>``, the document boundary micro was
trained on. ``n`` choices per prompt are independent sequences; with a ``seed``, choice k
samples with its own stream ``derive_seed(seed, k)``, and the text is a function of the
prompt, the parameters, the seed and the model only: the same under every ``speculation``
setting, alone or batched (``engine.sampling``). ``usage.prompt_tokens`` counts each prompt
once; ``usage.completion_tokens`` counts the tokens whose text was returned (at a stop
string, not those generated past it: ``server.generation``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from nodraft.drafters.registry import DrafterEnv
from nodraft.server import chat
from nodraft.engine.core import EngineStopped, GenerationRequest, QueueFull
from nodraft.server.errors import APIError, error_body
from nodraft.server.generation import Delta, GenerationFailed, Run
from nodraft.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                             CompletionResponse, ErrorResponse, ModelCard, ModelList)
from nodraft.engine.sampling import derive_seed
from nodraft.engine.verify import SamplingParams
from nodraft.micro.tokenizer import Tokenizer

ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}
DISCONNECT_POLL_SECONDS = 0.25

router = APIRouter()


@router.get("/health", summary="liveness: answers while generation runs (HEAD too)",
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


@router.get("/ready", summary="readiness: models loaded and not draining (HEAD too)",
            responses={503: {"model": ErrorResponse}})
async def ready(request: Request) -> Response:
    service = request.app.state.service
    if not service.ready:
        return JSONResponse(error_body("not ready: " + service.status, "service_unavailable",
                                       code="not_ready"), status_code=503)
    return JSONResponse({"status": "ready"})


# probes that send HEAD get the same status, without a body (kept out of the schema: one
# operation per path)
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", summary="Prometheus exposition", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.service.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(request: Request) -> ModelList:
    s = request.app.state.service
    methods = s.registry.describe()
    return ModelList(data=[_card(s, name, methods) for name in s.models])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
async def model(model: str, request: Request) -> ModelCard:
    """One model's card, as in ``GET /v1/models``; 404 (``model_not_found``) for an id
    that is not served."""
    s = request.app.state.service
    _served(s, model)
    return _card(s, model, s.registry.describe())


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Response:
    service = request.app.state.service
    method, params = _check(request, body)
    items = _completion_items(body, service)
    explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
    with _admit(service, len(items) * body.n):
        size = sum(_utf8_len(item) for item in items if isinstance(item, str))
        prompts = await service.text_work(size, _encode, service.tokenizer, items)
        run = _start(service, body, method, params, prompts, explicit, body.max_tokens or 16,
                     (), body.logprobs, bool(body.echo))
    return await _respond(request, body, run, prompts, chat_format=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service = request.app.state.service
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both",
                       param="max_completion_tokens")
    method, params = _check(request, body)
    messages = [(m.role, m.text()) for m in body.messages]
    size = sum(_utf8_len(text) for _, text in messages)
    _check_text_size(size, service, "messages", "the messages' contents are")
    explicit = body.max_tokens or body.max_completion_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    with _admit(service, body.n):
        prompt = await service.text_work(size, chat.render, messages, service.tokenizer)
        run = _start(service, body, method, params, [prompt], explicit,
                     service.settings.chat_max_tokens_default,
                     chat.stop_token_ids(service.tokenizer), top)
    return await _respond(request, body, run, [prompt], chat_format=True)


# -- the generation routes without FastAPI's request handling --------------------------------
# path -> (the body's model, the route): what ``server.app.DirectGeneration`` serves itself
DIRECT_ROUTES = {"/v1/completions": (CompletionRequest, completions),
                 "/v1/chat/completions": (ChatCompletionRequest, chat_completions)}


def direct_body(model: type, content_type: str | None, body: bytes) -> Any:
    """The route's body as FastAPI would give it -- ``json.loads`` (its ``Request.json``),
    then the pydantic model in Python mode, strict -- or None wherever FastAPI would not
    give one, or might not: a ``Content-Type`` other than ``application/json`` (with or
    without parameters), a body that is not JSON, one the model rejects. For None the
    request goes to FastAPI, whose parse and errors are then the only ones a client meets."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        return None
    try:
        return model.model_validate(json.loads(body))
    except Exception:  # ValueError (JSON, validation), RecursionError, ...: FastAPI says which
        return None


# -- from a request to sequences -------------------------------------------------------------
def _card(service, name: str, methods: dict) -> ModelCard:
    return ModelCard(id=name, created=service.created[name], max_model_len=service.context,
                     speculation_methods=methods)


def _served(service, model: str) -> None:
    if model not in service.models:
        raise APIError(404, f"the model {model!r} does not exist; available: "
                       + ", ".join(service.models), param="model", code="model_not_found")


def _check(request: Request, body: Any) -> tuple[str, Any]:
    """What is checked before admission, without tokenising: the model, ``speculation``
    (its canonical method and parameters are returned), ``stream_options``, that the
    request's sequences could ever fit, and that the server is not draining."""
    service = request.app.state.service
    _served(service, body.model)
    method, params = service.registry.parse(body.speculation, service.settings.speculation)
    request.state.speculation_method = method
    service.registry.check(method, params, DrafterEnv(
        body.model, None, checkpoint_dir=service.checkpoint_dir))
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")
    prompts = (len(body.prompt) if isinstance(body, CompletionRequest)
               and isinstance(body.prompt, list) and body.prompt
               and not isinstance(body.prompt[0], int) else 1)
    total, capacity = prompts * body.n, service.admission.capacity
    if total > capacity:
        raise APIError(400, f"{total} sequences (n x prompts) is more than this server holds "
                       f"at once ({capacity})", param="n")
    if service.draining:
        raise EngineStopped("draining")
    return method, params


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _check_text_size(size: int, service, param: str, what: str) -> None:
    """The prompt text limit (module docstring)."""
    if size > service.max_prompt_bytes:
        raise APIError(400, f"{what} {size} bytes of UTF-8; the context holds "
                       f"{service.context - 1} prompt tokens of at most "
                       f"{service.longest_token_bytes} bytes each, so a prompt text may have "
                       f"at most {service.max_prompt_bytes} bytes",
                       param=param, code="context_length_exceeded")


def _check_fits(n_tokens: int, ctx: int, param: str) -> None:
    if n_tokens > ctx - 1:
        raise APIError(400, f"the prompt is {n_tokens} tokens; the context holds {ctx} "
                       f"positions and needs room for at least one generated token, so a "
                       f"prompt may have at most {ctx - 1} tokens", param=param,
                       code="context_length_exceeded")


def _completion_items(body: CompletionRequest, service) -> list[str | list[int]]:
    """The request's prompts, each a text (within the text limit) or token ids (within
    the vocabulary and the context); cheap checks only, nothing tokenised."""
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    for item in p:
        if isinstance(item, str):
            _check_text_size(_utf8_len(item), service, "prompt", "the prompt is")
            continue
        _check_fits(len(item), service.context, "prompt")
        if any(not 0 <= t < service.tokenizer.vocab_size for t in item):
            raise APIError(400, f"prompt token ids must be in [0, {service.tokenizer.vocab_size})",
                           param="prompt")
    return list(p)


def _encode(tokenizer: Tokenizer, items: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt (on the text worker); an empty prompt is ``<|endoftext|>``."""
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    prompts = [next(encoded) if isinstance(item, str) else list(item) for item in items]
    return [ids or [tokenizer.eot_id] for ids in prompts]


@contextmanager
def _admit(service, sequences: int) -> Iterator[None]:
    """Admission (``server.admission``) for the block that prepares and submits the
    request; the engine client's own refusal, should it come, is the same 429."""
    with service.admission.reserve(sequences):
        try:
            yield
        except QueueFull:
            raise service.admission.refusal(sequences) from None


def _start(service, body: Any, method: str, params: Any, prompts: list[list[int]],
           explicit: int | None, default: int, stop_ids: tuple[int, ...],
           logprobs: int | None = None, echo: bool = False) -> Run:
    """Check the prompts against the context, then submit their sequences. ``logprobs``:
    None, or how many alternatives per token; ``echo``: the prompt leads the text (with
    its logprobs when ``logprobs`` is set)."""
    limits = _max_tokens(body, prompts, explicit, default, service.context)
    requests = []
    for ids, max_tokens in zip(prompts, limits):
        for k in range(body.n):
            seed = None if body.seed is None else derive_seed(body.seed, k)
            sampling = SamplingParams(body.temperature, body.top_p, body.top_k, seed)
            requests.append(GenerationRequest(body.model, ids, max_tokens, sampling, method,
                                              params, stop_ids, logprobs,
                                              echo and logprobs is not None))
    if service.draining:
        raise EngineStopped("draining")
    run = Run(service.client, service.tokenizer, requests, body.stop or [], echo)
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
        _check_fits(len(ids), ctx, "messages" if chat_format else "prompt")
        room = ctx - len(ids)
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
    lps: list[list[dict] | None] = [None] * len(run.choices)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, run))
    try:
        async for d in run.deltas():
            texts[d.index] += d.text
            reasons[d.index] = d.finish_reason or reasons[d.index]
            if d.logprobs is not None:
                lps[d.index] = (lps[d.index] or []) + d.logprobs
    except GenerationFailed as e:
        raise APIError(500, f"generation failed: {e}", code="generation_failed") from None
    finally:
        watcher.cancel()
        run.cancel()
    usage = _usage(prompt_tokens, run.completion_tokens, run.cached_tokens(body.n))
    spec = run.stats().to_dict()
    tok = run.tokenizer
    if chat_format:
        choices = [{"index": i, "message": {"role": "assistant", "content": t},
                    "finish_reason": r, "logprobs": _chat_logprobs(lp, tok, body)}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
        resp = ChatCompletionResponse(**head, choices=choices, usage=usage, speculation=spec)
    else:
        choices = [{"index": i, "text": t, "finish_reason": r,
                    "logprobs": _completion_logprobs(lp, tok, 0)}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
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

    offsets = [0] * len(run.choices)  # characters sent per choice (text_offset)
    try:
        if chat_format:  # OpenAI opens each choice with the assistant's role
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None} for c in run.choices])
        async for d in run.deltas():
            yield chunk([_choice(d, chat_format, run.tokenizer, body, offsets[d.index])],
                        **_origins(d))
            offsets[d.index] += len(d.text)
        spec = run.stats().to_dict()
        final = ({"usage": _usage(prompt_tokens, run.completion_tokens,
                                  run.cached_tokens(body.n))} if include_usage else {})
        yield chunk([], speculation=spec, **final)
    except GenerationFailed as e:  # OpenAI clients raise on a chunk that carries "error"
        yield json.dumps(error_body(f"generation failed: {e}", "server_error",
                                    code="generation_failed"))
    except BaseException:  # cancelled: the client went away (or the server is stopping)
        request.state.client_gone = True
        run.cancel()
        raise
    yield "[DONE]"


def _choice(d: Delta, chat_format: bool, tok: Tokenizer, body: Any, offset: int) -> dict:
    if chat_format:
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        return {"index": d.index, "delta": delta, "finish_reason": d.finish_reason,
                "logprobs": _chat_logprobs(d.logprobs, tok, body)}
    return {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
            "logprobs": _completion_logprobs(d.logprobs, tok, offset)}


def _token_text(tok: Tokenizer, token_id: int) -> str:
    """An alternative's text: its bytes decoded on their own (a token that ends inside a
    UTF-8 character shows U+FFFD)."""
    return tok.token_bytes(token_id).decode("utf-8", "replace")


def _completion_logprobs(entries: list[dict] | None, tok: Tokenizer, offset: int
                         ) -> dict | None:
    """``Delta.logprobs`` in the completions format; ``offset``: where the entries' text
    starts in the choice's text."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["text"])
    return {"tokens": [e["text"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_top(e, tok) for e in entries], "text_offset": offsets}


def _top(e: dict, tok: Tokenizer) -> dict[str, float] | None:
    """The alternatives by text, most likely first, and the token itself (as OpenAI: up
    to logprobs + 1 entries); where two tokens share a text, the more likely one's."""
    if e["top"] is None:
        return None
    out: dict[str, float] = {}
    for t, lp in e["top"]:
        out.setdefault(_token_text(tok, t), lp)
    out.setdefault(e["text"], e["logprob"])
    return out


def _chat_logprobs(entries: list[dict] | None, tok: Tokenizer, body: Any) -> dict | None:
    """``Delta.logprobs`` in the chat format: each token's text, logprob, UTF-8 bytes and
    its alternatives'."""
    if entries is None or not body.logprobs:
        return None
    def item(t: int, text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(tok.token_bytes(t))}
    return {"content": [{**item(e["id"], e["text"], e["logprob"]),
                         "top_logprobs": [item(t, _token_text(tok, t), lp) for t, lp in e["top"]]}
                        for e in entries], "refusal": None}


def _origins(d: Delta) -> dict:
    if not (d.tokens or d.rejected):
        return {}
    return {"nodraft": {"tokens": d.tokens, "rejected": d.rejected}}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
