"""The scheduler killed while the gate is closed: batch must stay paused until a new scheduler
decides, never resume because nobody is watching.

Real processes: a simulated replica in a shared interactive pool, ``tidal gateway``, ``tidal
worker --lane shared`` and ``tidal scheduler``, on the suite's own RabbitMQ node and PostgreSQL.
The fleet and the scheduler process are the gate's end-to-end test's. A batch runs on the shared
replica; an interactive burst closes the gate; the scheduler is
SIGKILLed while it is closed. With no scheduler, the lane's persisted pause holds: no batch line
is answered. A new scheduler starts paused, opens the gate after the pool stays calm for the hold
time, and the batch completes with every line once.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.harness import DEV_KEY, run_gateway
from tests.batch_tier import chat_lines, running_tier, wait_for
from tests.chaos.services import PrivatePostgres, PrivateRabbit
from tests.chaos.test_batch import LINES, _database, _done, _final, _row
from tests.scheduler.test_scheduler_e2e import _fleet, _scheduler
from tidal.replicas.launcher import ReplicaProcess
from tidal.replicas.wire.prom import parse_samples

pytestmark = pytest.mark.slow

HOLD_S = float(_fleet("")["gate"]["hold_s"])
UNWATCHED_S = 6.0  # how long the pool runs with no scheduler at all


def _paused(url: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return sum(
        s.value
        for s in parse_samples(text)
        if s.name == "tidal_gate_paused" and s.labels.get("pool") == "interactive"
    )


def _burst(client: openai.OpenAI, n: int) -> None:
    with ThreadPoolExecutor(n) as pool:
        for f in [
            pool.submit(
                client.chat.completions.create,
                model="tiny",
                messages=[{"role": "user", "content": f"burst {i}"}],
                max_tokens=48,
                extra_body={"ignore_eos": True},
            )
            for i in range(n)
        ]:
            f.result()


def test_scheduler_killed_while_the_gate_is_closed(
    tmp_path: Path, services: tuple[PrivateRabbit, PrivatePostgres], sims: list[ReplicaProcess]
) -> None:
    rabbit, pg = services
    with (
        _database(pg) as url,
        running_tier(tmp_path, url, _fleet(sims[0].url), broker_url=rabbit.url) as tier,
    ):
        tier.start_worker("shared", concurrency=2)
        with run_gateway(tier.root, tier.fleet, env=tier.env()) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0, timeout=60)
            with _scheduler(tier, gw.url) as first:
                wait_for(lambda: _paused(first.url) == 0, 60, "the gate to open")
                f = client.files.create(file=("in.jsonl", chat_lines(LINES, max_tokens=16)), purpose="batch")
                batch = client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                wait_for(lambda: _done(client, batch.id) >= 50, 120, "the batch to run")
                # An interactive burst closes the gate
                with ThreadPoolExecutor(1) as bg:
                    burst = bg.submit(_burst, client, 16)
                    wait_for(lambda: _paused(first.url) == 1, 30, "the gate to close")
                    # And the scheduler dies while it is closed
                    first.send_signal(signal.SIGKILL)
                    assert first.proc is not None
                    first.proc.wait(10)
                    killed_at = time.monotonic()
                    burst.result()
            # With nobody watching, the persisted pause holds: no batch line is answered.
            time.sleep(1.0)  # lines aborted at the pause settle
            before = _done(client, batch.id)
            time.sleep(UNWATCHED_S)
            unwatched = _done(client, batch.id) - before
            assert unwatched == 0, f"{unwatched} batch lines answered with no scheduler after the gate closed"
            # A new scheduler starts paused, opens after the calm hold, and batch resumes.
            started = time.monotonic()
            with _scheduler(tier, gw.url) as second:
                wait_for(lambda: _done(client, batch.id) > before, 60, "batch to resume")
                resumed_after = time.monotonic() - started
                assert resumed_after >= HOLD_S * 0.9, resumed_after  # only after it decided
                assert _paused(second.url) == 0
                final, hung = _final(client, batch.id)
            _row(
                tier,
                client,
                final,
                hung,
                "scheduler SIGKILL while the gate is closed",
                time.monotonic() - killed_at if hung else resumed_after,
                note=(
                    f"0 lines answered in {UNWATCHED_S:g} s with no scheduler; the new one resumed "
                    f"batch {resumed_after:.1f} s after its start (hold {HOLD_S:g} s)"
                ),
                part="scheduler",
            )
