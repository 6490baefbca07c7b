"""The deploy files describe the production shape, and hold together.

``docker-compose.yml`` and ``deploy/k8s/`` run several gateways that share load through Redis
and follow every interactive replica's KV events: each gateway's ``TIDAL_REDIS_URL`` names the
Redis service, the fleet config they mount validates with the project's own loader, every
interactive replica has ``kv_events`` whose host is a service of the same files, and the replica
binds those very ports (``tidal sim --kv-events-endpoint``, vLLM ``--kv-events-config``). On
Kubernetes the interactive pool is a Deployment that the scheduler's Kubernetes actuator scales
and registers pod by pod: the fleet's ``autoscale.kubernetes`` target names that Deployment, its
``kv_events`` ports are the ones the vLLM container binds, a NetworkPolicy admits only the gateways
to them, and the scheduler may scale the Deployment and list its pods. The checks collect
problems, so each case below that breaks one file must name what broke.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tidal.fleet import FleetConfig, FleetConfigError, load_fleet, parse_fleet
from tidal.replicas.wire.kv_events import KVEventsConfig

ROOT = Path(__file__).resolve().parents[1]
# The fleet each replica profile of the compose stack runs with (TIDAL_COMPOSE_FLEET).
COMPOSE_FLEETS = {"sim": "deploy/fleet.compose.yaml", "gpu": "deploy/fleet.compose.gpu.yaml"}
FLEET_MOUNT = "/etc/tidal/fleet.yaml"
REDIS_PORT = 6379

Doc = dict[str, Any]
Reader = Callable[[str], str]


def _read(path: str) -> str:
    return (ROOT / path).read_text()


def _compose() -> Doc:
    data = yaml.safe_load(_read("docker-compose.yml"))
    assert isinstance(data, dict)
    return data


def _k8s_docs() -> list[Doc]:
    return [
        d
        for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]


_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _defaults(value: str) -> str:
    """A compose value with its ``${NAME:-default}`` variables at their defaults."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def _flags(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


def _host_port(url: str, default_port: int | None = None) -> tuple[str, int | None]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or default_port


def _bound_ports(argv: list[str]) -> tuple[str | None, str | None]:
    """Where a replica's command binds its KV-event PUB and replay sockets."""
    if argv and argv[0] == "sim":
        return _flag(argv, "--kv-events-endpoint"), _flag(argv, "--kv-events-replay-endpoint")
    raw = _flag(argv, "--kv-events-config")
    if raw is None:
        return None, None
    cfg = KVEventsConfig.from_json(raw)
    return (cfg.endpoint, cfg.replay_endpoint) if cfg.enabled else (None, None)


def _check_binds(where: str, argv: list[str], endpoint: str, replay: str | None) -> list[str]:
    pub, rep = _bound_ports(argv)
    problems = []
    for what, bound, wanted in (("endpoint", pub, endpoint), ("replay_endpoint", rep, replay)):
        if bound is None:
            problems.append(f"{where}: publishes no KV-event {what} (the fleet says {wanted})")
        elif not bound.startswith("tcp://*:"):
            problems.append(
                f"{where}: KV-event {what} {bound} is not bound on every interface (tcp://*:PORT)"
            )
        elif wanted is None or _host_port(bound)[1] != _host_port(wanted)[1]:
            problems.append(f"{where}: binds KV-event {what} {bound}, the fleet connects to {wanted}")
    return problems


def _fleet(text: str, source: str) -> FleetConfig | str:
    try:
        return parse_fleet(yaml.safe_load(text), source)
    except FleetConfigError as exc:
        return f"{source}: {exc}"


# -- docker-compose.yml ----------------------------------------------------------------------------


def _gateways(services: Mapping[str, Doc]) -> dict[str, Doc]:
    return {n: s for n, s in services.items() if s.get("command", [None])[0] == "gateway"}


def _in_profile(services: Mapping[str, Doc], profile: str) -> dict[str, Doc]:
    return {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}


def _mounted(service: Doc, target: str) -> str | None:
    for v in service.get("volumes", []):
        parts = _defaults(v).split(":")
        if len(parts) >= 2 and parts[1] == target:
            return parts[0]
    return None


def compose_problems(compose: Doc, read: Reader = _read) -> list[str]:
    """What is wrong with several gateways, Redis and KV events in a compose file (none: [])."""
    services: dict[str, Doc] = compose["services"]
    problems: list[str] = []
    gateways = _gateways(services)
    if len(gateways) < 2:
        problems.append(f"several gateways expected, found {sorted(gateways)}")
    redis = {n for n, s in services.items() if str(s.get("image", "")).startswith("redis:")}
    for name in sorted(redis):
        if "healthcheck" not in services[name]:
            problems.append(f"{name}: Redis has no healthcheck")
    for name, gw in sorted(gateways.items()):
        url = gw.get("environment", {}).get("TIDAL_REDIS_URL")
        if url is None:
            problems.append(f"{name}: TIDAL_REDIS_URL is not set")
        else:
            host, port = _host_port(url, REDIS_PORT)
            if host not in redis or port != REDIS_PORT:
                problems.append(f"{name}: TIDAL_REDIS_URL {url} is not a Redis service of this file")
            elif host not in gw.get("depends_on", {}):
                problems.append(f"{name}: does not wait for {host}")
        workers = _flag(gw["command"], "--workers")
        if workers is None or not _defaults(workers).isdigit() or int(_defaults(workers)) < 1:
            problems.append(f"{name}: --workers {workers!r} is not a process count")
        if _mounted(gw, FLEET_MOUNT) != f"./{COMPOSE_FLEETS['sim']}":
            problems.append(f"{name}: mounts {_mounted(gw, FLEET_MOUNT)} at {FLEET_MOUNT} by default")

    # One entry point that streams: nginx with every gateway in its upstream, unbuffered.
    lbs = [s for s in services.values() if str(s.get("image", "")).startswith("nginx:")]
    if len(lbs) != 1:
        problems.append(f"one nginx in front of the gateways expected, found {len(lbs)}")
    else:
        conf_path = _mounted(lbs[0], "/etc/nginx/conf.d/default.conf") or ""
        conf = read(conf_path.removeprefix("./"))
        upstream = " ".join(re.findall(r"^\s*server\s+(\S+)", conf, re.M))
        for name in sorted(gateways):
            if f"{name}:8000" not in upstream.split():
                problems.append(f"nginx: gateway {name} is not in the upstream")
        for directive in ("proxy_buffering off;", "proxy_http_version 1.1;"):
            if directive not in conf:
                problems.append(f"nginx: `{directive}` missing, streams would not pass through as they come")

    sched = services.get("scheduler", {}).get("command", [])
    wanted = {f"http://{g}:8000" for g in gateways}
    if set(_flags(sched, "--gateway")) != wanted:
        problems.append(
            f"scheduler: --gateway {_flags(sched, '--gateway')}, expected each of {sorted(wanted)}"
        )
    prom_path = _mounted(services["prometheus"], "/etc/prometheus/prometheus.yml") or ""
    prom = yaml.safe_load(read(prom_path.removeprefix("./")))
    targets = {
        t
        for j in prom["scrape_configs"]
        if j["job_name"] == "tidal-gateway"
        for c in j["static_configs"]
        for t in c["targets"]
    }
    if targets != {f"{g}:8000" for g in gateways}:
        problems.append(f"prometheus: tidal-gateway scrapes {sorted(targets)}, not each gateway")

    for profile, path in COMPOSE_FLEETS.items():
        problems += _compose_fleet_problems(services, profile, path, read)
    return problems


def _compose_fleet_problems(services: Mapping[str, Doc], profile: str, path: str, read: Reader) -> list[str]:
    here = _in_profile(services, profile)
    fleet = _fleet(read(path), path)
    if isinstance(fleet, str):
        return [fleet]
    problems: list[str] = []
    for pool, replica in fleet.all_replicas():
        if pool.kind != "interactive":
            continue
        where = f"{path}: {replica.name}"
        host, port = _host_port(replica.base_url, 80)
        if host not in here:
            problems.append(f"{where}: {replica.base_url} is no service of profile {profile}")
            continue
        argv = [str(a) for a in here[host].get("command", [])]
        if port != int(_flag(argv, "--port") or 8000):
            problems.append(f"{where}: {replica.base_url} is not the port {host} serves on")
        if replica.kv_events is None:
            problems.append(f"{where}: no kv_events")
            continue
        for ep in filter(None, (replica.kv_events.endpoint, replica.kv_events.replay_endpoint)):
            if _host_port(ep)[0] not in here:
                problems.append(f"{where}: KV events at {ep}, no service of profile {profile} there")
        problems += _check_binds(
            f"{where} ({host})", argv, replica.kv_events.endpoint, replica.kv_events.replay_endpoint
        )
    # Gateways tokenise as the replicas do: the simulator's words, or files the gateways mount.
    for model in fleet.models:
        if model.tokenizer is None:
            problems.append(f"{path}: model {model.name} has no tokenizer, its KV events cannot be matched")
        elif model.tokenizer != "sim":
            for name, gw in _gateways(services).items():
                mounts = [_defaults(v).split(":") for v in gw.get("volumes", [])]
                vol = next((m[0] for m in mounts if model.tokenizer.startswith(m[1] + "/")), None)
                fetchers = [
                    n
                    for n, s in here.items()
                    if vol is not None
                    and any(_defaults(v).split(":")[0] == vol for v in s.get("volumes", []))
                    and model.tokenizer in s.get("entrypoint", [])
                ]
                if vol is None or not fetchers:
                    problems.append(
                        f"{path}: {name} has no {model.tokenizer} that a service of {profile} fills"
                    )
    return problems


def test_compose_file_has_the_production_shape() -> None:
    services = _compose()["services"]
    for name in [
        "rabbitmq",
        "postgres",
        "redis",
        "gateway",
        "scheduler",
        "worker-reserved",
        "worker-spot",
        "worker-shared",
        "flower",
        "prometheus",
        "grafana",
    ]:
        assert name in services, name
    assert "management" in services["rabbitmq"]["image"]
    assert services["gateway"]["ports"] == ["8000:8000"]  # clients reach the balancer only
    gpu = [n for n, s in services.items() if "gpu" in s.get("profiles", [])]
    sim = [n for n, s in services.items() if "sim" in s.get("profiles", [])]
    assert gpu and sim
    # Anchors resolve: every tidal service gets the shared environment.
    assert services["worker-spot"]["environment"]["TIDAL_ENVIRONMENT"] == "production"
    assert services["gateway-b"]["environment"]["TIDAL_DATABASE_URL"].startswith("postgresql+psycopg://")
    for name in ["gateway-a", "gateway-b", "scheduler", "worker-reserved", "flower"]:
        assert services[name]["command"][0] in {"gateway", "scheduler", "worker", "flower"}
    sched = services["scheduler"]["command"]
    assert sched[sched.index("--metrics-host") + 1] == "0.0.0.0"


def test_compose_gateways_share_redis_and_follow_every_replicas_kv_events() -> None:
    assert compose_problems(_compose()) == []
    for path in COMPOSE_FLEETS.values():
        load_fleet(ROOT / path)  # strict loading too: duplicate keys and all


def _set_env(service: str, key: str, value: str | None) -> Callable[[Doc], None]:
    def change(c: Doc) -> None:
        env = c["services"][service]["environment"]
        if value is None:
            env.pop(key)
        else:
            env[key] = value

    return change


def _set_command(service: str, old: str, new: str | None) -> Callable[[Doc], None]:
    def change(c: Doc) -> None:
        argv = c["services"][service]["command"]
        i = argv.index(old)
        argv[i : i + 1] = [] if new is None else [new]

    return change


def _drop_kv_config(service: str) -> Callable[[Doc], None]:
    def change(c: Doc) -> None:
        argv = c["services"][service]["command"]
        i = argv.index("--kv-events-config")
        del argv[i : i + 2]

    return change


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_set_env("gateway-b", "TIDAL_REDIS_URL", None), "gateway-b: TIDAL_REDIS_URL is not set"),
        (_set_env("gateway-a", "TIDAL_REDIS_URL", "redis://cache:6379/0"), "gateway-a: TIDAL_REDIS_URL"),
        (_set_command("sim-1", "tcp://*:5557", "tcp://*:5559"), "sim-1 (sim-1): binds KV-event endpoint"),
        (_set_command("sim-0", "tcp://*:5558", "tcp://127.0.0.1:5558"), "not bound on every interface"),
        (_drop_kv_config("vllm-1"), "vllm-1 (vllm-1): publishes no KV-event endpoint"),
        (_set_command("scheduler", "http://gateway-b:8000", None), "scheduler: --gateway"),
        (_set_command("gateway-a", "--workers", "--threads"), "gateway-a: --workers"),
    ],
    ids=["no-redis-url", "redis-elsewhere", "sim-port", "sim-bind", "vllm-no-events", "scheduler", "workers"],
)
def test_a_broken_compose_file_names_what_broke(change: Callable[[Doc], None], problem: str) -> None:
    compose = copy.deepcopy(_compose())
    change(compose)
    problems = compose_problems(compose)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    ("path", "old", "new", "problem"),
    [
        (COMPOSE_FLEETS["sim"], "tcp://sim-1:5557", "tcp://sim-9:5557", "no service of profile sim"),
        (COMPOSE_FLEETS["gpu"], "tcp://vllm-0:5558", "tcp://vllm-0:5560", "binds KV-event replay_endpoint"),
        (COMPOSE_FLEETS["sim"], "    tokenizer: sim\n", "", "has no tokenizer"),
        (
            COMPOSE_FLEETS["sim"],
            'replay_endpoint: "tcp://sim-1:5558"',
            'replay_endpoint: "tcp://sim-0:5558"',
            "duplicate",
        ),
        ("deploy/nginx.conf", "proxy_buffering off;", "", "proxy_buffering off"),
        ("deploy/nginx.conf", "server gateway-b:8000", "server gateway-c:8000", "gateway gateway-b is not"),
        ("deploy/prometheus.yml", '"gateway-b:8000"', '"gateway:8000"', "prometheus"),
    ],
    ids=[
        "fleet-host",
        "fleet-port",
        "tokenizer",
        "fleet-duplicate",
        "nginx-buffering",
        "nginx-upstream",
        "prometheus",
    ],
)
def test_a_broken_deploy_file_names_what_broke(path: str, old: str, new: str, problem: str) -> None:
    def read(p: str) -> str:
        text = _read(p)
        if p == path:
            assert old in text
            return text.replace(old, new)
        return text

    problems = compose_problems(_compose(), read)
    assert any(problem in p for p in problems), problems


# -- deploy/k8s ------------------------------------------------------------------------------------


def _containers(workload: Doc, init: bool = False) -> list[Doc]:
    spec = workload["spec"]["template"]["spec"]
    return list(spec.get("initContainers" if init else "containers", []))


def _env(container: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _expand(arg: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _workloads(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _selects(service: Doc, workload: Doc) -> bool:
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _subset(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return selector is not None and all(labels.get(k) == v for k, v in selector.items())


def _policy_problems(docs: list[Doc], dep: Doc, gw: Doc, ports: list[int]) -> list[str]:
    """The KV-event ports of ``dep``'s pods admit the gateway pods and nothing else."""
    ns = dep["metadata"].get("namespace", "default")
    labels = dep["spec"]["template"]["metadata"].get("labels", {})
    gw_labels = gw["spec"]["template"]["metadata"].get("labels", {})
    name = dep["metadata"]["name"]
    policies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and d["metadata"].get("namespace", "default") == ns
        and _subset(d["spec"].get("podSelector", {}).get("matchLabels", {}), labels)
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return [f"{name}: no NetworkPolicy keeps its KV-event ports {ports} to the gateways"]
    problems = []
    rules = [r for p in policies for r in p["spec"].get("ingress", [])]
    for port in ports:
        covering = [r for r in rules if "ports" not in r or any(p.get("port") == port for p in r["ports"])]
        if any("from" not in r for r in covering):
            problems.append(f"{name}: KV-event port {port} is open to every pod, not only the gateways")
        elif not any(
            _subset(f.get("podSelector", {}).get("matchLabels"), gw_labels)
            for r in covering
            for f in r["from"]
        ):
            problems.append(f"{name}: no NetworkPolicy admits the gateways to KV-event port {port}")
    return problems


def _rbac_problems(docs: list[Doc], scheduler: Doc) -> list[str]:
    """The scheduler's service account may scale Deployments and list (register) their pods."""
    account = scheduler["spec"]["template"]["spec"].get("serviceAccountName")
    roles = {
        b["roleRef"]["name"]
        for b in docs
        if b["kind"] == "RoleBinding"
        and any(s.get("kind") == "ServiceAccount" and s.get("name") == account for s in b.get("subjects", []))
    }
    rules = [r for d in docs if d["kind"] == "Role" and d["metadata"]["name"] in roles for r in d["rules"]]
    problems = []
    for resource, verb in (("deployments", "get"), ("deployments/scale", "patch"), ("pods", "list")):
        if not any(resource in r.get("resources", []) and verb in r.get("verbs", []) for r in rules):
            problems.append(f"tidal-scheduler: its Role does not allow {verb} on {resource}")
    return problems


def k8s_problems(docs: list[Doc]) -> list[str]:
    """What is wrong with several gateways, Redis and KV events in the manifests (none: [])."""
    problems: list[str] = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = _workloads(docs)
    gw = workloads.get("tidal-gateway")
    if gw is None:
        return ["no tidal-gateway workload"]
    if gw["spec"].get("replicas", 1) < 2:
        problems.append(f"tidal-gateway: {gw['spec'].get('replicas', 1)} replica(s), several expected")
    container = next(c for c in _containers(gw) if c["name"] == "gateway")
    env = _env(container)
    url = env.get("TIDAL_REDIS_URL")
    if url is None:
        problems.append("tidal-gateway: TIDAL_REDIS_URL is not set")
    else:
        host, port = _host_port(url, REDIS_PORT)
        svc = services.get(host)
        redis = [
            w
            for w in workloads.values()
            if svc is not None
            and _selects(svc, w)
            and any(str(c["image"]).startswith("redis:") for c in _containers(w))
        ]
        if svc is None or not redis or port not in {p["port"] for p in svc["spec"]["ports"]}:
            problems.append(f"tidal-gateway: TIDAL_REDIS_URL {url} is not a Redis Service of these manifests")
    args = [_expand(a, env) for a in container["args"]]
    workers = _flag(args, "--workers")
    if workers is None or not workers.isdigit() or int(workers) < 1:
        problems.append(f"tidal-gateway: --workers {workers!r} is not a process count")

    # The scheduler reaches each gateway pod by name.
    sched = _containers(workloads["tidal-scheduler"])[0]["args"]
    if gw["kind"] == "StatefulSet":
        pods = gw["spec"]["serviceName"]
        wanted = {f"http://tidal-gateway-{i}.{pods}:8000" for i in range(gw["spec"].get("replicas", 1))}
        if set(_flags(sched, "--gateway")) != wanted:
            problems.append(
                f"tidal-scheduler: --gateway {_flags(sched, '--gateway')}, expected {sorted(wanted)}"
            )
        if services.get(pods, {}).get("spec", {}).get("clusterIP") != "None":
            problems.append(f"tidal-gateway: {pods} is not a headless Service")
    else:
        problems.append("tidal-gateway: a Deployment's pods cannot be named to the scheduler")

    cm = next((d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tidal-fleet"), None)
    if cm is None:
        return [*problems, "no tidal-fleet ConfigMap"]
    fleet = _fleet(cm["data"]["fleet.yaml"], "tidal-fleet")
    if isinstance(fleet, str):
        return [*problems, fleet]
    # The interactive pool is a Deployment the scheduler's Kubernetes actuator scales and whose
    # ready pods it registers, by pod IP, with the ports of the target's kv_events.
    actuator = _flag(_containers(workloads["tidal-scheduler"])[0]["args"], "--actuator") or "auto"
    for pool in fleet.pools.values():
        if pool.kind != "interactive":
            continue
        where = f"tidal-fleet: pool {pool.name}"
        for replica in pool.replicas:
            if replica.kv_events is None:
                problems.append(f"tidal-fleet: {replica.name}: no kv_events")
        target = pool.autoscale.kubernetes if pool.autoscale is not None else None
        if target is None:
            if not pool.replicas:
                problems.append(f"{where}: no replicas and no Kubernetes target to register them")
            continue
        if actuator not in ("auto", "kubernetes"):
            problems.append(
                f"tidal-scheduler: --actuator {actuator} neither scales nor registers {pool.name}"
            )
        dep = next(
            (
                d
                for d in docs
                if d["kind"] == "Deployment"
                and d["metadata"]["name"] == target.deployment
                and d["metadata"].get("namespace", "default") == target.namespace
            ),
            None,
        )
        if dep is None:
            problems.append(f"{where}: no Deployment {target.namespace}/{target.deployment} to scale")
            continue
        name = target.deployment
        argv = [str(a) for c in _containers(dep) for a in c.get("args", [])]
        if int(_flag(argv, "--port") or 8000) != target.port:
            problems.append(
                f"{where}: registers port {target.port}, {name} serves on {_flag(argv, '--port')}"
            )
        if target.kv_events is None:
            problems.append(f"{where}: the Kubernetes target has no kv_events, its pods' events go unread")
            continue
        kv = target.kv_events
        replay = f"tcp://POD_IP:{kv.replay_port}" if kv.replay_port is not None else None
        problems += _check_binds(f"{where} ({name})", argv, f"tcp://POD_IP:{kv.port}", replay)
        problems += _policy_problems(docs, dep, gw, [p for p in (kv.port, kv.replay_port) if p is not None])
    problems += _rbac_problems(docs, workloads["tidal-scheduler"])
    for model in fleet.models:
        if model.tokenizer is None:
            problems.append(
                f"tidal-fleet: model {model.name} has no tokenizer, its KV events cannot be matched"
            )
        elif model.tokenizer != "sim":
            mount = next(
                (
                    m
                    for m in container.get("volumeMounts", [])
                    if model.tokenizer.startswith(m["mountPath"] + "/")
                ),
                None,
            )
            fills = [
                c
                for c in _containers(gw, init=True)
                if mount is not None
                and any(m["name"] == mount["name"] for m in c.get("volumeMounts", []))
                and model.tokenizer in c.get("command", []) + c.get("args", [])
            ]
            if not fills:
                problems.append(f"tidal-gateway: no init container fills the tokenizer {model.tokenizer}")
    return problems


def test_kubernetes_manifests_have_the_production_shape() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _k8s_docs()}
    for kind, name in [
        ("StatefulSet", "tidal-gateway"),
        ("Service", "tidal-gateway"),
        ("Deployment", "redis"),
        ("Service", "redis"),
        ("Deployment", "tidal-scheduler"),
        ("Deployment", "tidal-worker-reserved"),
        ("Deployment", "tidal-worker-spot"),
        ("Deployment", "tidal-worker-shared"),
        ("Deployment", "tidal-flower"),
        ("Deployment", "vllm-interactive"),
        ("NetworkPolicy", "vllm-interactive-kv-events"),
    ]:
        assert (kind, name) in kinds, (kind, name)


def test_kubernetes_gateways_share_redis_and_follow_every_replicas_kv_events() -> None:
    assert k8s_problems(_k8s_docs()) == []


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _k8s_drop_redis_url(docs: list[Doc]) -> None:
    c = _containers(_find(docs, "StatefulSet", "tidal-gateway"))[0]
    c["env"] = [e for e in c["env"] if e["name"] != "TIDAL_REDIS_URL"]


def _k8s_fleet(old: str, new: str) -> Callable[[list[Doc]], None]:
    def change(docs: list[Doc]) -> None:
        cm = _find(docs, "ConfigMap", "tidal-fleet")
        assert old in cm["data"]["fleet.yaml"]
        cm["data"]["fleet.yaml"] = cm["data"]["fleet.yaml"].replace(old, new)

    return change


def _k8s_vllm_as_statefulset(docs: list[Doc]) -> None:
    dep = _find(docs, "Deployment", "vllm-interactive")
    dep["kind"] = "StatefulSet"
    dep["spec"]["serviceName"] = "vllm-interactive"


def _k8s_drop_kv_config(docs: list[Doc]) -> None:
    c = _containers(_find(docs, "Deployment", "vllm-interactive"))[0]
    i = c["args"].index("--kv-events-config")
    del c["args"][i : i + 2]


def _k8s_other_publish_port(docs: list[Doc]) -> None:
    c = _containers(_find(docs, "Deployment", "vllm-interactive"))[0]
    i = c["args"].index("--kv-events-config")
    cfg = json.loads(c["args"][i + 1])
    c["args"][i + 1] = json.dumps({**cfg, "endpoint": "tcp://*:6557"})


def _k8s_policy_without(port: int) -> Callable[[list[Doc]], None]:
    def change(docs: list[Doc]) -> None:
        for rule in _find(docs, "NetworkPolicy", "vllm-interactive-kv-events")["spec"]["ingress"]:
            rule["ports"] = [p for p in rule.get("ports", []) if p["port"] != port]

    return change


def _k8s_policy_open(docs: list[Doc]) -> None:
    for rule in _find(docs, "NetworkPolicy", "vllm-interactive-kv-events")["spec"]["ingress"]:
        rule.pop("from", None)


def _k8s_no_policy(docs: list[Doc]) -> None:
    docs.remove(_find(docs, "NetworkPolicy", "vllm-interactive-kv-events"))


def _k8s_scheduler_gauge(docs: list[Doc]) -> None:
    _containers(_find(docs, "Deployment", "tidal-scheduler"))[0]["args"] += ["--actuator", "gauge"]


def _k8s_no_pod_listing(docs: list[Doc]) -> None:
    role = _find(docs, "Role", "tidal-scheduler")
    role["rules"] = [r for r in role["rules"] if "pods" not in r["resources"]]


def _k8s_hide_replay_port(docs: list[Doc]) -> None:
    c = _containers(_find(docs, "Deployment", "vllm-interactive"))[0]
    i = c["args"].index("--kv-events-config")
    cfg = json.loads(c["args"][i + 1])
    del cfg["replay_endpoint"]
    c["args"][i + 1] = json.dumps(cfg)


def _k8s_one_gateway_for_the_scheduler(docs: list[Doc]) -> None:
    c = _containers(_find(docs, "Deployment", "tidal-scheduler"))[0]
    i = c["args"].index("http://tidal-gateway-1.tidal-gateway-pods:8000")
    del c["args"][i - 1 : i + 1]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_k8s_drop_redis_url, "tidal-gateway: TIDAL_REDIS_URL is not set"),
        (_k8s_one_gateway_for_the_scheduler, "tidal-scheduler: --gateway"),
        (
            _k8s_fleet("deployment: vllm-interactive", "deployment: vllm-chat"),
            "tidal-fleet: pool interactive: no Deployment tidal/vllm-chat to scale",
        ),
        (_k8s_vllm_as_statefulset, "no Deployment tidal/vllm-interactive to scale"),
        (
            _k8s_fleet("kv_events: {port: 5557, replay_port: 5558}", ""),
            "the Kubernetes target has no kv_events",
        ),
        (
            _k8s_fleet("port: 5557,", "port: 5559,"),
            "binds KV-event endpoint tcp://*:5557, the fleet connects to tcp://POD_IP:5559",
        ),
        (_k8s_fleet("port: 8000\n", "port: 8001\n"), "registers port 8001"),
        (_k8s_drop_kv_config, "(vllm-interactive): publishes no KV-event endpoint"),
        (_k8s_other_publish_port, "binds KV-event endpoint tcp://*:6557"),
        (_k8s_hide_replay_port, "publishes no KV-event replay_endpoint"),
        (_k8s_policy_without(5558), "no NetworkPolicy admits the gateways to KV-event port 5558"),
        (_k8s_policy_open, "KV-event port 5557 is open to every pod"),
        (_k8s_no_policy, "vllm-interactive: no NetworkPolicy keeps its KV-event ports"),
        (_k8s_scheduler_gauge, "tidal-scheduler: --actuator gauge neither scales nor registers"),
        (_k8s_no_pod_listing, "tidal-scheduler: its Role does not allow list on pods"),
    ],
    ids=[
        "no-redis-url",
        "scheduler",
        "target-missing",
        "statefulset",
        "target-no-events",
        "target-port",
        "http-port",
        "no-events",
        "publish-port",
        "replay-port",
        "policy-port",
        "policy-open",
        "no-policy",
        "gauge-actuator",
        "rbac",
    ],
)
def test_broken_kubernetes_manifests_name_what_broke(
    change: Callable[[list[Doc]], None], problem: str
) -> None:
    docs = copy.deepcopy(_k8s_docs())
    change(docs)
    problems = k8s_problems(docs)
    assert any(problem in p for p in problems), problems
