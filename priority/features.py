"""Feature policies: which feature a request belongs to, and what that decides.

A feature (chat, rag, agent, ...) gives a request its priority class (vLLM ``priority``, wait
budget, TPOT SLO), its context cap, its pool (a ``long_context`` pool above the feature's
threshold when the fleet has one; never a ``batch`` or ``spot`` pool), the regions it must stay
in (``regions``: pools and an external provider elsewhere are never used), and whether it may
leave our replicas (``regulated`` never does; ``pin_external`` always does).

Resolution: the ``X-Tidal-Feature`` header, else the key's only feature, else the fleet's
``default`` feature, else an error naming the header. A feature the caller may not use is 403.
A batch names its feature in ``metadata.feature`` (:func:`resolve_batch_feature`).

Example::

    feature = resolve_feature(fleet, request.headers.get("x-tidal-feature"), allowed, key_default)
    plan = plan_request(fleet, feature, model="llama", prompt_tokens=1200, max_tokens=256)
    plan.pool, plan.class_spec.priority, plan.external
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from tidal.fleet import BATCH_ONLY_KINDS, ClassSpec, FeatureSpec, FleetConfig

__all__ = [
    "FEATURE_HEADER",
    "PlanError",
    "RequestPlan",
    "estimate_tokens",
    "plan_request",
    "resolve_batch_feature",
    "resolve_feature",
]

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
    # Not regulated, and the external provider is inside the feature's regions (if it has any).
    overflow_allowed: bool
    regions: frozenset[str] | None  # where replicas may serve it; None: anywhere


def _may_overflow(fleet: FleetConfig, feature: str) -> bool:
    """Whether the feature's requests may go to the external provider when the pool cannot take
    them: one is configured, the feature is not ``regulated``, and the provider's ``region`` is
    in the feature's ``regions`` (when it lists any)."""
    spec = fleet.features[feature]
    provider = fleet.external_provider
    return not spec.regulated and provider is not None and spec.allows_region(provider.region)


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
    _check_allowed(name, allowed, FEATURE_HEADER)
    return name


def _check_allowed(name: str, allowed: Set[str], param: str) -> None:
    if "*" not in allowed and name not in allowed:
        raise PlanError(
            403, f"This API key may not use the feature '{name}'.", code="feature_not_allowed", param=param
        )


def resolve_batch_feature(
    fleet: FleetConfig,
    named: str | None,
    allowed: Set[str],
    key_default: str | None,
    *,
    param: str = "metadata.feature",
) -> str | None:
    """A batch's feature: the one it names (``metadata.feature``; 400 unknown, 403 not allowed),
    else the key's only feature, else the fleet's ``batch`` or ``default`` feature when the key
    may use it. ``None`` (no feature policy) when none of these applies -- unless the key may use
    a feature with ``regions``: then it must name one (400), so that no batch slips past them."""
    if named is not None:
        if named not in fleet.features:
            raise PlanError(
                400, f"Unknown feature '{named[:100]}' in {param}.", code="unknown_feature", param=param
            )
        _check_allowed(named, allowed, param)
        return named
    if key_default is not None:
        return key_default
    for name in ("batch", "default"):
        if name in fleet.features and ("*" in allowed or name in allowed):
            return name
    resident = sorted(
        f
        for f, spec in fleet.features.items()
        if spec.regions is not None and ("*" in allowed or f in allowed)
    )
    if resident:
        raise PlanError(
            400,
            f"This API key may use features kept to some regions ({', '.join(resident)}): name the "
            f"batch's feature in {param}.",
            code="feature_required",
            param=param,
        )
    return None


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
        if not serving:
            raise PlanError(
                404, f"The model '{model}' does not exist.", code="model_not_found", param="model"
            )
        # Interactive requests never go to batch or spot pools, nor outside the feature's regions.
        usable = [p for p in serving if p.kind not in BATCH_ONLY_KINDS and feature.allows_region(p.region)]
        preferred = [p for p in usable if p.kind == "interactive"] or usable
        if not preferred:
            where = f" in the regions {', '.join(feature.regions)}" if feature.regions is not None else ""
            raise PlanError(
                400,
                f"The model '{model}' has no pool for interactive requests{where}.",
                code="model_not_available",
                param="model",
            )
        base = preferred[0].name
    threshold = feature.long_context_threshold
    if threshold is not None and prompt_tokens > threshold:
        long_pools = [
            p
            for p in fleet.pools.values()
            if p.kind == "long_context" and p.model == model and feature.allows_region(p.region)
        ]
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
    overflow = _may_overflow(fleet, feature)
    regions = frozenset(spec.regions) if spec.regions is not None else None
    if spec.pin_external:
        # The fleet config refuses a pinned feature whose regions exclude the provider.
        return RequestPlan(
            feature, spec, spec.class_, class_spec, None, True, prompt_tokens, max_tokens, overflow, regions
        )
    pool = _pool_for(fleet, spec, model, prompt_tokens)
    if fleet.pools[pool].kind in BATCH_ONLY_KINDS:  # the fleet config refuses it too; never serve it
        raise PlanError(
            400, f"The pool '{pool}' serves batches only.", code="model_not_available", param="model"
        )
    return RequestPlan(
        feature, spec, spec.class_, class_spec, pool, False, prompt_tokens, max_tokens, overflow, regions
    )
