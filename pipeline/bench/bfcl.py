"""BFCL v4 single-turn categories: load entries, convert their functions to OpenAI tools, score.

A port of the parts of the Berkeley Function Calling Leaderboard (PyPI `bfcl-eval`, package
`bfcl_eval`) that an OpenAI function-calling (FC) model goes through, for the Python categories:

- data: `bfcl_eval/data/BFCL_v4_<category>.json` and `possible_answer/...` (JSON lines), read
  straight from the package's wheel, which is fetched (pinned, SHA-256 checked) into
  `$MOONSERVE_HOME/wheels/` on first use rather than installed (`prepare.wheels.BFCL_EVAL`: its
  dependencies pin numpy 1.26 and every provider's SDK; its `utils.load_dataset_entry` imports them);
- prompt: `OpenAICompletionsHandler` sends `question[0]` as is, with the tools, no system prompt;
  the function docs get the Python hint of `utils._func_doc_language_specific_pre_processing`;
- tools: `model_handler/utils.convert_to_tool(functions, GORILLA_TO_OPENAPI, OPENAI_COMPLETIONS)`;
- answers: `OpenAICompletionsHandler.decode_ast` (FC) turns tool calls into [{name: {args}}];
- checker: `eval_checker/ast_eval/ast_checker.py`, Python branch only, with the same names.
  Its `ast_checker` imports `bfcl_eval.constants.model_config`, which imports every provider
  SDK, so it is ported rather than imported; `convert_func_name` takes the model's
  `underscore_to_dot` flag (True for OpenAI-style models) instead of a model name.

Example:
    >>> entry = load_entries("simple_python", limit=2)[1]
    >>> entry.tools[0]["function"]["name"]      # BFCL's "math.factorial"
    'math_factorial'
    >>> ast_checker(entry.functions, [{"math_factorial": {"number": 5}}],
    ...             entry.possible_answer, entry.category)["valid"]
    True
"""

from __future__ import annotations

import copy
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from moonserve.pipeline.prepare.wheels import BFCL_EVAL, fetch_wheel

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
VERSION_PREFIX = "BFCL_v4"

# bfcl_eval/constants/type_mappings.py
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
    "object": "object", "tuple": "array", "any": "string", "byte": "integer", "short": "integer",
    "long": "integer", "double": "number", "char": "string", "ArrayList": "array",
    "Array": "array", "HashMap": "object", "Hashtable": "object", "Queue": "array",
    "Stack": "array", "Any": "string", "String": "string", "Bigint": "integer",
}

# bfcl_eval/eval_checker/ast_eval/ast_checker.py
PYTHON_TYPE_MAPPING = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
    "dict": dict, "any": str,
}
PYTHON_NESTED_TYPE_CHECK_LIST = ["array", "tuple"]

PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


@dataclass(frozen=True)
class Entry:
    id: str
    category: str
    messages: list[dict]  # question[0]: what BFCL sends an FC model
    functions: list[dict]  # BFCL function docs as the checker reads them (Gorilla types, dots)
    tools: list[dict]  # OpenAI tools as BFCL's OpenAI handler sends them
    possible_answer: list[dict] | None  # ground_truth; None for irrelevance


def wheel(progress: bool = True) -> Path:
    """The verified bfcl-eval wheel (downloaded the first time; reused offline after)."""
    return fetch_wheel(BFCL_EVAL, progress=progress)


def data_dir() -> zipfile.Path:
    return zipfile.Path(wheel()) / "bfcl_eval" / "data"


def load_jsonl(path: Path | zipfile.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_entries(category: str, limit: int | None = None) -> list[Entry]:
    """The first `limit` entries of a category (all with None), in file order."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; expected one of {CATEGORIES}")
    rows = load_jsonl(data_dir() / f"{VERSION_PREFIX}_{category}.json")[:limit]
    answers = {}
    if category != "irrelevance":
        path = data_dir() / "possible_answer" / f"{VERSION_PREFIX}_{category}.json"
        answers = {a["id"]: a["ground_truth"] for a in load_jsonl(path)}
    return [Entry(row["id"], category, row["question"][0], row["function"],
                  convert_to_tool(add_python_hint(row["function"])), answers.get(row["id"]))
            for row in rows]


def add_python_hint(functions: list[dict]) -> list[dict]:
    """utils._func_doc_language_specific_pre_processing for a Python category (on a copy)."""
    functions = copy.deepcopy(functions)
    for item in functions:
        item["description"] = item["description"] + PYTHON_HINT
    return functions


def openai_function_name(name: str) -> str:
    # "OAI does not support '.' in the function name" (^[a-zA-Z0-9_-]{1,64}$), convert_to_tool.
    return re.sub(r"\.", "_", name)


def cast_to_openai_type(properties: dict, mapping: dict = GORILLA_TO_OPENAPI) -> dict:
    """utils._cast_to_openai_type: Gorilla types -> JSON Schema types, in place. Supports a list
    of any, a list of lists, a list of dicts, a list of lists of dicts, a dict of any."""
    for value in properties.values():
        if "type" not in value:
            value["type"] = "string"
        else:
            var_type = value["type"]
            if mapping == GORILLA_TO_OPENAPI and var_type == "float":
                value["format"] = "float"
                value["description"] += " This is a float type value."
            value["type"] = mapping.get(var_type, "string")
        if value["type"] in ("array", "object"):
            cast_nested(value, mapping)
    return properties


def cast_nested(schema: dict, mapping: dict) -> None:
    """The array/object branch of utils._cast_to_openai_type."""
    if "properties" in schema:
        schema["properties"] = cast_to_openai_type(schema["properties"], mapping)
    elif "items" in schema:
        items = schema["items"]
        items["type"] = mapping[items["type"]]
        if items["type"] == "array" and "items" in items:
            items["items"]["type"] = mapping[items["items"]["type"]]
        elif items["type"] == "object" and "properties" in items:
            items["properties"] = cast_to_openai_type(items["properties"], mapping)


def convert_to_tool(functions: list[dict]) -> list[dict]:
    """utils.convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)."""
    tools = []
    for item in copy.deepcopy(functions):
        if "." in item["name"]:
            item["name"] = openai_function_name(item["name"])
        item["parameters"]["type"] = "object"
        item["parameters"]["properties"] = cast_to_openai_type(item["parameters"]["properties"])
        tools.append({"type": "function", "function": item})
    return tools


def decode_tool_calls(tool_calls: list[tuple[str, str]]) -> list[dict]:
    """OpenAICompletionsHandler.decode_ast for an FC model: (name, arguments JSON) pairs ->
    [{name: {param: value}}]. Raises ValueError on arguments that are not JSON, as BFCL does."""
    return [{name: json.loads(arguments)} for name, arguments in tool_calls]


def is_function_calling_format_output(decoded_output) -> bool:
    """utils.is_function_calling_format_output: [{func: {param: value}}, ...]; [] counts."""
    if type(decoded_output) != list:
        return False
    return all(type(item) == dict and len(item) == 1 and type(next(iter(item.values()))) == dict
               for item in decoded_output)


def is_empty_output(decoded_output) -> bool:
    """utils.is_empty_output: no function call ([], [{}], or not in function-call format)."""
    if not is_function_calling_format_output(decoded_output):
        return True
    return len(decoded_output) == 0 or (len(decoded_output) == 1 and len(decoded_output[0]) == 0)


def score_entry(entry: Entry, tool_calls: list[tuple[str, str]] | None) -> dict:
    """BFCL's verdict on one answer: eval_runner._evaluate_single_relevance_entry for
    irrelevance, _evaluate_single_ast_entry otherwise. `tool_calls` None: the request failed.
    Returns {"valid": bool, "error_type": str} (error_type "" when valid)."""
    if tool_calls is None:
        return {"valid": False, "error_type": "request_failed"}
    try:
        decoded = decode_tool_calls(tool_calls)
    except ValueError:
        decoded = None
    if entry.category == "irrelevance":
        called = decoded is not None and not is_empty_output(decoded)
        return {"valid": not called, "error_type": "irrelevance_error:decoder_success" if called else ""}
    if decoded is None:
        return {"valid": False, "error_type": "ast_decoder:decoder_failed"}
    if not is_function_calling_format_output(decoded):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format"}
    result = ast_checker(entry.functions, decoded, entry.possible_answer, entry.category)
    return {"valid": result["valid"], "error_type": "" if result["valid"] else result["error_type"]}


def ast_checker(func_description: list[dict], model_output: list[dict], possible_answer: list[dict],
                test_category: str, underscore_to_dot: bool = True) -> dict:
    """ast_checker.ast_checker, language Python."""
    if "parallel" in test_category:
        return parallel_function_checker_no_order(func_description, model_output, possible_answer,
                                                  underscore_to_dot)
    if "multiple" in test_category:
        return multiple_function_checker(func_description, model_output, possible_answer,
                                         underscore_to_dot)
    if len(model_output) != 1:
        return {"valid": False, "error": ["Wrong number of functions."],
                "error_type": "simple_function_checker:wrong_count"}
    return simple_function_checker(func_description[0], model_output[0], possible_answer[0],
                                   underscore_to_dot)


def find_description(func_descriptions, name: str):
    if type(func_descriptions) == list:
        for func_description in func_descriptions:
            if func_description["name"] == name:
                return func_description
        return None
    return func_descriptions  # a dict: there is only one function


def get_possible_answer_type(possible_answer: list):
    for answer in possible_answer:
        if answer != "":  # "" marks an optional parameter
            return type(answer)
    return None


def convert_func_name(function_name: str, underscore_to_dot: bool) -> str:
    """The expected name as the model saw it (convert_to_tool replaced dots for OpenAI models):
    equivalent to mapping the model's names back to BFCL's."""
    if "." in function_name and underscore_to_dot:
        return openai_function_name(function_name)
    return function_name


def type_checker(param: str, value, possible_answer: list, expected_type_description: str,
                 expected_type_converted, nested_type_converted) -> dict:
    """ast_checker.type_checker: nested types are checked one level deep only. A value of the
    possible answers' type where another is declared is taken as a variable name."""
    result = {"valid": True, "error": [], "is_variable": False, "error_type": "type_error:simple"}
    possible_answer_type = get_possible_answer_type(possible_answer)
    is_variable = possible_answer_type is not None and possible_answer_type != expected_type_converted

    if type(value) == expected_type_converted:
        if nested_type_converted is None:
            result["is_variable"] = is_variable
            return result
        if nested_types_match(param, value, possible_answer, nested_type_converted):
            return {"valid": True, "error": [], "is_variable": is_variable}
        result["valid"] = False
        result["error"] = [(
            f"Nested type checking failed for parameter {param!r}. Expected outer type "
            f"{expected_type_description} with inner type {nested_type_converted}. "
            f"Parameter value: {value!r}.")]
        result["error_type"] = "type_error:nested"
        # Falls through as in BFCL (the result stays invalid either way).

    if possible_answer_type is not None and type(value) == possible_answer_type:
        result["is_variable"] = True
        return result
    result["valid"] = False
    result["error"].append(
        f"Incorrect type for parameter {param!r}. Expected type {expected_type_description}, "
        f"got {type(value).__name__}. Parameter value: {value!r}.")
    result["error_type"] = "type_error:simple"
    return result


def nested_types_match(param: str, value: list, possible_answer: list, nested_type_converted) -> bool:
    """The loop of type_checker: the items match the inner type for at least one possible
    answer (an answer that is not a list, such as "" for optional, counts as a match)."""
    for possible_answer_item in possible_answer:
        if type(possible_answer_item) != list:
            return True
        if all(type_checker(param, value_item, possible_answer_item, str(nested_type_converted),
                            nested_type_converted, None)["valid"] for value_item in value):
            return True
    return False


def standardize_string(input_string: str) -> str:
    """Drop spaces and ,./-_*^ and lowercase; single quotes become double. So "April 1, 2024"
    and "April 1 2024" compare equal."""
    regex_string = r"[ \,\.\/\-\_\*\^]"
    return re.sub(regex_string, "", input_string).lower().replace("'", '"')


def string_checker(param: str, model_output: str, possible_answer: list) -> dict:
    standardized = [standardize_string(a) for a in possible_answer if type(a) == str]
    if standardize_string(model_output) not in standardized:
        return {"valid": False,
                "error": [(f"Invalid value for parameter {param!r}: {model_output!r}. Expected "
                           f"one of {possible_answer}. Case insensitive.")],
                "error_type": "value_error:string"}
    return {"valid": True, "error": []}


def standardize_items(items: list) -> list:
    return [standardize_string(x) if type(x) == str else x for x in items]


def list_checker(param: str, model_output: list, possible_answer: list) -> dict:
    # BFCL indexes each possible answer as a list (a "" optional marker becomes []).
    standardized = [standardize_items(list(answer)) for answer in possible_answer]
    if standardize_items(list(model_output)) not in standardized:
        return {"valid": False,
                "error": [(f"Invalid value for parameter {param!r}: {model_output!r}. Expected "
                           f"one of {possible_answer}.")],
                "error_type": "value_error:list/tuple"}
    return {"valid": True, "error": []}


def dict_checker(param: str, model_output: dict, possible_answers: list) -> dict:
    """ast_checker.dict_checker: flat dicts only (all the dataset has)."""
    result = {"valid": False, "error": [], "error_type": "dict_checker:unclear"}
    for possible_answer in possible_answers:
        if possible_answer == "":
            continue
        result = dict_against_answer(model_output, possible_answer)
        if result["valid"]:
            return result
    return result


def dict_against_answer(model_output: dict, possible_answer: dict) -> dict:
    """One iteration of dict_checker's loop: the first bad key or value, then (as BFCL, which
    runs both checks) the first missing key, whose error type wins."""
    result = {"valid": True, "error": []}
    for key, value in model_output.items():
        if key not in possible_answer:
            result = {"valid": False, "error": [f"Unexpected dict key parameter: '{key}'."],
                      "error_type": "value_error:dict_key"}
            break
        standardize_value = standardize_string(value) if type(value) == str else value
        allowed = standardize_items(possible_answer[key])
        if standardize_value not in allowed:
            result = {"valid": False,
                      "error": [(f"Invalid value for parameter {key!r}: {value!r}. Expected one "
                                 f"of {allowed}.")],
                      "error_type": "value_error:dict_value"}
            break
    for key, value in possible_answer.items():
        if key not in model_output and "" not in value:
            result = {"valid": False,
                      "error": [*result["error"], f"Missing dict key parameter: '{key}'."],
                      "error_type": "value_error:dict_key"}
            break
    return result


def list_dict_checker(param: str, model_output: list, possible_answers: list) -> dict:
    """ast_checker.list_dict_checker: the dicts in order, against one possible answer."""
    result = {"valid": False, "error": [], "error_type": "list_dict_checker:unclear"}
    for answer in possible_answers:
        if len(model_output) != len(answer):
            result = {"valid": False, "error": ["Wrong number of dictionaries in the list."],
                      "error_type": "value_error:list_dict_count"}
            continue
        for item, expected in zip(model_output, answer):
            result = dict_checker(param, item, [expected])
            if not result["valid"]:
                break
        else:
            return {"valid": True, "error": []}
    return result


def simple_function_checker(func_description: dict, model_output: dict, possible_answer: dict,
                            underscore_to_dot: bool = True) -> dict:
    """ast_checker.simple_function_checker, language Python: name, required parameters, no
    unexpected parameter, each value's type and value, optional parameters left out."""
    possible_answer = next(iter(possible_answer.values()))
    param_details = func_description["parameters"]["properties"]
    func_name = convert_func_name(func_description["name"], underscore_to_dot)
    if func_name not in model_output:
        return {"valid": False, "error": [f"Function name {func_name!r} not found in model output."],
                "error_type": "simple_function_checker:wrong_func_name"}
    model_params = model_output[func_name]
    for param in func_description["parameters"]["required"]:
        if param not in model_params:
            return {"valid": False, "error": [f"Missing required parameter: {param!r}."],
                    "error_type": "simple_function_checker:missing_required"}
    for param, value in model_params.items():
        if param not in param_details or param not in possible_answer:
            return {"valid": False, "error": [f"Unexpected parameter: {param!r}."],
                    "error_type": "simple_function_checker:unexpected_param"}
        result = check_parameter(param, value, param_details[param], possible_answer[param])
        if not result["valid"]:
            return result
    for param in possible_answer:
        if param not in model_params and "" not in possible_answer[param]:
            return {"valid": False,
                    "error": [f"Optional parameter {param!r} not provided and not marked as optional."],
                    "error_type": "simple_function_checker:missing_optional"}
    return {"valid": True, "error": [], "error_type": "simple_function_checker:unclear"}


def check_parameter(param: str, value, details: dict, possible_answer: list) -> dict:
    """The per-parameter body of simple_function_checker's loop (Python)."""
    expected_type_description = details["type"]
    expected_type_converted = PYTHON_TYPE_MAPPING[expected_type_description]
    nested_type_converted = None
    if expected_type_description in PYTHON_NESTED_TYPE_CHECK_LIST:
        nested_type_converted = PYTHON_TYPE_MAPPING[details["items"]["type"]]
    if expected_type_description == "tuple" and type(value) == tuple:
        value = list(value)  # possible answers went through JSON: their tuples are lists
    if expected_type_description == "float" and type(value) == int:
        value = float(value)  # Python's own int -> float promotion
    result = type_checker(param, value, possible_answer, expected_type_description,
                          expected_type_converted, nested_type_converted)
    if not result["valid"]:
        return result
    # A variable is compared as a plain value, not with the dict/list/string rules.
    if not result["is_variable"]:
        if expected_type_converted == dict:
            return dict_checker(param, value, possible_answer)
        if expected_type_converted == list and nested_type_converted == dict:
            return list_dict_checker(param, value, possible_answer)
        if expected_type_converted == str:
            return string_checker(param, value, possible_answer)
        if expected_type_converted == list:
            return list_checker(param, value, possible_answer)
    if value not in possible_answer:
        return {"valid": False,
                "error": [(f"Invalid value for parameter {param!r}: {value!r}. Expected one "
                           f"of {possible_answer}.")],
                "error_type": "value_error:others"}
    return {"valid": True, "error": []}


def parallel_function_checker_no_order(func_descriptions: list[dict], model_output: list[dict],
                                       possible_answers: list[dict],
                                       underscore_to_dot: bool = True) -> dict:
    """Each expected call matches a distinct model call, in any order (first match wins)."""
    if len(model_output) != len(possible_answers):
        return {"valid": False, "error": ["Wrong number of functions."],
                "error_type": "parallel_function_checker_no_order:wrong_count"}
    matched_indices: list[int] = []
    for i, expected in enumerate(possible_answers):
        func_description = find_description(func_descriptions, next(iter(expected)))
        errors = []
        for index, call in enumerate(model_output):
            if index in matched_indices:
                continue
            result = simple_function_checker(func_description, call, expected, underscore_to_dot)
            if result["valid"]:
                matched_indices.append(index)
                break
            errors.append({f"Model Result Index {index}": {
                "sub_error": result["error"], "sub_error_type": result["error_type"]}})
        else:
            considered = [j for j in range(len(model_output)) if j not in matched_indices]
            return {"valid": False,
                    "error": [(f"Could not find a matching function among index {considered} "
                               f"of model output for index {i} of possible answers."), *errors],
                    "error_type": "parallel_function_checker_no_order:cannot_find_match"}
    return {"valid": True, "error": []}


def multiple_function_checker(func_descriptions: list[dict], model_output: list[dict],
                              possible_answers: list[dict], underscore_to_dot: bool = True) -> dict:
    """One call, to the one expected function among several offered."""
    if len(model_output) != len(possible_answers):
        return {"valid": False, "error": ["Wrong number of functions."],
                "error_type": "multiple_function_checker:wrong_count"}
    func_description = find_description(func_descriptions, next(iter(possible_answers[0])))
    return simple_function_checker(func_description, model_output[0], possible_answers[0],
                                   underscore_to_dot)
