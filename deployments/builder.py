"""The one place that turns the typed config into a Ray Serve application graph.

`serve run configs/local.yaml` imports `build_app`; Ray Serve validates the YAML `args` into
`AppConfig` through the annotation (so this module must not use `from __future__ import
annotations`). The deployment classes stay plain Python classes; only this module applies
`serve.deployment(...)` and `.bind(...)`.

Example:
    >>> from ray import serve
    >>> serve.run(build_app(AppConfig()))
"""

from ray import serve
from ray.serve import Application

from moonserve.deployments.admission import LaneAdmission
from moonserve.deployments.draft import DraftService
from moonserve.deployments.language_model import ImageInput, LanguageModel
from moonserve.deployments.preprocess import ImagePreprocessor
from moonserve.deployments.rate_limiter import RateLimiter
from moonserve.deployments.router import Router
from moonserve.deployments.vision import EngineVisionEncoder, VisionEncoder
from moonserve.pipeline.api.auth import ApiKeys, keys_from_env
from moonserve.pipeline.config import (
    EMBEDDED_MODEL,
    AppConfig,
    ChatConfig,
    DeploymentOptions,
    DraftConfig,
    LanesConfig,
    LanguageModelConfig,
    RateLimitsConfig,
    RouterConfig,
    VisionConfig,
    VisionEncoderConfig,
)


def resolve_model_path(config: LanguageModelConfig) -> str:
    """`embedded` -> the prepared SmolLM2 checkpoint (built on first use); else the path/id as is."""
    if config.engine.model != EMBEDDED_MODEL:
        return config.engine.model
    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return str(prepare_language_model())


def language_model_options(config: LanguageModelConfig, drain_s: float | None = None) -> dict:
    actor_options: dict = {"num_cpus": config.deployment.num_cpus}
    if config.env:
        actor_options["runtime_env"] = {"env_vars": dict(config.env)}
    router = config.routing.request_router_config()
    return {
        **config.deployment.serve_options(drain_s),
        **({"request_router_config": router} if router else {}),
        "ray_actor_options": actor_options,
        "placement_group_bundles": [dict(b) for b in config.placement.bundles],
        "placement_group_strategy": config.placement.strategy,
    }


def router_options(config: RouterConfig, drain_s: float | None = None) -> dict:
    return cpu_options(config.deployment, drain_s=drain_s)


def resolve_api_keys(config: RouterConfig) -> ApiKeys | None:
    """Digests of the configured keys plus those in `auth.api_keys_env`; None when auth is off."""
    auth = config.auth
    if not auth.enabled:
        return None
    keys = [k.get_secret_value() for k in auth.api_keys] + keys_from_env(auth.api_keys_env)
    if not keys:
        raise ValueError(
            f"router.auth.enabled is true but there is no API key: set router.auth.api_keys or "
            f"the environment variable {auth.api_keys_env}, or set router.auth.enabled: false"
        )
    return ApiKeys.from_plaintext(keys)


def bind_router(config: RouterConfig, language_model, model_path: str,
                vision: VisionConfig | None = None, preprocessor=None, encoder=None,
                trust_remote_code: bool = False, chat: ChatConfig | None = None,
                drain_s: float | None = None) -> Application:
    """The Router ingress bound to a LanguageModel (and, with `vision`, the image deployments);
    each a bound deployment or an existing handle. `drain_s`: its graceful shutdown."""
    router = serve.deployment(serve.ingress()(Router), name="Router",
                              **router_options(config, drain_s))
    return router.bind(
        config=config, language_model=language_model, model_path=model_path,
        api_keys=resolve_api_keys(config), vision=vision, preprocessor=preprocessor,
        encoder=encoder, trust_remote_code=trust_remote_code, chat=chat,
        rate_limiter=bind_rate_limiter(config.rate_limits),
        admission=bind_admission(config.lanes, config.deployment.max_replicas()))


def bind_admission(config: LanesConfig, router_replicas: int) -> Application | None:
    """One replica holds the lanes when they are the application's and the Router may have more
    than one replica; None when each Router replica's own lanes do."""
    if config.scope != "application" or router_replicas == 1:
        return None
    return serve.deployment(LaneAdmission, name="LaneAdmission", num_replicas=1,
                            # every queued request is one call waiting here
                            max_ongoing_requests=config.capacity() * router_replicas + 1024,
                            ray_actor_options={"num_cpus": 0}).bind(config=config)


def bind_rate_limiter(config: RateLimitsConfig) -> Application | None:
    """One replica holds every client's buckets (so the limits are the application's); None
    when no limit is set."""
    if not config.enabled():
        return None
    return serve.deployment(RateLimiter, name="RateLimiter", num_replicas=1,
                            max_ongoing_requests=4096,
                            ray_actor_options={"num_cpus": 0}).bind(config=config)


def resolve_encoder_path(config: VisionEncoderConfig, lm_path: str) -> str:
    """`embedded` -> the seeded random MoonViT projecting to the LM's hidden size."""
    if config.model != EMBEDDED_MODEL:
        return config.model
    from moonserve.pipeline.prepare.vision_encoder import prepare_vision_encoder

    return str(prepare_vision_encoder(lm_path))


def cpu_options(options: DeploymentOptions, num_gpus: float = 0.0,
                drain_s: float | None = None) -> dict:
    actor = {"num_cpus": options.num_cpus, **({"num_gpus": num_gpus} if num_gpus else {}),
             **({"resources": dict(options.resources)} if options.resources else {})}
    return {**options.serve_options(drain_s), "ray_actor_options": actor}


def encoder_env(lm: LanguageModelConfig) -> dict[str, str]:
    """The encoder engine's environment: the LM's (`language_model.env`: the platform's kernel
    settings, ROCm/AITER in production), so the tower runs on the kernels the LM's engine would
    use; less vLLM's Ray-executor variables, which only a TP>1 engine reads."""
    return {name: value for name, value in lm.env.items() if not name.startswith("VLLM_RAY_")}


def bind_vision(vision: VisionConfig, lm: LanguageModelConfig,
                lm_path: str) -> tuple[Application, Application]:
    """The ImagePreprocessor and VisionEncoder; with `handover: encoder_cache` the encoder is an
    encoder-only vLLM engine on the LM's own checkpoint (`EngineVisionEncoder`)."""
    engine_cache = vision.handover == "encoder_cache"
    preprocessor = serve.deployment(
        ImagePreprocessor, name="ImagePreprocessor", **cpu_options(vision.preprocessor.deployment)
    ).bind(config=vision.preprocessor, decoded_only=engine_cache)
    options = cpu_options(vision.encoder.deployment, vision.encoder.num_gpus)
    if engine_cache:
        if env := encoder_env(lm):
            options["ray_actor_options"]["runtime_env"] = {"env_vars": env}
        encoder = serve.deployment(EngineVisionEncoder, name="VisionEncoder", **options).bind(
            config=vision.encoder, engine=lm.engine, model_path=lm_path)
    else:
        encoder = serve.deployment(VisionEncoder, name="VisionEncoder", **options).bind(
            config=vision.encoder, model_path=resolve_encoder_path(vision.encoder, lm_path))
    return preprocessor, encoder


def resolve_draft_model_path(config: DraftConfig, lm_path: str) -> str:
    """The DSpark drafter's weights (`embedded`: built from the embedded target). The service gets
    them whichever drafter starts active, so `set_drafter` can switch at run time."""
    if config.model != EMBEDDED_MODEL:
        return config.model
    from moonserve.pipeline.prepare.drafter import prepare_drafter

    return str(prepare_drafter(lm_path))


def bind_draft_service(config: DraftConfig, lm_path: str,
                       drain_s: float | None = None) -> Application:
    router = config.request_router_config()
    return serve.deployment(
        DraftService, name="DraftService",
        **cpu_options(config.deployment, config.num_gpus, drain_s),
        **({"request_router_config": router} if router else {}),
    ).bind(config=config, draft_model_path=resolve_draft_model_path(config, lm_path),
           target_path=lm_path)


def bind_language_model(config: LanguageModelConfig, model_path: str, draft: DraftConfig,
                        drain_s: float | None = None,
                        images: ImageInput | None = None) -> Application:
    draft_service = bind_draft_service(draft, model_path, drain_s) \
        if draft.mode == "service" else None
    return serve.deployment(
        LanguageModel, name="LanguageModel", **language_model_options(config, drain_s)
    ).bind(config=config, model_path=model_path, draft=draft, draft_service=draft_service,
           images=images)


def build_app(args: AppConfig) -> Application:
    """Router (ingress) -> [ImagePreprocessor -> VisionEncoder] -> LanguageModel [<- DraftService].
    The Router, LanguageModel and DraftService drain for `args.drain_s()` when stopped."""
    model_path = resolve_model_path(args.language_model)
    drain_s = args.drain_s()
    images = None if args.vision is None or args.vision.handover != "encoder_cache" else \
        ImageInput(args.vision.encoder.store, args.router.limits.max_images,
                   args.vision.encoder.store_max_bytes)
    language_model = bind_language_model(args.language_model, model_path, draft=args.draft,
                                         drain_s=drain_s, images=images)
    trust = args.language_model.engine.trust_remote_code
    chat = args.language_model.chat
    if args.vision is None:
        return bind_router(args.router, language_model, model_path, trust_remote_code=trust,
                           chat=chat, drain_s=drain_s)
    preprocessor, encoder = bind_vision(args.vision, args.language_model, model_path)
    return bind_router(args.router, language_model, model_path, vision=args.vision,
                       preprocessor=preprocessor, encoder=encoder, trust_remote_code=trust,
                       chat=chat, drain_s=drain_s)
