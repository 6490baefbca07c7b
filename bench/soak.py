"""``tidal bench soak``: overload and abuse through the gateway.

Real processes: ``--replicas`` simulated replicas (``tidal sim --preset fast-test`` slowed to
25 ms steps) behind ``tidal gateway`` with a fixed cap per replica and the interactive class's
2 s wait budget. The pool's capacity is measured first (closed-loop streams at exactly the cap,
completed requests per second). Then, the overload for ``--seconds`` and the others for at most
two minutes each:

1. **1 x capacity**, open loop: the baseline.
2. **10 x capacity**, open loop: admission must refuse what it cannot serve in time. Every
   refusal must be a 429 with ``Retry-After`` (there is no external provider to overflow to),
   no 5xx, the gateway's RSS flat within 10% (from a quarter of the run to its end, after
   warm-up), and the admitted requests' TTFT p95 within the wait budget plus the TTFT SLO.
3. **10 x capacity with admission off**: a second gateway on the same replicas whose wait budget
   is an hour and whose queue is unbounded, to show what the mechanism bounds (a client gives up
   after 30 s: ``timed_out``).
4. **Abuse**: 1,000 slow clients (slowloris: half send a request's headers a line every 3 s,
   half a whole head then its body a byte every 3 s) and clients posting 64 MiB bodies, while
   normal clients send 0.5 x capacity: the normal requests must all be answered, with TTFT p95
   near the baseline's; the slow clients the gateway cut (408 or closed) before the end are
   counted (``gateway.head_timeout_s``, ``gateway.body_timeout_s``: a phase longer than them
   should cut every one).

Options: ``--seconds S`` (the overload's length: 600; ``--quick``: 15), ``--replicas N`` (2), ``--slow-clients
N`` (1000), ``--big-bodies N`` (4 concurrent 64 MiB posters).

Example::

    tidal bench soak --quick
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tidal.fleet import hash_api_key
from tidal.priority.window import quantile
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-soak-key-0123456789abcdef"
MODEL = "sim"
CAP = 2  # in flight per replica
TOKENS = 32
WAIT_BUDGET_S = 2.0
TTFT_SLO_S = 1.0
CLIENT_TIMEOUT_S = 30.0
# Idle connections are dropped well before the gateway's keep-alive timeout (uvicorn's 5 s), as
# the replica client does: a request sent on a connection the server is closing at that moment
# fails with no response, which a client that keeps them 15 s (aiohttp's default) meets at low
# request rates.
CLIENT_KEEPALIVE_S = 2.0
BIG_BODY = 64 * 1024 * 1024
SLOW_EVERY_S = 3.0  # a slow client's pace: one more header line, or body byte
ABUSE_S = 120.0  # the longest of the phases other than the overload


def _fleet(urls: list[str], *, admission: bool, deadline_s: tuple[float, float]) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "max_model_len": 32768}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": MODEL,
                "max_inflight_per_replica": CAP,
                "min_inflight_per_replica": CAP,
                "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
            }
        },
        "classes": {
            "interactive": {
                "priority": 0,
                "wait_budget_s": WAIT_BUDGET_S if admission else 3600.0,
                "tpot_slo_s": 0.05,
                "ttft_slo_s": TTFT_SLO_S,
            },
            "batch": {"priority": 100, "wait_budget_s": 3600.0, "tpot_slo_s": 1.0, "ttft_slo_s": 3600.0},
        },
        "features": {"default": {"class": "interactive", "context_cap": 32768}},
        "tenants": [{"name": "bench", "key_hashes": [hash_api_key(KEY)], "features": ["default"]}],
        "gateway": {
            "max_queue": 4096 if admission else 1_000_000,
            "head_timeout_s": deadline_s[0],
            "body_timeout_s": deadline_s[1],
        },
    }


# -- the processes ------------------------------------------------------------------------------


@dataclass
class _Setup:
    sims: list[ReplicaProcess]
    gateway: ReplicaProcess
    unbounded: ReplicaProcess
    deadline_s: tuple[float, float]  # the gateways' head and body deadlines


def _gateway(tmp: Path, name: str, fleet: dict[str, Any], pypath: str) -> ReplicaProcess:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fleet))
    port = free_port()
    return ReplicaProcess(
        name,
        [sys.executable, "-m", "tidal", "gateway", "--config", str(path), "--port", str(port)],
        port=port,
        env={"TIDAL_ENVIRONMENT": "test", "TIDAL_DATA_DIR": str(tmp / name), "PYTHONPATH": pypath},
        log_path=tmp / f"{name}.log",
        health_path="/healthz",
    )


@contextlib.contextmanager
def _processes(tmp: Path, replicas: int, deadline_s: tuple[float, float]) -> Iterator[_Setup]:
    pypath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with contextlib.ExitStack() as stack:
        sims = [
            sim_process(
                "fast-test",
                name=f"soak-sim-{i}",
                args=["--served-model-name", MODEL, "--time-scale", "0.04"],
                log_path=tmp / f"sim-{i}.log",
                env={"PYTHONPATH": pypath},
            )
            for i in range(replicas)
        ]
        for s in sims:
            s.start()
            stack.callback(s.stop)
        for s in sims:
            s.wait_ready(120)
        urls = [s.url for s in sims]
        gw = _gateway(tmp, "gateway", _fleet(urls, admission=True, deadline_s=deadline_s), pypath)
        unbounded = _gateway(
            tmp, "gateway-unbounded", _fleet(urls, admission=False, deadline_s=deadline_s), pypath
        )
        for g in (gw, unbounded):
            g.start()
            stack.callback(g.stop)
        for g in (gw, unbounded):
            g.wait_ready(60)
        yield _Setup(sims, gw, unbounded, deadline_s)


def rss_of(pid: int) -> int:
    """A process's resident memory in bytes (0 once it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the clients --------------------------------------------------------------------------------


@dataclass
class ChatResult:
    t0: float
    status: int  # 0: no response (connection error); -1: timed out
    retry_after: bool = False
    ttft: float | None = None


async def chat_request(
    session: aiohttp.ClientSession,
    url: str,
    i: int,
    *,
    key: str = KEY,
    model: str = MODEL,
    tokens: int = TOKENS,
    prompt: str = "soak",
) -> ChatResult:
    """One streamed chat completion: its status, whether a refusal said ``Retry-After``, and the
    time to its first content token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{prompt} {i} {secrets.token_hex(4)}"}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with session.post(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    return ChatResult(t0, resp.status, "Retry-After" in resp.headers)
                first: float | None = None
                async for line in resp.content:
                    if (
                        first is None
                        and line.startswith(b"data: {")
                        and b'"content":"' in line.replace(b'"content":""', b"")
                    ):
                        first = time.monotonic() - t0
                return ChatResult(t0, 200, ttft=first)
    except TimeoutError:
        return ChatResult(t0, -1)
    except aiohttp.ClientError:
        return ChatResult(t0, 0)


async def _open_loop(
    session: aiohttp.ClientSession, url: str, rate: float, seconds: float
) -> list[ChatResult]:
    """``rate`` requests per second, evenly spaced, for ``seconds``; waits for every answer."""
    n = max(1, int(rate * seconds))
    start = time.monotonic()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(chat_request(session, url, i)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    session: aiohttp.ClientSession, url: str, workers: int, seconds: float
) -> list[ChatResult]:
    until = time.monotonic() + seconds
    out: list[ChatResult] = []

    async def loop(w: int) -> None:
        i = w
        while time.monotonic() < until:
            out.append(await chat_request(session, url, i))
            i += workers

    await asyncio.gather(*(loop(w) for w in range(workers)))
    return out


@contextlib.asynccontextmanager
async def rss_watch(
    pids: Mapping[str, int | None], every_s: float = 0.5
) -> AsyncIterator[dict[str, list[tuple[float, int]]]]:
    """Each named process's RSS, sampled every ``every_s`` while the block runs: name ->
    [(monotonic time, bytes)] (0 bytes once a process is gone)."""
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}

    async def watch() -> None:
        while True:
            for name, pid in pids.items():
                samples[name].append((time.monotonic(), rss_of(pid) if pid else 0))
            await asyncio.sleep(every_s)

    task = asyncio.create_task(watch())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _slowloris(host: str, port: int, n: int, stop: asyncio.Event) -> dict[str, int]:
    """``n`` slow connections, every other one of each kind: a request's headers sent a line
    every ``SLOW_EVERY_S`` and never ended, or a whole head then its body a byte every
    ``SLOW_EVERY_S``; how many of each the gateway answered (408) or closed before the end."""

    async def client(i: int) -> tuple[str, bool | None]:
        kind = "head" if i % 2 == 0 else "body"
        try:
            reader, w = await asyncio.open_connection(host, port)
        except OSError:
            return kind, None
        try:
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")
            if kind == "body":
                w.write(
                    b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000\r\n\r\n{" % KEY.encode()
                )
            k = 0
            while not stop.is_set():
                read = asyncio.ensure_future(reader.read(65536))
                waiting = asyncio.ensure_future(stop.wait())
                done, _ = await asyncio.wait(
                    {read, waiting}, timeout=SLOW_EVERY_S, return_when=asyncio.FIRST_COMPLETED
                )
                waiting.cancel()
                if read in done:
                    return kind, True  # an answer (408) or the connection closed: cut by the gateway
                read.cancel()
                k += 1
                w.write(f"X-Slow-{k}: {k}\r\n".encode() if kind == "head" else b" ")
                await w.drain()
            return kind, False
        except (OSError, ConnectionError):
            return kind, True
        finally:
            w.close()

    out = await asyncio.gather(*(client(i) for i in range(n)))
    opened = [(kind, cut) for kind, cut in out if cut is not None]
    return {
        "slow_clients_opened": len(opened),
        "slow_heads_opened": sum(1 for kind, _ in opened if kind == "head"),
        "slow_bodies_opened": sum(1 for kind, _ in opened if kind == "body"),
        "slow_heads_cut_by_gateway": sum(1 for kind, cut in opened if kind == "head" and cut),
        "slow_bodies_cut_by_gateway": sum(1 for kind, cut in opened if kind == "body" and cut),
    }


async def _big_bodies(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[int]:
    """Post 64 MiB bodies (streamed, no Content-Length) again and again; the statuses."""
    statuses: list[int] = []
    piece = b" " * (1024 * 1024)

    async def body() -> AsyncIterator[bytes]:
        for _ in range(BIG_BODY // len(piece)):
            yield piece

    while not stop.is_set():
        try:
            async with session.post(
                url + "/v1/chat/completions",
                data=body(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
            ) as resp:
                await resp.read()
                statuses.append(resp.status)
        except aiohttp.ClientError:
            statuses.append(0)  # the gateway closed the connection while the body was being sent
        await asyncio.sleep(0.1)
    return statuses


# -- the figures --------------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float | None:
    v = [x for x in values if math.isfinite(x)]
    return quantile(v, q) if v else None


def chat_counts(results: list[ChatResult]) -> dict[str, Any]:
    """What a list of chat requests got: answers, refusals (and whether they said
    ``Retry-After``), errors, and the answered ones' TTFT."""
    ok = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {
        "requests": len(results),
        "admitted": len(ok),
        "refused_429": len(refused),
        "refused_429_without_retry_after": sum(1 for r in refused if not r.retry_after),
        "server_errors": sum(1 for r in results if r.status >= 500),
        "other_status": sum(1 for r in results if r.status not in (200, 429) and 0 < r.status < 500),
        "connection_errors": sum(1 for r in results if r.status == 0),
        "timed_out": sum(1 for r in results if r.status == -1),
        "ttft_p50_s": _p(ttfts, 0.5),
        "ttft_p95_s": _p(ttfts, 0.95),
    }


def rss_growth(samples: list[tuple[float, int]]) -> dict[str, float | None]:
    """Resident memory from a quarter of the run (after warm-up) to its end, in MB, and the
    ratio of the two; ``samples`` are (time, bytes), 0 bytes meaning the process was not there."""
    live = [(t, b) for t, b in samples if b > 0]
    if not live:
        return {"start_mb": None, "end_mb": None, "ratio": None}
    t_first, t_last = live[0][0], live[-1][0]
    start = next(b for t, b in live if t >= t_first + 0.25 * (t_last - t_first))
    end = live[-1][1]
    return {"start_mb": start / 2**20, "end_mb": end / 2**20, "ratio": end / start}


def _phase(
    name: str, offered_rps: float | None, results: list[ChatResult], rss: list[tuple[float, int]]
) -> dict[str, Any]:
    growth = rss_growth(rss)
    return {
        "phase": name,
        "offered_rps": offered_rps,
        **chat_counts(results),
        "rss_start_mb": growth["start_mb"],
        "rss_end_mb": growth["end_mb"],
        "rss_ratio": growth["ratio"],
    }


async def _bench(
    setup: _Setup, seconds: float, slow_clients: int, big_bodies: int, log: Any
) -> dict[str, Any]:
    gw, unbounded = setup.gateway, setup.unbounded
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Capacity: closed loop at exactly the pool's cap, after a short warm-up.
        slots = CAP * len(setup.sims)
        await _closed_loop(session, gw.url, slots, 3.0)
        t0 = time.monotonic()
        measured = await _closed_loop(session, gw.url, slots, max(8.0, min(seconds / 4, 30.0)))
        capacity = sum(1 for r in measured if r.status == 200) / (time.monotonic() - t0)
        log(f"capacity: {capacity:.2f} requests/s ({slots} slots)")

        # The overload runs the whole ``seconds``; the phases beside it at most two minutes.
        short = _short_phase(seconds)
        phases = []
        for name, url, proc, factor, secs in (
            ("1 x capacity", gw.url, gw, 1.0, short),
            ("10 x capacity", gw.url, gw, 10.0, seconds),
            ("10 x capacity, admission off", unbounded.url, unbounded, 10.0, short),
        ):
            async with rss_watch({name: proc.pid}) as rss:
                results = await _open_loop(session, url, factor * capacity, secs)
            phases.append(_phase(name, factor * capacity, results, rss[name]))
            log(f"{name}: {json.dumps({k: v for k, v in phases[-1].items() if k != 'phase'})}")

        # Abuse: slow clients and huge bodies beside normal traffic at half the capacity.
        stop = asyncio.Event()
        host, port = "127.0.0.1", gw.port
        async with rss_watch({"gateway": gw.pid}) as rss:
            loris = asyncio.create_task(_slowloris(host, port, slow_clients, stop))
            bodies = [asyncio.create_task(_big_bodies(session, gw.url, stop)) for _ in range(big_bodies)]
            await asyncio.sleep(2.0)  # the slow clients are connected
            normal = await _open_loop(session, gw.url, 0.5 * capacity, short)
            stop.set()
            loris_out = await loris
            body_statuses = [s for t in bodies for s in await t]
        abuse = _phase(
            "abuse: 0.5 x capacity beside slow clients and 64 MiB bodies",
            0.5 * capacity,
            normal,
            rss["gateway"],
        )
        abuse.update(loris_out)
        abuse["big_bodies_sent"] = len(body_statuses)
        abuse["big_body_statuses"] = {str(s): body_statuses.count(s) for s in sorted(set(body_statuses))}
        phases.append(abuse)
        log(f"abuse: {json.dumps({k: v for k, v in abuse.items() if k != 'phase'})}")

    base, over, off, ab = phases
    budget = WAIT_BUDGET_S + TTFT_SLO_S
    checks = {
        "no_5xx": all(p["server_errors"] == 0 for p in phases),
        "every_refusal_429_with_retry_after": all(
            p["other_status"] == 0
            and p["refused_429_without_retry_after"] == 0
            and p["connection_errors"] == 0
            for p in (base, over, ab)
        ),
        "rss_flat_within_10pct": over["rss_ratio"] is not None and over["rss_ratio"] <= 1.10,
        "overload_ttft_p95_within_budget_plus_slo": over["ttft_p95_s"] is not None
        and over["ttft_p95_s"] <= budget,
        "abuse_normal_all_answered": ab["admitted"] == ab["requests"],
        "abuse_ttft_p95_within_2x_baseline": (
            ab["ttft_p95_s"] is not None
            and base["ttft_p95_s"] is not None
            and ab["ttft_p95_s"] <= max(2 * base["ttft_p95_s"], base["ttft_p95_s"] + 0.25)
        ),
        # The phase lasts at least three deadlines: every slow client is cut before its end.
        "abuse_slow_clients_all_cut": ab["slow_heads_cut_by_gateway"] == ab["slow_heads_opened"]
        and ab["slow_bodies_cut_by_gateway"] == ab["slow_bodies_opened"],
    }
    return {
        "capacity_rps": capacity,
        "overload_s": seconds,
        "other_phases_s": short,
        "phases": phases,
        "checks": checks,
        "ttft_p95_ratio_overload_vs_baseline": _ratio(over["ttft_p95_s"], base["ttft_p95_s"]),
        "ttft_p95_ratio_admission_off_vs_on": _ratio(off["ttft_p95_s"], over["ttft_p95_s"]),
        "wait_budget_plus_ttft_slo_s": budget,
        "setup": (
            f"{len(setup.sims)} x tidal sim fast-test at 25 ms steps, cap {CAP}/replica, streams of "
            f"{TOKENS} tokens; interactive wait budget {WAIT_BUDGET_S:g} s, TTFT SLO {TTFT_SLO_S:g} s; "
            f"clients give up after {CLIENT_TIMEOUT_S:g} s; gateway head and body deadlines "
            f"{setup.deadline_s[0]:.3g} s and {setup.deadline_s[1]:.3g} s"
        ),
    }


def _short_phase(seconds: float) -> float:
    """How long each phase beside the overload (and the abuse) runs in a run of ``seconds``."""
    return min(seconds, ABUSE_S)


def _deadlines(seconds: float) -> tuple[float, float]:
    """The gateway's head and body deadlines: its defaults (10 s, 20 s), or a third of a shorter
    abuse phase, so that a quick run sees the slow clients cut too."""
    short = _short_phase(seconds)
    return min(10.0, short / 3), min(20.0, short / 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(
    quick: bool,
    out_dir: Path,
    seconds: str | float | None = None,
    replicas: str | int = 2,
    slow_clients: str | int = 1000,
    big_bodies: str | int = 4,
) -> dict[str, Any]:
    from tidal.cli.bench import print_table

    secs = float(seconds) if seconds is not None else (15.0 if quick else 600.0)
    with (
        tempfile.TemporaryDirectory(prefix="tidal-bench-soak-") as tmp,
        _processes(Path(tmp), int(replicas), _deadlines(secs)) as setup,
    ):
        result = asyncio.run(
            _bench(setup, secs, int(slow_clients), int(big_bodies), lambda m: print(m, flush=True))
        )

    def ms(v: Any) -> str:
        return f"{v * 1000:.0f}" if isinstance(v, float) else "-"

    print()
    print_table(
        [
            {
                "phase": p["phase"],
                "offered_rps": f"{p['offered_rps']:.1f}",
                "requests": p["requests"],
                "admitted": p["admitted"],
                "429": p["refused_429"],
                "429_no_RA": p["refused_429_without_retry_after"],
                "5xx": p["server_errors"],
                "conn_err": p["connection_errors"],
                "timed_out": p["timed_out"],
                "ttft_p95_ms": ms(p["ttft_p95_s"]),
                "rss_mb": f"{p['rss_start_mb'] or 0:.0f}->{p['rss_end_mb'] or 0:.0f}",
            }
            for p in result["phases"]
        ]
    )
    ab = result["phases"][-1]
    print(
        f"\nslow clients: {ab['slow_heads_opened']} slow heads opened, {ab['slow_heads_cut_by_gateway']} cut by the "
        f"gateway; {ab['slow_bodies_opened']} slow bodies opened, {ab['slow_bodies_cut_by_gateway']} cut; "
        f"64 MiB bodies: {ab['big_bodies_sent']} sent, statuses {ab['big_body_statuses']}"
    )
    print(f"checks: {json.dumps(result['checks'])}")
    print(f"\n{result['setup']}; capacity {result['capacity_rps']:.2f} requests/s")
    return result
