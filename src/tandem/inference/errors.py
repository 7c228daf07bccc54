"""OpenAI-style error bodies, and the handlers that turn every failure into one.

Every error the server answers has the body `{"error": {"message", "type", "param", "code"}}`,
with vLLM's conventions (type = the error's class name, code = the HTTP status), so a client sees
the same shape from the native and the vLLM backend.
"""

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.inference.engine.api import EngineDeadError

log = logging.getLogger("tandem.inference")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request the server refuses; `param` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


class ErrorResponse(JSONResponse):
    """JSON in ASCII: a message that quotes the client's text still renders when that text holds a
    lone surrogate (JSON escapes allow one, and FastAPI's parser of the admin routes lets it through),
    which JSONResponse's UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(status, message, param), status_code=status)


def describe_validation_error(error: RequestValidationError) -> tuple[str, str | None]:
    """One message for all problems of a request body, and the first offending field's path."""
    problems: list[str] = []
    first_param: str | None = None
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        # pydantic puts the union member's type name into the path; it means nothing to a client
        loc = [p for p in loc if p not in ("str", "int") and not p.startswith(("list[", "function-"))]
        path = ".".join(loc)
        if item.get("type") == "json_invalid":
            problems.append(f"malformed JSON: {item.get('ctx', {}).get('error', item.get('msg'))}")
            continue
        if not path and item.get("type") == "missing":  # (no body at all)
            problems.append("the request has no body; expected a JSON object")
            continue
        if not path and item.get("type") in ("model_type", "model_attributes_type", "dict_type"):
            problems.append("the request body must be a JSON object")
            continue
        message = str(item.get("msg", "invalid value"))
        problems.append(f"{path}: {message}" if path else message)
        first_param = first_param or path or None
    return "; ".join(dict.fromkeys(problems)) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"{exc}; this server can no longer generate and is shutting down")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
