"""JSON Schemas that xgrammar enforces, or a 400 naming the keyword (issue 36).

The engine compiles every JSON Schema with xgrammar (`STRUCTURED_OUTPUTS`: vLLM's `auto`
picks a backend per request for validation, but its engine builds one backend, from the first
request, and compiles every later schema with it). xgrammar drops some keywords without a word:
a keyword beside `$ref`, `anyOf`, `oneOf`, `allOf`, `enum` or `const` (it reads those and nothing
beside them), a length or range in a schema that names no `type`, `oneOf`'s "exactly one", `not`,
`if`, `dependencies`, `contains`, remote `$ref`s. An answer could then break the schema the
client asked for, with status 200. `enforced_schema` makes a schema one xgrammar enforces, or
refuses it:

1. Drafts: a schema is read by the draft its `$schema` names, else as 2020-12 (what
   `jsonschema.validators.validator_for` picks), and translated to 2020-12's keywords.
2. References: anchors and the root's own `$id` become JSON Pointers; anything else (a remote
   `$ref`, a resource embedded below the root) is refused before anything could fetch it.
3. Exact rewrites: `oneOf` with branches that cannot overlap becomes `anyOf` (judged on the
   schema as sent), a combinator's siblings merge into its branches, `allOf` into one schema,
   `enum`/`const` are filtered by their siblings, keywords that assert nothing are dropped, draft
   7's `dependencies` are read as such whatever the draft.
4. Narrowing, where xgrammar cannot hold the keyword itself: the schema becomes a stricter one
   whose every answer still validates. `if`/`then` hold both; `dependentRequired` and
   `dependentSchemas` always apply; `contains` holds for the first items; `not: {type}` takes
   those types away; `patternProperties` beside `properties` apply to the properties they match
   and nothing undeclared is allowed; names in `required` are declared (xgrammar's strict mode
   admits no other). A type-specific keyword without `type` gets every type written out, so
   xgrammar applies it to its type and lets the others through, as JSON Schema does.
5. Refusals, each a 400 naming the keyword and its JSON Pointer: what is left that xgrammar
   would drop, and what vLLM's own check says xgrammar does not support.

Example:
    >>> enforced_schema({"type": "string", "enum": ["a", 1]}, "response_format.json_schema.schema",
    ...                 check=lambda schema: None)
    {'enum': ['a']}
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from jsonschema import FormatChecker
from jsonschema.validators import Draft202012Validator, validator_for

from moonserve.pipeline.api.errors import APIError, bad_request

Schema = dict[str, Any] | bool

# Keywords that assert nothing (annotations, identifiers, vocabularies).
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$comment", "$anchor", "$dynamicAnchor", "$vocabulary", "title",
    "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly",
    "contentEncoding", "contentMediaType", "contentSchema", "$defs", "definitions", "nullable",
    "discriminator", "strict"})
# What xgrammar drops, when no rewrite below could keep it.
NEVER_ENFORCED = {
    "not": "a negation other than of types", "if": "a conditional", "then": "a conditional",
    "else": "a conditional", "dependencies": "a dependency", "dependentRequired": "a dependency",
    "dependentSchemas": "a dependency", "contains": "an array containment",
    "minContains": "an array containment", "maxContains": "an upper bound on containment",
    "uniqueItems": "item uniqueness", "unevaluatedItems": "an unevaluated-items rule",
    "$dynamicRef": "a dynamic reference", "$recursiveRef": "a recursive reference"}
# The type each type-specific keyword constrains ("number" covers integers).
KEYWORD_TYPES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    "number"),
    **dict.fromkeys(("items", "prefixItems", "minItems", "maxItems"), "array"),
    **dict.fromkeys(("properties", "patternProperties", "additionalProperties", "required",
                     "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties"),
                    "object")}
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
          "minContains", "maxContains")
COMBINATORS = ("anyOf", "oneOf", "allOf")
# Keywords whose meaning depends on their siblings (keyword: the siblings it reads; None: all).
ADJACENT = {"additionalProperties": {"properties", "patternProperties"},
            "items": {"prefixItems"}, "unevaluatedProperties": None, "$ref": None}
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Where xgrammar compiles a `false` schema (anywhere else it fails to compile).
FALSE_ALLOWED = ("additionalProperties", "items", "unevaluatedProperties")
# Subschema-holding keywords, by shape.
ONE_SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


class Unenforceable(Exception):
    """A keyword xgrammar would not enforce: where (a JSON Pointer), which, and why."""

    def __init__(self, path: str, keyword: str, why: str):
        super().__init__(f"{keyword} at {path or '/'}: {why}")
        self.path, self.keyword, self.why = path, keyword, why

    def api_error(self, param: str, subject: str) -> APIError:
        where = f" at {self.path}" if self.path else ""
        return bad_request(f"{param}: the keyword {self.keyword!r}{where} cannot be enforced: "
                           f"{self.why}; {subject} could break the schema, so it is refused",
                           param, "unenforceable_schema")


def enforced_schema(schema: dict, param: str, check: Callable[[dict], None],
                    subject: str = "an answer") -> dict:
    """`schema` as the engine should get it, or a 400 naming `param`. `check(schema)` is vLLM's
    own validation of the result (it raises its 400); `subject` is what the schema holds."""
    try:
        out = translate(schema, draft_of(schema))
        resolve_references(out)  # first: nothing below may try to fetch one
        decide_negations(out)
        normalize(out)
        refuse_what_xgrammar_drops(out)
        refuse_xgrammar_unsupported(out)
    except Unenforceable as exc:
        raise exc.api_error(param, subject) from None
    check(out)
    return out


def draft_of(schema: dict) -> type:
    return validator_for(schema, default=Draft202012Validator)


# --- walking ------------------------------------------------------------------------------------

def subschemas(node: Schema, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every schema object in `node` (itself first), with its JSON Pointer."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key, value in node.items():
        where = f"{path}/{escape(key)}"
        if key in ONE_SCHEMA and isinstance(value, dict):
            yield from subschemas(value, where)
        elif key in (*SCHEMA_MAPS, "dependencies") and isinstance(value, dict):
            for name, sub in value.items():
                yield from subschemas(sub, f"{where}/{escape(name)}")
        elif key in (*SCHEMA_LISTS, "items") and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from subschemas(sub, f"{where}/{i}")


def children(node: dict) -> Iterator[tuple[str, Schema]]:
    """(keyword, subschema) of every schema directly inside `node`, booleans included."""
    for key, value in node.items():
        if key in ONE_SCHEMA:
            yield key, value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            yield from ((key, sub) for sub in value.values())
        elif key in SCHEMA_LISTS and isinstance(value, list):
            yield from ((key, sub) for sub in value)


def escape(key) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def assertions(node: dict) -> set[str]:
    """The node's keywords that assert something."""
    return set(node) - ANNOTATIONS


def rest_of(node: dict, *keywords: str) -> dict:
    """The node's assertions other than `keywords`."""
    return {k: v for k, v in node.items() if k in assertions(node) - set(keywords)}


# --- 1. drafts ----------------------------------------------------------------------------------

def translate(schema: dict, draft: type) -> dict:
    """A copy in 2020-12's vocabulary (the draft's meaning kept)."""
    out = copy.deepcopy(schema)
    out.pop("$schema", None)
    legacy_refs = draft is not Draft202012Validator and draft.META_SCHEMA.get(
        "$schema", "").rstrip("#").endswith(("draft-04/schema", "draft-06/schema",
                                            "draft-07/schema"))
    for _, node in list(subschemas(out)):
        translate_node(node, legacy_refs, legacy=draft is not Draft202012Validator)
    return out


def translate_node(node: dict, legacy_refs: bool, legacy: bool) -> None:
    for key in COUNTS:  # 2.0 is a count in JSON Schema; xgrammar wants an integer
        if isinstance(node.get(key), float) and node[key].is_integer():
            node[key] = int(node[key])
    # Draft 7's `dependencies` (2020-12 has no keyword by that name), whatever the $schema.
    if isinstance(node.get("dependencies"), dict):
        for name, value in node.pop("dependencies").items():
            kind = "dependentRequired" if isinstance(value, list) else "dependentSchemas"
            node.setdefault(kind, {})[name] = value
    if not legacy:
        return
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    node.pop("additionalItems", None)  # without an items array it constrains nothing
    for exclusive, bound in (("exclusiveMaximum", "maximum"), ("exclusiveMinimum", "minimum")):
        if isinstance(node.get(exclusive), bool):
            if node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    if legacy_refs and "$ref" in node:
        # Drafts 4-7: "All other properties in a $ref object MUST be ignored."
        for key in assertions(node) - {"$ref"}:
            del node[key]


# --- 2. references ------------------------------------------------------------------------------

def resolve_references(root: dict) -> None:
    """Every `$ref` as a JSON Pointer into this schema (anchors and the root's own `$id`
    rewritten); a remote one is refused, never fetched."""
    base = root.get("$id") if isinstance(root.get("$id"), str) else None
    anchors = {node["$anchor"]: path for path, node in subschemas(root)
               if isinstance(node.get("$anchor"), str)}
    for path, node in subschemas(root):
        if path and "$id" in node:
            raise Unenforceable(path, "$id", "a schema resource embedded below the root is not "
                                "resolved; give references as JSON Pointers from the root")
        ref = node.get("$ref")
        if ref is None:
            continue
        if isinstance(ref, str) and base and ref.startswith(base.split("#")[0] + "#"):
            ref = ref[len(base.split("#")[0]):]
        if isinstance(ref, str) and ref.startswith("#") and ref[1:] in anchors:
            ref = "#" + anchors[ref[1:]]
        if not (ref == "#" or (isinstance(ref, str) and ref.startswith("#/"))):
            raise Unenforceable(path, "$ref", "a remote $ref is never fetched")
        if pointer_target(root, ref) is None:
            raise Unenforceable(path, "$ref", f"{ref} points at nothing in the schema")
        node["$ref"] = ref


def pointer_target(root: dict, ref: str) -> Schema | None:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def resolve(branch: Schema, root: dict) -> Schema:
    """A branch that is only a local `$ref`, as its target (one level)."""
    if isinstance(branch, dict) and set(assertions(branch)) == {"$ref"}:
        target = pointer_target(root, branch["$ref"])
        if target is not None:
            return copy.deepcopy(target)
    return branch


# --- 3. the two places where narrowing a part would widen the whole: judged as sent -------------

def decide_negations(root: dict) -> None:
    """`not` and `oneOf` read their subschemas negatively (narrowing one would let more through),
    so they are settled first, on the schema as sent: `not` of types takes those types away,
    `oneOf` whose branches cannot overlap becomes `anyOf`; the rest is refused."""
    for path, node in list(subschemas(root)):
        if "not" in node:
            remove_negated_types(node, path)
        if "oneOf" in node:
            branches = [resolve(b, root) for b in node["oneOf"]]
            if not pairwise_exclusive(branches, types_of(node)):
                raise Unenforceable(path, "oneOf", "exactly one branch is enforced only for "
                                    "branches that cannot overlap, and these may (give them "
                                    "distinct types, or make them objects with a required "
                                    "property of distinct const values, or use anyOf)")
            node["anyOf"] = node.pop("oneOf")


def remove_negated_types(node: dict, path: str) -> None:
    negated = node["not"]
    if negated is False:
        del node["not"]
        return
    if not isinstance(negated, dict) or set(assertions(negated)) != {"type"}:
        raise Unenforceable(path, "not", "xgrammar has no negation; only `not` of types is "
                            "held (as the types left)")
    gone = set(types_of(negated))
    kept = [t for t in types_of(node) if t not in gone and
            not (t == "number" and "integer" in gone)]  # "a number but no integer": no type
    if not kept:
        raise Unenforceable(path, "not", "it takes away every type the schema allows")
    del node["not"]
    node["type"] = kept[0] if len(kept) == 1 else kept


def pairwise_exclusive(branches: list[Schema], outer: list[str]) -> bool:
    """By types (within the node's `outer` types), by enumerated values, or for objects by a
    required property whose values differ."""
    if any(not isinstance(b, dict) for b in branches):
        return False
    kinds = [set(types_of(b)) & set(outer) for b in branches]
    if all(a.isdisjoint(b) for i, a in enumerate(kinds) for b in kinds[i + 1:]):
        return True
    if disjoint_values([enumerated(b) for b in branches]):
        return True
    if any(k - {"object"} for k in kinds):
        return False  # a required property discriminates objects only
    shared = set.intersection(*(set(b.get("required", ())) for b in branches))
    return any(disjoint_values([enumerated(b.get("properties", {}).get(name, {}))
                                for b in branches]) for name in shared)


def enumerated(node: Schema) -> list | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node.get("enum") if isinstance(node.get("enum"), list) else None


def disjoint_values(values: list[list | None]) -> bool:
    if any(v is None for v in values):
        return False
    seen: set[str] = set()
    for vs in values:
        keys = {json.dumps(v, sort_keys=True) for v in vs}
        if keys & seen:
            return False
        seen |= keys
    return True


def types_of(node: dict) -> list[str]:
    """The JSON types a schema admits by its `type` (or its enumerated values); all without."""
    declared = node.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        return [*declared, "integer"] if "number" in declared and "integer" not in declared \
            else list(declared)
    values = enumerated(node)
    if values is not None:
        return sorted({json_type(v) for v in values})
    return list(JSON_TYPES)


def json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(value)]


# --- 4. rewrites --------------------------------------------------------------------------------

def normalize(root: dict) -> None:
    """Inner schemas first, so a merge sees its branches' final form; then, on the final schemas,
    the narrowings that read a whole node (`write_out_type`, `declare_required`, `make_room`)."""
    for path, node in reversed(list(subschemas(root))):
        settle(node, root, path)
    for path, node in subschemas(root):
        names = node.get("propertyNames")
        if isinstance(names, dict) and "type" not in names and enumerated(names) is None:
            names["type"] = "string"  # property names are strings (xgrammar writes the key as it)
        write_out_type(node)
        declare_required(node, path)
        make_room(node, path)


def settle(node: dict, root: dict, path: str) -> None:
    drop_no_ops(node)
    hold_conditional(node, root, path)
    hold_dependencies(node, root, path)
    merge_allof(node, root, path)
    merge_into_branches(node, root, path)
    hold_contains(node, root, path)
    fold_pattern_properties(node, path)
    drop_false_properties(node, path)
    filter_enum(node, root, path)


def drop_no_ops(node: dict) -> None:
    """Keywords that assert nothing where they stand (JSON Schema says they are ignored)."""
    if node.get("uniqueItems") is False or (node.get("uniqueItems") is True and
                                            node.get("maxItems", 2) <= 1):
        del node["uniqueItems"]
    if "contains" not in node:
        node.pop("minContains", None)
        node.pop("maxContains", None)
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
    elif "then" not in node and "else" not in node:
        del node["if"]
    for keyword in ("unevaluatedItems", "unevaluatedProperties"):
        if node.get(keyword) in (True, {}):
            del node[keyword]
    if "unevaluatedItems" in node and not any(k in node for k in (*COMBINATORS, "$ref",
                                                                  "contains", "if")):
        # Only this node's own `prefixItems`/`items` evaluate items: the rest are `items`.
        rule = node.pop("unevaluatedItems")
        node.setdefault("items", rule)
    if isinstance(node.get("dependentRequired"), dict):
        node["dependentRequired"] = {k: v for k, v in node["dependentRequired"].items() if v}
        if not node["dependentRequired"]:
            del node["dependentRequired"]


def merge_into(node: dict, other: Schema, path: str, keyword: str) -> bool:
    """`node` replaced by what it and `other` both accept; False when that cannot be said
    exactly (node unchanged)."""
    merged = merged_or_none(node, other)
    if merged is None:
        return False
    if merged is False:
        raise Unenforceable(path, keyword, "it leaves no value the schema admits")
    replacement = {k: v for k, v in node.items() if k in ANNOTATIONS} | \
        ({} if merged is True else dict(merged))  # `merged` may be `node` itself
    node.clear()
    node.update(replacement)
    return True


def hold_conditional(node: dict, root: dict, path: str) -> None:
    """`if`/`then`/`else` held as `if` and `then` both (narrower: `else` is never taken);
    `if`/`else` alone as `if` (its answers satisfy the conditional either way)."""
    if "if" not in node:
        return
    condition, then = resolve(node["if"], root), resolve(node.get("then", True), root)
    both = merged_or_none(condition, then)
    if both is None:
        return
    for key in ("if", "then", "else"):
        node.pop(key, None)
    if not merge_into(node, both, path, "if"):
        node.update({"if": condition, "then": then})  # left for the refusal to name


def hold_dependencies(node: dict, root: dict, path: str) -> None:
    """`dependentRequired` and `dependentSchemas` applied whether or not their property is
    there (narrower: the dependency always holds)."""
    for name, names in node.pop("dependentRequired", {}).items():
        node["required"] = list(dict.fromkeys([*node.get("required", ()), *names]))
    schemas = node.pop("dependentSchemas", {})
    for name, schema in list(schemas.items()):
        schema = resolve(schema, root)
        if schema is False and name not in node.get("properties", {}) and \
                node.get("additionalProperties", False) is False:
            del schemas[name]  # `name` may not be present, and (strict mode) it never is
        elif schema is not False and merge_into(node, schema, path, "dependentSchemas"):
            del schemas[name]
    if schemas:
        node["dependentSchemas"] = schemas  # left for the refusal to name


def merge_allof(node: dict, root: dict, path: str) -> None:
    """`allOf` folded into its node when its branches merge (`merged_or_none`)."""
    branches = node.get("allOf")
    if not isinstance(branches, list):
        return
    merged: Schema = rest_of(node, "allOf")
    for branch in branches:
        merged = merged_or_none(merged, resolve(branch, root))
        if merged is None:
            return  # left for the refusal to name
    if merged is False:
        raise Unenforceable(path, "allOf", "its branches admit no value in common")
    replacement = {k: v for k, v in node.items() if k in ANNOTATIONS} | \
        ({} if merged is True else dict(merged))
    node.clear()
    node.update(replacement)


def merge_into_branches(node: dict, root: dict, path: str) -> None:
    """`{"type": "object", "required": ["a"], "anyOf": [A, B]}` as `{"anyOf": [A + rest, B +
    rest]}`: xgrammar reads a combinator and ignores its siblings."""
    if not isinstance(node.get("anyOf"), list):
        return
    rest = rest_of(node, "anyOf")
    branches = [merged_or_none(rest, resolve(b, root)) if rest else b for b in node["anyOf"]]
    if any(b is None for b in branches):
        return  # left for the refusal to name
    kept = [b for b in branches if b is not False]
    if not kept:
        raise Unenforceable(path, "anyOf", "no branch admits anything beside the keywords next "
                            "to it")
    for key in rest:
        del node[key]
    node["anyOf"] = kept
    for i, branch in enumerate(kept):
        if isinstance(branch, dict) and rest:  # a new schema: its own rewrites
            settle(branch, root, f"{path}/anyOf/{i}")


def merged_or_none(a: Schema, b: Schema) -> Schema | None:
    """A schema accepting what both accept, or None when this merge cannot say so exactly."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    if interacts(a, b) or interacts(b, a):
        return None
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or key in ANNOTATIONS:
            out.setdefault(key, value)
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "type":
            both = [t for t in types_of(out) if t in types_of(b)]
            if not both:
                return False
            out[key] = both
        elif key == "properties":
            properties = dict(out[key])
            for name, schema in value.items():
                properties[name] = schema if name not in properties else \
                    merged_or_none(properties[name], schema)
                if properties[name] is None:
                    return None
            out[key] = properties
        else:
            return None
    return out


def interacts(a: dict, b: dict) -> bool:
    """Whether a keyword of `a` reads a sibling that merging `b` in would add."""
    added = assertions(b)
    for keyword, reads in ADJACENT.items():
        if keyword in a and added and (reads is None or reads & added):
            return True
    return False


def hold_contains(node: dict, root: dict, path: str) -> None:
    """`contains` (at least `minContains` items) held by the first items (narrower)."""
    if "contains" not in node or "prefixItems" in node:
        return
    count = node.get("minContains", 1)
    bounded = "maxContains" in node and node["maxContains"] < node.get("maxItems", float("inf"))
    if bounded and ("items" in node or count > node["maxContains"]):
        raise Unenforceable(path, "maxContains", "xgrammar cannot bound how many items match")
    if count == 0:
        for key in ("contains", "minContains", "maxContains"):
            node.pop(key, None)
        return
    first = merged_or_none(resolve(node.get("items", True), root), resolve(node["contains"], root))
    if first is None:
        return
    if first is False:
        raise Unenforceable(path, "contains", "no item the array may hold matches it")
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    node["prefixItems"] = [copy.deepcopy(first) for _ in range(count)]
    node["minItems"] = max(node.get("minItems", 0), count)
    # With a bound on matches, exactly the first items (no other item could match too).
    node.setdefault("items", False if bounded else True)


def fold_pattern_properties(node: dict, path: str) -> None:
    """`patternProperties` xgrammar cannot hold as they are (beside `properties`, or several):
    each declared property gets the schemas of the patterns that match its name, and no other
    property is allowed (narrower)."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or ("properties" not in node and len(patterns) <= 1):
        return
    properties = dict(node.get("properties", {}))
    for pattern, schema in patterns.items():
        for name in properties:
            if compiled(pattern, path).search(name):
                properties[name] = merged_or_none(properties[name], schema)
                if properties[name] is None:
                    return  # left for the refusal to name
    del node["patternProperties"]
    node["properties"] = properties
    node["additionalProperties"] = False


def compiled(pattern: str, path: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise Unenforceable(path, "patternProperties", f"{pattern!r}: {exc}") from None


def drop_false_properties(node: dict, path: str) -> None:
    """`"a": false` in `properties` (never present) as `a` left out, where nothing undeclared
    may be (xgrammar cannot compile `false` there)."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or not any(v is False for v in properties.values()):
        return
    if node.get("additionalProperties", False) is not False:
        return  # left for the refusal to name
    node["properties"] = {k: v for k, v in properties.items() if v is not False}


def filter_enum(node: dict, root: dict, path: str) -> None:
    """`enum`/`const` with other assertions beside it: the values those admit, as one `enum`."""
    values = enumerated(node)
    keyword = "const" if "const" in node else "enum"
    rest = rest_of(node, keyword)
    if values is None or not rest:
        return
    # Formats count: xgrammar enforces those it knows.
    validator = draft_of(root)(root, format_checker=FormatChecker()).evolve(schema=rest)
    kept = [v for v in values if validator.is_valid(v)]
    if not kept:
        raise Unenforceable(path, keyword, "no listed value satisfies the keywords beside it")
    for key in assertions(node):
        del node[key]
    node["enum"] = kept


def write_out_type(node: dict) -> None:
    """A schema with type-specific keywords and no `type` gets every type written out: xgrammar
    then applies each keyword to its own type (and lets the others through, as JSON Schema
    does); without a `type` it reads some of them and drops others."""
    if "type" in node or enumerated(node) is not None or "$ref" in node or \
            any(k in node for k in COMBINATORS) or not any(k in node for k in KEYWORD_TYPES):
        return
    node["type"] = [t for t in JSON_TYPES if t != "integer"]  # "number" covers integers


def declare_required(node: dict, path: str) -> None:
    """Required names missing from `properties` are declared with the schema JSON Schema holds
    them to (the matching `patternProperties`, else `additionalProperties`), or, where no such
    property may be, make the schema unsatisfiable: refused."""
    required = node.get("required")
    if not isinstance(required, list) or "object" not in types_of(node):
        return
    properties = node.setdefault("properties", {})
    for name in required:
        if name not in properties:
            properties[name] = undeclared_schema(node, name, path)
    fold_pattern_properties(node, path)  # now beside `properties`


def undeclared_schema(node: dict, name: str, path: str) -> Schema:
    matching = [schema for pattern, schema in node.get("patternProperties", {}).items()
                if compiled(pattern, path).search(name)]
    if not matching:
        extra = node.get("additionalProperties", True)
        if extra is False:
            raise Unenforceable(path, "required", f"{name!r} can never be present: no property "
                                "declares it and additionalProperties is false")
        return {} if extra is True else copy.deepcopy(extra)
    merged: Schema = True
    for schema in matching:
        merged = merged_or_none(merged, schema)
        if merged is None:
            raise Unenforceable(path, "patternProperties", f"the patterns matching {name!r} "
                                "could not be merged into one schema")
    return merged


def make_room(node: dict, path: str) -> None:
    """xgrammar's strict mode reads a missing `items` or `additionalProperties` as false; where
    a count needs more, they are written out as JSON Schema reads them (anything)."""
    types = types_of(node)
    if "array" in types and "items" not in node and \
            node.get("minItems", 0) > len(node.get("prefixItems", ())):
        node["items"] = True
    if "object" in types and "additionalProperties" not in node and \
            "patternProperties" not in node and \
            node.get("minProperties", 0) > len(node.get("properties", {})):
        node["additionalProperties"] = True


# --- 5. refusals --------------------------------------------------------------------------------

def refuse_what_xgrammar_drops(schema: dict) -> None:
    """What is left that xgrammar would drop without a word, or cannot compile."""
    for path, node in subschemas(schema):
        for keyword in node:
            if keyword in NEVER_ENFORCED:
                raise Unenforceable(path, keyword, f"{NEVER_ENFORCED[keyword]} is not held by "
                                    "the structured-output backend (xgrammar)")
        selector = next((k for k in ("$ref", *COMBINATORS, "enum", "const") if k in node), None)
        if selector is not None:
            beside = sorted(assertions(node) - {selector})
            if beside:
                raise Unenforceable(path, beside[0], f"xgrammar reads {selector!r} and ignores "
                                    "the keywords beside it")
        if "allOf" in node:
            raise Unenforceable(path, "allOf", "xgrammar holds allOf only as one schema, and "
                                "these branches could not be merged into one")
        for keyword, sub in children(node):
            if sub is False and keyword not in FALSE_ALLOWED:
                raise Unenforceable(path, keyword, "xgrammar cannot compile a `false` schema "
                                    "here")


def refuse_xgrammar_unsupported(schema: dict) -> None:
    """What vLLM's own check says xgrammar does not support, at its innermost part."""
    from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    if not has_xgrammar_unsupported_json_features(schema):
        return
    for path, node in reversed(list(subschemas(schema))):
        if has_xgrammar_unsupported_json_features(node):
            # The keyword whose removal makes this part enforceable (`type` only selects which
            # checks apply).
            keyword = next((k for k in node if k != "type" and not
                            has_xgrammar_unsupported_json_features(
                                {key: v for key, v in node.items() if key != k})), "?")
            raise Unenforceable(path, keyword, "xgrammar does not support it here")
