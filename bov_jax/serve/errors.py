"""OpenAI's error shape for every failure: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"message": message, "type": kind, "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


def field_of(message: str) -> str | None:
    """The field a ValueError's message starts with ("max_tokens=...", "prompt: ...")."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.isidentifier() else None


def install(app: FastAPI) -> None:
    """Answer validation failures and `BadRequest`s with a 400 in OpenAI's error shape."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        if first["type"] == "json_invalid":
            return error_response(400, "the body is not valid JSON", None, "invalid_request_error")
        if first["type"] == "model_attributes_type":
            return error_response(
                400, "the body must be a JSON object", None, "invalid_request_error"
            )
        param = where[0] if where else None
        message = f"{'.'.join(where) or 'body'}: {first['msg']}"
        return error_response(400, message, param, "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def refused(_: Request, err: BadRequest) -> JSONResponse:
        return error_response(400, str(err), err.param, "invalid_request_error")
