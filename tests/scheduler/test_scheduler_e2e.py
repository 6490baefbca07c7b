"""The batch gate end to end: `tidal scheduler` as a process over `tidal gateway`, a real vLLM CPU
replica in a shared interactive pool, a `shared` lane worker on real RabbitMQ and PostgreSQL.

An OpenAI batch runs on the shared replica; an interactive burst through the gateway crosses the
gate's queue-wait threshold (lowered in the test's fleet); the gate closes, the worker stops
consuming the shared queue, batch sequences leave the replica while the burst is served; after
calm plus the hold time the gate reopens and the batch completes with every line once.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import ADMIN_KEY, DEV_KEY, run_gateway
from tests.batch_tier import (
    BatchTier,
    chat_lines,
    postgres_database,
    read_jsonl,
    require_postgres,
    require_rabbitmq,
    running_tier,
    wait_for,
)
from tidal.priority.queues import Topology
from tidal.replicas.launcher import ReplicaProcess, free_port
from tidal.replicas.wire.prom import parse_samples

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.vllm]

CAP = 2  # interactive requests the gateway keeps in flight on the replica
LINES = 600
# Long enough lines that the batch runs for about half a minute: the scene must play out before
# it ends, on a machine whose processes are now and then not scheduled for seconds.
LINE_TOKENS = 64


def _fleet(url: str) -> dict[str, Any]:
    return {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "shared": True,
                "model": "tiny",
                "max_inflight_per_replica": CAP,
                "min_inflight_per_replica": 1,
                "batch_concurrency_per_replica": 16,
                "replicas": [{"name": "i0", "url": url}],
            }
        },
        # Users wait in the gateway's queue (no 429) while the batch makes room.
        "classes": {
            "interactive": {"priority": 0, "wait_budget_s": 30.0},
            "batch": {"priority": 100, "wait_budget_s": 3600.0, "tpot_slo_s": 1.0, "ttft_slo_s": 3600.0},
        },
        "features": {
            "default": {"class": "interactive", "context_cap": 4096},
            "batch": {"class": "batch", "context_cap": 4096},
        },
        # A small interactive burst crosses these; calm for 3 s reopens the gate.
        "gate": {"queue_wait_p95_pause_s": 0.2, "queue_wait_p95_resume_s": 0.05, "hold_s": 3},
        "gateway": {"scrape_interval_s": 0.5},
    }


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for s in parse_samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture
def tier(tmp_path: Path, vllm_urls: list[str]) -> Iterator[BatchTier]:
    require_rabbitmq()
    require_postgres()
    with postgres_database() as url, running_tier(tmp_path, url, _fleet(vllm_urls[0])) as t:
        yield t


@contextlib.contextmanager
def _scheduler(tier: BatchTier, gateway_url: str) -> Iterator[ReplicaProcess]:
    port = free_port()
    proc = ReplicaProcess(
        "scheduler",
        [
            sys.executable, "-m", "tidal", "scheduler",
            "--config", str(tier.fleet_path),
            "--gateway", gateway_url,
            "--metrics-port", str(port),
        ],
        port=port,
        env={**tier.env(), "TIDAL_ADMIN_KEY": ADMIN_KEY},
        log_path=tier.root / "scheduler.log",
        health_path="/metrics",
    )  # fmt: skip
    proc.start()
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


def _chat(client: openai.OpenAI, i: int) -> str:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"question {i}"}],
        max_tokens=48,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].message.content or ""


def test_the_gate_pauses_batch_for_an_interactive_burst_and_the_batch_completes_once(
    tier: BatchTier, vllm_urls: list[str]
) -> None:
    from tidal.workers.app import control_app

    replica = vllm_urls[0]
    worker = tier.start_worker("shared", concurrency=2)
    shared_queue = Topology(tier.namespace).queue("shared")
    control = control_app(tier.settings())
    with (
        contextlib.closing(control),
        run_gateway(tier.root, tier.fleet, env=tier.env()) as gw,
        _scheduler(tier, gw.url) as sched,
    ):
        log = tier.root / "scheduler.log"
        # Given the gate opened after the pool stayed calm for the hold time
        wait_for(
            lambda: _metric(sched.url, "tidal_gate_paused", pool="interactive") == 0, 30, "the gate to open"
        )
        assert "gate interactive -> open (calm)" in log.read_text()
        # And a batch running on the shared replica
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
        f = client.files.create(file=("in.jsonl", chat_lines(LINES, max_tokens=LINE_TOKENS)), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        def done() -> int:
            c = client.batches.retrieve(batch.id).request_counts
            return (c.completed + c.failed) if c is not None else 0

        wait_for(lambda: done() >= 20, 60, "the batch to run")
        # (vLLM's gauges are a snapshot: between two chunks the replica may briefly run nothing)
        wait_for(
            lambda: _metric(replica, "vllm:num_requests_running") > CAP, 10, "batch sequences on the replica"
        )

        # When an interactive burst queues in the gateway
        with ThreadPoolExecutor(16) as pool:
            t0 = time.monotonic()
            answers = [pool.submit(_chat, client, i) for i in range(16)]
            # Then the gate closes on the queue wait, logged and counted
            wait_for(
                lambda: _metric(sched.url, "tidal_gate_paused", pool="interactive") == 1,
                10,
                "the gate to close",
            )
            closed_after = time.monotonic() - t0
            assert _metric(sched.url, "tidal_gate_transitions_total", pool="interactive", to="paused") >= 1
            assert "gate interactive -> paused (queue_wait" in log.read_text()

            # And the worker stops consuming the shared queue (confirmed by the worker itself)
            def consumes() -> bool:
                reply = control.control.inspect(timeout=1.0).active_queues() or {}
                return any(q["name"] == shared_queue for qs in reply.values() for q in qs or [])

            wait_for(lambda: not consumes(), 5, "the worker to stop consuming the shared queue")
            # And within seconds only interactive sequences run on the replica
            wait_for(
                lambda: _metric(replica, "vllm:num_requests_running") <= CAP, 5, "batch sequences to leave"
            )
            # And every interactive request succeeds
            assert all(len(a.result(timeout=60)) > 0 for a in answers)
        # And while the gate holds, no batch work runs and no line finishes
        assert _metric(sched.url, "tidal_gate_paused", pool="interactive") == 1
        wait_for(lambda: _metric(replica, "vllm:num_requests_running") == 0, 5, "the replica to drain")
        frozen = done()
        time.sleep(1.0)
        assert _metric(sched.url, "tidal_gate_paused", pool="interactive") == 1  # hold >= 3 s after calm
        assert done() == frozen < LINES
        # When the pool stays calm for the hold time, the gate reopens and the batch completes
        wait_for(
            lambda: _metric(sched.url, "tidal_gate_paused", pool="interactive") == 0, 30, "the gate to reopen"
        )
        assert _metric(sched.url, "tidal_gate_transitions_total", pool="interactive", to="open") >= 2
        wait_for(consumes, 10, "the worker to consume again")
        final = wait_for(
            lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
            90,
            "the batch to finish",
        )
        # Then every line was answered exactly once: nothing lost
        assert final.status == "completed"
        out = read_jsonl(client.files.content(final.output_file_id).text) if final.output_file_id else []
        err = read_jsonl(client.files.content(final.error_file_id).text) if final.error_file_id else []
        assert not err, err[:3]
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(LINES))
        assert final.request_counts.completed == LINES
        print(f"gate closed {closed_after:.2f} s after the burst started")
    assert worker.proc.poll() is None
    # And the scheduler stopped cleanly on SIGTERM
    assert "scheduler stopped" in log.read_text(), log.read_text()[-2000:]
