"""Hypothesis strategies more than one test module draws from."""

from __future__ import annotations

from hypothesis import strategies as st

# JSON Schemas of every keyword family, nested (tests/unit/test_json_schemas.py holds each one the
# Router accepts to xgrammar's grammar; tests/server/test_agentic_fuzz.py sends them).
scalar = st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
    {"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 9},
    {"enum": ["x", "y", 1]}, {"const": "k"}, {"maxLength": 2}, {"minimum": 2},
    {"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": "^[ab]+$"},
    {"type": "integer", "multipleOf": 2}, {"type": "string", "format": "email"},
    {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, {"$ref": "#/$defs/word"},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"required": ["a"]},
    {"type": ["string", "null"], "minLength": 1}, {}, True])


def extend(inner):
    names = st.sampled_from(["a", "b", "c"])
    return st.one_of(
        st.builds(lambda props, req, extra: {"type": "object", "properties": props,
                                             "required": req, **extra},
                  st.dictionaries(names, inner, max_size=2), st.lists(names, max_size=2,
                                                                       unique=True),
                  st.sampled_from([{}, {"additionalProperties": False}, {"minProperties": 1},
                                   {"additionalProperties": {"type": "integer"}},
                                   {"propertyNames": {"maxLength": 1}},
                                   {"propertyNames": {"pattern": "^[ab]$"}}])),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                  inner, st.integers(1, 3)),
        st.builds(lambda bs: {"anyOf": bs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda bs: {"oneOf": bs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda bs: {"allOf": bs}, st.lists(inner, min_size=1, max_size=2)),
        st.builds(lambda s, k, v: {**s, k: v} if isinstance(s, dict) else s, inner,
                  st.sampled_from(["not", "type", "minLength", "required", "enum",
                                   "uniqueItems", "maxItems", "if"]),
                  st.sampled_from([{"const": 1}, "string", 1, ["a"], ["a", 1], True])))


random_schema = st.builds(
    lambda schema, defs: {"$defs": {"word": {"type": "string", "maxLength": 4}}, **schema}
    if defs and isinstance(schema, dict) else schema,
    st.recursive(scalar, extend, max_leaves=5), st.booleans()).filter(
    lambda schema: isinstance(schema, dict))
