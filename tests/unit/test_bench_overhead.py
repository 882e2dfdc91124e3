"""`moonserve bench overhead`'s arms: vLLM's server gets the engine arguments the LanguageModel
gives AsyncLLM (asked of vLLM's own argument parser), the pipeline arms differ only in what they
say, and the serving-path CPU leaves out the engine's own processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import yaml

from moonserve.deployments.language_model import engine_args
from moonserve.pipeline.bench import overhead
from moonserve.pipeline.config import DEFAULT_CONFIG, load_app_config

# AsyncEngineArgs fields where the LanguageModel passes None ("vLLM's default") and vLLM's CLI
# fills in that default, or that only name the tokenizer the model already is.
SAME_BY_DEFAULT = {"tokenizer", "enable_prefix_caching", "mm_encoder_tp_mode",
                   "mm_device_do_normalize", "enable_lora", "reasoning_parser_plugin"}


def test_vllm_server_gets_the_language_models_engine_arguments():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine = load_app_config(DEFAULT_CONFIG).language_model.engine
    cmd = overhead.vllm_command(engine, "/m", 8100)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    server = AsyncEngineArgs.from_cli_args(parsed)
    ours = engine_args(engine, "/m")
    differ = {f.name for f in dataclasses.fields(AsyncEngineArgs)
              if getattr(server, f.name) != getattr(ours, f.name)}
    assert differ <= SAME_BY_DEFAULT, {n: (getattr(ours, n), getattr(server, n)) for n in differ}
    # The parts the comparison depends on, spelled out.
    assert server.scheduler_cls == "moonserve.pipeline.engine.lane_scheduler.LaneScheduler"
    assert server.max_num_batched_tokens == engine.max_num_batched_tokens
    assert server.scheduling_policy == "priority" and server.async_scheduling is False


def test_pipeline_arms_differ_only_in_ingress_and_drafts(tmp_path: Path):
    base = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    for arm, spec in overhead.PIPELINE_ARMS.items():
        out = overhead.pipeline_config(str(DEFAULT_CONFIG), "off", tmp_path / arm,
                                       spec.router_ingress)
        config = load_app_config(out)
        assert config.draft.mode == "off" and config.router.ingress == spec.router_ingress
        args = yaml.safe_load(out.read_text())["applications"][0]["args"]
        base_args = base["applications"][0]["args"]
        assert args["language_model"] == base_args["language_model"]
        assert {k: v for k, v in args["router"].items() if k != "ingress"} == \
            {k: v for k, v in base_args["router"].items() if k != "ingress"}
    kept = overhead.pipeline_config(str(DEFAULT_CONFIG), "config", tmp_path / "kept")
    assert load_app_config(kept).draft == load_app_config(DEFAULT_CONFIG).draft


def test_the_tiny_engine_is_the_same_for_both_arms_with_room_for_256_streams(tmp_path: Path):
    """`--engine tiny`: vLLM's server and the pipeline get the tiny model with the same engine
    arguments, and the pipeline's lanes and Serve limits do not cap its 256 streams."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    config = load_app_config(overhead.tiny_config(str(DEFAULT_CONFIG), tmp_path / "tiny.yaml"))
    engine = config.language_model.engine
    assert json.loads((Path(engine.model) / "config.json").read_text())["num_hidden_layers"] == 2
    assert config.vision is None and engine.max_num_seqs == 256
    cmd = overhead.vllm_command(engine, engine.model, 8100)
    server = AsyncEngineArgs.from_cli_args(
        make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:]))
    ours = engine_args(engine, engine.model)
    assert (server.max_num_seqs, server.max_num_batched_tokens) == \
        (ours.max_num_seqs, ours.max_num_batched_tokens) == (256, 4096)
    lanes = config.router.lanes
    assert min(lanes.interactive.max_in_flight, lanes.fifo.max_in_flight) >= 256
    assert config.language_model.deployment.max_ongoing_requests >= 256


def test_serving_cpu_leaves_out_the_engine_processes():
    cpu = {"VLLM::EngineCore": 30.0, "python": 1.5, "ray::Router": 2.0, "ray::ProxyActor": 1.0,
           "VLLM::Worker_TP0": 4.0, "raylet": 0.5}
    assert overhead.serving_cpu(cpu) == 5.0


def test_cli_defaults_are_the_issue_levels():
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args([])
    assert args.concurrency is None and args.engine == "config" and args.draft == "off"
    assert args.arms == ["vllm", "pipeline", "pipeline_haproxy"]


def test_direct_ingress_arms_reach_the_router_on_its_port_or_through_haproxy(tmp_path: Path):
    from types import SimpleNamespace

    args = SimpleNamespace(config=str(DEFAULT_CONFIG), draft="off", port=8100)
    urls = {arm: overhead.pipeline_server(arm, args, tmp_path) for arm in
            ("pipeline", "pipeline_direct_ingress", "pipeline_haproxy")}
    assert {arm: s.health_url for arm, s in urls.items()} == {
        "pipeline": "http://127.0.0.1:8101/health",  # Serve's proxy
        "pipeline_direct_ingress": "http://127.0.0.1:8103/health",  # the Router replica's port
        "pipeline_haproxy": "http://127.0.0.1:8101/health"}  # HAProxy, in front of 8103
    config = urls["pipeline_haproxy"].cmd[urls["pipeline_haproxy"].cmd.index("--config") + 1]
    assert load_app_config(config).router.ingress == "haproxy"
    assert urls["pipeline_haproxy"].env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8103"
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in urls["pipeline"].env


def test_serve_env_names_ray_serves_own_settings():
    """`moonserve serve`'s SERVE_ENV changes what Ray Serve reads (a renamed variable would be
    silently ignored), the `pipeline_serve_defaults` arm puts back Ray's defaults, and
    `pipeline_one_loop` changes only Serve's threads."""
    import json
    import os
    import subprocess
    import sys

    from moonserve.pipeline.app.server import SERVE_ENV

    read = ("import json; from ray.serve._private import constants as c; print(json.dumps("
            "[c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS, "
            "c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP]"
            "))")
    clean = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}

    def constants(env: dict) -> list:
        out = subprocess.run([sys.executable, "-c", read], env=clean | env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    defaults = dict(overhead.PIPELINE_ARMS["pipeline_serve_defaults"].env)
    assert set(defaults) == set(SERVE_ENV)
    ray_defaults = constants({})
    assert ray_defaults == [0.1, 100, True, True] == constants(defaults)
    assert constants(SERVE_ENV) == [0.5, 1000, True, True]
    one_loop = dict(overhead.PIPELINE_ARMS["pipeline_one_loop"].env)
    assert constants(SERVE_ENV | one_loop) == [0.5, 1000, False, False]


def test_idle_cpu_is_taken_off_per_token_figures():
    before = {1: ("ray::Router", 1.0), 2: ("VLLM::EngineCore", 5.0), 3: ("gcs_server", 2.0)}
    after = {1: ("ray::Router", 1.5), 2: ("VLLM::EngineCore", 9.0), 3: ("gcs_server", 2.25),
             4: ("ray::ProxyActor", 0.5)}  # started between the two readings
    cpu = overhead.cpu_per_token(before, after, 100)
    assert list(cpu) == ["VLLM::EngineCore", "ray::Router", "ray::ProxyActor", "gcs_server"]
    assert cpu["ray::Router"] == 5.0 and cpu["gcs_server"] == 2.5
    level = {"serving_cpu_ms_per_output_token": overhead.serving_cpu(cpu), "wall_s": 2.0,
             "output_tokens": 100}
    # 12.5 ms/token of serving CPU; 100 ms/s idle over 2 s is 2 ms per token of it.
    assert overhead.less_idle(level, {"serving_cpu_ms_per_s": 100.0}) == 10.5


def test_the_image_body_arms_serve_one_multimodal_model_and_a_padded_image_is_the_same_image(
        tmp_path: Path):
    """`--engine k25 --image-body-mb`: both arms serve the synthetic Kimi-K2.5 with the same
    engine arguments (the pipeline handing images to its engine), the pipeline takes the body,
    and the padded PNG is the small one's pixels to both vLLM's image loader and the
    Preprocess deployment's decoder, so only the body's size differs."""
    import base64

    import numpy as np
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.multimodal.media import MediaConnector
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from moonserve.pipeline.vision.preprocess import decode_image

    config = load_app_config(overhead.k25_config(str(DEFAULT_CONFIG), tmp_path))
    engine = config.language_model.engine
    cmd = overhead.vllm_command(engine, engine.model, 8100)
    server = AsyncEngineArgs.from_cli_args(
        make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:]))
    ours = engine_args(engine, engine.model)
    for name in ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_prompt_embeds"):
        assert getattr(server, name) == getattr(ours, name), name
    assert config.vision.handover == "encoder_cache"
    # vLLM's arm gets a chat template that writes an image as K2.5's own placeholder (what
    # vLLM's processor expands), as the Router writes it from vision.image_placeholder.
    import jinja2
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    template = jinja2.Template(overhead.k25_chat_template(tmp_path).read_text())
    prompt = template.render(add_generation_prompt=True, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image"}]}])
    placeholder = KimiK25ForConditionalGeneration.get_placeholder_str("image", 0)
    assert prompt.count(placeholder) == 1 and "kimi_image_placeholder" not in prompt

    small = overhead.gradient_png()
    padded = overhead.padded_png(small, 6_000_000)
    url = overhead.data_url(padded)
    assert abs(len(url) - 6_000_000) < 100
    assert config.router.limits.max_request_bytes > len(url) + 1000
    loaded = [np.asarray(MediaConnector().fetch_image(overhead.data_url(png)))
              for png in (small, padded)]
    decoded = [np.asarray(decode_image(png, config.vision.preprocessor)) for png in (small, padded)]
    assert loaded[0].shape == (48, 64, 3)
    assert np.array_equal(*loaded) and np.array_equal(*decoded)
    assert base64.b64decode(url.split(",", 1)[1]) == padded
