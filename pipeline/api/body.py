"""A request's body: read within its byte limit (413), then validated (400 naming the field)."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from moonserve.pipeline.api.errors import APIError, from_validation_error


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes",
                    code="request_too_large")


def parse_body(model: type[BaseModel], raw: bytes):
    """`raw` JSON validated as `model`; a 400 naming the first offending field otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
