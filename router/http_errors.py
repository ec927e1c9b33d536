"""The HTTP API's answers that are not a model's: errors in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the status a gRPC code maps to and a
`Retry-After` header where the router has a retry hint; and the JSON and server-sent event
encodings. Torch-free."""
from __future__ import annotations

import math
from typing import Any

import grpc
import orjson
from aiohttp import web

from router.attempt import RequestFailed

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC status -> HTTP status; anything else is 500 (never a caller's mistake)."""
GRPC_STATUS = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
               404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
               409: grpc.StatusCode.ALREADY_EXISTS, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
"""HTTP status -> the gRPC status an access line gives it; any other 4xx is INVALID_ARGUMENT, 5xx INTERNAL."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
               413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled",
               503: "service_unavailable_error", 504: "timeout_error"}
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def error(status: int, message: str, param: str | None = None, code: str | int | None = None,
          retry_after_s: float | None = None) -> web.Response:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "internal_error"), "param": param,
                      "code": code if code is not None else status}}
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers, dumps=dumps)


def failed(e: RequestFailed) -> web.Response:
    return error(HTTP_STATUS.get(e.code, 500), e.message, code=e.code.name.lower(), retry_after_s=e.retry_after_s)


def grpc_status(http_status: int) -> grpc.StatusCode:
    """What an HTTP answer's status is as a gRPC status (the access log's one scale)."""
    fallback = grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL
    return GRPC_STATUS.get(http_status, fallback)


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def sse(value: Any) -> bytes:
    return b"data: " + orjson.dumps(value) + b"\n\n"
