"""OpenAI-style errors: every rejection the API makes is an `APIError`.

The body is always `{"error": {"message", "type", "param", "code"}}` so the `openai` client raises the
matching exception class (`BadRequestError` for 400, `NotFoundError` for 404, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError


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
# Tags of the content-part union: in `loc` a tag follows the part's list index.
CONTENT_PART_TAGS = {"text", "image_url"}


def field_loc(loc: tuple) -> tuple:
    """Drop the union-member labels and tagged-union tags pydantic adds to an error's `loc`."""
    out: list = []
    previous = None
    for part in loc:
        is_label = isinstance(part, str) and ("[" in part or part in _UNION_MEMBER_LABELS)
        is_tag = isinstance(previous, int) and part in CONTENT_PART_TAGS
        if not (is_label or is_tag):
            out.append(part)
        previous = part
    return tuple(out)
