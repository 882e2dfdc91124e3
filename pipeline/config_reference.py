"""The configuration reference in docs/configuration.md, rendered from `AppConfig`'s fields.

`render()` walks the pydantic models under `AppConfig` (their `model_fields`, and the
`__pydantic_fields__` of the pydantic dataclasses among them) and writes one Markdown table per
section: key path, type, default (the default where that key sits, e.g. `router.deployment`'s
`max_ongoing_requests` is 256, the LanguageModel's 64) and the field's `description`. A model
used under more than one field (`DeploymentOptions`, `LaneLimits`) gets one table of its own,
and each field that uses it a row whose default lists what differs from that table's defaults.
`write()` puts the result between the two marker lines of the page; the rest of the page is
hand-written. tests/unit/test_config_reference.py fails when the page and `render()` differ.

Example:
    >>> "| `router.limits.max_request_bytes` | int > 0 | `1048576` |" in render()
    True
    >>> write(PAGE)          # `moonserve config-reference --write docs/configuration.md`
    False
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import annotated_types
import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from moonserve.pipeline.config import AppConfig

BEGIN = "<!-- generated: moonserve config-reference -->"
END = "<!-- end generated -->"
COMMAND = "moonserve config-reference --write docs/configuration.md"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
UNSET = " Unset (`null`) by default; the defaults below hold once it is set."


@dataclass(frozen=True)
class Row:
    key: str  # e.g. "router.limits.max_request_bytes"; in a shared table "*.deployment.num_cpus"
    type: str  # Markdown
    default: str  # Markdown
    description: str


@dataclass
class Section:
    heading: str  # Markdown
    intro: str
    rows: list[Row]


def model_fields(cls: type) -> dict[str, FieldInfo]:
    """The fields of a pydantic model or pydantic dataclass, in declaration order."""
    return getattr(cls, "model_fields", None) or cls.__pydantic_fields__


def is_model(annotation) -> bool:
    return isinstance(annotation, type) and (issubclass(annotation, BaseModel) or (
        dataclasses.is_dataclass(annotation) and hasattr(annotation, "__pydantic_fields__")))


def model_of(annotation) -> type | None:
    """The model class a field holds (`X` and `X | None` alike), else None."""
    options = typing.get_args(annotation) if is_union(annotation) else (annotation,)
    models = [a for a in options if is_model(a)]
    return models[0] if models else None


def is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def holders() -> Counter[type]:
    """Every model under AppConfig (AppConfig too), with how many fields hold it."""
    held: Counter[type] = Counter({AppConfig: 0})
    todo = [AppConfig]
    while todo:
        for field in model_fields(todo.pop()).values():
            if (sub := model_of(field.annotation)) is not None:
                if sub not in held:
                    todo.append(sub)
                held[sub] += 1
    return held


def shared_models() -> set[type]:
    """Models that more than one field holds: each gets one table of its own."""
    return {cls for cls, count in holders().items() if count > 1}


def default_instance(cls: type, value):
    """`value`, or the model's own defaults where the field defaults to None (e.g. `vision`)."""
    if value is not None and value is not PydanticUndefined:
        return value
    try:
        return cls()
    except (TypeError, ValueError):  # a field without a default
        return None


def field_default(field: FieldInfo):
    return field.get_default(call_default_factory=True)


def walk(cls: type, instance, path: str, intro: str, shared: set[type],
         uses: dict[type, list[str]]) -> Iterator[Section]:
    """The section of the model at `path` (`instance`: its value there, None where it has no
    default), then those of its unshared sub-models; `uses` collects where shared models sit."""
    rows, subsections = [], []
    for name, field in model_fields(cls).items():
        key = f"{path}.{name}" if path else name
        value = getattr(instance, name) if instance is not None else field_default(field)
        sub = model_of(field.annotation)
        description = field.description or ""
        if sub is None:
            rows.append(Row(key, type_text(field), value_text(value), description))
        elif sub in shared:
            uses.setdefault(sub, []).append(key)
            rows.append(Row(key, type_text(field), changed_text(sub, value), description))
        else:
            intro_of_sub = description + (UNSET if value is None else "")
            subsections.append((sub, default_instance(sub, value), key, intro_of_sub))
    if path:
        yield Section(f"`{path}`", intro, rows)
    for sub, value, key, intro_of_sub in subsections:
        yield from walk(sub, value, key, intro_of_sub, shared, uses)


def shared_sections(cls: type, paths: list[str], shared: set[type]) -> list[Section]:
    """One table for a model several fields hold; keys start at the paths' common part."""
    listed = ", ".join(f"`{p}`" for p in paths)
    intro = (f"{first_line(cls.__doc__)} The keys under {listed}; the default given there "
             "lists what differs from this table's.")
    sections = list(walk(cls, default_instance(cls, None), common_key(paths), intro,
                         shared - {cls}, {}))
    sections[0].heading = f"`{cls.__name__}`"
    return sections


def common_key(paths: list[str]) -> str:
    """`router.lanes.*` for router.lanes.{interactive,fifo}; `*.deployment` for x.deployment,
    y.z.deployment."""
    split = [p.split(".") for p in paths]
    head = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        head.append(parts[0])
    tail = []
    for parts in zip(*(reversed(s[len(head):]) for s in split)):
        if len(set(parts)) > 1:
            break
        tail.insert(0, parts[0])
    return ".".join([*head, "*", *tail])


def first_line(doc: str | None) -> str:
    return " ".join((doc or "").split("\n\n")[0].split())


def type_text(field: FieldInfo) -> str:
    return escape(annotation_text(field.annotation, field.metadata))


def annotation_text(annotation, metadata=()) -> str:
    """`int > 0`, `` `a` | `b` ``, `list[str]`, `LaneLimits`, ... ("or null" for X | None)."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *more = typing.get_args(annotation)
        return annotation_text(base, [*more, *metadata])
    if is_union(annotation):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        text = " | ".join(annotation_text(a) for a in options)
        nullable = len(options) < len(typing.get_args(annotation))
        return f"{text} | null" if nullable else text
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(f"`{value_yaml(v)}`" for v in typing.get_args(annotation))
    bounds = ", ".join(filter(None, map(constraint, metadata)))
    return f"{plain_type(annotation)} {bounds}" if bounds else plain_type(annotation)


def plain_type(annotation) -> str:
    if is_model(annotation):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if annotation is SecretStr:
        return "secret str"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple and args[-1:] != (Ellipsis,):
        return "[" + ", ".join(annotation_text(a) for a in args) + "]"
    if origin in (list, tuple):
        return f"list[{annotation_text(args[0])}]"
    if origin is dict:
        return f"dict[{annotation_text(args[0])}, {annotation_text(args[1])}]"
    return getattr(annotation, "__name__", str(annotation))


CONSTRAINTS = {annotated_types.Gt: (">", "gt"), annotated_types.Ge: (">=", "ge"),
               annotated_types.Lt: ("<", "lt"), annotated_types.Le: ("<=", "le")}


def constraint(item) -> str | None:
    """`> 0` for Gt(0), ...; None for metadata that is not a bound."""
    for kind, (sign, attribute) in CONSTRAINTS.items():
        if isinstance(item, kind):
            return f"{sign} {getattr(item, attribute)}"
    if isinstance(item, annotated_types.MinLen):
        return f"(at least {item.min_length})"
    return None


def value_yaml(value) -> str:
    """A value as it is written in the YAML config (flow style; a string as it is)."""
    if isinstance(value, str):
        return value
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, width=1 << 16,
                          sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def value_text(value) -> str:
    if value is PydanticUndefined:
        return "required"
    return escape(f"`{value_yaml(value)}`")


def changed_text(cls: type, value) -> str:
    """A shared model's value: the fields that differ from its own table's defaults."""
    if value is None:
        return "`null`"
    changed = {name: getattr(value, name) for name, field in model_fields(cls).items()
               if getattr(value, name) != field_default(field)}
    return value_text(changed)


def escape(text: str) -> str:
    return text.replace("|", "\\|")


def sections() -> list[Section]:
    """AppConfig's sections in field order, then one per shared model by name."""
    shared, uses = shared_models(), {}
    own = list(walk(AppConfig, AppConfig(), "", "", shared, uses))
    return own + [s for cls in sorted(uses, key=lambda c: c.__name__)
                  for s in shared_sections(cls, uses[cls], shared)]


def section_text(section: Section) -> str:
    lines = [f"### {section.heading}", ""]
    if section.intro:
        lines += [section.intro, ""]
    if section.rows:
        lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r.key}` | {r.type} | {r.default} | {escape(r.description)} |"
                  for r in section.rows]
    return "\n".join(lines).rstrip("\n")


def render() -> str:
    """The generated part of docs/configuration.md: the text between the line `BEGIN` and the
    line `END`, with a blank line after the one and before the other."""
    note = f"<!-- Written by `{COMMAND}` from pipeline/config.py; do not edit by hand. -->"
    return "\n" + "\n\n".join([note, *map(section_text, sections())]) + "\n\n"


def generated_part(page: str) -> str:
    """The text between the marker lines of `page`."""
    start, end = marker_offsets(page)
    return page[start:end]


def splice(page: str, generated: str) -> str:
    """`page` with the text between its marker lines replaced by `generated`."""
    start, end = marker_offsets(page)
    return page[:start] + generated + page[end:]


def marker_offsets(page: str) -> tuple[int, int]:
    begin = page.find(BEGIN + "\n")
    end = page.find("\n" + END, begin)
    if begin < 0 or end < begin:
        raise ValueError(f"the page has no lines {BEGIN!r} ... {END!r} to write between")
    return begin + len(BEGIN) + 1, end + 1


def write(path: Path = PAGE) -> bool:
    """Render into the page at `path`; whether it changed."""
    page = path.read_text()
    updated = splice(page, render())
    if updated != page:
        path.write_text(updated)
    return updated != page
