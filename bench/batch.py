"""Batch throughput: tokens per second through Tidal's batch tier against the same requests sent
straight to the replicas at full concurrency, and the chunk dispatch rate through RabbitMQ.

Setup: two simulated 70B replicas (``tidal sim --preset llama-3.1-70b-fp8-h200-tp4`` with a large
``--max-num-seqs``). The workload is a list of (prompt tokens, output tokens) drawn from a real
trace's length distribution (``--trace FILE``; by default ``../shared/traces`` or
``TIDAL_TRACES_DIR``, Azure conversation trace) or, without one, a built-in synthetic log-normal
workload; the table says which.

* ``direct`` -- every request sent to the replicas with an asyncio client, ``max_num_seqs`` in
  flight per replica (the best any client can do);
* ``through_tidal`` -- the same requests as one batch: the store, chunks on the RabbitMQ lane
  queue, a ``tidal worker`` process sending each chunk's lines concurrently with vLLM priority;
  from ``create_batch`` to the batch's final status;
* ``dispatch`` -- chunks whose lines are already answered, so a worker only takes each from
  RabbitMQ, claims it in the store and acknowledges it: the per-chunk overhead of the tier.

Options: ``--requests N``, ``--preset P``, ``--max-num-seqs N`` (256), ``--time-scale X`` (1; the
simulator runs X times faster than real time; throughput is reported in model seconds),
``--chunk-lines N``, ``--dispatch-chunks N``, ``--trace FILE``, ``--replicas URL,URL`` (use
running replicas instead of starting simulators), ``--model NAME``, ``--seed N``.

Example::

    tidal bench batch --quick
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tidal.batch_jobs import queries
from tidal.batch_jobs.dispatch import CeleryChunkPublisher, producer_app, publish_pending
from tidal.batch_jobs.files import file_store_from_settings
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.models import BatchCreate, BatchRecord
from tidal.batch_jobs.results import LineResult, record_results
from tidal.batch_jobs.service import BatchService
from tidal.batch_jobs.store import Store
from tidal.bench.traces import find_trace, load_trace
from tidal.fleet import parse_fleet
from tidal.priority.queues import Topology, declare_topology, delete_topology, is_amqp
from tidal.replicas.client import ReplicaClient
from tidal.replicas.launcher import ReplicaProcess, sim_process
from tidal.settings import DEFAULT_BROKER_URL, Settings

__all__ = ["Workload", "load_workload", "run"]

ROOT = Path(__file__).resolve().parents[1]
PRESET = "llama-3.1-70b-fp8-h200-tp4"


@dataclass
class Workload:
    requests: list[tuple[int, int]]  # (prompt tokens, output tokens)
    source: str


def load_workload(
    n: int, *, trace: str | None, seed: int, max_prompt: int = 3000, max_output: int = 512
) -> Workload:
    """``n`` requests sampled from a trace's lengths (capped to fit the context), or synthetic."""
    rng = random.Random(seed)
    path = Path(trace) if trace else find_trace("AzureLLMInferenceTrace_conv.csv")
    if path is not None and path.exists():
        lengths = [(r.input_length, r.output_length) for r in load_trace(path, seed=seed)]
        picked = [lengths[rng.randrange(len(lengths))] for _ in range(n)]
        reqs = [(max(8, min(p, max_prompt)), max(1, min(o, max_output))) for p, o in picked]
        return Workload(
            reqs, f"lengths sampled from {path.name} (prompt <= {max_prompt}, output <= {max_output})"
        )
    reqs = [
        (
            max(8, min(int(rng.lognormvariate(math.log(600), 0.8)), max_prompt)),
            max(1, min(int(rng.lognormvariate(math.log(120), 0.7)), max_output)),
        )
        for _ in range(n)
    ]
    return Workload(
        reqs, "synthetic log-normal (prompt median 600, output median 120 tokens); no trace found"
    )


def _body(i: int, prompt_tokens: int, output_tokens: int, model: str, run: str) -> dict[str, Any]:
    # " the" is one token for the simulator's tokenizer. The run and request ids in front keep
    # prompts distinct, so neither run finds the other's prompts in the prefix cache.
    text = f"{run} request {i}:" + " the" * max(1, prompt_tokens - 5)
    return {"model": model, "prompt": text, "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0}


# -- direct -------------------------------------------------------------------------------------


async def _roots(urls: list[str]) -> list[str]:
    out = []
    for u in urls:
        async with ReplicaClient(u) as c:
            models = await c.models()
        out += [str(m.get("root") or m.get("id")) for m in models[:1]]
    return out


async def _direct(urls: list[str], bodies: list[dict[str, Any]], per_replica: int) -> tuple[float, int, int]:
    clients = [ReplicaClient(u, pool_size=per_replica) for u in urls]
    sems = [asyncio.Semaphore(per_replica) for _ in urls]
    out_tokens = 0
    failures = 0

    async def one(i: int, body: dict[str, Any]) -> None:
        nonlocal out_tokens, failures
        k = i % len(clients)
        async with sems[k]:
            try:
                reply = await clients[k].completions(body)
                out_tokens += int(reply.get("usage", {}).get("completion_tokens", 0))
            except Exception:
                failures += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.aclose()
    return wall, out_tokens, failures


# -- through Tidal ------------------------------------------------------------------------------


@dataclass
class _Tier:
    settings: Settings
    service: BatchService
    worker: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def _tier(
    urls: list[str], model: str, per_replica: int, chunk_lines: int, concurrency: int, tmp: Path
) -> Iterator[_Tier]:
    broker = os.environ.get("TIDAL_BROKER_URL", DEFAULT_BROKER_URL)
    namespace = f"bench{secrets.token_hex(4)}"
    fleet = {
        "models": [{"name": model, "max_model_len": 131072}],
        "pools": {
            "batch": {
                "kind": "batch",
                "model": model,
                "batch_concurrency_per_replica": per_replica,
                "replicas": [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)],
            }
        },
    }
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    env = {
        "TIDAL_ENVIRONMENT": "test",
        "TIDAL_DATA_DIR": str(tmp / "data"),
        "TIDAL_BROKER_URL": broker,
        "TIDAL_QUEUE_NAMESPACE": namespace,
        "TIDAL_FLEET_CONFIG": str(tmp / "fleet.yaml"),
        "TIDAL_CHUNK_LINES": str(chunk_lines),
        "TIDAL_MAX_BATCH_LINES": "100000",
    }
    settings = Settings(
        _env_file=None,
        environment="test",
        data_dir=tmp / "data",
        broker_url=broker,
        queue_namespace=namespace,
        chunk_lines=chunk_lines,
        max_batch_lines=100_000,
    )
    if is_amqp(broker):
        declare_topology(broker, Topology(namespace))
    publisher = CeleryChunkPublisher.from_settings(settings)
    service = BatchService(
        store=Store.from_url(settings.resolved_database_url),
        files=file_store_from_settings(settings),
        fleet=parse_fleet(fleet),
        settings=settings,
        publisher=publisher,
    )
    log = tmp / "worker.log"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tidal",
            "--log-level",
            "WARNING",
            "worker",
            "--lane",
            "reserved",
            "--concurrency",
            str(concurrency),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    control = producer_app(settings)
    try:
        _wait(lambda: worker.poll() is not None or bool(control.control.ping(timeout=0.5)), 60)
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{log.read_text()[-2000:]}")
        yield _Tier(settings, service, worker, log)
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        publisher.close()
        control.close()
        service.store.dispose()
        if is_amqp(broker):
            with contextlib.suppress(Exception):
                delete_topology(broker, Topology(namespace))


def _wait(pred: Any, timeout: float, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(step)


def _batch(tier: _Tier, lines: list[bytes], tenant: str = "bench") -> BatchRecord:
    svc = tier.service
    f = svc.save_generated_file(tenant, filename="bench.jsonl", purpose="batch", lines=lines)
    return svc.create_batch(
        tenant, BatchCreate(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    )


def _final(tier: _Tier, batch_id: str, timeout: float) -> BatchRecord:
    svc = tier.service
    sweeper = BatchMaintenance(svc.store, svc.files, clock=svc.clock)
    deadline = time.monotonic() + timeout
    while True:
        b = svc.get_batch("bench", batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} not final after {timeout:.0f} s")
        sweeper.sweep()
        time.sleep(0.05)


def _through_tidal(tier: _Tier, bodies: list[dict[str, Any]], timeout: float) -> tuple[float, int, int]:
    lines = [
        (
            json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": b}) + "\n"
        ).encode()
        for i, b in enumerate(bodies)
    ]
    t0 = time.perf_counter()
    batch = _batch(tier, lines)
    final = _final(tier, batch.id, timeout)
    wall = time.perf_counter() - t0
    usage = json.loads(final.usage_json or "{}")
    return wall, int(usage.get("output_tokens", 0)), final.failed


def _dispatch(tier: _Tier, chunks: int, model: str) -> tuple[float, float]:
    """(publish tasks/s, worker take-claim-ack tasks/s) for chunks with nothing left to send."""
    svc = tier.service
    assert svc.publisher is not None
    # Plan one-line chunks without publishing them, then publish them as one timed burst.
    planner = BatchService(
        store=svc.store,
        files=svc.files,
        fleet=svc.fleet,
        settings=svc.settings.model_copy(update={"chunk_lines": 1}),
        publisher=None,
    )
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    lines = [
        (
            json.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/completions", "body": body})
            + "\n"
        ).encode()
        for i in range(chunks)
    ]
    f = planner.save_generated_file("bench", filename="dispatch.jsonl", purpose="batch", lines=lines)
    batch = planner.create_batch(
        "bench", BatchCreate(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    )
    # Every line already answered and the batch held open (a claim no finaliser owns): the
    # worker's whole job per chunk is to take it from RabbitMQ, claim it in the store and ack it.
    record_results(svc.store, batch.id, [LineResult.ok(n, "pre", "{}", None) for n in range(1, chunks + 1)])
    with svc.store.session() as s:
        queries.hold_final_claim(s, batch.id)
        # Keep the maintenance sweeps (which publish chunks left pending) off them: the burst
        # below is what we time.
        queries.defer_chunks(s, batch.id, created_at=time.time() + 3600)
    # Publish every chunk as one timed burst, as create_batch does, while the worker consumes.
    t0 = time.perf_counter()
    published = publish_pending(svc.store, svc.publisher, batch_id=batch.id, limit=chunks)
    t_pub = time.perf_counter() - t0

    def delivered() -> int:
        with svc.store.session() as s:
            return queries.chunk_deliveries(s, batch.id)

    # Each delivery is counted by the worker when it takes the chunk.
    _wait(lambda: delivered() >= chunks, 600, step=0.02)
    t_all = time.perf_counter() - t0
    return published / t_pub, chunks / t_all


def run(
    quick: bool,
    out_dir: Path,
    requests: str | int | None = None,
    model: str = "llama-3.1-70b",
    preset: str = PRESET,
    max_num_seqs: str | int = 256,
    time_scale: str | float | None = None,
    chunk_lines: str | int = 64,
    dispatch_chunks: str | int | None = None,
    seed: str | int = 0,
    trace: str | None = None,
    replicas: str | None = None,
) -> list[dict[str, Any]]:
    """Rows ``direct`` and ``tidal``; ``replicas`` (comma-separated URLs) measures running replicas
    instead of starting simulated ones (their ``time_scale`` is then only known if given: 1 otherwise)."""
    from tidal.cli.bench import print_table

    n = int(requests) if requests is not None else (600 if quick else 3000)
    model = str(model)
    preset = str(preset)
    max_num_seqs = int(max_num_seqs)
    # 1.0: at higher scales the simulators become CPU-bound on a small machine and measure it.
    time_scale = float(time_scale) if time_scale is not None else 1.0
    chunk_lines = int(chunk_lines)
    dispatch_chunks = int(dispatch_chunks) if dispatch_chunks is not None else (300 if quick else 1500)
    seed = int(seed)
    workload = load_workload(n, trace=trace, seed=seed)
    bodies = {
        run: [_body(i, p, o, model, run) for i, (p, o) in enumerate(workload.requests)]
        for run in ("direct", "tidal")
    }
    print(f"workload: {n} requests, {workload.source}")
    given = replicas
    with tempfile.TemporaryDirectory(prefix="tidal-bench-batch-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        if given:
            urls = [u.strip() for u in str(given).split(",") if u.strip()]
            # Running replicas: their time scale is only known if given (else wall seconds).
            scale = time_scale
            roots = asyncio.run(_roots(urls))
            replicas_desc = (
                f"{len(urls)} given replicas ({', '.join(sorted(set(roots)))}), time scale {scale:g}"
            )
        else:
            import importlib.util

            if importlib.util.find_spec("tidal.replicas.sim") is None:
                raise SystemExit(
                    "tidal bench batch needs the simulated replica (replicas.sim, `tidal sim`); "
                    "or pass --replicas URL,URL to measure running replicas"
                )
            procs: list[ReplicaProcess] = []
            for i in range(2):
                p = sim_process(
                    preset,
                    name=f"bench-sim-{i}",
                    args=[
                        "--served-model-name",
                        model,
                        "--max-num-seqs",
                        str(max_num_seqs),
                        "--time-scale",
                        str(time_scale),
                    ],
                    log_path=tmp / f"sim-{i}.log",
                )
                procs.append(p.start())
                stack.callback(p.stop)
            for p in procs:
                p.wait_ready(120)
            urls = [p.url for p in procs]
            scale, replicas_desc = (
                time_scale,
                f"2 x tidal sim {preset}, max_num_seqs {max_num_seqs}, time scale {time_scale:g}",
            )
        print(f"replicas: {replicas_desc}")
        timeout = 1800.0
        d_wall, d_tokens, d_fail = asyncio.run(_direct(urls, bodies["direct"], max_num_seqs))
        # Twice the chunks needed to fill every replica slot: while some chunks wait for their
        # last lines, the others keep the slots busy.
        concurrency = 2 * math.ceil(len(urls) * max_num_seqs / chunk_lines) + 2
        with _tier(urls, model, max_num_seqs, chunk_lines, concurrency, tmp) as tier:
            t_wall, t_tokens, t_fail = _through_tidal(tier, bodies["tidal"], timeout)
            pub_rate, dispatch_rate = _dispatch(tier, dispatch_chunks, model)
            broker = tier.settings.broker_url.split("://")[0]
    # Throughput in the replicas' own (model) seconds: wall seconds times the time scale.
    direct_tok_s = d_tokens / (d_wall * scale)
    tidal_tok_s = t_tokens / (t_wall * scale)
    modes = [
        {
            "mode": "direct",
            "requests": n,
            "failed": d_fail,
            "output_tokens": d_tokens,
            "wall_s": d_wall,
            "tok_s": direct_tok_s,
        },
        {
            "mode": "through_tidal",
            "requests": n,
            "failed": t_fail,
            "output_tokens": t_tokens,
            "wall_s": t_wall,
            "tok_s": tidal_tok_s,
        },
    ]
    print()
    print_table(modes)
    summary = {
        "through_tidal_tok_s": tidal_tok_s,
        "direct_tok_s": direct_tok_s,
        "ratio": tidal_tok_s / direct_tok_s if direct_tok_s else 0.0,
        "dispatch_tasks_per_s": dispatch_rate,
        "publish_tasks_per_s": pub_rate,
        "broker": broker,
        "requests": n,
        "workload": workload.source,
        "replicas": replicas_desc,
        "chunk_lines": chunk_lines,
        "worker_concurrency": concurrency,
    }
    print()
    print_table(
        [summary],
        [
            "through_tidal_tok_s",
            "direct_tok_s",
            "ratio",
            "dispatch_tasks_per_s",
            "publish_tasks_per_s",
            "broker",
        ],
    )
    return [summary, *modes]
