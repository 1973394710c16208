"""The wire format: OpenAI's request and response shapes, plus nodraft's extensions.

Extensions, which OpenAI clients pass with ``extra_body`` and ignore in responses:

- request ``speculation``: a drafter name or ``{"method": ..., **params}`` (DESIGN.md);
  absent or null means the server's default. ``top_k`` (0 = no limit), as vLLM has it.
- response ``speculation``: the request's figures (drafted, accepted, acceptance_rate,
  target_passes, tokens_per_pass, draft_cost, estimated_speedup, accepted_by_position);
  for ``n`` > 1, summed over the choices. When streaming, in the final chunk.
- stream chunk ``nodraft``: where each token of the step came from --
  ``{"tokens": [{"id", "text", "origin": "accepted" | "bonus"}], "rejected": [...]}`` --
  for the playground. Token texts concatenate to the choice's text (a token that ends
  inside a UTF-8 character has text "" and the next one carries the character).

Every request model forbids unknown fields: a parameter nodraft cannot honour is a 400
naming it, never silently ignored. The OpenAI parameters in ``UNSUPPORTED`` are accepted
only with their neutral value (``presence_penalty: 0``, ``logprobs: null``, ...), which
some clients always send.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_STOP = 4

# parameter -> the values that ask for nothing (accepted and dropped)
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
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
    return stops


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="micro or micro-layerskip (GET /v1/models)",
                       examples=["micro"])
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description="0 = greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = no limit (extension)")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Annotated[Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None,
                    AfterValidator(_stop_list)] = Field(
        None, description=f"up to {MAX_STOP} strings; the text stops before the first one")
    n: int = Field(1, ge=1, le=MAX_N, description="independent choices")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: str | dict[str, Any] | None = Field(
        None, description='drafter: "prompt_lookup" or {"method": "early_exit", '
        '"exit_layer": 2}; null = the server default')
    user: str | None = Field(None, description="an end-user id (not used for generation)")

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        """Drop unsupported OpenAI parameters that carry their neutral value; any other
        value stays and is rejected by ``extra="forbid"``, naming the parameter."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items()
                    if not (k in UNSUPPORTED and any(_same(v, n) for n in UNSUPPORTED[k]))}
        return data


class CompletionRequest(_Request):
    prompt: (Annotated[Text, Field(max_length=200_000)]
             | Annotated[list[Text], Field(min_length=1, max_length=MAX_N)]
             | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_N)]) = Field(
        description="text, a batch of texts, token ids, or a batch of token-id lists")
    max_tokens: int | None = Field(16, ge=1, description="default 16, as OpenAI")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the room left in the "
                                   "context")
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens")


# -- responses -----------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Speculation(BaseModel):
    """The request's speculation figures (``engine.stats.SpecStats.to_dict``)."""

    model_config = ConfigDict(extra="allow")
    method: str
    drafted: int
    accepted: int
    acceptance_rate: float | None = Field(description="accepted / drafted; null if drafted = 0")
    target_passes: int
    tokens_per_pass: float | None
    draft_cost: float
    estimated_speedup: float | None
    accepted_by_position: list[int]
    drafter_errors: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


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
