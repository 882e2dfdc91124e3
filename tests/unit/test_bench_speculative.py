"""`moonserve bench speculative`'s arms and workloads, without starting a server."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from moonserve.pipeline.bench import speculative
from moonserve.pipeline.config import load_app_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    speculative.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arms_share_engines_and_take_the_asked_k(tmp_path):
    args = parse("--num-speculative-tokens", "8", "--vllm-ngram-k", "4",
                 "--arms", "off,vllm_ngram,service_ngram_fixed,service_ngram")
    arms = speculative.chosen_arms(args)
    assert list(arms) == ["off", "vllm_ngram", "service_ngram_fixed", "service_ngram",
                          "vllm_ngram_k4"]
    assert arms["service_ngram_fixed"].engine == arms["service_ngram"].engine
    assert (arms["service_ngram_fixed"].adaptive, arms["service_ngram"].adaptive) == (False, None)
    for name, k in (("vllm_ngram", 8), ("service_ngram", 8), ("vllm_ngram_k4", 4)):
        path = speculative.arm_config(args.config, arms[name].draft, tmp_path / f"{name}.yaml")
        draft = load_app_config(path).draft  # the app's own validation of the written section
        assert draft.num_speculative_tokens == k
        assert draft.mode == ("service" if name.startswith("service") else "inline")


def test_suffix_arms_share_the_service_engine_and_set_factor_and_prefetch_per_arm(tmp_path):
    args = parse("--arms", "service_ngram,service_suffix,service_suffix_noprefetch",
                 "--suffix-spec-factor", "2", "3.5")
    arms = speculative.chosen_arms(args)
    assert list(arms) == ["service_ngram", "service_suffix", "service_suffix_noprefetch",
                          "service_suffix_f2", "service_suffix_f3.5"]
    assert {a.engine for a in arms.values()} == {"service"}
    assert [(a.drafter, a.settings, a.prefetch) for a in arms.values()] == [
        ("ngram", None, None), ("suffix", None, None), ("suffix", None, False),
        ("suffix", {"max_spec_factor": 2.0}, None), ("suffix", {"max_spec_factor": 3.5}, None)]
    from moonserve.deployments.draft import drafter_factories

    config = load_app_config(args.config).draft
    factory = drafter_factories(config, str(tmp_path), "/target")["suffix"]
    assert factory().settings == config.suffix
    assert factory(max_spec_factor=3.5).settings == \
        dataclasses.replace(config.suffix, max_spec_factor=3.5)
    with pytest.raises(ValueError, match="max_spec"):
        factory(max_spec=2)


def test_unknown_arm_is_refused_by_name():
    with pytest.raises(ValueError, match="service_magic"):
        speculative.chosen_arms(parse("--arms", "off,service_magic"))


def test_short_chat_answers_are_32_tokens_whatever_max_tokens_says():
    loads = speculative.workloads(parse("--requests", "3", "--max-tokens", "200"))
    assert {name: (len(w.prompts), w.max_tokens) for name, w in loads.items()} == \
        {"copy": (3, 200), "chat": (3, 200), "short_chat": (3, 32)}
    assert all("\n" not in p for p in loads["short_chat"].prompts)


def test_workloads_can_be_chosen_and_unknown_ones_are_refused():
    assert list(speculative.workloads(parse("--workloads", "short_chat"))) == ["short_chat"]
    with pytest.raises(ValueError, match="long_chat"):
        speculative.workloads(parse("--workloads", "copy,long_chat"))


def test_agentic_sessions_are_bfcl_multi_turn_conversations_with_the_tools_they_call():
    from moonserve.pipeline.bench import agentic, bfcl

    load = speculative.workloads(parse("--workloads", "agentic", "--requests", "5"))["agentic"]
    assert [s.id for s in load.sessions] == [f"multi_turn_base_{i}" for i in range(5)]
    answers = {a["id"]: a["ground_truth"] for a in bfcl.load_jsonl(
        bfcl.data_dir() / "possible_answer" / "BFCL_v4_multi_turn_base.json")}
    for session in load.sessions:
        names = {t["function"]["name"] for t in session.tools}
        assert names == agentic.called_functions(answers[session.id])
        assert len(session.turns) == len(answers[session.id])
        assert all(turn[0]["role"] == "user" for turn in session.turns)
        for tool in session.tools:
            assert tool["function"]["parameters"]["type"] == "object"
            assert agentic.DESCRIPTION_MARK not in tool["function"]["description"]
    assert agentic.called_functions([["cd(folder='a')", " mv (source='x', destination='y')"],
                                     ["math.mean(numbers=[1])"]]) == {"cd", "mv", "math.mean"}


def test_a_cell_is_its_median_round_and_keeps_every_round():
    rounds = [{"decode_tokens_per_s": v, "texts": ["a"]} for v in (30.0, 10.0, 20.0, 40.0)]
    cell = speculative.median_cell(rounds)
    assert cell["decode_tokens_per_s"] == 20.0  # the lower middle of an even count
    assert cell["decode_tokens_per_s_rounds"] == [30.0, 10.0, 20.0, 40.0]
    assert cell["rounds"] is rounds
    args = parse("--concurrency", "1", "4", "--rounds", "2")
    off = {"copy": {"c1": speculative.median_cell(rounds[:3])}}
    other = [{"decode_tokens_per_s": 40.0, "texts": ["a"]},
             {"decode_tokens_per_s": 50.0, "texts": ["b"]}]
    report = speculative.summarize(args, {"off": off,
                                          "service_suffix": {"copy": {"c1": speculative.median_cell(
                                              other)}}})
    cell = report["arms"]["service_suffix"]["copy"]["c1"]
    assert cell["speedup_vs_off"] == 2.0 and cell["outputs_match_off"] is False
    assert report["concurrency"] == [1, 4] and report["rounds"] == 2


def test_hidden_state_steps_carry_each_rows_hidden_states_through_a_step_server():
    """The bytes are the rows' hidden states plus a small envelope, at every batch size."""
    from moonserve.pipeline.bench import hidden_steps

    section = hidden_steps.measure(steps=3, k=4, batches=(1, 3))
    width = section["drafter"]["context_width"]
    row_hidden = hidden_steps.NEW_TOKENS * width * 2  # bfloat16
    for b in section["batches"]:
        assert row_hidden < b["bytes_per_row"] < row_hidden + 200
        assert b["prefill_bytes"] > b["batch"] * hidden_steps.PROMPT_TOKENS * width * 2
        k3_row = hidden_steps.NEW_TOKENS * section["k3_context_width"] * 2
        assert b["batch"] * k3_row < b["bytes_per_step_k3"] < b["batch"] * (k3_row + 200)
        assert 0 < b["service_step_ms_p50"] <= b["round_trip_ms_p50"]
    assert [b["bytes_per_step"] for b in section["per_request_passes"]] == \
        [b["bytes_per_step"] for b in section["batches"]]  # the same steps, drafted apart
    assert parse().hidden_state_steps == 20
    assert parse("--hidden-state-steps", "0").hidden_state_steps == 0


def test_cpu_is_counted_per_part_of_the_server():
    """Processes are told apart by their titles (as Ray and vLLM set them), and the CPU a process
    burns is counted against its part."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from moonserve.pipeline.bench.overhead import cpu_seconds_by_process
    from moonserve.pipeline.bench.speculative import cpu_by_part, cpu_part

    assert cpu_part("VLLM::EngineCore") == cpu_part("VLLM::Worker") == "engine"
    assert cpu_part("ray::ServeReplica:moonserve:DraftService") == "draft_service"
    assert cpu_part("ray::ServeReplica:moonserve:LanguageModel") == "rest"
    assert cpu_part("python3") == "rest"
    burn = ("import time\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\ntime.sleep(60)")
    # `exec -a` gives the child the title vLLM's engine core process has.
    child = subprocess.Popen(["bash", "-c", f'exec -a VLLM::EngineCore {sys.executable} -c "$0"',
                              burn])
    server = SimpleNamespace(pid=child.pid, descendants=lambda: [])
    try:
        # Started after the first reading (here: no process at all), it counts in full.
        deadline, used = time.monotonic() + 30, cpu_by_part({}, cpu_seconds_by_process(server))
        while used["engine"] < 0.2 and time.monotonic() < deadline:
            time.sleep(0.1)
            used = cpu_by_part({}, cpu_seconds_by_process(server))
        assert used["engine"] >= 0.2 and used["draft_service"] == used["rest"] == 0.0, used
        idle = cpu_by_part(cpu_seconds_by_process(server), cpu_seconds_by_process(server))
        assert idle["engine"] < 0.05, idle
    finally:
        child.kill()
