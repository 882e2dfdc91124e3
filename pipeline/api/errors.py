"""OpenAI-style errors: every rejection the API makes is an `APIError`.

The body is always `{"error": {"message", "type", "param", "code"}}` so the `openai` client raises the
matching exception class (`BadRequestError` for 400, `NotFoundError` for 404, ...).
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field

import msgspec
from pydantic import ValidationError

logger = logging.getLogger("moonserve.router")

# The request id header Serve's proxy (and its HAProxy mode) sets on every request it forwards.
REQUEST_ID_HEADER = b"x-request-id"


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }


# A chat message's index in an error's message and param.
MESSAGE_INDEX = re.compile(r"messages\[(\d+)\]")


def in_fields(exc: APIError, origins: list[str], fields: list[tuple[re.Pattern, str]],
              index: re.Pattern = MESSAGE_INDEX) -> APIError:
    """An error of a chat request's validation in the field names of the API it was translated
    from: `messages[i]` (matched by `index`) becomes `origins[i]`, where chat message i came
    from, then each `(pattern, replacement)` of `fields` renames the rest."""
    def rename(text: str | None) -> str | None:
        if text is None:
            return None
        text = index.sub(lambda m: origins[int(m.group(1))]
                         if int(m.group(1)) < len(origins) else m.group(0), text)
        for pattern, replacement in fields:
            text = pattern.sub(replacement, text)
        return text

    exc.param, exc.message = rename(exc.param), rename(exc.message)
    return exc


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def format_loc(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """The most specific pydantic error, as a 400 naming the offending field.

    For a union (`content: str | list[part]`) pydantic reports one error per member; the deepest
    one points at the actual mistake (`messages[0].content[1].text`).
    """
    first = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    param = format_loc(field_loc(first["loc"])) or None
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param, first["type"])


# Labels pydantic puts in `loc` for the members of a union (`str`, `list[...]`, `function-after`).
_UNION_MEMBER_LABELS = {"str", "int", "float", "bool", "dict", "function-after", "function-plain"}
# Tags of the content-part and item unions: in `loc` a tag follows the part's list index.
CONTENT_PART_TAGS = {"text", "image_url",
                     # the Responses API's content parts and input items
                     "input_text", "input_image", "output_text", "message", "function_call",
                     "function_call_output", "reasoning",
                     # the Messages API's content blocks
                     "image", "tool_use", "tool_result", "thinking"}
# Tags of the unions a field holds: in `loc` the tag follows the field's name.
FIELD_TAGS = {"source": {"base64", "url"},
              "format": {"text", "json_object", "json_schema"},
              "response_format": {"text", "json_object", "json_schema"}}


def field_loc(loc: tuple) -> tuple:
    """Drop the union-member labels and tagged-union tags pydantic adds to an error's `loc`."""
    out: list = []
    previous = None
    for part in loc:
        # A model class among a union's members (`FunctionChoice`): API fields are snake_case.
        is_label = isinstance(part, str) and ("[" in part or part in _UNION_MEMBER_LABELS
                                              or part[:1].isupper())
        is_tag = (isinstance(previous, int) and part in CONTENT_PART_TAGS) or \
            (isinstance(previous, str) and part in FIELD_TAGS.get(previous, ()))
        if not (is_label or is_tag):
            out.append(part)
        previous = part
    return tuple(out)


class InternalErrors:
    """ASGI middleware: an exception that escapes a handler is logged once, with its traceback,
    and answered as an OpenAI-shaped 500 naming the request id (the `x-request-id` Serve's proxy
    set, else a new one, sent back as that header). `request.state.request_id` holds the id.

    Example:
        >>> app.add_middleware(InternalErrors)       # a FastAPI app; doctest: +SKIP
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER)
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_started(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not given:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:
            logger.exception("request %s: unhandled error", request_id)
            if not started:  # past the headers the connection just ends
                await send_internal_error(send, request_id, exc)


async def send_internal_error(send, request_id: str, exc: Exception) -> None:
    error = APIError(500, f"internal error ({type(exc).__name__}) in request {request_id}; the "
                     "server logged it under that id", type="internal_error", code="internal_error")
    body = msgspec.json.encode(error.body())
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (REQUEST_ID_HEADER, request_id.encode())]})
    await send({"type": "http.response.body", "body": body})
