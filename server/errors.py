"""One function maps every exception to an OpenAI error body with the right status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "context_length_exceeded"}}

Routes raise ``APIError`` for what they check themselves; the rest arrive here as the
engine's and the registry's own exceptions (``QueueFull`` -> 429, ``EngineStopped`` and
``EngineDead`` -> 503,
``SpeculationError`` -> 400), FastAPI's validation errors (-> 400, not FastAPI's 422) and
Starlette's HTTP exceptions (404, 405, a body that is not UTF-8). Anything else is a
bug: 500, logged with its traceback, and its text is not echoed to the client.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from drafters.registry import SpeculationError
from engine.core import EngineDead, EngineStopped, QueueFull
from server.protocol import UNSUPPORTED

log = logging.getLogger("nodraft.server")

RETRY_AFTER_SECONDS = 1

_TYPE_BY_STATUS = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    429: "rate_limit_error", 503: "service_unavailable", 500: "server_error",
}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class APIError(Exception):
    """An error the API chose to return, with its status and OpenAI fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
    """FastAPI exception handler: every handled exception goes through ``error_response``."""
    return error_response(exc)


def _http_error(exc: HTTPException) -> APIError:
    status = exc.status_code
    if status == 404:
        return APIError(404, "no such endpoint", code="unknown_url")
    if status == 405:
        return APIError(405, "method not allowed on this endpoint", code="method_not_allowed",
                        headers=exc.headers)
    if status == 400:  # Starlette could not read the body (e.g. it is not UTF-8)
        return APIError(400, "the request body could not be parsed: send UTF-8 JSON",
                        code="invalid_body")
    return APIError(status, str(exc.detail), headers=exc.headers)


def _param(loc: tuple) -> str | None:
    """Dotted field path from a pydantic location, without ``body`` and union tags."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and _NAME.match(p) and p not in _UNION_TAGS:
            parts.append(p)
    return ".".join(parts) or None


def _validation_error(errors: list[dict]) -> APIError:
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "),
                        code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        message = (f"{param} is not supported by this server; leave it out"
                   if param in UNSUPPORTED else f"unrecognized request argument: {param}")
        return APIError(400, message, param=param, code="unsupported_parameter")
    if param is None:  # the body as a whole
        message = ("the request body is missing" if first.get("type") == "missing"
                   else "the request body must be a JSON object" if first.get("type") in (
                       "model_attributes_type", "model_type", "dict_type")
                   else "invalid request: " + first["msg"])
        return APIError(400, message, code="invalid_body")
    msgs = []
    for e in errors:
        if _param(tuple(e.get("loc", ()))) == param and e["msg"] not in msgs:
            msgs.append(e["msg"])
    return APIError(400, f"{param}: {'; or '.join(msgs)}", param=param, code="invalid_value")
