"""The built-in profiles, selectable by name even when the fleet config defines none.

They are written in the same shape as the fleet config's ``router:`` section and loaded by the
same strict loader. ``tidal`` is the default; the others are the anchors' policies, so that one
benchmark run compares them on the same trace, load and replicas:

==================== =====================================================================
profile              what it does
==================== =====================================================================
tidal                adapter affinity (16) > session ring (4) > prefill cost (2) > load (1)
                     > prefix ring (0.25)
round_robin          the candidates in turn (a Kubernetes Service)
least_load           fewest gateway in-flight requests
power_of_two         the less loaded of two random candidates
sglang_cache_aware   SGLang's cache_aware: approximate tree, imbalance thresholds
llm_d                llm-d's default: queue (2), KV usage (2), approximate prefix (3)
==================== =====================================================================

``tidal``'s prefill cost (:mod:`~router.plugins.scorers.prefill_cost`) is the predicted prefill
work on each replica -- queued prompt tokens plus this prompt's tokens not in that replica's KV
cache as the ``kv-index`` tracks it, a cached prefix counted 6 x for the turns that follow --
so a conversation stays where its history is cached until that replica's queue outweighs it, and
a prompt cached nowhere goes where the least work waits. The prefix ring only breaks near-ties
(a new conversation on an idle pool goes to its ring replica, so gateways that share no state
agree on it).

Every profile starts with the same filters: inside the request's regions, healthy, serves the
model, adapter loadable, canary split, below its in-flight cap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUILTIN_PROFILES", "BUILTIN_ROUTER", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "tidal"

_FILTERS = [
    {"ref": "region-filter"},
    {"ref": "healthy-filter"},
    {"ref": "model-filter"},
    {"ref": "adapter-filter"},
    {"ref": "canary-filter"},
    {"ref": "capacity-filter"},
]

BUILTIN_ROUTER: dict[str, Any] = {
    "plugins": [
        {"type": t}
        for t in (
            "region-filter",
            "healthy-filter",
            "model-filter",
            "adapter-filter",
            "canary-filter",
            "capacity-filter",
            "prefix-affinity-scorer",
            "session-affinity-scorer",
            "lora-affinity-scorer",
            "load-scorer",
            "least-inflight-scorer",
            "queue-scorer",
            "kv-cache-utilization-scorer",
            "prefix-cache-scorer",
            "cache-aware-scorer",
            "prefill-cost-scorer",
            "max-score-picker",
            "round-robin-picker",
            "power-of-two-picker",
        )
    ],
    "profiles": [
        {
            "name": "tidal",
            "plugins": [
                *_FILTERS,
                {"ref": "lora-affinity-scorer", "weight": 16},
                {"ref": "session-affinity-scorer", "weight": 4},
                {"ref": "prefill-cost-scorer", "weight": 2},
                {"ref": "load-scorer", "weight": 1},
                {"ref": "prefix-affinity-scorer", "weight": 0.25},
                {"ref": "max-score-picker"},
            ],
        },
        {"name": "round_robin", "plugins": [*_FILTERS, {"ref": "round-robin-picker"}]},
        {
            "name": "least_load",
            "plugins": [*_FILTERS, {"ref": "least-inflight-scorer"}, {"ref": "max-score-picker"}],
        },
        {
            "name": "power_of_two",
            "plugins": [*_FILTERS, {"ref": "least-inflight-scorer"}, {"ref": "power-of-two-picker"}],
        },
        {
            "name": "sglang_cache_aware",
            "plugins": [*_FILTERS, {"ref": "cache-aware-scorer"}, {"ref": "max-score-picker"}],
        },
        {
            "name": "llm_d",
            "plugins": [
                *_FILTERS,
                {"ref": "queue-scorer", "weight": 2},
                {"ref": "kv-cache-utilization-scorer", "weight": 2},
                {"ref": "prefix-cache-scorer", "weight": 3},
                {"ref": "max-score-picker"},
            ],
        },
    ],
}

BUILTIN_PROFILES = tuple(p["name"] for p in BUILTIN_ROUTER["profiles"])
