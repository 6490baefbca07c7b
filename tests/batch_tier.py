"""Helpers for batch-tier tests: a throwaway PostgreSQL database, an isolated queue namespace on
the shared RabbitMQ, worker processes, and an in-process gateway with the `openai` SDK.

Everything is named uniquely per test session or test (other engineers use the same broker and
database server at the same time) and removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.services import require_module, require_tcp

ROOT = Path(__file__).resolve().parents[1]
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672//"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"

__all__ = [
    "RABBIT_URL",
    "BatchTier",
    "WorkerProc",
    "chat_lines",
    "postgres_database",
    "require_postgres",
    "require_rabbitmq",
    "running_tier",
    "tiny_fleet",
    "wait_for",
]


def require_rabbitmq() -> None:
    require_tcp("RabbitMQ", "127.0.0.1", 5672)


def require_postgres() -> None:
    require_tcp("PostgreSQL", "127.0.0.1", 5432)
    require_module("psycopg", "install the `postgres` extra")


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database, dropped afterwards; yields its SQLAlchemy URL."""
    import psycopg

    name = f"tidal_batch_{secrets.token_hex(6)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll until ``predicate()`` is truthy (real processes: there is no clock to inject)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def tiny_fleet(
    replica_urls: list[str], *, batch_concurrency: int = 32, shared_urls: list[str] | None = None
) -> dict[str, Any]:
    """A fleet on real vLLM CPU replicas (served model ``tiny``): a batch pool, a spot pool and a
    shared interactive pool, all on the given replicas unless ``shared_urls`` says otherwise."""

    def replicas(prefix: str, urls: list[str]) -> list[dict[str, str]]:
        return [{"name": f"{prefix}{i}", "url": u} for i, u in enumerate(urls)]

    pool = {"model": "tiny", "batch_concurrency_per_replica": batch_concurrency}
    return {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "pools": {
            "batch": {"kind": "batch", **pool, "replicas": replicas("b", replica_urls)},
            "spot": {"kind": "spot", **pool, "replicas": replicas("s", replica_urls)},
            "interactive": {
                "kind": "interactive",
                "shared": True,
                **pool,
                "replicas": replicas("i", shared_urls or replica_urls),
            },
        },
        "features": {"batch": {"class": "batch", "context_cap": 4096}},
    }


def chat_lines(n: int, *, max_tokens: int = 2, prefix: str = "r", model: str = "tiny") -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"{prefix}{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"item {i}"}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
            }
        )
        + "\n"
        for i in range(n)
    ).encode()


@dataclass
class WorkerProc:
    """A ``tidal worker`` process (its own session, so signals reach it alone)."""

    lane: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def hostname_prefix(self) -> str:
        return f"{self.lane}@"

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class BatchTier:
    """One isolated batch tier: namespace, store, files, fleet, workers, and a gateway."""

    root: Path
    database_url: str
    fleet: dict[str, Any]
    broker_url: str = RABBIT_URL
    namespace: str = field(default_factory=lambda: f"t{secrets.token_hex(5)}")
    extra_env: dict[str, str] = field(default_factory=dict)
    workers: list[WorkerProc] = field(default_factory=list)

    @property
    def fleet_path(self) -> Path:
        return self.root / "fleet.yaml"

    def env(self) -> dict[str, str]:
        return {
            "TIDAL_ENVIRONMENT": "test",
            "TIDAL_DATA_DIR": str(self.root / "data"),
            "TIDAL_DATABASE_URL": self.database_url,
            "TIDAL_FILES_DIR": str(self.root / "files"),
            "TIDAL_BROKER_URL": self.broker_url,
            "TIDAL_BROKER_DIR": str(self.root / "broker"),
            "TIDAL_QUEUE_NAMESPACE": self.namespace,
            "TIDAL_FLEET_CONFIG": str(self.fleet_path),
            "TIDAL_CHUNK_LINES": "50",
            **self.extra_env,
        }

    def settings(self) -> Any:
        from tidal.settings import Settings

        env = self.env()
        return Settings(
            _env_file=None,  # type: ignore[call-arg]
            environment="test",
            data_dir=Path(env["TIDAL_DATA_DIR"]),
            database_url=self.database_url,
            files_dir=Path(env["TIDAL_FILES_DIR"]),
            broker_url=self.broker_url,
            broker_dir=Path(env["TIDAL_BROKER_DIR"]),
            queue_namespace=self.namespace,
            chunk_lines=int(env["TIDAL_CHUNK_LINES"]),
            soft_shutdown_s=float(env.get("TIDAL_SOFT_SHUTDOWN_S", 20.0)),
            delivery_limit=int(env.get("TIDAL_DELIVERY_LIMIT", 10)),
            batch_tenant_window_chunks=int(
                env.get(
                    "TIDAL_BATCH_TENANT_WINDOW_CHUNKS",
                    Settings.model_fields["batch_tenant_window_chunks"].default,
                )
            ),
        )

    def write_fleet(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.fleet_path.write_text(yaml.safe_dump(self.fleet))

    def start_worker(
        self, lane: str, *, concurrency: int = 4, wait_ready: bool = True, metrics_port: int | None = None
    ) -> WorkerProc:
        n = len(self.workers)
        log_path = self.root / f"worker-{n}-{lane}.log"
        metrics = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tidal",
                "worker",
                "--lane",
                lane,
                "--concurrency",
                str(concurrency),
                *metrics,
            ],
            cwd=ROOT,
            env={**os.environ, **self.env()},
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        w = WorkerProc(lane, proc, log_path)
        self.workers.append(w)
        if wait_ready:
            wait_for(lambda: " ready." in w.log() or proc.poll() is not None, 60, f"worker {lane} to start")
            assert proc.poll() is None, f"worker exited:\n{w.log()[-3000:]}"
        return w

    def start_workers(self, lanes: list[str], *, concurrency: int = 2) -> list[WorkerProc]:
        """Start several workers at once and wait for all (they boot in parallel)."""
        started = [self.start_worker(lane, concurrency=concurrency, wait_ready=False) for lane in lanes]
        for w in started:
            wait_for(
                lambda w=w: " ready." in w.log() or w.proc.poll() is not None, 60, f"worker {w.lane} to start"
            )
            assert w.proc.poll() is None, f"worker exited:\n{w.log()[-3000:]}"
        return started

    def gateway(self, keys: dict[str, tuple[str, bool]] | None = None) -> Any:
        """A TestClient for the gateway (enter it to run the lifespan: the maintenance loop)."""
        from fastapi.testclient import TestClient

        from tidal.api.app import create_app
        from tidal.api.auth import KeyStore, Principal
        from tidal.fleet import parse_fleet

        store = KeyStore()
        for key, (tenant, admin) in (keys or {"key-a": ("tenant-a", False)}).items():
            store.add_key(key, Principal(tenant, frozenset({"*"}), admin=admin))
        app = create_app(parse_fleet(self.fleet), self.settings(), keys=store)
        return TestClient(app)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        if self.broker_url.startswith("amqp"):
            from tidal.priority.queues import Topology, delete_topology

            with contextlib.suppress(Exception):
                delete_topology(self.broker_url, Topology(self.namespace))


@contextlib.contextmanager
def running_tier(root: Path, database_url: str, fleet: dict[str, Any], **kw: Any) -> Iterator[BatchTier]:
    """A :class:`BatchTier` with its fleet written and its queues declared on RabbitMQ; its
    workers stopped and its queues deleted on exit."""
    from tidal.priority.queues import Topology, declare_topology

    t = BatchTier(root=root, database_url=database_url, fleet=fleet, **kw)
    t.write_fleet()
    declare_topology(t.broker_url, Topology(t.namespace))
    try:
        yield t
    finally:
        t.close()


def openai_client(tc: Any, key: str = "key-a") -> Any:
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=tc, max_retries=0)


def read_jsonl(text: str) -> list[dict[str, Any]]:
    # Split on "\n" only: model output may hold U+2028 and friends, which str.splitlines() splits on.
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def skip_unless(cond: bool, reason: str) -> None:
    if not cond:
        pytest.skip(reason)
