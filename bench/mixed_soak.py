"""``tidal bench mixed-soak``: the whole platform under every kind of work at once, for an hour.

One ``tidal up`` -- simulated replicas, gateway, batch worker, scheduler -- on a fleet of its own:
an interactive pool of two stable replicas and a canary build at weight 0 that the scheduler
rolls out while users are served, an embedding pool, and a batch pool; the interactive pool is
shared, so the scheduler's gate lends it to batch between spikes and takes it back. Through the
gateway, all at once for ``--seconds``:

* **chat**: streamed completions, open loop, a square wave of quiet and busy periods (the busy
  one makes the gate pause batch on the shared replicas);
* **batches**: an OpenAI-style batch of chat lines every ``--batch-every`` seconds, through the
  ``openai`` SDK (files, batches, output files);
* **jobs**: a summaries job and an embedding backfill in turn every ``--jobs-every`` seconds;
* **canary**: the scheduler moves traffic to the canary group step by step and decides.

Then the batches and jobs are let finish. The checks are the overload soak's (no 5xx, every
refusal a 429 with ``Retry-After``, the gateway's RSS flat within 10% from a quarter of the run to
its end, admitted TTFT p95 within the interactive class's wait budget plus its TTFT SLO) and the
batch tier's (every accepted batch line answered exactly once, no line failed, every job
completed), and the rollout reaching a decision with the canary group serving users meanwhile.
The worker's and the scheduler's RSS are reported beside the gateway's.

Options: ``--seconds S`` (3600; ``--quick``: 60), ``--batch-every S`` (120; quick 15),
``--batch-lines N`` (200; quick 40), ``--jobs-every S`` (300; quick 20), ``--quiet-rps R`` (2),
``--busy-rps R`` (20).

Example::

    tidal bench mixed-soak --quick
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import yaml

from tidal.bench.soak import (
    CLIENT_KEEPALIVE_S,
    ChatResult,
    chat_counts,
    chat_request,
    rss_growth,
    rss_watch,
)
from tidal.cli.platform import LocalPlatform, local_platform
from tidal.replicas.launcher import free_port
from tidal.replicas.wire.prom import Sample, parse_samples, sample_total

__all__ = ["run"]

CHAT_MODEL = "llama-3.1-8b-instruct"
EMBED_MODEL = "e5-mistral-7b-instruct"
PRESET = "llama-3.1-8b-h100"
WAIT_BUDGET_S = 2.0
TTFT_SLO_S = 1.0
CHAT_TOKENS = 48
CAP = 4  # in flight per interactive replica


def _fleet(ports: dict[str, int], canary_step_s: float, cap: int) -> dict[str, Any]:
    def sim(name: str, group: str = "stable", weight: float = 1.0, preset: str = PRESET) -> dict[str, Any]:
        return {
            "name": name,
            "url": f"http://127.0.0.1:{ports[name]}",
            "group": group,
            "weight": weight,
            "launch": {"kind": "sim", "preset": preset},
        }

    return {
        "models": [
            {"name": CHAT_MODEL, "max_model_len": 32768, "tokenizer": "sim"},
            {"name": EMBED_MODEL, "max_model_len": 4096, "embedding": True},
        ],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "shared": True,
                "model": CHAT_MODEL,
                # Small caps, so a busy period queues at admission and the gate pauses batch.
                "max_inflight_per_replica": cap,
                "min_inflight_per_replica": cap,
                "replicas": [sim("sim-i0"), sim("sim-i1"), sim("sim-c0", group="canary", weight=0.0)],
                # Judged on error rates (the build is a good one: it is promoted at the end).
                "canary": {
                    "steps": [0.1, 0.3, 0.5],
                    "step_s": canary_step_s,
                    "min_requests": max(5, int(canary_step_s / 20)),
                    "interval_s": 1.0,
                },
            },
            "embed": {
                "kind": "interactive",
                "shared": True,
                "model": EMBED_MODEL,
                "replicas": [sim("sim-e0", preset="e5-mistral-7b-h100")],
            },
            "batch": {
                "kind": "batch",
                "model": CHAT_MODEL,
                "batch_concurrency_per_replica": 64,
                "replicas": [sim("sim-b0")],
            },
        },
        "classes": {
            "interactive": {
                "priority": 0,
                "wait_budget_s": WAIT_BUDGET_S,
                "tpot_slo_s": 0.05,
                "ttft_slo_s": TTFT_SLO_S,
            },
            "batch": {"priority": 100, "wait_budget_s": 3600.0, "tpot_slo_s": 1.0, "ttft_slo_s": 3600.0},
        },
        "features": {
            "default": {"class": "interactive", "context_cap": 32768},
            "batch": {"class": "batch", "context_cap": 32768},
        },
        "gate": {
            "queue_wait_p95_pause_s": 0.2,
            "queue_wait_p95_resume_s": 0.05,
            "kv_usage_pause": 0.5,
            "kv_usage_resume": 0.3,
            "hold_s": 5,
        },
    }


# -- the platform ------------------------------------------------------------------------------


def _write_fleet(tmp: Path, canary_step_s: float) -> Path:
    ports = {n: free_port() for n in ("sim-i0", "sim-i1", "sim-c0", "sim-e0", "sim-b0")}
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(_fleet(ports, canary_step_s, CAP), sort_keys=False))
    return path


# -- the work ----------------------------------------------------------------------------------


@dataclass
class _Tally:
    """What the batch and job clients saw."""

    api_errors: Counter[int] = field(default_factory=Counter)  # status -> count, 0: no answer
    batches: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)


async def _call(tally: _Tally, coro_fn: Any, *args: Any, **kw: Any) -> Any:
    """An API call, tried until it answers (every failure counted by status)."""
    for attempt in range(60):
        try:
            return await coro_fn(*args, **kw)
        except openai.APIStatusError as exc:
            tally.api_errors[exc.status_code] += 1
            if exc.status_code < 500 and exc.status_code != 429:
                raise
        except (openai.APIConnectionError, httpx.HTTPError):
            tally.api_errors[0] += 1
        await asyncio.sleep(min(5.0, 0.5 * (attempt + 1)))
    raise RuntimeError("the API did not answer in 60 tries")


async def _batches(
    client: openai.AsyncOpenAI, tally: _Tally, every_s: float, lines: int, until: float
) -> None:
    n = 0
    while time.monotonic() < until:
        rows = [
            {
                "custom_id": f"b{n}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": CHAT_MODEL,
                    "messages": [{"role": "user", "content": f"summarise item {i} of batch {n}"}],
                    "max_tokens": 16,
                },
            }
            for i in range(lines)
        ]
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        f = await _call(tally, client.files.create, file=(f"soak-{n}.jsonl", data), purpose="batch")
        b = await _call(
            tally,
            client.batches.create,
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        tally.batches.append({"id": b.id, "lines": lines, "ids": [r["custom_id"] for r in rows]})
        n += 1
        await asyncio.sleep(max(0.0, min(every_s, until - time.monotonic())))


async def _jobs(client: openai.AsyncOpenAI, tally: _Tally, every_s: float, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        kind, model = ("summaries", CHAT_MODEL) if n % 2 == 0 else ("embedding_backfill", EMBED_MODEL)
        items = 12
        data = "".join(
            json.dumps({"id": f"doc-{n}-{i}", "text": f"document {i} of job {n}: " + "words " * 40}) + "\n"
            for i in range(items)
        ).encode()
        f = await _call(tally, client.files.create, file=(f"job-{n}.jsonl", data), purpose="user_data")
        resp = await _call(
            tally,
            client.post,
            "/jobs",
            body={"kind": kind, "input_file_id": f.id, "model": model, "options": {}},
            cast_to=httpx.Response,
        )
        tally.jobs.append({"id": resp.json()["id"], "kind": kind, "items": items})
        n += 1
        await asyncio.sleep(max(0.0, min(every_s, until - time.monotonic())))


async def _chat(
    session: aiohttp.ClientSession,
    p: LocalPlatform,
    quiet_rps: float,
    busy_rps: float,
    period_s: float,
    until: float,
) -> list[tuple[str, ChatResult]]:
    """Open loop, a square wave: a third of each period busy, the rest quiet."""
    tasks: list[tuple[str, asyncio.Task[ChatResult]]] = []
    start = time.monotonic()
    i = 0
    next_at = start
    while next_at < until:
        busy = (next_at - start) % period_s >= period_s * 2 / 3
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(
            chat_request(session, p.url, i, key=p.key, model=CHAT_MODEL, tokens=CHAT_TOKENS)
        )
        tasks.append(("busy" if busy else "quiet", task))
        i += 1
        next_at += 1.0 / (busy_rps if busy else quiet_rps)
    return [(phase, await t) for phase, t in tasks]


async def _settle(client: openai.AsyncOpenAI, tally: _Tally, drain_s: float, log: Any) -> None:
    """Wait for every batch and job to end (at most ``drain_s``), then read their answers."""
    started = time.monotonic()
    deadline = started + drain_s
    pending = {b["id"] for b in tally.batches} | {j["id"] for j in tally.jobs}
    status: dict[str, Any] = {}
    while pending and time.monotonic() < deadline:
        for b in tally.batches:
            if b["id"] in pending:
                got = await _call(tally, client.batches.retrieve, b["id"])
                status[b["id"]] = got
                if got.status in ("completed", "failed", "expired", "cancelled"):
                    pending.discard(b["id"])
        for j in tally.jobs:
            if j["id"] in pending:
                resp = await _call(tally, client.get, f"/jobs/{j['id']}", cast_to=httpx.Response)
                status[j["id"]] = resp.json()
                if status[j["id"]]["status"] != "in_progress":
                    pending.discard(j["id"])
        if pending:
            await asyncio.sleep(2.0)
    log(
        f"settled: {len(pending)} batches or jobs still running after "
        f"{time.monotonic() - started:.1f} s (at most {drain_s:g} s)"
    )
    for b in tally.batches:
        got = status.get(b["id"])
        b["status"] = got.status if got is not None else "unknown"
        counts = got.request_counts if got is not None else None
        b["failed"] = counts.failed if counts is not None else None
        seen: Counter[str] = Counter()
        for fid in (getattr(got, "output_file_id", None), getattr(got, "error_file_id", None)):
            if fid:
                text = (await _call(tally, client.files.content, fid)).text
                seen.update(json.loads(line)["custom_id"] for line in text.splitlines() if line.strip())
        b["answered"] = sum(1 for c in b["ids"] if seen[c] >= 1)
        b["lost"] = sum(1 for c in b["ids"] if seen[c] == 0)
        b["duplicated"] = sum(1 for c in b["ids"] if seen[c] > 1)
        b["stray"] = sum(1 for c in seen if c not in set(b["ids"]))
        del b["ids"]
    for j in tally.jobs:
        got = status.get(j["id"]) or {}
        j["status"] = got.get("status", "unknown")
        j["error"] = got.get("error")
        j["result"] = got.get("result")


def _scrape(url: str) -> str:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5.0).text
    return ""


# -- the figures --------------------------------------------------------------------------------


def _chat_row(phase: str, results: list[ChatResult]) -> dict[str, Any]:
    return {"phase": phase, **chat_counts(results)}


async def _bench(p: LocalPlatform, o: dict[str, float], log: Any) -> dict[str, Any]:
    tally = _Tally()
    seconds = o["seconds"]
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=p.key, max_retries=0, timeout=60.0)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with (
        client,
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session,
        rss_watch(p.pids(), max(1.0, seconds / 600)) as rss,
    ):
        t0 = time.monotonic()
        until = t0 + seconds
        period = max(15.0, min(300.0, seconds / 6))
        chat, _, _ = await asyncio.gather(
            _chat(session, p, o["quiet_rps"], o["busy_rps"], period, until),
            _batches(client, tally, o["batch_every"], int(o["batch_lines"]), until),
            _jobs(client, tally, o["jobs_every"], until),
        )
        log(f"traffic done after {time.monotonic() - t0:.0f} s: {len(chat)} chat requests")
        await _settle(client, tally, o["drain_s"], log)
    metrics: list[Sample] = []
    with contextlib.suppress(ValueError):  # a page cut short reads as no transitions
        metrics = list(parse_samples(_scrape(f"{p.scheduler_url}/metrics")))
    outcomes_file = p.data_dir / "scheduler" / "canary-outcomes.json"
    outcome = (
        json.loads(outcomes_file.read_text())["pools"].get("interactive") if outcomes_file.exists() else None
    )
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {p.admin_key}"}) as admin:
        load = (await admin.get(p.url + "/admin/load")).json()
    groups = {g: v.get("requests", 0) for g, v in (load.get("groups") or {}).items()}

    rows = [_chat_row(phase, [r for ph, r in chat if ph == phase]) for phase in ("quiet", "busy")]
    rows.append(_chat_row("all", [r for _, r in chat]))
    everything = rows[-1]
    rss_rows = {part: rss_growth(s) for part, s in rss.items()}
    batch = {
        "submitted": len(tally.batches),
        "completed": sum(1 for b in tally.batches if b["status"] == "completed"),
        "lines": sum(b["lines"] for b in tally.batches),
        "answered": sum(b["answered"] for b in tally.batches),
        "lost": sum(b["lost"] for b in tally.batches),
        "duplicated": sum(b["duplicated"] for b in tally.batches),
        "stray": sum(b["stray"] for b in tally.batches),
        "failed_lines": sum(b["failed"] or 0 for b in tally.batches),
    }
    jobs: dict[str, Any] = {
        "submitted": len(tally.jobs),
        "completed": sum(1 for j in tally.jobs if j["status"] == "completed"),
        "by_kind": dict(Counter(j["kind"] for j in tally.jobs)),
        "not_completed": [j for j in tally.jobs if j["status"] != "completed"],
    }
    gate = {
        "pauses": sample_total(metrics, "tidal_gate_transitions_total", to="paused"),
        "resumes": sample_total(metrics, "tidal_gate_transitions_total", to="open"),
    }
    budget = WAIT_BUDGET_S + TTFT_SLO_S
    gw_rss = rss_rows.get("gateway", {}).get("ratio")
    checks = {
        "no_5xx": everything["server_errors"] == 0 and not any(s >= 500 for s in tally.api_errors),
        "every_refusal_429_with_retry_after": everything["other_status"] == 0
        and everything["refused_429_without_retry_after"] == 0
        and everything["connection_errors"] == 0
        and everything["timed_out"] == 0,
        "gateway_rss_flat_within_10pct": gw_rss is not None and gw_rss <= 1.10,
        "ttft_p95_within_budget_plus_slo": everything["ttft_p95_s"] is not None
        and everything["ttft_p95_s"] <= budget,
        "batch_lines_exactly_once": batch["submitted"] > 0
        and batch["completed"] == batch["submitted"]
        and batch["lost"] == 0
        and batch["duplicated"] == 0
        and batch["stray"] == 0
        and batch["failed_lines"] == 0,
        "jobs_all_completed": jobs["submitted"] > 0 and jobs["completed"] == jobs["submitted"],
        "canary_decided_while_serving": outcome is not None and groups.get("canary", 0) > 0,
    }
    return {
        "seconds": seconds,
        "chat": rows,
        "batches": batch,
        "jobs": jobs,
        "canary": {"outcome": outcome, "requests_by_group": groups},
        "gate": gate,
        "rss": rss_rows,
        "api_errors_by_status": {str(k): v for k, v in sorted(tally.api_errors.items())},
        "checks": checks,
        "wait_budget_plus_ttft_slo_s": budget,
        "setup": (
            f"tidal up: 2 stable + 1 canary {PRESET} sims (interactive, shared), 1 embedding sim, 1 batch "
            f"sim; chat {o['quiet_rps']:g}/{o['busy_rps']:g} requests/s quiet/busy (a third of every "
            f"{period:g} s busy), {CHAT_TOKENS}-token streams; a {int(o['batch_lines'])}-line batch every "
            f"{o['batch_every']:g} s; a job every {o['jobs_every']:g} s"
        ),
    }


def run(
    quick: bool,
    out_dir: Path,
    seconds: str | float | None = None,
    batch_every: str | float | None = None,
    batch_lines: str | int | None = None,
    jobs_every: str | float | None = None,
    quiet_rps: str | float = 2.0,
    busy_rps: str | float = 20.0,
    drain_s: str | float | None = None,
) -> dict[str, Any]:
    from tidal.cli.bench import print_table

    secs = float(seconds) if seconds is not None else (60.0 if quick else 3600.0)
    o = {
        "seconds": secs,
        "batch_every": float(batch_every) if batch_every is not None else (15.0 if quick else 120.0),
        "batch_lines": float(batch_lines) if batch_lines is not None else (40 if quick else 200),
        "jobs_every": float(jobs_every) if jobs_every is not None else (20.0 if quick else 300.0),
        "quiet_rps": float(quiet_rps),
        "busy_rps": float(busy_rps),
        "drain_s": float(drain_s) if drain_s is not None else (180.0 if quick else 900.0),
    }
    # The rollout's three steps take half the run; the decision comes after the last.
    canary_step_s = max(5.0, secs / 6)

    def log(m: str) -> None:
        print(m, flush=True)

    with (
        tempfile.TemporaryDirectory(prefix="tidal-bench-mixed-soak-") as tmp,
        local_platform(_write_fleet(Path(tmp), canary_step_s), Path(tmp), log=log) as platform,
    ):
        result = asyncio.run(_bench(platform, o, log))

    def ms(v: Any) -> str:
        return f"{v * 1000:.0f}" if isinstance(v, float) else "-"

    print()
    print_table(
        [
            {
                "chat": r["phase"],
                "requests": r["requests"],
                "admitted": r["admitted"],
                "429": r["refused_429"],
                "5xx": r["server_errors"],
                "conn_err": r["connection_errors"],
                "timed_out": r["timed_out"],
                "ttft_p50_ms": ms(r["ttft_p50_s"]),
                "ttft_p95_ms": ms(r["ttft_p95_s"]),
            }
            for r in result["chat"]
        ]
    )
    b, j = result["batches"], result["jobs"]
    print(
        f"\nbatches: {b['completed']}/{b['submitted']} completed, {b['answered']}/{b['lines']} lines answered, "
        f"{b['lost']} lost, {b['duplicated']} duplicated, {b['failed_lines']} failed"
    )
    print(f"jobs: {j['completed']}/{j['submitted']} completed ({j['by_kind']})")
    print(f"canary: {result['canary']['outcome']}; requests by group {result['canary']['requests_by_group']}")
    print(f"gate: {result['gate']['pauses']:.0f} pauses, {result['gate']['resumes']:.0f} resumes")
    print(
        "rss: "
        + ", ".join(
            f"{part} {r['start_mb'] or 0:.0f}->{r['end_mb'] or 0:.0f} MB ({r['ratio'] or 0:.2f}x)"
            for part, r in result["rss"].items()
        )
    )
    print(f"API errors by status (batches, jobs): {result['api_errors_by_status']}")
    print(f"checks: {json.dumps(result['checks'])}")
    print(f"\n{result['setup']}")
    return result
