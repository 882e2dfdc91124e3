"""Agent sessions for the speculation bench: BFCL's multi-turn conversations, replayed as tool loops.

Each session is one entry of BFCL v4's `multi_turn_base` (from the bfcl-eval wheel, as
`moonserve.pipeline.bench.bfcl` reads it): its user turns, in order, and as tools the functions
its ground truth calls (BFCL offers every function of the involved API classes, about 3,000
tokens of schemas per class, more than the embedded model's 4,096-token window holds with a
conversation). Each function keeps its name, parameters and its own part of the description
(after BFCL's "Tool description: "), not the class's preamble that BFCL repeats in every
function, nor BFCL's `response` schema, which OpenAI's tool format has no field for.

A turn: the user's message, then up to `max_steps` model calls. The first has
`tool_choice: required` (the agent acts: the embedded model, left to `auto`, writes prose about
the tools instead of calling them), the next ones `auto`. After a call that makes tool calls,
each call gets a tool message (BFCL's backends are not run: the reply is a fixed JSON echo of the
call's name) and the model is called again; a call without tool calls ends the turn.
Every request is greedy, so a session takes the same path in every arm of a bench, and the
transcripts must match across arms as the bench's other workloads' texts do. Tool-call ids are
replaced with deterministic ones before they go back into the conversation.

Sessions run `concurrency` at a time; each session's requests run one after another.

Example:
    >>> sessions = load_sessions(2)
    >>> sessions[0].id, len(sessions[0].turns), sorted(t["function"]["name"] for t in sessions[0].tools)
    ('multi_turn_base_0', 4, ['cd', 'diff', 'grep', 'mkdir', 'mv', 'sort'])
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import aiohttp

from moonserve.pipeline.bench import bfcl
from moonserve.pipeline.bench.client import RequestResult, in_pool, stream_chat

# bfcl_eval/constants/executable_backend_config.py: MULTI_TURN_FUNC_DOC_FILE_MAPPING
FUNC_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
}
CATEGORY = "multi_turn_base"
MAX_STEPS = 2
DESCRIPTION_MARK = "Tool description: "


@dataclass(frozen=True)
class AgentSession:
    id: str
    tools: list[dict]  # OpenAI tools
    turns: list[list[dict]]  # each turn's user messages


def called_functions(ground_truth: list[list[str]]) -> set[str]:
    """Names of the functions a BFCL multi-turn ground truth calls (`"mv(source='a', ...)"`)."""
    return {re.match(r"\s*([\w.]+)\s*\(", call).group(1) for turn in ground_truth for call in turn}


def load_sessions(n: int) -> list[AgentSession]:
    """The first `n` entries of BFCL's `multi_turn_base`, in file order."""
    data = bfcl.data_dir()
    rows = bfcl.load_jsonl(data / f"{bfcl.VERSION_PREFIX}_{CATEGORY}.json")[:n]
    answers = {a["id"]: a["ground_truth"] for a in bfcl.load_jsonl(
        data / "possible_answer" / f"{bfcl.VERSION_PREFIX}_{CATEGORY}.json")}
    docs = {name: bfcl.load_jsonl(data / "multi_turn_func_doc" / file)
            for name, file in FUNC_DOC_FILES.items()}
    sessions = []
    for row in rows:
        wanted = called_functions(answers[row["id"]])
        functions = [{"name": f["name"], "parameters": f["parameters"],
                      "description": f["description"].split(DESCRIPTION_MARK)[-1]}
                     for cls in row["involved_classes"] for f in docs[cls] if f["name"] in wanted]
        sessions.append(AgentSession(row["id"], bfcl.convert_to_tool(functions), row["question"]))
    return sessions


def tool_reply(name: str) -> str:
    return json.dumps({"tool": name, "status": "done"})


async def run_session(http: aiohttp.ClientSession, url: str, body: dict, session: AgentSession,
                      max_steps: int) -> tuple[list[RequestResult], list[dict]]:
    """One session's tool loop; returns its requests' results and the final conversation."""
    messages: list[dict] = []
    results: list[RequestResult] = []
    for turn_index, turn in enumerate(session.turns):
        messages.extend(turn)
        for step in range(max_steps):
            result = await stream_chat(http, url, {
                **body, "messages": messages, "tools": session.tools,
                "tool_choice": "required" if step == 0 else "auto"})
            results.append(result)
            calls = [{"id": f"call_{turn_index}_{step}_{i}", "type": "function",
                      "function": {"name": name, "arguments": arguments}}
                     for i, (name, arguments) in enumerate(result.tool_calls)]
            messages.append({"role": "assistant", "content": result.text or None,
                             **({"tool_calls": calls} if calls else {})})
            if not calls:
                break
            messages.extend({"role": "tool", "tool_call_id": c["id"],
                             "content": tool_reply(c["function"]["name"])} for c in calls)
    return results, messages


async def run_sessions(url: str, body: dict, sessions: list[AgentSession], concurrency: int,
                       max_steps: int = MAX_STEPS) -> tuple[list[RequestResult], list[str], float]:
    """Every session with at most `concurrency` in flight. Returns all requests' results, each
    session's transcript (its assistant turns as JSON, in session order) and wall seconds.
    `body` holds the model and sampling fields of every request."""
    outcomes, wall = await in_pool(
        sessions, concurrency, lambda http, session: run_session(http, url, body, session,
                                                                 max_steps), timeout_s=1800)
    results = [r for rs, _ in outcomes for r in rs]
    transcripts = [json.dumps([m for m in messages if m["role"] == "assistant"])
                   for _, messages in outcomes]
    return results, transcripts, wall
