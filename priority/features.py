"""Feature policies: which feature a request belongs to, and what that decides.

A feature (chat, rag, agent, ...) gives a request its priority class (vLLM ``priority``, wait
budget, TPOT SLO), its context cap, its pool (a ``long_context`` pool above the feature's
threshold when the fleet has one), and whether it may leave our replicas (``regulated`` never
does; ``pin_external`` always does).

Resolution: the ``X-Tidal-Feature`` header, else the key's only feature, else the fleet's
``default`` feature, else an error naming the header. A feature the caller may not use is 403.

Example::

    feature = resolve_feature(fleet, request.headers.get("x-tidal-feature"), allowed, key_default)
    plan = plan_request(fleet, feature, model="llama", prompt_tokens=1200, max_tokens=256)
    plan.pool, plan.class_spec.priority, plan.external
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from tidal.fleet import ClassSpec, FeatureSpec, FleetConfig

__all__ = ["FEATURE_HEADER", "PlanError", "RequestPlan", "estimate_tokens", "plan_request", "resolve_feature"]

FEATURE_HEADER = "X-Tidal-Feature"


class PlanError(Exception):
    """A request that policy refuses before it reaches any replica (an OpenAI-shaped 4xx)."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What policy decided for one request before admission."""

    feature: str
    feature_spec: FeatureSpec
    class_name: str
    class_spec: ClassSpec
    pool: str | None  # None: the request goes to the external provider only
    external: bool  # pinned to the external provider
    prompt_tokens: int
    max_tokens: int | None

    @property
    def overflow_allowed(self) -> bool:
        return not self.feature_spec.regulated


def estimate_tokens(text_bytes: int) -> int:
    """Prompt tokens estimated from the prompt's UTF-8 size (about 4 bytes a token for BPE
    tokenizers on English); the replica counts exactly and refuses what does not fit."""
    return (text_bytes + 3) // 4


def resolve_feature(
    fleet: FleetConfig, header: str | None, allowed: Set[str], key_default: str | None
) -> str:
    """The request's feature; raises :class:`PlanError` (400 unknown/missing, 403 not allowed)."""
    if header is not None:
        name = header.strip()
        if name not in fleet.features:
            raise PlanError(
                400,
                f"Unknown feature '{name[:100]}' in the {FEATURE_HEADER} header.",
                code="unknown_feature",
                param=FEATURE_HEADER,
            )
    elif key_default is not None:
        name = key_default
    elif "default" in fleet.features:
        name = "default"
    else:
        raise PlanError(
            400,
            f"This key may use several features: name one in the {FEATURE_HEADER} header.",
            code="feature_required",
            param=FEATURE_HEADER,
        )
    if "*" not in allowed and name not in allowed:
        raise PlanError(
            403,
            f"This API key may not use the feature '{name}'.",
            code="feature_not_allowed",
            param=FEATURE_HEADER,
        )
    return name


def _pool_for(fleet: FleetConfig, feature: FeatureSpec, model: str, prompt_tokens: int) -> str:
    if feature.pool is not None:
        pool = fleet.pools[feature.pool]
        if pool.model != model:
            raise PlanError(
                400,
                f"This feature is served by model '{pool.model}', not '{model}'.",
                code="model_not_available",
                param="model",
            )
        base = pool.name
    else:
        serving = [p for p in fleet.pools.values() if p.model == model]
        preferred = [p for p in serving if p.kind == "interactive"] or serving
        if not preferred:
            raise PlanError(
                404, f"The model '{model}' does not exist.", code="model_not_found", param="model"
            )
        base = preferred[0].name
    threshold = feature.long_context_threshold
    if threshold is not None and prompt_tokens > threshold:
        long_pools = [p for p in fleet.pools.values() if p.kind == "long_context" and p.model == model]
        if long_pools:
            return long_pools[0].name
    return base


def plan_request(
    fleet: FleetConfig, feature: str, *, model: str, prompt_tokens: int, max_tokens: int | None
) -> RequestPlan:
    """Apply the feature's policy: context cap (400 naming it), pool, class, external pinning."""
    spec = fleet.features[feature]
    class_spec = fleet.classes[spec.class_]
    need = prompt_tokens + (max_tokens or 0)
    if need > spec.context_cap:
        what = f"about {prompt_tokens} prompt tokens" + (f" + max_tokens {max_tokens}" if max_tokens else "")
        raise PlanError(
            400,
            f"This request needs {what}, above the context cap of {spec.context_cap} tokens "
            f"for the feature '{feature}'. Shorten the prompt or lower max_tokens.",
            code="context_length_exceeded",
            param="messages",
        )
    if spec.pin_external:
        return RequestPlan(feature, spec, spec.class_, class_spec, None, True, prompt_tokens, max_tokens)
    pool = _pool_for(fleet, spec, model, prompt_tokens)
    return RequestPlan(feature, spec, spec.class_, class_spec, pool, False, prompt_tokens, max_tokens)
