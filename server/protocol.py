"""The wire format: OpenAI's request and response shapes, plus nodraft's extensions.

Extensions, which OpenAI clients pass with ``extra_body`` and ignore in responses:

- request ``speculation``: a drafter name or ``{"method": ..., **params}`` (each drafter's
  ``Params``, listed by ``GET /v1/models``); absent or null means the server's default. ``top_k`` (0 = no limit), as vLLM has it.
- response ``speculation``: the request's figures (drafted, accepted, acceptance_rate,
  target_passes, tokens_per_pass, draft_cost, estimated_speedup, measured_cost_speedup
  with its plain/verify/draft seconds, accepted_by_position;
  defined in docs/ARCHITECTURE.md, "Words, formulas and metric names"); for ``n`` > 1,
  summed over the choices. When streaming, in the final chunk.
- stream chunk ``nodraft``: where each token of the step came from --
  ``{"tokens": [{"id", "text", "origin": "accepted" | "bonus"}], "rejected": [...]}`` --
  for the playground. A token is reported in the chunk that releases its text, so the
  tokens' texts concatenate to the choice's text, stop strings included (a token that ends
  inside a UTF-8 character has text "" and the next one carries the character).

Every request model forbids unknown fields: a parameter nodraft cannot honour is a 400
naming it, never silently ignored. The OpenAI parameters in ``UNSUPPORTED`` are accepted
only with their neutral value (``presence_penalty: 0``, ``logit_bias: {}``, ...), which
some clients always send.

JSON types are strict, as OpenAI's are: an integer field takes a JSON integer only (not
``16.0``, ``"16"`` or ``true``), a boolean field ``true``/``false`` only, a string field a
string only; a number field takes integers and floats. A lone surrogate (``"\\ud800"``)
anywhere in the body -- a value or a key, at any depth, ``speculation``'s parameter names
included -- is a 400 naming where it is, before any other check (``_reject_lone_surrogates``).

Differences from OpenAI's limits: ``stop`` takes up to ``MAX_STOP`` (16) strings of at most
``MAX_STOP_CHARS`` (256) characters each (OpenAI: 4); a chat message's ``name`` is accepted
and not rendered (micro's chat template has no place for it: ``server.chat``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_STOP = 16  # OpenAI allows 4; lm-eval's code tasks send 6
MAX_STOP_CHARS = 256  # a stop string's length bounds the text held back at every step
MAX_LOGPROBS = 20  # alternatives per token (OpenAI: completions 5, chat 20)
STRICT = ConfigDict(extra="forbid", strict=True)

# parameter -> the values that ask for nothing (accepted and dropped)
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}


def _same(a: Any, b: Any) -> bool:
    """Equal, with booleans kept apart from numbers (``0`` is not ``False``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it contains a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]


def _stop_list(v: str | list[str] | None) -> list[str]:
    stops = [] if v is None else [v] if isinstance(v, str) else list(v)
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
    return stops


def _has_lone_surrogate(s: str) -> bool:
    if s.isascii():  # O(1) for a str object
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_CONTAINERS = frozenset((str, dict, list))


def _lone_surrogate(where: tuple, key: bool) -> PydanticCustomError:
    path = ".".join(map(str, where))
    return PydanticCustomError(
        "lone_surrogate", "{what} contains a lone surrogate (an unpaired \\ud800-\\udfff "
        "escape), which is not valid Unicode",
        {"what": (f"a key of {path}" if path else "a top-level key") if key
         else path or "the request body", "param": path or None})


def _reject_lone_surrogates(data: Any) -> None:
    """Raise a ``lone_surrogate`` error (ctx ``param``: the dotted path) for the first key
    or string in ``data`` holding an unpaired UTF-16 surrogate, which UTF-8 cannot encode
    (a JSON ``\\udXXX`` escape can smuggle one in). Iterative, so any depth is safe; the
    keys of a dict are checked before its values, so a reported path holds none."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        kind = type(value)
        if kind is str:
            if _has_lone_surrogate(value):
                raise _lone_surrogate(path, key=False)
        elif kind is dict:
            if any(type(k) is str and _has_lone_surrogate(k) for k in value):
                raise _lone_surrogate(path, key=True)
            stack.extend((v, (*path, k)) for k, v in reversed(value.items())
                         if type(v) in _CONTAINERS)
        elif kind is list and any(map(_CONTAINERS.__contains__, map(type, value))):
            stack.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value)))
                         if type(v) in _CONTAINERS)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Request(BaseModel):
    """Fields common to both endpoints."""

    model_config = STRICT

    model: str = Field(description="micro or micro-layerskip (GET /v1/models)",
                       examples=["micro"])
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description="0 = greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = no limit (extension)")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Annotated[Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None,
                    AfterValidator(_stop_list)] = Field(
        None, description=f"up to {MAX_STOP} strings (OpenAI: 4) of at most "
        f"{MAX_STOP_CHARS} characters; the text stops before the first one")
    n: int = Field(1, ge=1, le=MAX_N, description="independent choices")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: str | dict[str, Any] | None = Field(
        None, description='drafter: "prompt_lookup" or {"method": "early_exit", '
        '"exit_layer": 2}; null = the server default')
    user: str | None = Field(None, description="an end-user id (not used for generation)")

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        """Reject lone surrogates anywhere; drop unsupported OpenAI parameters that carry
        their neutral value (any other value stays and is rejected by ``extra="forbid"``,
        naming the parameter)."""
        _reject_lone_surrogates(data)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if not (k in UNSUPPORTED and any(_same(v, n) for n in UNSUPPORTED[k]))}
        return data


class CompletionRequest(_Request):
    # a text's length is checked against the context before it is tokenised (server.api)
    prompt: (Text
             | Annotated[list[Text], Field(min_length=1, max_length=MAX_N)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_N)]) = Field(
        description="text, a batch of texts, token ids, or a batch of token-id lists")
    max_tokens: int | None = Field(16, ge=1, description="default 16, as OpenAI")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "each returned token's logprob and the N most likely alternatives' (up to "
        f"{MAX_LOGPROBS}), under the target's own distribution (no temperature or top-p)"))
    echo: bool | None = Field(False, description="the prompt first, in the text (and its tokens' "
                       "logprobs with logprobs set)")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]
    name: Annotated[Text, Field(max_length=256)] | None = Field(
        None, description="the participant's name: accepted, and not rendered (micro's chat "
        "template has no place for it)")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the server's "
                                   "--chat-max-tokens-default, at most the room left in "
                                   "the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens")
    logprobs: bool | None = Field(False, description="each returned token's logprob, under the "
                           "target's own distribution (no temperature or top-p)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        f"with logprobs: the N most likely alternatives per token (up to {MAX_LOGPROBS})"))


# -- responses -----------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # read from the prefix cache, not prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Speculation(BaseModel):
    """The request's speculation figures (``engine.stats.SpecStats.to_dict``)."""

    model_config = ConfigDict(extra="allow")
    method: str
    drafted: int
    accepted: int
    acceptance_rate: float | None = Field(description="accepted / drafted; null if drafted = 0")
    target_passes: int
    tokens_per_pass: float | None
    draft_cost: float = Field(description="the drafters' modelled compute, summed over the "
                              "request's passes, in target-pass units")
    estimated_speedup: float | None = Field(
        description="the course's estimate: (accepted + passes) / (passes + draft_cost); "
                    "every pass priced at one target pass whatever its rows")
    measured_cost_speedup: float | None = Field(
        None, description="plain_seconds / (verify_seconds + draft_seconds): the request's "
                          "passes priced by what a pass of that many rows measured on this "
                          "machine, plus the drafter's timed work; as if it ran alone")
    plain_seconds: float = Field(0.0, description="seconds plain decoding would have spent on "
                                                  "the tokens the passes emitted")
    verify_seconds: float = Field(0.0, description="seconds the passes cost by their rows, "
                                                   "measured on this machine")
    draft_seconds: float = Field(0.0, description="the drafter's own wall time, in seconds")
    accepted_by_position: list[int]
    drafter_errors: int = 0


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) format: per token, its text, logprob (null for an
    echoed prompt's first token), the alternatives by text, and its offset in ``text``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: Speculation


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: Speculation


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nodraft"
    max_model_len: int
    speculation_methods: dict[str, dict] = Field(
        description="every drafter with its parameters and their defaults")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
