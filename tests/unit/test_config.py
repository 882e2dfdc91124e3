"""The typed app config: the shipped configs validate, mistakes fail naming the key."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from moonserve.pipeline.config import AppConfig, load_app_config
from moonserve.pipeline.app.server import read_apps
from tests.conftest import LOCAL_CONFIG


def local_args() -> dict:
    return yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"]


def test_local_config_is_the_embedded_float32_default():
    cfg = load_app_config(LOCAL_CONFIG)
    assert cfg.language_model.engine.model == "embedded"
    assert cfg.language_model.engine.dtype == "float32"
    assert cfg.language_model.placement.bundles == [{"CPU": 1.0}]


def test_local_config_is_a_ray_serve_config_file():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(LOCAL_CONFIG.read_text()))
    assert schema.applications[0].import_path == "moonserve.deployments.builder:build_app"


EXTRA = "Extra inputs are not permitted"  # pydantic models
UNEXPECTED = "Unexpected keyword argument"  # the pydantic dataclasses the inner code uses too


@pytest.mark.parametrize("path, key, message", [
    (("language_model", "engine", "dtyp"), "language_model.engine.dtyp", EXTRA),
    (("router", "max_body"), "router.max_body", EXTRA),
    (("language_model", "placment"), "language_model.placment", EXTRA),
    (("tokenizer",), "tokenizer", EXTRA),
    (("draft", "sessions", "max_session"), "draft.sessions.max_session", UNEXPECTED),
    (("vision", "preprocessor", "remote", "allowed_host"), "vision.preprocessor.remote.allowed_host",
     UNEXPECTED),
])
def test_unknown_keys_fail_naming_the_key(path, key, message):
    args = local_args()
    node = args
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = 1
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert key in str(err.value).replace("\n  ", ".").replace("\n", ".")
    assert message in str(err.value)


def test_mistyped_values_fail_naming_the_key():
    args = local_args()
    args["language_model"]["engine"]["max_model_len"] = "lots"
    with pytest.raises(ValidationError, match="max_model_len"):
        AppConfig.model_validate(args)
    args = local_args()
    args["language_model"]["engine"]["dtype"] = "float8"
    with pytest.raises(ValidationError, match="dtype"):
        AppConfig.model_validate(args)


def test_tensor_parallel_needs_a_bundle_per_rank():
    args = local_args()
    args["language_model"]["engine"]["tensor_parallel_size"] = 3
    with pytest.raises(ValidationError, match="one bundle per TP rank"):
        AppConfig.model_validate(args)
    args["language_model"]["placement"]["bundles"] = [{"CPU": 0.3}] * 3
    assert AppConfig.model_validate(args).language_model.engine.tensor_parallel_size == 3


def test_image_handover_needs_what_its_path_uses():
    args = local_args()
    args["language_model"]["engine"]["enable_prompt_embeds"] = False
    with pytest.raises(ValidationError, match="vision.handover is prompt_embeds but .*"
                                              "enable_prompt_embeds is false"):
        AppConfig.model_validate(args)
    args["vision"]["handover"] = "encoder_cache"
    with pytest.raises(ValidationError, match="needs a model vLLM serves as multimodal"):
        AppConfig.model_validate(args)  # the embedded model is text-only
    args["language_model"]["engine"]["model"] = "/models/kimi-k2.5"
    config = AppConfig.model_validate(args)  # no prompt embeddings needed
    assert config.vision.handover == "encoder_cache"
    assert config.vision.encoder.store == "/dev/shm/moonserve-ec"


def test_serve_rejects_ray_deployment_overrides(tmp_path):
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["applications"][0]["deployments"] = [{"name": "Router", "num_replicas": 2}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"applications\[0\].deployments"):
        read_apps(path)


def test_ingress_is_the_clusters_and_sets_serves_haproxy_mode(tmp_path, monkeypatch):
    from moonserve.pipeline.app.server import SERVE_ENV, cluster_env

    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    for name in SERVE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cluster_env(read_apps(path)[1]) == SERVE_ENV  # proxy: Serve's default mode
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")  # the user's own wins
    data["applications"][0]["args"]["router"]["ingress"] = "haproxy"
    path.write_text(yaml.safe_dump(data))
    assert cluster_env(read_apps(path)[1]) == SERVE_ENV | {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    second = {**data["applications"][0], "name": "other", "route_prefix": "/other"}
    second["args"] = {**second["args"], "router": {**second["args"]["router"], "ingress": "proxy"}}
    data["applications"].append(second)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"router.ingress differs between applications "
                                         r"\(\{'moonserve': 'haproxy', 'other': 'proxy'\}\)"):
        read_apps(path)


def test_an_external_scaler_app_has_no_autoscaling(tmp_path):
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["applications"][0]["external_scaler_enabled"] = True
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    # configs/local.yaml autoscales the ImagePreprocessor.
    with pytest.raises(ValueError, match=r"external_scaler_enabled: .* set num_replicas instead "
                                         r"of vision.preprocessor.deployment.autoscaling"):
        read_apps(path)
    data["applications"][0]["args"]["vision"]["preprocessor"]["deployment"] = \
        {"num_replicas": 2, "max_ongoing_requests": 32}
    path.write_text(yaml.safe_dump(data))
    (app,) = read_apps(path)[1]
    assert app.external_scaler_enabled and app.config.autoscaled() == []


def test_builder_binds_router_and_language_model_from_config():
    """The app graph and resources come from the typed config (no Ray started)."""
    from moonserve.deployments.builder import language_model_options, router_options

    cfg = load_app_config(LOCAL_CONFIG)
    lm = language_model_options(cfg.language_model)
    assert lm["placement_group_bundles"] == [{"CPU": 1.0}]
    assert lm["placement_group_strategy"] == "STRICT_PACK"
    # No env: the replica inherits the environment (VLLM_CPU_OMP_THREADS_BIND where it is set).
    assert "runtime_env" not in lm["ray_actor_options"]
    with_env = cfg.language_model.model_copy(update={"env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}})
    assert language_model_options(with_env)["ray_actor_options"]["runtime_env"] == \
        {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}
    assert router_options(cfg.router)["max_ongoing_requests"] == 256


def test_custom_resources_pin_replicas_and_serve_gets_the_proxy_location(tmp_path):
    """`deployment.resources` reaches each replica's actor options (the LanguageModel's go in its
    bundles, and the config says so); the file's `proxy_location` reaches `serve.start`."""
    from moonserve.deployments.builder import build_app
    from tests.unit.test_production_config import deployments_of

    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    args = data["applications"][0]["args"]
    args["router"]["deployment"]["resources"] = {"moonserve_head": 0.01}
    args["router"]["deployment"]["max_replicas_per_node"] = 1
    args["draft"]["deployment"]["resources"] = {"moonserve_worker": 0.01}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    serve_wide, (app,) = read_apps(path)
    assert serve_wide["proxy_location"] == "HeadOnly"
    graph = deployments_of(build_app(app.config))
    resources = {name: d.ray_actor_options.get("resources") for name, d in graph.items()}
    assert resources == {"Router": {"moonserve_head": 0.01}, "LanguageModel": None,
                         "DraftService": {"moonserve_worker": 0.01}, "ImagePreprocessor": None,
                         "VisionEncoder": None}
    spread = {name: d._replica_config.max_replicas_per_node for name, d in graph.items()}
    assert spread == {"Router": 1, "LanguageModel": None, "DraftService": None,
                      "ImagePreprocessor": None, "VisionEncoder": None}
    args["language_model"]["deployment"]["resources"] = {"moonserve_lm": 1}
    with pytest.raises(ValidationError, match=r"put custom resources in placement.bundles\[0\]"):
        AppConfig.model_validate(args)
    del args["language_model"]["deployment"]["resources"]
    args["language_model"]["deployment"]["max_replicas_per_node"] = 1
    with pytest.raises(ValidationError, match=r"deployment.max_replicas_per_node: the Language"):
        AppConfig.model_validate(args)


def test_a_sharded_draft_service_routes_by_shard_and_names_its_shards_to_the_engine():
    from moonserve.deployments.builder import build_app
    from moonserve.deployments.language_model import export_draft_env
    from moonserve.pipeline.engine.proposer import ENV_SHARDS
    from tests.unit.test_production_config import deployments_of

    args = local_args()
    args["draft"]["deployment"] = {"num_replicas": 3, "max_ongoing_requests": 64}
    config = AppConfig.model_validate(args)
    graph = deployments_of(build_app(config))
    router = graph["DraftService"]._deployment_config.request_router_config
    assert router.request_router_class.endswith("draft_shards.ShardRouter")
    assert graph["DraftService"]._deployment_config.num_replicas == 3
    environ = {}
    export_draft_env(config.draft, "/tmp/x.sock", environ)
    assert environ[ENV_SHARDS] == "3" and ENV_SHARDS in environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"]
    one = deployments_of(build_app(load_app_config(LOCAL_CONFIG)))["DraftService"]
    assert "ShardRouter" not in str(one._deployment_config.request_router_config)


def test_the_hidden_state_drafter_names_its_target_layers_to_the_engine(tmp_path):
    from moonserve.deployments.draft import drafter_factories
    from moonserve.deployments.language_model import export_draft_env
    from moonserve.pipeline.engine.proposer import ENV_HIDDEN_LAYERS

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "vocab_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 96, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "target_layer_ids": [0, 7, 13]}))
    args = local_args()
    args["draft"].update(mode="service", drafter="dspark_context", model=str(tmp_path))
    config = AppConfig.model_validate(args)
    environ = {}
    export_draft_env(config.draft, "/tmp/x.sock", environ)
    assert environ[ENV_HIDDEN_LAYERS] == "0,7,13"
    assert ENV_HIDDEN_LAYERS in environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"]
    assert "dspark_context" in drafter_factories(config.draft, str(tmp_path), "/target")
    token_only = AppConfig.model_validate(local_args()).draft
    export_draft_env(token_only, "/tmp/x.sock", environ)
    assert environ[ENV_HIDDEN_LAYERS] == ""
    assert "dspark_context" not in drafter_factories(token_only, "/d", "/target")


def test_drains_are_sized_from_the_lanes_and_max_tokens():
    """What Serve is given as each deployment's graceful shutdown (the bound graph's config)."""
    from moonserve.deployments.builder import build_app
    from tests.unit.test_production_config import deployments_of

    cfg = load_app_config(LOCAL_CONFIG)
    # The long_context lane's 300 s queue, then 4096 tokens (the context) at 4 tokens/s.
    assert cfg.drain_s() == 300 + 4096 / 4
    graph = deployments_of(build_app(cfg))
    graceful = {name: d._deployment_config.graceful_shutdown_timeout_s
                for name, d in graph.items()}
    assert graceful == {"Router": 1324, "LanguageModel": 1324, "DraftService": 1324,
                        "ImagePreprocessor": 20, "VisionEncoder": 20}
    capped = cfg.model_copy(update={"router": cfg.router.model_copy(update={
        "limits": cfg.router.limits.model_copy(update={"max_tokens": 400})})})
    assert capped.drain_s() == 300 + 400 / 4
    own = AppConfig.model_validate({"router": {"auth": {"enabled": False}, "deployment": {
        "graceful_shutdown_timeout_s": 5, "max_ongoing_requests": 256}}})
    assert deployments_of(build_app(own))["Router"]._deployment_config \
        .graceful_shutdown_timeout_s == 5


def test_serve_run_path_builds_the_app_from_the_yaml():
    """What `serve run configs/local.yaml` does: import the builder, validate `args` through its
    annotation, build the graph (binding needs no running Ray)."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray._common.utils import import_attr

    app_entry = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]
    builder = import_attr(app_entry["import_path"])
    app = call_user_app_builder_with_args_if_necessary(builder, app_entry["args"])
    assert app._bound_deployment.name == "Router"

    bad = {**app_entry["args"], "routr": {}}
    with pytest.raises(ValidationError, match="routr"):
        call_user_app_builder_with_args_if_necessary(builder, bad)


@pytest.mark.parametrize("args, needle", [
    ({"router": {"deployment": {"max_ongoing_requests": 50}}},
     "max_ongoing_requests (50) is below what the lanes hold (in flight + queued = 216)"),
    ({"language_model": {"deployment": {"max_ongoing_requests": 20}}},
     "must exceed the requests the router lanes admit (56)"),
    # Two Router replicas with per-replica lanes admit twice the lanes' numbers.
    ({"router": {"lanes": {"scope": "replica"},
                 "deployment": {"num_replicas": 2, "max_ongoing_requests": 256}},
      "language_model": {"deployment": {"max_ongoing_requests": 100}}},
     "must exceed the requests the router lanes admit (112)"),
    ({"language_model": {"engine": {"scheduling_policy": "fcfs"}}},
     "scheduling_policy is not 'priority'"),
    ({"router": {"limits": {"max_tokens": 8, "default_max_tokens": 16}}},
     "default_max_tokens (16) is over max_tokens (8)"),
    ({"router": {"lanes": {"interactive": {"max_in_flight": 0, "max_queue": 1}}}},
     "router.lanes.interactive.max_in_flight"),
    ({"draft": {"mode": "service", "deployment": {
        "autoscaling": {"min_replicas": 1, "max_replicas": 2}}}},
     "draft.deployment.autoscaling: each request's context lives in the replica"),
    ({"draft": {"mode": "inline", "drafter": "dspark"}},
     "needs a target checkpoint that ships DSpark weights"),
    ({"draft": {"mode": "inline", "drafter": "dspark_context"}},
     "draft.drafter dspark_context is a DraftService drafter"),
    ({"draft": {"mode": "inline", "drafter": "suffix"}},
     "draft.drafter suffix is a DraftService drafter"),
    ({"draft": {"mode": "service", "drafter": "suffix", "suffix": {"max_depth": 1}}},
     "draft.suffix.max_depth"),
    ({"draft": {"mode": "service", "drafter": "dspark_context"}},
     "draft.model: drafter dspark_context needs a K3 DSpark checkpoint"),
    ({"draft": {"ngram_min": 6, "ngram_max": 5}}, "draft.ngram_min (6) is over draft.ngram_max (5)"),
    ({"draft": {"mode": "sometimes"}}, "draft.mode"),
    ({"language_model": {"engine": {"background_priority": 10, "strict_prefill_priority": False}}},
     "background_priority needs scheduling_policy: priority and strict_prefill_priority: true"),
    ({"language_model": {"engine": {"background_priority": 0, "strict_prefill_priority": True}}},
     ("router.lanes.interactive.priority (0) must be better (lower) than "
      "language_model.engine.background_priority (0)")),
])
def test_inconsistent_lane_and_limit_settings_fail_at_load(args, needle):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert needle in str(err.value)


def test_local_engine_runs_the_lane_scheduler_with_the_long_lane_as_background():
    from moonserve.deployments.language_model import engine_args

    cfg = load_app_config(LOCAL_CONFIG)
    engine = cfg.language_model.engine
    args = engine_args(engine, "/models/embedded")
    assert args.scheduler_cls == "moonserve.pipeline.engine.lane_scheduler.LaneScheduler"
    assert args.async_scheduling is False  # LaneScheduler extends the synchronous scheduler
    assert args.additional_config["moonserve_lanes"]["background_priority"] == \
        cfg.router.lanes.long_context.priority
    fcfs = engine.model_copy(update={"scheduling_policy": "fcfs", "background_priority": None})
    assert fcfs.scheduler_cls() is None  # vLLM's own scheduler


def test_application_lanes_admit_their_numbers_whatever_the_router_replicas():
    cfg = AppConfig.model_validate({"router": {"deployment": {"num_replicas": 4,
                                                              "max_ongoing_requests": 256}},
                                    "language_model": {"deployment": {"max_ongoing_requests": 57}}})
    assert cfg.router.lanes.scope == "application"
    assert cfg.router.lanes.copies(cfg.router.deployment.max_replicas()) == 1


def test_lanes_off_needs_no_priority_scheduling():
    cfg = AppConfig.model_validate({"router": {"lanes": {"enabled": False}},
                                    "language_model": {"engine": {"scheduling_policy": "fcfs"}}})
    assert list(cfg.router.lanes.active()) == ["fifo"]


def test_image_preprocessor_defaults_are_the_preprocessing_defaults():
    from moonserve.pipeline.config import ImagePreprocessorConfig
    from moonserve.pipeline.vision.preprocess import PreprocessConfig

    assert ImagePreprocessorConfig().preprocess_config() == PreprocessConfig()
    custom = ImagePreprocessorConfig(patch_size=16, max_image_pixels=1000)
    assert custom.preprocess_config() == PreprocessConfig(patch_size=16, max_image_pixels=1000)


def test_inner_dataclasses_are_the_yaml_blocks():
    """`vision.preprocessor.remote` and `draft.sessions` are validated as the dataclasses the
    replicas run with (one definition of each field, default and bound)."""
    from moonserve.pipeline.speculative.sessions import SessionLimits
    from moonserve.pipeline.vision.sources import RemotePolicy

    cfg = load_app_config(LOCAL_CONFIG)
    assert cfg.draft.sessions == SessionLimits()
    assert cfg.vision.preprocessor.remote == RemotePolicy()
    remote = AppConfig.model_validate({**local_args(), "vision": {"preprocessor": {"remote": {
        "allowed_hosts": ["Images.Example.com."]}}}}).vision.preprocessor.remote
    assert remote.allowed_hosts == ("images.example.com",)


@pytest.mark.parametrize("block, needle", [
    ({"draft": {"sessions": {"max_sessions": 0}}}, "draft.sessions.max_sessions"),
    ({"vision": {"preprocessor": {"remote": {"connect_timeout_s": 0}}}},
     "vision.preprocessor.remote.connect_timeout_s"),
    ({"vision": {"preprocessor": {"remote": {"allowed_networks": ["ten"]}}}},
     "'ten' is not an IP network"),
    ({"vision": {"preprocessor": {"merge_kernel": [2, 3]}}},
     "PreprocessConfig.merge_kernel must be square and positive, got (2, 3)"),
    ({"vision": {"preprocessor": {"image_std": [0.5, 0, 0.5]}}}, "image_mean/image_std"),
])
def test_bad_inner_values_fail_at_load(block, needle):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({**local_args(), **block})
    assert needle in str(err.value).replace("\n  ", ".").replace("\n", ".")


def test_draft_modes_become_vllm_speculative_configs():
    from moonserve.pipeline.config import DraftConfig

    assert DraftConfig(mode="off").speculative_config() is None
    assert DraftConfig(mode="service", num_speculative_tokens=3).speculative_config() == {
        "method": "custom_class", "num_speculative_tokens": 3,
        "model": "moonserve.pipeline.engine.proposer.ServiceProposer"}
    assert DraftConfig(mode="inline", drafter="ngram", ngram_min=2, ngram_max=4) \
        .speculative_config() == {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    local = load_app_config(LOCAL_CONFIG).draft
    assert (local.mode, local.drafter) == ("service", "suffix")


def test_vllms_in_engine_suffix_method_cannot_run_here():
    """Why `drafter: suffix` is the DraftService's only: vLLM's own `suffix` method needs Arctic
    Inference, which has no wheel for this machine."""
    from vllm.config import SpeculativeConfig

    with pytest.raises(ImportError, match="Arctic Inference is required"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=4)


def doc_yaml_lines() -> list[str]:
    """Each line of the ```yaml blocks of README.md and every docs/*.md page: one `key: {...}` of
    the app's args each (the blocks list alternatives, so a block is not one document)."""
    from tests.conftest import REPO

    lines = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        inside = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                inside = line == "```yaml"
            elif inside and line.strip() and not line.lstrip().startswith("#"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("line", doc_yaml_lines())
def test_every_yaml_line_in_the_docs_validates(line):
    """What a user copies from the README or docs/ into a config's args is accepted as written."""
    snippet = yaml.safe_load(line)
    args = local_args()
    for key, value in snippet.items():
        args[key] = {**args.get(key, {}), **value} if isinstance(value, dict) else value
    AppConfig.model_validate(args)


def test_the_docs_have_yaml_to_check():
    lines = doc_yaml_lines()
    assert any("mode: off" in line for line in lines)
    assert any("rate_limits" in line for line in lines)


def test_a_bare_yaml_off_is_mode_off():
    args = local_args()
    args["draft"] = yaml.safe_load("{mode: off}")
    assert args["draft"]["mode"] is False  # what YAML 1.1 makes of it
    assert AppConfig.model_validate(args).draft.mode == "off"
