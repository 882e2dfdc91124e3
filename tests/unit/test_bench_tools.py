"""`moonserve bench tools` without a server: BFCL entries -> OpenAI tools, the ported AST checker
(on real possible answers, and against BFCL's own checker), schema validity, the JSON summary."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import types
from pathlib import Path

import pytest

from moonserve.pipeline.bench import bfcl, tools

try:  # the BFCL data: bfcl-eval's wheel, fetched once (SHA-256 checked) into $MOONSERVE_HOME
    BFCL_WHEEL = bfcl.wheel(progress=False)
except OSError as error:  # offline and never fetched; a wheel that fails its digest still fails
    pytest.skip(f"bfcl-eval's wheel (the BFCL data) cannot be fetched: {error}", allow_module_level=True)


def entry(entry_id: str) -> bfcl.Entry:
    category = entry_id.rsplit("_", 1)[0]
    return next(e for e in bfcl.load_entries(category) if e.id == entry_id)


def call(name: str, **arguments) -> tuple[str, str]:
    return name, json.dumps(arguments)


def verdict(entry_id: str, *calls: tuple[str, str]) -> dict:
    return bfcl.score_entry(entry(entry_id), list(calls))


# Conversion: BFCL's convert_to_tool for OpenAI-style models.

def test_dotted_name_sanitized_and_hint_added_checker_docs_untouched():
    e = entry("simple_python_1")  # math.factorial
    function = e.tools[0]["function"]
    assert e.tools[0]["type"] == "function"
    assert function["name"] == "math_factorial"
    assert function["description"].endswith(" Note that the provided function is in Python 3 syntax.")
    assert function["parameters"]["type"] == "object"  # BFCL's "dict"
    # The checker reads the original docs: dotted name, Gorilla types, no hint.
    assert e.functions[0]["name"] == "math.factorial"
    assert e.functions[0]["parameters"]["type"] == "dict"
    assert "Python 3" not in e.functions[0]["description"]


def test_types_mapped_float_tuple_any_nested():
    distance = entry("simple_python_83").tools[0]["function"]["parameters"]["properties"]
    assert distance["coord1"]["type"] == "array"  # tuple
    assert distance["coord1"]["items"]["type"] == "number"  # float
    props = entry("multiple_0").tools[1]["function"]["parameters"]["properties"]  # circle radius
    assert props["radius"]["type"] == "number"
    assert props["radius"]["format"] == "float"
    assert props["radius"]["description"].endswith(" This is a float type value.")
    train = entry("simple_python_109").tools[0]["function"]
    assert train["name"] == "random_forest_train"
    assert train["parameters"]["properties"]["data"]["type"] == "string"  # any
    table = entry("simple_python_122").tools[0]["function"]["parameters"]["properties"]["table"]
    assert table["items"]["type"] == "array" and table["items"]["items"]["type"] == "integer"
    conditions = entry("simple_python_96").tools[0]["function"]["parameters"]["properties"]["conditions"]
    assert conditions["items"]["type"] == "object"  # list of dict
    assert {p["type"] for p in conditions["items"]["properties"].values()} <= {"string", "integer", "number"}
    info = entry("simple_python_94").tools[0]["function"]["parameters"]["properties"]["update_info"]
    assert info["type"] == "object" and info["properties"]["name"]["type"] == "string"


def test_every_converted_schema_is_valid_json_schema():
    import jsonschema

    for category in bfcl.CATEGORIES:
        for e in bfcl.load_entries(category, limit=60):
            for tool in e.tools:
                jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
                assert "." not in tool["function"]["name"]
                assert not _gorilla_only_types(tool["function"]["parameters"]), e.id


def _gorilla_only_types(schema) -> set[str]:
    found = set()
    if isinstance(schema, dict):
        if isinstance(schema.get("type"), str) and schema["type"] in {"dict", "float", "tuple", "any"}:
            found.add(schema["type"])
        for value in schema.values():
            found |= _gorilla_only_types(value)
    return found


def test_limit_takes_first_entries_and_irrelevance_has_no_answer():
    simple = bfcl.load_entries("simple_python", limit=3)
    assert [e.id for e in simple] == ["simple_python_0", "simple_python_1", "simple_python_2"]
    assert simple[0].messages == [{"role": "user", "content": simple[0].messages[0]["content"]}]
    assert all(e.possible_answer is None for e in bfcl.load_entries("irrelevance", limit=3))
    with pytest.raises(ValueError, match="unknown BFCL category"):
        bfcl.load_entries("simple_java")


# The checker on real possible answers.

def test_simple_correct_call_passes_with_and_without_optional():
    assert verdict("simple_python_0", call("calculate_triangle_area", base=10, height=5))["valid"]
    assert verdict("simple_python_0", call("calculate_triangle_area", base=10, height=5,
                                           unit="Units"))["valid"]  # case-insensitive string


@pytest.mark.parametrize("calls, error_type", [
    ([call("calculate_triangle_area", base=10, height=6)], "value_error:others"),
    ([call("calculate_triangle_area", base=10)], "simple_function_checker:missing_required"),
    ([call("calculate_triangle_area", base="10", height=5)], "type_error:simple"),
    ([call("calculate_triangle_area", base=10, height=5, color="red")],
     "simple_function_checker:unexpected_param"),
    ([call("calculate_triangle_area", base=10, height=5, unit="cm")], "value_error:string"),
    ([call("calculate_area", base=10, height=5)], "simple_function_checker:wrong_func_name"),
    ([call("calculate_triangle_area", base=10, height=5)] * 2, "simple_function_checker:wrong_count"),
    ([], "simple_function_checker:wrong_count"),
    ([("calculate_triangle_area", '{"base": 10, "height": ')], "ast_decoder:decoder_failed"),
])
def test_simple_wrong_calls_fail(calls, error_type):
    assert verdict("simple_python_0", *calls) == {"valid": False, "error_type": error_type}


def test_dotted_function_must_be_called_by_its_openai_name():
    assert verdict("simple_python_1", call("math_factorial", number=5))["valid"]
    assert verdict("simple_python_1", call("math.factorial", number=5))["error_type"] == \
        "simple_function_checker:wrong_func_name"


def test_int_accepted_for_float_but_float_not_for_integer():
    # multiple_0 expects triangle_properties.get(side1=5, side2=4, side3=3), sides "integer".
    assert verdict("multiple_0", call("triangle_properties_get", side1=5, side2=4, side3=3))["valid"]
    assert verdict("multiple_0", call("triangle_properties_get", side1=5.0, side2=4, side3=3)) == \
        {"valid": False, "error_type": "type_error:simple"}
    # parallel_multiple_1: area_rectangle.calculate(length=7.0, breadth=3.0), "float" params.
    good = [call("area_rectangle_calculate", length=7, breadth=3),
            call("area_circle_calculate", radius=5)]
    assert bfcl.score_entry(entry("parallel_multiple_1"), good)["valid"]


def test_multiple_wrong_function_among_offered_fails():
    assert verdict("multiple_0", call("circle_properties_get", radius=5)) == \
        {"valid": False, "error_type": "simple_function_checker:wrong_func_name"}


def test_parallel_any_order_but_each_answer_once():
    taylor = call("spotify_play", artist="Taylor Swift", duration=20)
    maroon = call("spotify_play", artist="Maroon 5", duration=15)
    assert verdict("parallel_0", taylor, maroon)["valid"]
    assert verdict("parallel_0", maroon, taylor)["valid"]
    assert verdict("parallel_0", taylor, taylor)["error_type"] == \
        "parallel_function_checker_no_order:cannot_find_match"
    assert verdict("parallel_0", taylor)["error_type"] == "parallel_function_checker_no_order:wrong_count"


def test_nested_list_dict_and_list_of_dict_values():
    ok = [call("math_toolkit_sum_of_multiples", lower_limit=1, upper_limit=1000, multiples=[3, 5]),
          call("math_toolkit_product_of_primes", count=5)]
    assert verdict("parallel_multiple_0", *ok)["valid"]
    bad = [call("math_toolkit_sum_of_multiples", lower_limit=1, upper_limit=1000, multiples=["3", "5"]),
           ok[1]]
    assert not verdict("parallel_multiple_0", *bad)["valid"]
    john = {"name": "John Doe", "email": "johndoe@email.com"}
    assert verdict("simple_python_94", call("update_user_info", user_id=43523, update_info=john))["valid"]
    assert verdict("simple_python_94", call("update_user_info", user_id=43523, update_info={
        "name": "Jane", "email": "johndoe@email.com"}))["error_type"] == "value_error:dict_value"
    # A missing key wins over a bad value (BFCL runs both checks).
    jane = call("update_user_info", user_id=43523, update_info={"name": "Jane"})
    assert verdict("simple_python_94", jane)["error_type"] == "value_error:dict_key"
    conditions = [{"field": "age", "operation": ">", "value": "25"},
                  {"field": "job", "operation": "=", "value": "engineer"}]
    assert verdict("simple_python_96", call("database_query", table="user", conditions=conditions))["valid"]
    assert not verdict("simple_python_96", call("database_query", table="user",
                                                conditions=conditions[::-1]))["valid"]


def test_irrelevance_scores_no_call():
    assert verdict("irrelevance_0") == {"valid": True, "error_type": ""}
    assert not verdict("irrelevance_0", call("determine_body_mass_index", weight=70, height=1.8))["valid"]
    # Arguments that are not JSON do not decode: BFCL counts that as no call.
    assert verdict("irrelevance_0", ("determine_body_mass_index", "{oops"))["valid"]
    assert bfcl.score_entry(entry("irrelevance_0"), None)["error_type"] == "request_failed"


# The port against BFCL's own checker (its provider-SDK import stubbed).

@pytest.fixture
def original_checker(monkeypatch):
    class OpenAIStyle:
        underscore_to_dot = True

    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = type("AnyModel", (dict,), {"__missing__": lambda self, k: OpenAIStyle()})()
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    monkeypatch.syspath_prepend(str(BFCL_WHEEL))  # a pure-Python wheel imports as a zip
    monkeypatch.delitem(sys.modules, "bfcl_eval.eval_checker.ast_eval.ast_checker", raising=False)
    module = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
    from bfcl_eval.constants.enums import Language

    yield lambda e, output: module.ast_checker(e.functions, output, e.possible_answer,
                                               Language.PYTHON, e.category, "gpt")
    sys.modules.pop("bfcl_eval.eval_checker.ast_eval.ast_checker", None)


def gold_outputs(e: bfcl.Entry) -> list[dict]:
    """One correct-looking output per expected call: each parameter's first allowed value."""
    def pick(value):
        if isinstance(value, dict):
            return {k: pick(v[0]) for k, v in value.items() if v and v[0] != ""}
        if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            return [pick(x) for x in value]
        return value

    out = []
    for answer in e.possible_answer:
        (name, params), = answer.items()
        out.append({bfcl.openai_function_name(name): {k: pick(v[0]) for k, v in params.items()
                                                      if v and v[0] != ""}})
    return out


def mutations(output: list[dict]) -> list[list[dict]]:
    """The gold output and variants: reversed, one call dropped, a call renamed, and per
    parameter of the first call: removed, stringified, bumped, an extra one added."""
    variants = [output, output[::-1], output[1:], [{"not_a_tool": {}}, *output[1:]]]
    (name, args), = output[0].items()
    for key, value in args.items():
        bumped = value + 1 if type(value) in (int, float) else None
        for new in ("removed", json.dumps(value), [value], bumped):
            changed = {k: v for k, v in args.items() if k != key}
            if new != "removed":
                changed[key] = new
            variants.append([{name: changed}, *output[1:]])
    variants.append([{name: {**args, "extra_param": 1}}, *output[1:]])
    return variants


@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple"])
def test_port_agrees_with_bfcl_checker(category, original_checker):
    compared = passed = 0
    for e in bfcl.load_entries(category):
        for output in mutations(gold_outputs(e)):
            output = copy.deepcopy(output)
            theirs = original_checker(e, copy.deepcopy(output))
            ours = bfcl.ast_checker(e.functions, output, e.possible_answer, e.category)
            # BFCL leaves a stale error_type on some valid results; compare it on failures.
            assert ours["valid"] == theirs["valid"], (e.id, output)
            if not ours["valid"]:
                assert ours["error_type"] == theirs["error_type"], (e.id, output)
            compared += 1
            passed += ours["valid"]
    assert compared > 1000 and 0 < passed < compared


# Schema validity and the summary.

def test_arguments_valid_against_schema():
    e = entry("simple_python_0")
    assert tools.arguments_valid(e, "calculate_triangle_area", '{"base": 10, "height": 5}')
    assert not tools.arguments_valid(e, "calculate_triangle_area", '{"base": 10}')  # required
    assert not tools.arguments_valid(e, "calculate_triangle_area", '{"base": "10", "height": 5}')
    assert not tools.arguments_valid(e, "calculate_triangle_area", '{"base": 10, "height": 5')
    assert not tools.arguments_valid(e, "calculate_triangle_area", '[10, 5]')
    assert not tools.arguments_valid(e, "other_function", '{"base": 10, "height": 5}')
    # Schema validity is not BFCL accuracy: a wrong value still validates.
    assert tools.arguments_valid(e, "calculate_triangle_area", '{"base": 11, "height": 5}')


def answers_for(entries, *tool_calls, error_at: int | None = None) -> list[tools.Answer]:
    out = []
    for i, (e, calls) in enumerate(zip(entries, tool_calls)):
        failed = i == error_at
        out.append(tools.Answer(e.id, 0.5 * (i + 1), None if failed else calls,
                                error="APIStatusError: HTTP 400 bad tools" if failed else None,
                                finish_reason=None if failed else "length" if not calls else "tool_calls",
                                completion_tokens=0 if failed else 10))
    return out


def test_cell_metrics_counts():
    entries = bfcl.load_entries("simple_python", limit=3)
    answers = answers_for(entries,
                          [call("calculate_triangle_area", base=10, height=5)],  # right
                          [("math_factorial", '{"number": "five"}')],  # invalid and wrong
                          [], error_at=2)
    m = tools.cell_metrics(entries, answers, wall_s=3.0)
    assert (m["requests"], m["answered"], m["errors"], m["calls"]) == (3, 2, 1, 2)
    assert (m["cut_at_max_tokens"], m["completion_tokens"]) == (0, 20)
    assert m["first_error"] == "APIStatusError: HTTP 400 bad tools"
    assert m["schema_valid_fraction"] == 0.5
    assert m["ast_accuracy"] == m["accuracy"] == pytest.approx(1 / 3)
    assert m["error_types"] == {"type_error:simple": 1, "request_failed": 1}
    assert m["seconds_per_request"] == 1.0 and m["mean_latency_s"] == pytest.approx(1.0)
    assert [r["id"] for r in m["entries"]] == ["simple_python_0", "simple_python_1", "simple_python_2"]


def test_irrelevance_metrics_and_cells():
    entries = bfcl.load_entries("irrelevance", limit=2)
    m = tools.cell_metrics(entries, answers_for(entries, [], [call("math_sum", numbers=[1.0])]), 2.0)
    assert m["ast_accuracy"] is None and m["accuracy_kind"] == "no_call"
    assert m["accuracy"] == m["no_call_fraction"] == 0.5
    assert m["cut_at_max_tokens"] == 1  # the answer without a call ran to --max-tokens
    args = argparse.Namespace(tool_choice=["auto", "required"], categories=["simple_python", "irrelevance"])
    assert tools.cells(args) == [("simple_python", "auto"), ("irrelevance", "auto"),
                                 ("simple_python", "required")]


def test_summary_shape_and_comparison_against_best_vllm_arm():
    entries = bfcl.load_entries("simple_python", limit=2)
    right = [call("calculate_triangle_area", base=10, height=5)]
    wrong = [call("calculate_triangle_area", base="ten", height=5)]
    factorial = [call("math_factorial", number=5)]

    def cell(first, wall):
        metrics = tools.cell_metrics(entries, answers_for(entries, first, factorial), wall)
        return {"simple_python": {"auto": metrics}}

    arms = {"moonserve": cell(right, 4.0), "vllm-default": cell(wrong, 1.0),
            "vllm-parameter": cell(right, 2.0)}
    args = argparse.Namespace(config="configs/local.yaml", limit=2, max_tokens=256, concurrency=4,
                              categories=["simple_python"], tool_choice=["auto"])
    result = tools.summary(args, "moonserve-embedded", {"moonserve": 1.0}, arms)
    default = json.loads(json.dumps(result))["arms"]["vllm-default"]["simple_python"]["auto"]
    assert default["accuracy"] == 0.5 and default["schema_valid_fraction"] == 0.5
    r = result["comparison"]["simple_python"]["auto"]
    assert r["best_accuracy_arm"] == "vllm-parameter" and r["accuracy_delta"] == 0.0
    assert r["fastest_arm"] == "vllm-default" and r["seconds_per_request_ratio"] == 4.0
    assert r["schema_valid_delta"] == 0.0
    assert tools.summary(args, "m", {}, {"vllm-default": arms["vllm-default"]})["comparison"] == {}


def test_vllm_command_enables_tools_and_strict_level():
    from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config

    config = load_app_config(DEFAULT_CONFIG).language_model
    default = tools.vllm_tools_command(config, "/m", 8200, None)
    strict = tools.vllm_tools_command(config, "/m", 8200, "parameter")
    assert default[default.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in default and "--tool-strict-level" not in default
    assert strict[-2:] == ["--tool-strict-level", "parameter"]
    template = default[default.index("--chat-template") + 1]
    assert template.endswith("smollm2_tools.jinja") and Path(template).is_file()
