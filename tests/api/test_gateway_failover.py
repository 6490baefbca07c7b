"""A replica that fails under the gateway: marked unhealthy mid-stream, killed before the first token.

Uses a vLLM replica of its own (it gets killed) beside one of the shared pair.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.api.harness import DEV_KEY, Gateway, fleet_dict, play_until, run_gateway, session_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def doomed(vllm_factory) -> object:  # type: ignore[no-untyped-def]
    return vllm_factory.start(1)[0]


@pytest.fixture(scope="module")
def gateway(doomed, vllm_pair: list, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:  # type: ignore[no-untyped-def, type-arg]
    fleet = fleet_dict([doomed.url, vllm_pair[0].url])
    with run_gateway(tmp_path_factory.mktemp("gw-failover"), fleet) as gw:
        yield gw


def _stream(gw: Gateway, session: str, max_tokens: int) -> Iterator[str]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    with gw.sse(body, headers={"X-Session-Id": session}, timeout=120) as resp:
        assert resp.status_code == 200
        yield from (line for line in resp.iter_lines() if line.startswith("data: "))


def test_failures_before_and_after_the_first_token(gateway: Gateway, doomed) -> None:  # type: ignore[no-untyped-def]
    session = session_for("replica-0", ["replica-0", "replica-1"])

    def stream_marked_unhealthy() -> list[str]:
        """The events of a long stream (2900 tokens, about 6 s) on replica-0, which the health
        prober marks unhealthy after the stream's sixth event."""
        events: list[str] = []
        for i, event in enumerate(_stream(gateway, session, 2900)):
            events.append(event)
            if i == 5:
                r = gateway.admin("PATCH", "/admin/replicas/replica-0", json={"healthy": False})
                assert r.status_code == 200 and r.json()["healthy"] is False
        gateway.admin("PATCH", "/admin/replicas/replica-0", json={"healthy": True})
        return events

    def cut(events: list[str]) -> bool:
        return len(events) >= 2 and '"error"' in events[-2]

    # Given a stream on replica-0 that has delivered tokens,
    # When the health prober marks replica-0 unhealthy,
    # Then the stream ends at once with a retryable error event and [DONE] (played until a
    # stream is cut: without the cut every play runs to the end).
    plays = play_until(stream_marked_unhealthy, cut)
    events = plays[-1]
    assert cut(events) and len(events) < 2900, [len(p) for p in plays]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "upstream_failed" and error["retryable"] is True

    # Given replica-0 frozen with a request waiting on it (no token yet),
    client = openai.OpenAI(
        base_url=gateway.url + "/v1",
        api_key=DEV_KEY,
        max_retries=0,
        default_headers={"X-Session-Id": session},
    )
    retries_before = gateway.metric("tidal_gateway_retries_total")
    doomed.send_signal(signal.SIGSTOP)
    answers: list[object] = []
    worker = threading.Thread(
        target=lambda: answers.append(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
        )
    )
    worker.start()
    time.sleep(1.5)
    assert not answers
    # When replica-0 is killed, Then the request is retried on replica-1 and answered.
    doomed.send_signal(signal.SIGKILL)
    worker.join(60)
    assert len(answers) == 1
    assert gateway.metric("tidal_gateway_retries_total") - retries_before == 1

    # And later streams of that session still succeed (connection refused -> the other replica).
    events = list(_stream(gateway, session, 8))
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert gateway.metric("tidal_gateway_retries_total") - retries_before == 2
