"""One function maps every exception to an OpenAI error body with the right status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "context_length_exceeded"}}

Routes raise ``APIError`` for what they check themselves (admission's 429 with its
measured ``Retry-After`` included: ``server.admission``); the rest arrive here as the
engine's and the registry's own exceptions (``QueueFull`` -> 429, should the engine
client refuse after admission, ``EngineStopped`` and ``EngineDead`` -> 503,
``SpeculationError`` -> 400), FastAPI's validation errors (-> 400, not FastAPI's 422: the
first, most specific error, naming the field by its dotted path, with the JSON type that
was sent when it was the wrong one) and Starlette's HTTP exceptions (404, 405, a body that
is not UTF-8 or is nested too deeply). A body sent without a JSON ``Content-Type`` is a
400 saying so. Anything else is a bug: 500, logged with its traceback, and its text is not
echoed to the client.

Any input renders: an error's message and param may quote what the client sent (a
parameter's name, a value), which may hold characters UTF-8 cannot encode (a lone
surrogate); ``error_body`` writes those as backslash escapes (``\\ud800``), so building
the error itself can never fail.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nodraft.drafters.registry import SpeculationError
from nodraft.engine.core import EngineDead, EngineStopped, QueueFull
from nodraft.server.protocol import UNSUPPORTED

log = logging.getLogger("nodraft.server")

RETRY_AFTER_SECONDS = 1

_TYPE_BY_STATUS = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    429: "rate_limit_error", 503: "service_unavailable", 500: "server_error",
}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}
_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


class APIError(Exception):
    """An error the API chose to return, with its status and OpenAI fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; ``message`` and ``param`` made printable (module docstring)."""
    return {"error": {"message": printable(message), "type": type,
                      "param": None if param is None else printable(param), "code": code}}


def to_api_error(exc: Exception) -> APIError:
    """The one mapping from an exception to what the client is told."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, SpeculationError):
        return APIError(400, str(exc), param=exc.param, code="invalid_speculation")
    if isinstance(exc, QueueFull):
        return APIError(429, f"the server is busy ({exc}); retry after {RETRY_AFTER_SECONDS} s",
                        code="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineDead):
        return APIError(503, f"the engine is not running ({exc}); the server is restarting",
                        code="engine_dead")
    if isinstance(exc, EngineStopped):
        return APIError(503, "the server is shutting down and takes no new requests",
                        code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})", code="internal_error")


def error_response(exc: Exception) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(error_body(err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


async def handle_exception(request: Any, exc: Exception) -> JSONResponse:
    """FastAPI exception handler: every handled exception goes through ``error_response``.
    A body FastAPI did not parse as JSON (no JSON ``Content-Type``) is named as such."""
    if isinstance(exc, RequestValidationError) and isinstance(exc.body, (bytes, bytearray)):
        exc = content_type_error(request.headers.get("content-type"))
    return error_response(exc)


def content_type_error(content_type: str | None) -> APIError:
    """A body sent without ``Content-Type: application/json`` is not read as JSON (FastAPI's
    strict content type: a page on another site can send ``text/plain`` without a CORS
    preflight, so such bodies must not be acted on)."""
    given = f"the Content-Type {content_type!r}" if content_type else "no Content-Type"
    return APIError(400, f"the request body must be JSON, sent with Content-Type: "
                    f"application/json (this request has {given})", code="invalid_content_type")


def _http_error(exc: HTTPException) -> APIError:
    status = exc.status_code
    if status == 404:
        return APIError(404, "no such endpoint", code="unknown_url")
    if status == 405:
        return APIError(405, "method not allowed on this endpoint", code="method_not_allowed",
                        headers=exc.headers)
    if status == 400:  # the body could not be read as JSON
        if isinstance(exc.__cause__, RecursionError):
            return APIError(400, "the request body is nested too deeply to parse",
                            code="invalid_json")
        return APIError(400, "the request body could not be parsed: send UTF-8 JSON",
                        code="invalid_body")
    return APIError(status, str(exc.detail), headers=exc.headers)


def _param(loc: tuple, key: bool = False) -> str | None:
    """Dotted field path from a pydantic location, without ``body`` and union members'
    tags (``str``, ``list[int]``, ``function-after[...]``). ``key``: the location ends at a
    key the client sent (an unknown field), kept whatever it is."""
    loc = tuple(loc[1:] if loc and loc[0] == "body" else loc)
    last = loc[-1:] if key else ()
    parts = []
    for p in loc[:len(loc) - len(last)]:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and p not in _UNION_TAGS and "[" not in p:
            parts.append(p)
    parts.extend(str(p) for p in last)
    return ".".join(parts) or None


def _got(error: dict) -> str:
    """`` (got a string)`` for a type error (strict JSON types), else ""."""
    if not _is_type_error(error) or "input" not in error:
        return ""
    kind = _JSON_TYPES.get(type(error["input"]))
    return f" (got {kind})" if kind else ""


def _specific(errors: list[dict]) -> dict:
    """The error to report: the first, unless it is a union member's type error and a
    member whose type fits has a more specific complaint about the value (an unknown key
    inside it, a bad item) -- then the first such complaint."""
    first = errors[0]
    if not _is_type_error(first):
        return first
    where = _param(tuple(first.get("loc", ()))) or ""
    for e in errors:
        p = _param(tuple(e.get("loc", ())), key=e.get("type") == "extra_forbidden") or ""
        if not _is_type_error(e) and (p == where or p.startswith(where + ".") or not where):
            return e
    return first


def _validation_error(errors: list[dict]) -> APIError:
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = _specific(errors)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "),
                        code="invalid_json")
    if first.get("type") == "lone_surrogate":
        return APIError(400, first["msg"], param=(first.get("ctx") or {}).get("param"),
                        code="invalid_unicode")
    if first.get("type") == "extra_forbidden":
        param = _param(tuple(first.get("loc", ())), key=True)
        message = (f"{param} is not supported by this server; leave it out"
                   if param in UNSUPPORTED else f"unrecognized request argument: {param}")
        return APIError(400, message, param=param, code="unsupported_parameter")
    param = _param(tuple(first.get("loc", ())))
    if param is None:  # the body as a whole
        message = ("the request body is missing" if first.get("type") == "missing"
                   else "the request body must be a JSON object" if first.get("type") in (
                       "model_attributes_type", "model_type", "dict_type")
                   else "invalid request: " + first["msg"])
        return APIError(400, message, code="invalid_body")
    mine = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    field = param.rsplit(".", 1)[-1]
    if _is_type_error(first) and field in _UNIONS:  # no member's type fits
        got = "" if isinstance(first.get("input"), list) else _got(first)
        return APIError(400, f"{param} must be {_UNIONS[field]}{got}", param=param,
                        code="invalid_value")
    if any(not _is_type_error(e) for e in mine):  # the value's type fits; its content not
        mine = [e for e in mine if not _is_type_error(e)]
    msgs = []
    for e in mine:
        if e["msg"] + _got(e) not in msgs:
            msgs.append(e["msg"] + _got(e))
    return APIError(400, f"{param}: {'; or '.join(msgs)}", param=param, code="invalid_value")


# the request fields that take one of several JSON types: what to say when none fits
_UNIONS = {
    "prompt": "a string, an array of strings, an array of token ids (integers) or an array "
              "of arrays of token ids",
    "stop": "a string, an array of strings or null",
    "content": "a string or an array of text parts ({\"type\": \"text\", \"text\": ...})",
    "speculation": "a method name, an object with a string \"method\", or null",
}


def _is_type_error(error: dict) -> bool:
    return error.get("type", "").endswith("_type")
