"""Every plugin type, registered in one place: ``type name -> factory(name, params)``.

Adding a policy is one module under ``router/plugins/`` and one line here; configs then name it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tidal.router.framework import Plugin
from tidal.router.plugins.filters.adapter import AdapterFilter
from tidal.router.plugins.filters.canary import CanaryFilter
from tidal.router.plugins.filters.capacity import CapacityFilter
from tidal.router.plugins.filters.healthy import HealthyFilter
from tidal.router.plugins.filters.model import ModelFilter
from tidal.router.plugins.filters.region import RegionFilter
from tidal.router.plugins.pickers.max_score import MaxScorePicker
from tidal.router.plugins.pickers.power_of_two import PowerOfTwoPicker
from tidal.router.plugins.pickers.random_pick import RandomPicker
from tidal.router.plugins.pickers.round_robin import RoundRobinPicker
from tidal.router.plugins.producers.block_index import ApproxPrefixIndex, RadixTree
from tidal.router.plugins.producers.kv_index import KVIndex
from tidal.router.plugins.producers.rings import PrefixRing, SessionRing
from tidal.router.plugins.scorers.cache_aware import CacheAwareScorer
from tidal.router.plugins.scorers.kv_cache import KVCacheUtilizationScorer
from tidal.router.plugins.scorers.least_inflight import LeastInflightScorer
from tidal.router.plugins.scorers.load import LoadScorer
from tidal.router.plugins.scorers.lora_affinity import LoraAffinityScorer
from tidal.router.plugins.scorers.prefill_cost import PrefillCostScorer
from tidal.router.plugins.scorers.prefix_affinity import PrefixAffinityScorer
from tidal.router.plugins.scorers.prefix_cache import PrefixCacheScorer
from tidal.router.plugins.scorers.queue import QueueScorer
from tidal.router.plugins.scorers.session_affinity import SessionAffinityScorer

__all__ = ["REGISTRY", "PluginFactory", "register"]

PluginFactory = Callable[[str, Mapping[str, Any] | None], Plugin]

REGISTRY: dict[str, PluginFactory] = {}


def register(type_name: str, factory: PluginFactory) -> None:
    if type_name in REGISTRY:
        raise ValueError(f"plugin type '{type_name}' is registered twice")
    REGISTRY[type_name] = factory


# filters
register(HealthyFilter.TYPE, HealthyFilter.from_config)
register(ModelFilter.TYPE, ModelFilter.from_config)
register(AdapterFilter.TYPE, AdapterFilter.from_config)
register(CanaryFilter.TYPE, CanaryFilter.from_config)
register(CapacityFilter.TYPE, CapacityFilter.from_config)
register(RegionFilter.TYPE, RegionFilter.from_config)
# producers
register(PrefixRing.TYPE, PrefixRing.from_config)
register(SessionRing.TYPE, SessionRing.from_config)
register(ApproxPrefixIndex.TYPE, ApproxPrefixIndex.from_config)
register(RadixTree.TYPE, RadixTree.from_config)
register(KVIndex.TYPE, KVIndex.from_config)
# scorers
register(PrefixAffinityScorer.TYPE, PrefixAffinityScorer.from_config)
register(SessionAffinityScorer.TYPE, SessionAffinityScorer.from_config)
register(LoraAffinityScorer.TYPE, LoraAffinityScorer.from_config)
register(LoadScorer.TYPE, LoadScorer.from_config)
register(LeastInflightScorer.TYPE, LeastInflightScorer.from_config)
register(QueueScorer.TYPE, QueueScorer.from_config)
register(KVCacheUtilizationScorer.TYPE, KVCacheUtilizationScorer.from_config)
register(PrefixCacheScorer.TYPE, PrefixCacheScorer.from_config)
register(CacheAwareScorer.TYPE, CacheAwareScorer.from_config)
register(PrefillCostScorer.TYPE, PrefillCostScorer.from_config)
# pickers
register(MaxScorePicker.TYPE, MaxScorePicker.from_config)
register(RoundRobinPicker.TYPE, RoundRobinPicker.from_config)
register(PowerOfTwoPicker.TYPE, PowerOfTwoPicker.from_config)
register(RandomPicker.TYPE, RandomPicker.from_config)
