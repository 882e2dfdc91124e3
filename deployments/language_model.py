"""LanguageModel deployment: vLLM's engine behind a Ray Serve replica.

The replica hosts vLLM's engine (an AsyncLLM's input processor, engine core and stat loggers)
and sends what the engine core makes of each request to the Router that forwarded it, which runs
vLLM's output processing (`moonserve.pipeline.engine.output_sender`,
`moonserve.pipeline.router.output_receiver`): each token is processed by one frontend.

The replica owns a placement group (bundles from the config). With `tensor_parallel_size > 1` on
GPUs vLLM's Ray executor puts one worker in each bundle; on CPU, vLLM 0.32 has no Ray executor
(`CpuPlatform.ray_device_key` is empty), so the workers are vLLM's own processes inside the
replica's reserved group.

Example (without Serve, inside an event loop; `address` an `OutputReceiver`'s):
    >>> lm = LanguageModel(LanguageModelConfig(), model_path="/path/to/ckpt")
    >>> await lm.generate_to(GenerateRequest("r1", [1, 2, 3], SamplingSpec(8)), address)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moonserve.pipeline.engine.output_wire import ChannelAddress
from moonserve.pipeline.config import (
    STRUCTURED_OUTPUTS,
    DraftConfig,
    EngineConfig,
    LanguageModelConfig,
    check_k3_dspark_draft,
)
from moonserve.pipeline.api.protocol import GenerateRequest, ModelInfo, SamplingSpec
from moonserve.pipeline.engine.output_sender import EngineOutputs
from moonserve.pipeline.models.weights import TOKEN_EMBEDDING_NAMES, find_tensor, read_tensors, tensor_files

logger = logging.getLogger("moonserve.language_model")


@dataclass
class EngineLoad:
    """Scheduler counts reported by the engine core (updated every engine step)."""

    num_running: int = 0
    num_waiting: int = 0
    # Speculative decoding totals since start (vLLM's spec_decode counters).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prefix cache totals since start, in prompt tokens (vLLM's prefix_cache_queries / _hits).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_requests: int = 0  # generate calls since start


def load_logger_factory(load: EngineLoad):
    """A vLLM stat-logger factory that copies the scheduler's request counts into `load`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineLoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                load.num_running = scheduler_stats.num_running_reqs
                load.num_waiting = scheduler_stats.num_waiting_reqs
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None:
                    load.num_drafts += spec.num_drafts
                    load.num_draft_tokens += spec.num_draft_tokens
                    load.num_accepted_tokens += spec.num_accepted_tokens
                load.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
                load.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits

        def log_engine_initialized(self):
            pass

    return EngineLoadLogger


def replica_name() -> str | None:
    """This replica's Serve id (None outside Serve)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None


def check_platform(platform: str) -> None:
    """Refuses to start where vLLM's platform is not `language_model.platform` ("any" passes)."""
    if platform == "any":
        return
    from vllm.platforms import current_platform

    running = next((name for name, test in (("rocm", current_platform.is_rocm),
                                            ("cuda", current_platform.is_cuda),
                                            ("cpu", current_platform.is_cpu)) if test()),
                   current_platform.device_name)
    if running != platform:
        raise RuntimeError(
            f"language_model.platform: this config is for {platform}, and vLLM on this node "
            f"runs on {running} ({type(current_platform).__name__}); run it on a {platform} node "
            f"with vLLM's {platform} build (docs/production.md), or use a config for {running}")


def resolved_summary(vllm_config) -> str:
    """One line of what vLLM resolved this replica's engine to (its VllmConfig, after every
    default and model-specific update), logged at start: the line docs/bring-up.md reads to see
    that each setting took effect."""
    from vllm.platforms import current_platform

    model, cache = vllm_config.model_config, vllm_config.cache_config
    scheduler, parallel = vllm_config.scheduler_config, vllm_config.parallel_config
    spec, images = vllm_config.speculative_config, vllm_config.ec_transfer_config
    draft = "off" if spec is None else (
        f"{spec.method} k={spec.num_speculative_tokens}"
        + (f" {spec.draft_model_config.architecture}" if spec.draft_model_config else "")
        + f" backend={spec.attention_backend.name if spec.attention_backend else 'auto'}")
    fields = {
        "architecture": model.architecture, "tp": parallel.tensor_parallel_size,
        "dcp": parallel.decode_context_parallel_size, "max_model_len": model.max_model_len,
        "kv_cache_dtype": cache.cache_dtype, "prefix_caching": cache.enable_prefix_caching,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "policy": scheduler.policy, "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "long_prefill_token_threshold": scheduler.long_prefill_token_threshold,
        "cudagraph_mode": vllm_config.compilation_config.cudagraph_mode.name,
        "draft": draft,
        "ec_transfer": "none" if images is None else f"{images.ec_role} {images.ec_connector}",
    }
    if current_platform.is_rocm():  # the SiTU MoE activation AITER runs (vllm/_aiter_ops.py)
        from vllm._aiter_ops import _resolve_situv2_activation

        fields["aiter_moe"] = _resolve_situv2_activation()
    return "moonserve LanguageModel engine: " + ", ".join(f"{k}={v}" for k, v in fields.items())


def executor_backend(engine: EngineConfig) -> str | None:
    """vLLM's distributed executor for this engine: Ray on accelerators, its mp executor on CPU."""
    if engine.tensor_parallel_size == 1:
        return None
    from vllm.platforms import current_platform

    return "mp" if current_platform.is_cpu() else "ray"


@dataclass(frozen=True)
class ImageInput:
    """`vision.handover: encoder_cache` as the LanguageModel sees it: the node-local store its
    engine (`ec_consumer`) reads the VisionEncoder's outputs from, and the most images one prompt
    may carry (the router's `limits.max_images`; vLLM's `limit_mm_per_prompt`)."""

    store: str
    max_images: int
    max_bytes: int | None = None  # the store's bound (vision.encoder.store_max_bytes)


def image_engine_args(images: ImageInput | None, modality: str | None) -> dict:
    """The engine arguments of an `ec_consumer` engine; {} without images."""
    if images is None:
        return {}
    from moonserve.pipeline.engine.ec_connector import ec_transfer_config

    return {"ec_transfer_config": ec_transfer_config("ec_consumer", images.store),
            "limit_mm_per_prompt": {modality: images.max_images}}


def engine_args(engine: EngineConfig, model_path: str, draft: DraftConfig | None = None,
                reasoning_parser: str | None = None, images: ImageInput | None = None,
                modality: str | None = None):
    """`images` and `modality` (its model's `ImageFormat.modality`): vision.handover
    encoder_cache."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    scheduler = engine.scheduler_cls()
    return AsyncEngineArgs(
        model=model_path,
        tokenizer=model_path,
        served_model_name=[engine.model_name()],
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
        tensor_parallel_size=engine.tensor_parallel_size,
        decode_context_parallel_size=engine.decode_context_parallel_size,
        kv_cache_dtype=engine.kv_cache_dtype,
        distributed_executor_backend=executor_backend(engine),
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        # Structured outputs start after the thinking this parser finds (language_model.chat).
        reasoning_parser=reasoning_parser or "",
        structured_outputs_config=StructuredOutputsConfig(**STRUCTURED_OUTPUTS),
        enable_prefix_caching=engine.enable_prefix_caching,
        enforce_eager=engine.enforce_eager,
        scheduling_policy=engine.scheduling_policy,
        scheduler_cls=scheduler,
        additional_config=engine.scheduler_options() if scheduler else {},
        # LaneScheduler extends the synchronous scheduler; None lets vLLM choose.
        async_scheduling=False if scheduler else None,
        long_prefill_token_threshold=engine.long_prefill_token_threshold,
        seed=engine.seed,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        trust_remote_code=engine.trust_remote_code,
        enable_prompt_embeds=engine.enable_prompt_embeds,
        mm_encoder_tp_mode=engine.mm_encoder_tp_mode,
        compilation_config=engine.compilation_config(),
        speculative_config=draft.speculative_config() if draft is not None else None,
        worker_extension_cls=engine.worker_extension_cls or "",
        disable_log_stats=False,
        **image_engine_args(images, modality),
    )


def load_token_embeddings(model_path: str):
    """The checkpoint's input embedding table [vocab, hidden], read from its safetensors files."""
    files = tensor_files(model_path)
    name = find_tensor(files, TOKEN_EMBEDDING_NAMES)
    if name is None:
        raise FileNotFoundError(f"{model_path}: none of {TOKEN_EMBEDDING_NAMES} found, needed for "
                                "prompt embeddings")
    return read_tensors(files, [name])[name]


def sampling_params(spec: SamplingSpec):
    """`SamplingSpec`'s fields are named as vLLM's `SamplingParams` arguments."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    fields = dataclasses.asdict(spec)
    structured = None if spec.structured_outputs is None else \
        StructuredOutputsParams(**spec.structured_outputs)
    return SamplingParams(
        **fields | {"stop": list(spec.stop), "stop_token_ids": list(spec.stop_token_ids),
                    "structured_outputs": structured},
        # Deltas, so each chunk carries only new text; the Router merges those its reader has
        # not read yet, which batches tokens under load without adding a timer to the stream.
        output_kind=RequestOutputKind.DELTA,
    )


# vLLM's Ray executor copies to its TP workers only VLLM_*, NCCL_*, HF_*... and the names listed
# here (vllm/ray/ray_env.py `get_env_vars_to_copy`); the copy is taken when the engine starts.
RAY_COPY_LIST = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def add_to_ray_copy_list(environ, names) -> None:
    """Append `names` to vLLM's Ray copy list in `environ`, keeping what the config listed."""
    listed = [n.strip() for n in environ.get(RAY_COPY_LIST, "").split(",") if n.strip()]
    environ[RAY_COPY_LIST] = ",".join(dict.fromkeys([*listed, *names]))


def export_draft_env(draft: DraftConfig, socket_path: str, environ=os.environ) -> None:
    """Name the DraftService endpoint to the proposer in every engine worker: the variables are
    set in this replica and added to the list vLLM's Ray executor copies to its TP workers."""
    from moonserve.pipeline.engine.proposer import (
        ENV_DEADLINE_MS,
        ENV_HIDDEN_LAYERS,
        ENV_SHARDS,
        ENV_SOCKET,
    )

    environ[ENV_SOCKET] = socket_path
    environ[ENV_DEADLINE_MS] = str(draft.deadline_ms)
    environ[ENV_SHARDS] = str(draft.shards())
    environ[ENV_HIDDEN_LAYERS] = ",".join(map(str, hidden_layers(draft)))
    add_to_ray_copy_list(environ, (ENV_SOCKET, ENV_DEADLINE_MS, ENV_SHARDS, ENV_HIDDEN_LAYERS))


def hidden_layers(draft: DraftConfig) -> tuple[int, ...]:
    """The target layers whose hidden states the proposer sends: the `dspark_context` drafter's
    `target_layer_ids` (from its checkpoint's config.json); none for the other drafters."""
    if draft.drafter != "dspark_context":
        return ()
    from moonserve.pipeline.models.dspark import DSparkConfig
    from moonserve.pipeline.models.weights import CONFIG_FILE

    config = DSparkConfig.from_json(Path(draft.model) / CONFIG_FILE)
    if not config.target_layer_ids:
        raise ValueError(f"draft.model {draft.model}: its config.json names no target_layer_ids "
                         "(the target layers dspark_context drafts from)")
    return config.target_layer_ids


def start_draft_resolver(draft: DraftConfig, draft_service):
    """With `draft.mode: service`: where vLLM's proposer asks for the DraftService's address,
    named to the engine's workers by environment variables (`export_draft_env`)."""
    if draft.mode != "service":
        return None
    if draft_service is None:
        raise ValueError("draft.mode is service but no DraftService handle was bound")
    from moonserve.pipeline.speculative.endpoint import EndpointResolver

    resolver = EndpointResolver(draft_service, draft.service_timeout_s, shards=draft.shards())
    resolver.start()
    export_draft_env(draft, resolver.path)
    return resolver


class LanguageModel:
    """One vLLM engine. `generate_to` runs a request with its outputs going to a Router's output
    channel; cancelling it aborts the request.

    `draft` picks speculative decoding (moonserve.pipeline.config.DraftConfig); with `mode: service`,
    `draft_service` is the DraftService handle the engine's proposer drafts through. `images`:
    with `vision.handover: encoder_cache`, images reach the engine as multimodal inputs whose
    encoder outputs it loads from `images.store` (else, as rows spliced into prompt embeddings).
    """

    def __init__(self, config: LanguageModelConfig, model_path: str,
                 draft: DraftConfig | None = None, draft_service=None,
                 images: ImageInput | None = None):
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from moonserve.pipeline.engine.image_format import image_format

        check_platform(config.platform)
        if draft is not None and draft.mode == "inline" and draft.attention_backend:
            check_k3_dspark_draft(draft.model, "draft.attention_backend")  # on this node
        self.config = config
        self.load = EngineLoad()
        self.images = images
        self.image_format = None if images is None else image_format(model_path)
        self.resolver = start_draft_resolver(draft, draft_service) if draft is not None else None
        self.engine = AsyncLLM.from_engine_args(
            engine_args(config.engine, model_path, draft, config.chat.reasoning.parser, images,
                        self.image_format and self.image_format.modality),
            # vLLM's own metrics (vllm:* -> ray_vllm_*) through Ray's metrics agent.
            stat_loggers=[load_logger_factory(self.load), RayPrometheusStatLogger],
        )
        # The engine's outputs go to the Routers, which process them (vLLM's output processor
        # runs there, once per token): AsyncLLM's own output handler is never started.
        self.outputs = EngineOutputs(self.engine)
        logging.getLogger("ray.serve").info(resolved_summary(self.engine.vllm_config))
        self.supported_tasks = None
        model_config = self.engine.model_config
        # Multimodal prompts are built here as embeddings: token rows from this table, image rows
        # from the VisionEncoder.
        self.token_embeddings = load_token_embeddings(model_path) \
            if config.engine.enable_prompt_embeds else None
        self.info = ModelInfo(
            name=config.engine.model_name(),
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            tokenizer=model_config.tokenizer,
            tokenizer_mode=model_config.tokenizer_mode,
            trust_remote_code=model_config.trust_remote_code,
        )

    def prompt(self, request: GenerateRequest, image_embeds: tuple):
        """Token ids for text; with images, `prompt_embeds` [seq, hidden] with the images spliced
        in, or (encoder_cache) the images themselves (`image_prompt`)."""
        from vllm.inputs import EmbedsPrompt, TokensPrompt

        if not image_embeds:
            return TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        if self.images is not None:
            return self.image_prompt(request, image_embeds)
        import torch

        from moonserve.pipeline.engine.splice import splice_image_embeddings

        if self.token_embeddings is None:
            raise ValueError("image embeddings sent, but engine.enable_prompt_embeds is false")
        ids = torch.tensor(request.prompt_token_ids)
        embeds = splice_image_embeddings(self.token_embeddings[ids], ids,
                                         request.image_placeholder_id,
                                         [torch.from_numpy(np.array(e)) for e in image_embeds])
        return EmbedsPrompt(prompt_embeds=embeds)

    def image_prompt(self, request: GenerateRequest, images: tuple):
        """`vision.handover: encoder_cache`: each image's run of placeholders back to one token
        (vLLM's processor expands it again, by its own count), and the images under their keys.
        An encoder output missing from this node's store (the encoder ran on another node) is
        fetched from where the encoder stored it and stored here first, within the store's bound,
        so the engine does not run the tower for it; one that cannot be fetched is encoded by the
        engine (its tower is loaded for that)."""
        from vllm.inputs import TokensPrompt

        from moonserve.pipeline.api.placeholders import collapse_placeholders
        from moonserve.pipeline.engine.ec_store import evict, fetch_from, has, put

        uuids = list(request.image_hashes)
        keys = self.image_format.store_keys(uuids, self.engine.model_config)
        for key, stored in zip(keys, request.encoder_outputs, strict=True):
            if has(self.images.store, key):
                continue
            try:
                put(self.images.store, key, fetch_from(stored.node_id, stored.store, key))
            except Exception as exc:  # evicted there, or that node is gone: the engine encodes
                logger.warning("image %s: its encoder output could not be fetched from node %s "
                               "(%s); the engine encodes it", key[:16], stored.node_id[:12],
                               type(exc).__name__)
                continue
            if self.images.max_bytes is not None:
                evict(self.images.store, self.images.max_bytes)
        ids = collapse_placeholders(request.prompt_token_ids, request.image_placeholder_id)
        return TokensPrompt(prompt_token_ids=ids, **self.image_format.multi_modal(images, uuids))

    async def generate_to(self, request: GenerateRequest, address: ChannelAddress,
                          *image_embeds) -> int:
        """Run `request` in the engine with what the engine core makes of it each step going to
        the Router at `address` (`EngineOutputs`: one frame per step for all of that Router's
        requests); returns the number of output tokens. Cancelling this call aborts the request.
        `image_embeds`: per image, in prompt order, its [num_image_tokens, hidden] array (Ray
        resolves the router's ObjectRefs, so they come straight from the encoder's output); with
        `vision.handover: encoder_cache`, the decoded PIL image."""
        self.load.num_requests += 1
        # Gathering and splicing embeddings is CPU work: off the loop that serves every stream.
        prompt = await asyncio.to_thread(self.prompt, request, image_embeds) if image_embeds \
            else self.prompt(request, image_embeds)
        del image_embeds  # the prompt holds its own copy; let the object store free the arrays
        core_request = await self.engine_request(request, prompt)
        connection = await self.outputs.connections.get(address)
        return await self.outputs.run(core_request, connection)

    async def engine_request(self, request: GenerateRequest, prompt):
        """vLLM's EngineCoreRequest for `prompt`, made by the engine's own input processor (as
        `AsyncLLM.add_request` makes it), with the request's id, priority and reasoning state."""
        processor = self.engine.input_processor
        if self.supported_tasks is None:
            self.supported_tasks = await self.engine.get_supported_tasks()
        core_request = await processor.process_inputs_async(
            request.request_id, prompt, sampling_params(request.sampling), self.supported_tasks,
            arrival_time=time.time(), priority=request.priority)
        if request.reasoning_ended is not None:
            core_request.reasoning_ended = request.reasoning_ended
        processor.assign_request_id(core_request)
        return core_request

    async def model_info(self) -> ModelInfo:
        return self.info

    async def collective_rpc(self, method: str, *args) -> list:
        """vLLM's `collective_rpc`: `method` of `engine.worker_extension_cls` run in every engine
        worker, their results in rank order (probes for debugging and tests; Serve handles only,
        never HTTP)."""
        return await self.engine.collective_rpc(method, args=args)

    async def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefixes (vLLM's `reset_prefix_cache`; False while requests
        hold blocks): benchmarks start each arm cold. Serve handles only, never HTTP."""
        return await self.engine.reset_prefix_cache()

    async def stats(self) -> dict:
        return {
            "num_unfinished_requests": len(self.outputs.routes),
            "num_running": self.load.num_running,
            "num_waiting": self.load.num_waiting,
            "num_drafts": self.load.num_drafts,
            "num_draft_tokens": self.load.num_draft_tokens,
            "num_accepted_tokens": self.load.num_accepted_tokens,
            "prefix_cache_queries": self.load.prefix_cache_queries,
            "prefix_cache_hits": self.load.prefix_cache_hits,
            "num_requests": self.load.num_requests,
            "replica": replica_name(),
        }

    async def check_health(self) -> None:
        """Raises when the engine is dead; Serve then replaces this replica."""
        if self.outputs.error is not None:
            raise self.outputs.error
        await self.engine.check_health()

    def __del__(self):
        outputs = getattr(self, "outputs", None)
        if outputs is not None:
            outputs.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        resolver = getattr(self, "resolver", None)
        if resolver is not None:
            resolver.close()
            self.resolver = None
