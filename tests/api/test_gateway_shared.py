"""Several gateways route as one: ``tidal gateway`` processes sharing load state through a real
Redis, in front of simulated replicas (``tidal sim``).

* Three gateways: a replica's in-flight count, wherever its requests entered, is seen by every
  gateway within the staleness bound (:data:`BOUND_S`), when they start and when they end.
* Redis stopped and restarted under traffic (a Redis of the test's own, on its own port and data
  directory): no request fails, the gateways say Redis is gone, and rejoin when it returns; the
  recovery time is printed.
* ``--workers 2`` shares the same way, and is refused without Redis.

The bound: a gateway publishes and reads every ``shared_state_interval_s`` (50 ms), so a change is
seen after two intervals plus two Redis round trips, about 0.1 s on an idle machine. This shared
two-core machine stalls processes now and then, so the test accepts :data:`BOUND_S` (0.5 s) and
prints what it measured; counts older than ``shared_state_ttl_s`` (2 s) are never used at all.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.api.harness import ADMIN_KEY, DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.services import in_ci, require_tcp
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process
from tidal.replicas.wire.prom import parse_samples

pytestmark = pytest.mark.redis

BOUND_S = 0.5
SHARED_REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProcess]]:
    # Paced like a GPU decode step (about 10 ms), so a 300-token stream lasts about 3 s.
    logs = tmp_path_factory.mktemp("sims")
    procs = [
        sim_process(
            "fast-test",
            args=["--served-model-name", "tiny", "--time-scale", "0.1"],
            log_path=logs / f"sim-{i}.log",
            name=f"sim-{i}",
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs:
            p.stop()


def _fleet(sims: list[ReplicaProcess], **kw: Any) -> dict[str, Any]:
    fleet = fleet_dict([p.url for p in sims], wait_budget_s=30.0, **kw)
    fleet["gateway"]["shared_state_interval_s"] = 0.05
    fleet["gateway"]["shared_state_ttl_s"] = 2.0
    return fleet


def _env(url: str, namespace: str) -> dict[str, str]:
    return {"TIDAL_REDIS_URL": url, "TIDAL_REDIS_NAMESPACE": namespace}


def _replicas(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in gw.admin("GET", "/admin/replicas").json()["data"]}


def _stream(gw: Gateway, tokens: int, content: str, stop: threading.Event | None = None) -> int:
    """One streamed chat request read to its end (or until ``stop`` is set); its HTTP status."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with gw.sse(body, timeout=120) as resp:
        for _ in resp.iter_bytes():
            if stop is not None and stop.is_set():
                break
        return resp.status_code


def _wait(condition: Callable[[], bool], timeout: float, poll: float = 0.01) -> float | None:
    """Seconds until ``condition()`` held, or ``None`` after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if condition():
            return time.monotonic() - t0
        time.sleep(poll)
    return None


@pytest.fixture(scope="module")
def gateways(sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Gateway]]:
    require_tcp("Redis", "127.0.0.1", 6379)
    env = _env(SHARED_REDIS, f"tidal-test-{secrets.token_hex(4)}")
    tmp = tmp_path_factory.mktemp("gw-shared")
    with contextlib.ExitStack() as stack:
        gws = [stack.enter_context(run_gateway(tmp, _fleet(sims), env=env)) for _ in range(3)]
        assert _wait(lambda: all(g.metric("tidal_gateway_shared_state_gateways") == 3 for g in gws), 10)
        yield gws


def test_a_replicas_in_flight_count_is_seen_by_every_gateway_within_the_bound(
    gateways: list[Gateway],
) -> None:
    delays: list[float] = []
    for play in range(3):
        # Given three gateways sharing Redis, When long streams enter through two of them,
        senders = gateways[:2]
        with ThreadPoolExecutor(4) as pool:
            streams = [
                pool.submit(_stream, senders[i % 2], 300, f"play {play} stream {i}: a long story")
                for i in range(4)
            ]

            def own(senders: list[Gateway] = senders) -> dict[str, int]:
                counts: dict[str, int] = {}
                for g in senders:
                    for name, r in _replicas(g).items():
                        counts[name] = counts.get(name, 0) + r["inflight"]
                return counts

            # (the moment the entering gateways hold all four)
            assert _wait(lambda: sum(own().values()) == 4, 30) is not None
            expected = own()

            # Then every gateway, the third one too, counts all four on the replicas that run them,
            for g in gateways:
                seen = _wait(
                    lambda g=g, expected=expected: (
                        {n: r["inflight_all"] for n, r in _replicas(g).items()} == expected
                    ),
                    5,
                )
                assert seen is not None, f"{g.url} never saw {expected}: {_replicas(g)}"
                delays.append(seen)
            # and when the streams end, none, within the bound again.
            assert all(s.result() == 200 for s in streams)
        assert _wait(lambda: sum(own().values()) == 0, 10) is not None
        for g in gateways:
            gone = _wait(lambda g=g: all(r["inflight_all"] == 0 for r in _replicas(g).values()), 5)
            assert gone is not None
            delays.append(gone)
    staleness = [g.metric("tidal_gateway_shared_state_staleness_seconds_sum") for g in gateways]
    count = [g.metric("tidal_gateway_shared_state_staleness_seconds_count") for g in gateways]
    print(
        f"\nin-flight count seen by every gateway after (s): max {max(delays):.3f}, "
        f"all {[round(d, 3) for d in sorted(delays)]}; mean staleness per sync "
        f"{[round(s / c, 3) for s, c in zip(staleness, count, strict=True)]}"
    )
    assert max(delays) <= BOUND_S


def test_the_cap_of_a_replica_holds_across_gateways_together(
    sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Given three gateways in front of one replica whose cap is 4 (pinned),
    require_tcp("Redis", "127.0.0.1", 6379)
    env = _env(SHARED_REDIS, f"tidal-test-{secrets.token_hex(4)}")
    fleet = _fleet(sims[:1], cap=4, min_cap=4)
    tmp = tmp_path_factory.mktemp("gw-cap")
    with contextlib.ExitStack() as stack:
        gws = [stack.enter_context(run_gateway(tmp, fleet, env=env)) for _ in range(3)]
        assert _wait(lambda: all(g.metric("tidal_gateway_shared_state_gateways") == 3 for g in gws), 10)
        running: list[float] = []
        done = threading.Event()

        def sample() -> None:
            time.sleep(2.5)  # past the clients' staggered start
            while not done.is_set():
                text = httpx.get(sims[0].url + "/metrics", timeout=5).text
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        running.append(float(line.rsplit(" ", 1)[1]))
                time.sleep(0.05)

        # When three clients per gateway, starting a quarter of a second apart (a burst at every
        # gateway within one staleness bound would overshoot: see router.shared), keep sending
        # 150-token streams (about 1.5 s each) for 9 s,
        def client(i: int) -> list[int]:
            codes = []
            t_end = time.monotonic() + 9
            time.sleep(0.25 * i)
            while time.monotonic() < t_end:
                codes.append(_stream(gws[i % 3], 150, f"client {i} at {time.monotonic()}"))
            return codes

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(9) as pool:
            codes = [c for f in [pool.submit(client, i) for i in range(9)] for c in f.result()]
        done.set()
        sampler.join(10)
    # Then every request is served, and the replica runs about 4 at a time, not 3 gateways x 4:
    # a slot freed at one gateway may be taken at two within one staleness bound, so the cap is
    # exceeded now and then, by about (slots freed per second) x (staleness) on average.
    mean = sum(running) / len(running)
    print(
        f"\ncap 4 through 3 gateways: running mean {mean:.2f}, max {max(running):.0f}, {len(codes)} requests"
    )
    assert set(codes) == {200}
    assert mean <= 5.0


@contextlib.contextmanager
def _redis_server(port: int, data_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    exe = shutil.which("redis-server")
    if exe is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if in_ci():
            pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)", pytrace=False)
        pytest.skip(message)
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait(lambda: _tcp_open(port), 10), "redis-server did not start"
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def _tcp_open(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def test_redis_stopped_and_restarted_under_traffic(
    sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("redis-fault")
    port = free_port()
    env = _env(f"redis://127.0.0.1:{port}/0", "tidal-fault")
    codes: list[int] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(_redis_server(port, tmp))
        gws = [stack.enter_context(run_gateway(tmp, _fleet(sims), env=env)) for _ in range(2)]
        assert _wait(lambda: all(g.metric("tidal_gateway_shared_state_gateways") == 2 for g in gws), 10)

        def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                codes.append(_stream(gws[i % 2], 20, f"client {i} request {n}"))
                n += 1

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client, i) for i in range(4)]
            # Given traffic through two gateways sharing a Redis, When Redis stops,
            time.sleep(1.0)
            redis.terminate()
            redis.wait(10)
            t_stop = time.monotonic()
            # Then both say so (up 0) while they keep serving,
            down = _wait(lambda: all(g.metric("tidal_gateway_shared_state_up") == 0 for g in gws), 10, 0.1)
            assert down is not None
            served_before = len(codes)
            time.sleep(2.5)  # past the ttl: each routes on its own counts
            assert len(codes) > served_before
            # and when Redis is back (empty, as after a restart), both rejoin and see each other.
            outage = time.monotonic() - t_stop
            redis = stack.enter_context(_redis_server(port, tmp))
            rejoined = _wait(
                lambda: all(
                    g.metric("tidal_gateway_shared_state_up") == 1
                    and g.metric("tidal_gateway_shared_state_gateways") == 2
                    for g in gws
                ),
                10,
                0.02,
            )
            time.sleep(1.0)
            stop.set()
            for f in futures:
                f.result()
    print(
        f"\nRedis down {outage:.1f} s under traffic: {len(codes)} requests, statuses {sorted(set(codes))}; "
        f"gateways saw it down after {down:.2f} s, recovered {rejoined if rejoined is None else round(rejoined, 3)} s "
        "after Redis was back"
    )
    assert rejoined is not None and rejoined < 5.0
    assert set(codes) == {200}


def _workers_gateway(tmp: Path, fleet: dict[str, Any], env: dict[str, str], workers: int) -> ReplicaProcess:
    path = tmp / f"fleet-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(fleet))
    port = free_port()
    argv = [sys.executable, "-m", "tidal", "gateway", "--config", str(path), "--port", str(port)]
    return ReplicaProcess(
        "gateway",
        [*argv, "--workers", str(workers)],
        port=port,
        env={"TIDAL_ADMIN_KEY": ADMIN_KEY, "TIDAL_DEV_API_KEY": DEV_KEY, **env},
        log_path=tmp / f"gateway-{port}.log",
        health_path="/healthz",
    )


def test_workers_share_load_through_redis_and_are_refused_without_it(
    sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory
) -> None:
    require_tcp("Redis", "127.0.0.1", 6379)
    tmp = tmp_path_factory.mktemp("gw-workers")
    # Without Redis, --workers 2 is refused with the reason.
    refused = _workers_gateway(tmp, _fleet(sims), {"TIDAL_REDIS_URL": ""}, 2)
    out = subprocess.run(refused.argv, env=refused.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "TIDAL_REDIS_URL" in out.stderr
    # With it, two processes serve one port and count each other's requests.
    fleet = _fleet(sims)
    # Counts are checked for a while here, not their expiry: a worker the machine leaves
    # unscheduled for a couple of seconds must not look gone.
    fleet["gateway"]["shared_state_ttl_s"] = 10.0
    fleet["gateway"]["head_timeout_s"] = 2.0
    proc = _workers_gateway(tmp, fleet, _env(SHARED_REDIS, f"tidal-test-{secrets.token_hex(4)}"), 2)
    proc.start()
    try:
        proc.wait_ready(60)
        gw = Gateway(proc, proc.url)
        # (one scrape answers for both workers, each reporting the two it shares state with)
        assert _wait(lambda: gw.metric("tidal_gateway_shared_state_gateways") == 2 * 2, 15, 0.1)
        stop = threading.Event()
        with ThreadPoolExecutor(8) as pool:
            # Streams far longer than the checks (about 28 s, longer on a loaded machine); the
            # client closes them at the end.
            streams = [pool.submit(_stream, gw, 2800, f"worker stream {i}", stop) for i in range(8)]
            try:
                # Each /admin call (a new connection) lands on either worker; both count all eight
                # within the bound of the first answer that does (while the streams start, the
                # worker that took the last of them sees all eight an interval before the other).
                assert _wait(lambda: sum(r["inflight_all"] for r in _replicas(gw).values()) == 8, 10)
                time.sleep(BOUND_S)
                for _ in range(6):
                    seen = sum(r["inflight_all"] for r in _replicas(gw).values())
                    assert seen == 8, (seen, [f.result() for f in streams if f.done()])
                # And either worker's load signal answers for both (the scheduler polls one).
                for _ in range(6):
                    load = gw.admin("GET", "/admin/load").json()
                    assert load["scope"] == "fleet" and load["pools"]["interactive"]["inflight"] == 8, load
            finally:
                stop.set()
            assert all(s.result() == 200 for s in streams)
        # /metrics answers for both workers, whichever accepts the scrape: every series labelled
        # with its worker, so the eight streams add up whichever worker served which.
        for _ in range(6):
            text = httpx.get(gw.url + "/metrics", timeout=10).text
            samples = list(parse_samples(text))
            up = {s.labels["worker"]: s.value for s in samples if s.name == "tidal_gateway_worker_scrape_up"}
            assert up == {"0": 1.0, "1": 1.0}, up
            admitted = [
                s
                for s in samples
                if s.name == "tidal_admission_outcomes_total" and s.labels["outcome"] == "admitted"
            ]
            assert sum(s.value for s in admitted) == 8 and {s.labels["worker"] for s in admitted} <= {
                "0",
                "1",
            }

        # So does a replica group's request count (what a canary rollout reads the growth of):
        # the same from either worker once a sync has carried the last of the eight.
        def stable_requests() -> int:
            load = gw.admin("GET", "/admin/load").json()
            return int(load["groups"]["stable"]["requests"])

        assert _wait(lambda: [stable_requests() for _ in range(6)] == [8] * 6, 5) is not None
        local = list(parse_samples(httpx.get(gw.url + "/metrics?scope=process", timeout=10).text))
        assert not any("worker" in s.labels for s in local)  # (one worker's own, as a worker asks)
        # An admin change reaches both workers, whichever one answered it.
        assert gw.admin("PATCH", "/admin/replicas/replica-0", json={"weight": 3}).status_code == 200
        assert _wait(lambda: all(_replicas(gw)["replica-0"]["weight"] == 3 for _ in range(6)), 5) is not None
        # Every worker bounds a request's head: a head left unfinished is answered 408.
        slow = [socket.create_connection(("127.0.0.1", proc.port), timeout=10) for _ in range(6)]
        for s in slow:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n")
        for s in slow:
            with s:
                assert s.recv(64).startswith(b"HTTP/1.1 408 ")
    finally:
        t0 = time.monotonic()
        proc.stop(timeout=45)  # the supervisor waits up to 30 s for its workers' graceful stop
        print(f"\n--workers 2 stopped in {time.monotonic() - t0:.2f} s")
    # A graceful stop: the supervisor exits 0 once its workers have (a SIGKILL would be -9).
    assert proc.proc is not None and proc.proc.returncode == 0


def test_admin_changes_reach_every_gateway_and_a_late_one(
    sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory
) -> None:
    require_tcp("Redis", "127.0.0.1", 6379)
    tmp = tmp_path_factory.mktemp("gw-admin")
    env = _env(SHARED_REDIS, f"tidal-test-{secrets.token_hex(4)}")
    fleet = _fleet(sims[:1])
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(run_gateway(tmp, fleet, env=env)) for _ in range(2))
        # A replica registered at one gateway is routed to by the other,
        r = a.admin(
            "POST", "/admin/replicas", json={"name": "late", "url": sims[1].url, "pool": "interactive"}
        )
        assert r.status_code == 201, r.text
        assert _wait(lambda: "late" in _replicas(b), 5) is not None
        # marked unhealthy at the other, it is out at the first,
        assert b.admin("PATCH", "/admin/replicas/late", json={"healthy": False}).status_code == 200
        assert _wait(lambda: _replicas(a)["late"]["healthy"] is False, 5) is not None
        assert (
            b.admin("PATCH", "/admin/replicas/late", json={"healthy": True, "weight": 2}).status_code == 200
        )
        assert _wait(lambda: _replicas(a)["late"]["weight"] == 2, 5) is not None
        # and a gateway started afterwards has it, in the state it has now.
        c = stack.enter_context(run_gateway(tmp, fleet, env=env))
        assert _wait(lambda: _replicas(c).get("late", {}).get("weight") == 2, 5) is not None
        # Removed at one, it is gone from all.
        assert b.admin("DELETE", "/admin/replicas/late").status_code == 200
        assert _wait(lambda: all("late" not in _replicas(g) for g in (a, c)), 10) is not None
        # An unknown name is a 404 and tells nobody.
        assert a.admin("PATCH", "/admin/replicas/nobody", json={"healthy": False}).status_code == 404
