"""Tenants through ``tidal gateway`` with the ``openai`` SDK: quotas with OpenAI's rate-limit
headers, held across gateways through Redis, and a fair share of a saturated pool.

The replica is a simulated one paced like a GPU (``--time-scale 0.1``, about 10 ms a token).
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import ACME_KEY, Gateway, fleet_dict, run_gateway, running
from tests.services import require_tcp
from tidal.fleet import hash_api_key
from tidal.replicas.launcher import ReplicaProcess, sim_process

METERED_KEY = "tidal-test-metered-key-0123456789"
HEAVY_KEY = "tidal-test-heavy-key-0123456789"
LIGHT_KEY = "tidal-test-light-key-0123456789"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    with running(
        sim_process(
            "fast-test",
            args=["--served-model-name", "tiny", "--time-scale", "0.1"],
            log_path=tmp_path_factory.mktemp("sim") / "sim.log",
            name="sim",
        )
    ) as proc:
        yield proc


def _fleet(sim: ReplicaProcess, **kw: Any) -> dict[str, Any]:
    fleet = fleet_dict([sim.url], **kw)
    fleet["tenants"] += [
        {
            "name": "metered",
            "key_hashes": [hash_api_key(METERED_KEY)],
            "features": ["chat"],
            "quota": {"requests_per_minute": 5},
        },
        {"name": "heavy", "key_hashes": [hash_api_key(HEAVY_KEY)], "features": ["chat"]},
        {"name": "light", "key_hashes": [hash_api_key(LIGHT_KEY)], "features": ["chat"]},
    ]
    return fleet


def _client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, text: str = "hi", max_tokens: int = 4) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=max_tokens
    )


def test_a_quota_counts_down_in_the_headers_and_refuses_with_the_limit_named(
    sim: ReplicaProcess, tmp_path: Path
) -> None:
    with run_gateway(tmp_path, _fleet(sim)) as gw:
        client = _client(gw, METERED_KEY)
        remaining = []
        for i in range(4):
            raw = _ask(client, f"question {i}")
            assert raw.parse().choices[0].message.content is not None
            assert raw.headers["x-ratelimit-limit-requests"] == "5"
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        assert remaining == ["4", "3", "2", "1"]
        # A stream carries them too.
        with httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True},
            headers={"Authorization": f"Bearer {METERED_KEY}"},
            timeout=30,
        ) as resp:
            assert resp.status_code == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"
            resp.read()
        with pytest.raises(openai.RateLimitError) as refused:
            _ask(client, "one too many")
        err = refused.value
        assert err.code == "rate_limit_exceeded" and err.type == "requests"
        assert "requests per minute" in err.message and "metered" in err.message
        assert 1 <= int(err.response.headers["retry-after"]) <= 61
        assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
        # A tenant without a quota is never counted, and gets no rate-limit headers.
        free = _ask(_client(gw, ACME_KEY))
        assert "x-ratelimit-limit-requests" not in free.headers
        assert gw.metric("tidal_tenant_requests_total", tenant="metered", outcome="quota_requests") == 1
        assert gw.metric("tidal_tenant_requests_total", tenant="metered", outcome="admitted") == 5


def test_a_quota_holds_across_gateways_sharing_redis(sim: ReplicaProcess, tmp_path: Path) -> None:
    require_tcp("Redis", "127.0.0.1", 6379)
    env = {
        "TIDAL_REDIS_URL": "redis://127.0.0.1:6379/0",
        "TIDAL_REDIS_NAMESPACE": f"tidal-test-{secrets.token_hex(4)}",
    }
    with run_gateway(tmp_path, _fleet(sim), env) as a, run_gateway(tmp_path, _fleet(sim), env) as b:
        codes = []
        for i in range(8):
            gw = (a, b)[i % 2]
            try:
                _ask(_client(gw, METERED_KEY), f"turn {i}")
                codes.append(200)
            except openai.RateLimitError:
                codes.append(429)
        assert codes == [200] * 5 + [429] * 3


def _closed_loop(gw: Gateway, key: str, stop: threading.Event, ttfts: list[float]) -> None:
    """Streams of 40 tokens (about 0.4 s), one after the other, until ``stop``."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"a story {secrets.token_hex(4)}"}],
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as resp:
                first = None
                for line in resp.iter_lines():
                    if (
                        first is None
                        and '"content":' in line.replace(" ", "")
                        and '"content":""' not in line.replace(" ", "")
                    ):
                        first = time.monotonic() - t0
                if resp.status_code == 200 and first is not None:
                    ttfts.append(first)


def _saturate(gw: Gateway, seconds: float) -> tuple[list[float], list[float]]:
    """Twelve closed-loop clients of the heavy tenant and one of the light one on a pool of two
    slots; the TTFTs each tenant saw."""
    stop = threading.Event()
    heavy: list[float] = []
    light: list[float] = []
    threads = [threading.Thread(target=_closed_loop, args=(gw, HEAVY_KEY, stop, heavy)) for _ in range(12)]
    threads.append(threading.Thread(target=_closed_loop, args=(gw, LIGHT_KEY, stop, light)))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    return heavy, light


def test_a_light_tenant_gets_its_share_of_a_saturated_pool(sim: ReplicaProcess, tmp_path: Path) -> None:
    seen = {}
    for policy in ("fifo", "fair"):
        fleet = _fleet(sim, cap=2, min_cap=2, wait_budget_s=60.0)
        fleet["gateway"]["admission_policy"] = policy
        with run_gateway(tmp_path, fleet) as gw:
            seen[policy] = _saturate(gw, 10.0)
    (fifo_heavy, fifo_light), (fair_heavy, fair_light) = seen["fifo"], seen["fair"]
    print(
        f"\n2 slots, 12 heavy clients and 1 light one for 10 s: light answered {len(fifo_light)} (fifo) "
        f"vs {len(fair_light)} (fair), TTFT p50 {statistics.median(fifo_light or [0]):.2f} s vs "
        f"{statistics.median(fair_light or [0]):.2f} s; heavy answered {len(fifo_heavy)} vs {len(fair_heavy)}"
    )
    # Fair share: the light tenant asks for one slot of two and gets it each time it asks, so it
    # is answered several times as often as behind the heavy tenant's queue, and waits little.
    assert len(fair_light) >= 3 * max(1, len(fifo_light))
    assert statistics.median(fair_light) < statistics.median(fifo_light or [60.0]) / 3
    # Work-conserving: the pool stays busy either way.
    assert len(fair_heavy) + len(fair_light) >= 0.8 * (len(fifo_heavy) + len(fifo_light))
