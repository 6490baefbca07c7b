"""Build a :class:`~router.framework.Router` from the fleet config's ``router:`` section, strictly.

The built-in profiles (:mod:`router.profiles`) are always available; the config may add
plugins (``type``, ``name``, ``parameters``) and profiles that reference them by name, and
choose the default profile. Everything is checked at start, and every problem is reported with
the key it concerns::

    router config is invalid:
      router.plugins[1].type: unknown type 'prefix-scorer' (known: adapter-filter, ...)
      router.profiles[0].plugins[2].ref: unknown plugin 'load' (known: healthy, ring)
      router.profiles[0]: needs exactly one picker, has 0

Producers are not referenced in profiles: a profile runs the producers its scorers consume, the
one configured in ``plugins`` for that type if any, else one with default parameters. Data
residency is not left to the config: a profile that lists no ``region-filter`` runs one first.

Example::

    router = build_router(fleet.router, clock=SystemClock(), seed=None, observer=metrics)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidal.clock import Clock
from tidal.fleet import RouterSpec
from tidal.router.framework import Filter, Picker, Plugin, Producer, Profile, Router, RouterObserver, Scorer
from tidal.router.plugins.base import PluginConfigError
from tidal.router.plugins.filters.region import RegionFilter
from tidal.router.plugins.register import REGISTRY
from tidal.router.profiles import BUILTIN_ROUTER, DEFAULT_PROFILE

__all__ = ["RouterConfigError", "build_router", "check_router"]


class RouterConfigError(ValueError):
    """The ``router:`` section cannot be used; ``problems`` lists each offending key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("router config is invalid:\n" + "\n".join(f"  {p}" for p in problems))


def _instantiate(plugins: list[Mapping[str, Any]], where: str, problems: list[str]) -> dict[str, Plugin]:
    out: dict[str, Plugin] = {}
    for i, spec in enumerate(plugins):
        type_ = spec["type"]
        name = spec.get("name") or type_
        factory = REGISTRY.get(type_)
        if factory is None:
            problems.append(
                f"{where}.plugins[{i}].type: unknown type '{type_}' (known: {', '.join(sorted(REGISTRY))})"
            )
            continue
        if name in out:
            problems.append(f"{where}.plugins[{i}].name: duplicate name '{name}'")
            continue
        try:
            out[name] = factory(name, spec.get("parameters") or {})
        except PluginConfigError as exc:
            problems.append(f"{where}.plugins[{i}].parameters: {exc}")
    return out


def _profiles(
    profiles: list[Mapping[str, Any]],
    plugins: Mapping[str, Plugin],
    where: str,
    taken: set[str],
    shared_producers: dict[str, Producer],
    problems: list[str],
) -> dict[str, Profile]:
    configured_producers: dict[str, Producer] = {}
    for p in plugins.values():
        if isinstance(p, Producer) and p.KIND == "producer":
            if p.TYPE in configured_producers:
                problems.append(f"{where}.plugins: two producers of type '{p.TYPE}' ({p.name}); one per type")
            configured_producers[p.TYPE] = p
    out: dict[str, Profile] = {}
    for i, spec in enumerate(profiles):
        name = spec["name"]
        at = f"{where}.profiles[{i}]"
        if name in taken or name in out:
            problems.append(f"{at}.name: duplicate profile name '{name}'")
            continue
        prof = Profile(name)
        pickers = 0
        for j, ref in enumerate(spec["plugins"]):
            plugin = plugins.get(ref["ref"])
            if plugin is None:
                problems.append(
                    f"{at}.plugins[{j}].ref: unknown plugin '{ref['ref']}' (known: {', '.join(sorted(plugins)) or 'none'})"
                )
                continue
            weight = float(ref.get("weight", 1.0))
            if plugin.KIND == "filter":
                assert isinstance(plugin, Filter)
                prof.filters.append(plugin)
            elif plugin.KIND == "scorer":
                assert isinstance(plugin, Scorer)
                prof.scorers.append((plugin, weight))
            elif plugin.KIND == "picker":
                assert isinstance(plugin, Picker)
                prof.picker = plugin
                pickers += 1
            else:
                problems.append(
                    f"{at}.plugins[{j}].ref: '{ref['ref']}' is a producer; profiles list filters, "
                    "scorers and a picker, and run the producers their scorers consume"
                )
        if pickers != 1:
            problems.append(f"{at}: needs exactly one picker, has {pickers}")
        if not any(f.TYPE == RegionFilter.TYPE for f in prof.filters):
            prof.filters.insert(0, RegionFilter())
        for scorer, _ in prof.scorers:
            for ptype in scorer.CONSUMES:
                producer = configured_producers.get(ptype) or shared_producers.get(ptype)
                if producer is None:
                    made = REGISTRY[ptype](ptype, {})
                    assert isinstance(made, Producer)
                    producer = shared_producers[ptype] = made
                if producer not in prof.producers:
                    prof.producers.append(producer)
        out[name] = prof
    return out


def _spec_dict(spec: RouterSpec | Mapping[str, Any] | None) -> dict[str, Any]:
    if spec is None:
        return {"plugins": [], "profiles": [], "default_profile": None}
    if isinstance(spec, RouterSpec):
        return spec.model_dump()
    return RouterSpec.model_validate(spec).model_dump()


def check_router(spec: RouterSpec | Mapping[str, Any] | None) -> list[str]:
    """The problems of a ``router:`` section (empty when it is valid)."""
    try:
        build_router(spec, seed=0)
    except RouterConfigError as exc:
        return exc.problems
    return []


def build_router(
    spec: RouterSpec | Mapping[str, Any] | None = None,
    *,
    clock: Clock | None = None,
    seed: int | None = None,
    observer: RouterObserver | None = None,
) -> Router:
    """The built-in profiles plus the config's, with fresh plugin state (indexes, cursors)."""
    problems: list[str] = []
    user = _spec_dict(spec)
    producers: dict[str, Producer] = {}
    builtin_plugins = _instantiate(BUILTIN_ROUTER["plugins"], "builtin", problems)
    profiles = _profiles(BUILTIN_ROUTER["profiles"], builtin_plugins, "builtin", set(), producers, problems)
    assert not problems, problems  # the built-ins are ours; a failure here is a bug
    user_plugins = _instantiate(user["plugins"], "router", problems)
    # User profiles get their own default producers, so their indexes never mix with built-ins'.
    profiles.update(_profiles(user["profiles"], user_plugins, "router", set(profiles), {}, problems))
    default = user.get("default_profile") or DEFAULT_PROFILE
    if default not in profiles:
        problems.append(f"router.default_profile: unknown profile '{default}' (known: {', '.join(profiles)})")
    if problems:
        raise RouterConfigError(problems)
    return Router(profiles, default, clock=clock, seed=seed, observer=observer)
