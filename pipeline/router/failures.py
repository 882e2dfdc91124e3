"""Failures of the Router's calls to other deployments, as the API errors a client can act on.

A replica or Serve failure (not the request's fault) is a 503 with Retry-After; an image the
preprocessor refused is a 400 naming its message and part; anything else is a 500 naming the
stage. These need Ray's exception types, so they live here and not in `moonserve.pipeline.api`.
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
)
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.router.output_receiver import ChannelLost
from moonserve.pipeline.vision.errors import ImageError

logger = logging.getLogger("moonserve.router")

# ChannelLost: the LanguageModel replica's output channel closed mid-request (the replica died).
REPLICA_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError, OwnerDiedError,
                    ObjectLostError, BackPressureError, DeploymentUnavailableError, ChannelLost)


def is_vllm_client_error(exc: BaseException) -> bool:
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, VLLMClientError)


def retryable(exc: BaseException) -> bool:
    """Failures of a replica or of Serve (not of the request): the client should retry."""
    return isinstance(exc, REPLICA_FAILURES)


def image_failure(exc: Exception, where: str, stage: str) -> APIError:
    """A bad image is a 400 naming its message and part; a lost replica is a 503 to retry."""
    cause = getattr(exc, "cause", exc)  # a RayTaskError carries the replica's exception
    if isinstance(cause, ImageError):
        return APIError(400, f"{where}: {cause.reason}", param=where, code=cause.code)
    logger.warning("%s failed for %s: %r", stage, where, exc)
    if retryable(exc):
        return APIError(503, f"the {stage} is unavailable; retry the request",
                        type="service_unavailable", code="replica_unavailable",
                        headers={"Retry-After": "2"})
    return APIError(500, f"{where}: the {stage} failed ({type(cause).__name__})",
                    type="internal_error", code="image_failed")


def lm_failure(exc: Exception, request_id: str) -> APIError:
    """Map a failure of the LM call to an API error (503 when the replica or engine is gone)."""
    if isinstance(exc, APIError):
        return exc
    cause = getattr(exc, "cause", exc)  # a RayTaskError carries the replica's exception
    if is_vllm_client_error(cause):
        # vLLM refused the request's parameters: the client's to fix, as vLLM's server says.
        param = getattr(cause, "parameter", None)
        return APIError(400, f"{param + ': ' if param else ''}{cause}", param=param)
    logger.warning("request %s failed in the language model: %r", request_id, exc)
    if retryable(exc):
        return APIError(503, "the language model replica is unavailable; retry the request",
                        type="service_unavailable", code="replica_unavailable",
                        headers={"Retry-After": "2"})
    return APIError(500, f"generation failed ({type(exc).__name__}); request {request_id}",
                    type="internal_error", code="generation_failed")


def gather_calls(*calls) -> asyncio.Future:
    """`asyncio.gather` whose result is always read: when the request awaiting it is cancelled
    (client gone), its calls end with CancelledError after nobody awaits the gather any more,
    and asyncio would log "_GatheringFuture exception was never retrieved" with a traceback per
    request. Serve already logs the cancelled request in one line."""
    gathered = asyncio.gather(*calls)
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    return gathered
