"""Errors in the OpenAI error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

Routers raise `APIError`; FastAPI's validation errors and unexpected exceptions are mapped
here too, so every error body a client sees has this shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineStoppedError, RequestFailedError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 422: "invalid_request_error",
          409: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _is_json(content_type: str) -> bool:
    """application/json, with or without parameters, or any application/...+json (as FastAPI reads)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# Where a field's type is a union (prompt: str | list[str] | ...), pydantic puts the member it
# tried into the error's location: ("prompt", "list[str]", 0), ("body", "TokenizeChatRequest",
# "messages"). Such a part is a type's name, never a field of the API (snake_case names): a
# builtin's, one with parameters ("list[int]", "function-after[...]"), or a class's.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_name(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part[:1].isupper())


def _field_path(loc) -> str:
    """An error location as the request's field path ("messages.0.content"), "" for the body."""
    return ".".join(str(p) for p in loc if p != "body" and not _is_type_name(p))


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type),
                            status_code=exc.status)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        # e.g. the request's adapter failed to load (missing or corrupt files, wrong shapes)
        return JSONResponse(error_body(exc.status, str(exc), code=exc.code), status_code=exc.status)

    @app.exception_handler(EngineStoppedError)
    async def _engine_stopped(_: Request, exc: EngineStoppedError) -> JSONResponse:
        # The engine loop crashed under this request (logged once, by the engine thread).
        return JSONResponse(error_body(503, str(exc), type="service_unavailable", code="engine_stopped"),
                            status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # Body that is not JSON at all, or JSON with wrong or missing fields: 400, as OpenAI
        # and vLLM answer both (FastAPI's 422 is, for the official client, no BadRequestError).
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse(error_body(400, "The request body is not valid JSON.", code="invalid_json"),
                                status_code=400)
        # FastAPI reads a body as JSON only when its content type says so; any other body
        # reaches validation as bytes ("not a valid dictionary"). Say what is wrong: 415.
        content_type = request.headers.get("content-type", "")
        if content_type and not _is_json(content_type) and any(
                tuple(e.get("loc", ())) == ("body",) and e.get("type") in ("model_attributes_type", "dict_type")
                for e in errors):
            return JSONResponse(error_body(
                415, f"The request body must be JSON, sent with Content-Type: application/json "
                     f"(this one came as {content_type!r}).", code="unsupported_media_type"), status_code=415)
        param = _field_path(errors[0].get("loc", ())) if errors else ""
        # One line per field and message: a union's members may each say the same.
        msg = "; ".join(dict.fromkeys(f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors))
        return JSONResponse(error_body(400, msg, param=param or None, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)
