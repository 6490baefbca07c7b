"""``tidal bench gateway``: what the gateway adds to a streamed request, against a Rust peer.

One simulated replica (``tidal sim --preset fast-test``) is reached several ways, in the same
run and in turn: **direct**; through **tidal** (``tidal gateway`` as its own process: auth,
feature policy, admission, the ``tidal`` router profile, the streaming proxy, metrics) with its
lean HTTP/1.1 pool (:mod:`replicas.wire.http1`); through **tidal-aiohttp**, the same gateway
sending with aiohttp instead (``gateway.upstream_client: aiohttp``), which says whether the lean
pool is worth keeping; through **vllm-router** (the Rust router from PyPI, policy
``consistent_hash``, the closest to Tidal's prefix ring); and, with ``--baseline-src DIR``,
through **tidal-baseline**, the gateway of another checkout of Tidal (say, the last release),
so that a change is compared with what it replaces in one run. Closed-loop clients stream chat completions of ``--tokens`` tokens; the rows give
TTFT p50/p99 (to the first content token), streamed tokens per second, the TTFT added over
direct, and the proxy's CPU time, so ``tokens_per_cpu_s`` is streamed tokens per second per core
of the proxy. Two modes, each row saying which (``mode``):

* ``saturated`` -- the replica at full speed (about 1 ms per engine step) and clients that start
  their next request at once, at 64 and 256 streams: the replica, proxy and load generator
  saturate the machine's cores together, so this measures throughput per proxy core and the
  latency of a proxy competing for CPU, not its per-request cost.
* ``latency`` -- 64 streams the machine can carry: the replica paced like a GPU decode step
  (``--time-scale 0.1``: about 10 ms per step, 100 tokens/s per stream) and a random think time
  (up to ``--think-ms``) before each request, so requests arrive at random points of the
  replica's step. Here the added TTFT is the proxy's own per-request cost.

With ``--workers N`` the two ``tidal`` targets run ``tidal gateway --workers N``: N processes on
one port sharing their load through Redis (``--redis-url``, else ``TIDAL_REDIS_URL``, else a
``redis-server`` the benchmark starts on a free port in its temporary directory); their CPU time
is every gateway process's plus the Redis server's, and after each of their measurements the
gateways' shared-state staleness (the oldest the other processes' counts got before a refresh,
from ``tidal_gateway_shared_state_staleness_seconds``) is printed.

Everything shares this machine's cores (the simulated replica, the proxy, the load generator):
the figures compare the targets with each other in one run, not with a dedicated deployment.

Example::

    tidal bench gateway --quick
    tidal bench gateway --mode latency --latency-concurrency 64 --seconds 20
    tidal bench gateway --mode saturated --concurrency 64,256 --seconds 20 --tokens 128
    tidal bench gateway --mode latency --baseline-src ../tidal-main
    tidal bench gateway --mode saturated --concurrency 256 --workers 2
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click
import yaml

from tidal.fleet import hash_api_key
from tidal.priority.window import quantile
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process
from tidal.replicas.wire.prom import parse_samples
from tidal.replicas.wire.sse import SSEDecoder

__all__ = ["run"]

KEY = "bench-gateway-key-0123456789"
MODEL = "sim"
MODES = ("saturated", "latency")


def _cpu(pid: int) -> float:
    """User + system CPU seconds of one process and its threads so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a gateway's worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


@dataclass
class _Target:
    name: str
    url: str
    proc: ReplicaProcess | None
    headers: dict[str, str]
    workers: int = 1
    extra_pids: list[int] = field(default_factory=list)  # the Redis server of shared gateways

    def cpu_seconds(self) -> float:
        """User + system CPU of the proxy's processes and threads so far (0 for direct)."""
        if self.proc is None or self.proc.pid is None:
            return 0.0
        return sum(_cpu(p) for p in [*_tree(self.proc.pid), *self.extra_pids])


def _fleet(sim_url: str, upstream_client: str | None = None) -> dict[str, Any]:
    gateway: dict[str, Any] = {"max_queue": 4096}
    if upstream_client is not None:
        gateway["upstream_client"] = upstream_client
    return {
        "models": [{"name": MODEL, "max_model_len": 32768}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": MODEL,
                # The fast preset's TPOT stays far under the SLO, so the cap never binds here.
                "max_inflight_per_replica": 4096,
                "min_inflight_per_replica": 4096,
                "replicas": [{"name": "sim-0", "url": sim_url}],
            }
        },
        "features": {"default": {"class": "interactive", "context_cap": 32768}},
        "tenants": [{"name": "bench", "key_hashes": [hash_api_key(KEY)], "features": ["default"]}],
        "gateway": gateway,
    }


@contextlib.contextmanager
def _redis(workdir: Path, url: str | None) -> Iterator[tuple[str, list[int]]]:
    """A Redis for shared gateways: ``url``, else ``TIDAL_REDIS_URL``, else a private
    ``redis-server`` on a free port (its pid is returned, to count its CPU)."""
    url = url or os.environ.get("TIDAL_REDIS_URL")
    if url:
        yield url, []
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise click.UsageError(
            "--workers > 1 needs Redis: pass --redis-url, set TIDAL_REDIS_URL or install redis-server"
        )
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise click.ClickException("redis-server did not start")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0", [proc.pid]
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def _services(
    workdir: Path,
    time_scale: float = 1.0,
    baseline_src: Path | None = None,
    workers: int = 1,
    redis_url: str | None = None,
) -> Iterator[list[_Target]]:
    procs: list[ReplicaProcess] = []
    workdir.mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    try:
        shared_env: dict[str, str] = {}
        redis_pids: list[int] = []
        if workers > 1:
            url, redis_pids = stack.enter_context(_redis(workdir, redis_url))
            shared_env = {"TIDAL_REDIS_URL": url, "TIDAL_REDIS_NAMESPACE": f"bench-{secrets.token_hex(4)}"}
        sim = sim_process(
            "fast-test",
            args=["--served-model-name", MODEL, "--time-scale", f"{time_scale:g}"],
            log_path=workdir / "sim.log",
            name="sim",
        )
        procs.append(sim.start())
        sim.wait_ready(60)
        gateways: list[tuple[str, str | None, Path | None]] = [
            ("tidal", None, None),
            ("tidal-aiohttp", "aiohttp", None),
        ]
        if baseline_src is not None:
            gateways.append(("tidal-baseline", None, baseline_src))
        targets = [_Target("direct", sim.url, None, {})]
        for name, client, src in gateways:
            fleet_path = workdir / f"fleet-{name}.yaml"
            fleet_path.write_text(yaml.safe_dump(_fleet(sim.url, client)))
            gw_port = free_port()
            # Another checkout may predate shared state: its gateway runs as one process.
            n = workers if src is None else 1
            env = {"TIDAL_ADMIN_KEY": "bench-admin-key-0123456789"}
            if src is not None:
                env["PYTHONPATH"] = str(src)
            if n > 1:
                env |= shared_env | {"TIDAL_REDIS_NAMESPACE": f"{shared_env['TIDAL_REDIS_NAMESPACE']}-{name}"}
            gateway = ReplicaProcess(
                name,
                [
                    sys.executable,
                    "-m",
                    "tidal",
                    "gateway",
                    "--config",
                    str(fleet_path),
                    "--port",
                    str(gw_port),
                    *(["--workers", str(n)] if n > 1 else []),
                ],
                port=gw_port,
                env=env,
                cwd=src,
                log_path=workdir / f"{name}.log",
                health_path="/healthz",
            )
            procs.append(gateway.start())
            headers = {"Authorization": f"Bearer {KEY}"}
            targets.append(_Target(name, gateway.url, gateway, headers, n, redis_pids if n > 1 else []))
        router_bin = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
        if Path(router_bin).exists():
            r_port = free_port()
            router = ReplicaProcess(
                "vllm-router",
                [
                    router_bin,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(r_port),
                    "--worker-urls",
                    sim.url,
                    "--policy",
                    "consistent_hash",
                    "--prometheus-port",
                    str(free_port()),
                    "--log-level",
                    "warning",
                ],
                port=r_port,
                log_path=workdir / "vllm-router.log",
                health_path="/health",
            )
            procs.append(router.start())
            router.wait_ready(60)
            targets.append(_Target("vllm-router", router.url, router, {}))
        else:
            click.echo("vllm-router is not installed (pip install 'tidal[bench]'): peer rows skipped")
        for target in targets:
            if target.proc is not None:
                target.proc.wait_ready(60)
        yield targets
    finally:
        for p in reversed(procs):
            p.stop()
        stack.close()


async def _client(
    session: aiohttp.ClientSession,
    target: _Target,
    tokens: int,
    deadline: float,
    warmup_end: float,
    ttfts: list[float],
    counted: list[int],
    worker: int,
    think_s: float,
) -> None:
    i = 0
    rng = random.Random(worker)
    while time.perf_counter() < deadline:
        if think_s > 0:
            await asyncio.sleep(rng.uniform(0.0, think_s))
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"client {worker} request {i}: tell me a story"}],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }
        i += 1
        t0 = time.perf_counter()
        first: float | None = None
        n = 0
        decoder = SSEDecoder()
        async with session.post(
            target.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **target.headers},
        ) as resp:
            if resp.status != 200:
                await resp.read()
                await asyncio.sleep(0.01)
                continue
            async for piece in resp.content.iter_any():
                for event in decoder.feed(piece):
                    if b'"content":"' in event.data.replace(b'"content":""', b""):
                        n += 1
                        if first is None:
                            first = time.perf_counter()
        if t0 >= warmup_end and first is not None:
            ttfts.append(first - t0)
            counted[0] += n


async def _measure(
    target: _Target, concurrency: int, seconds: float, warmup: float, tokens: int, think_s: float = 0.0
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    ttfts: list[float] = []
    counted = [0]
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        start = time.perf_counter()
        warmup_end = start + warmup
        deadline = warmup_end + seconds
        cpu0: float | None = None

        async def mark_cpu() -> None:
            nonlocal cpu0
            await asyncio.sleep(warmup)
            cpu0 = target.cpu_seconds()

        marker = asyncio.ensure_future(mark_cpu())
        await asyncio.gather(
            *(
                _client(session, target, tokens, deadline, warmup_end, ttfts, counted, w, think_s)
                for w in range(concurrency)
            )
        )
        await marker
        elapsed = time.perf_counter() - warmup_end
        cpu = target.cpu_seconds() - (cpu0 or 0.0)
    return {
        "target": target.name,
        "concurrency": concurrency,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p99_s": quantile(ttfts, 0.99),
        "tokens_per_s": counted[0] / elapsed,
        "requests": len(ttfts),
        "proxy_cpu_s": cpu,
        "tokens_per_cpu_s": counted[0] / cpu if cpu > 0 else None,
    }


def run(
    quick: bool,
    out_dir: Path,
    concurrency: str = "64,256",
    seconds: str | float | None = None,
    tokens: str | int = 64,
    rounds: str | int | None = None,
    mode: str = ",".join(MODES),
    latency_concurrency: str = "64",
    time_scale: str | float = 0.1,
    think_ms: str | float = 50,
    baseline_src: str | None = None,
    workers: str | int = 1,
    redis_url: str | None = None,
    **_: Any,
) -> list[dict[str, Any]]:
    """Rows: ``target``, ``concurrency``, ``mode``, ``ttft_p50_s``, ``ttft_p99_s``,
    ``tokens_per_s`` and the proxy's CPU use (medians over rounds), and the TTFT added over
    direct (the median of the rounds' pairs, :func:`paired_added`; each round's in
    ``added_ttft_p50_rounds_s``). ``concurrency`` is the saturated mode's levels,
    ``latency_concurrency`` the latency mode's; ``time_scale`` paces the latency mode's replica,
    ``think_ms`` bounds its think time; ``baseline_src`` is another checkout whose gateway runs
    as one more target; ``workers`` runs the tidal gateways with ``--workers`` (sharing load
    through ``redis_url``)."""
    modes = [m.strip() for m in str(mode).split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise click.UsageError(f"unknown mode '{m}' (known: {', '.join(MODES)})")
    secs = float(seconds) if seconds is not None else (6.0 if quick else 15.0)
    # A comparison with another checkout is about a few tenths of a millisecond: more rounds.
    n_rounds = int(rounds) if rounds is not None else (1 if quick else 7 if baseline_src else 3)
    n_tokens = int(tokens)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tidal-bench-gw-") as tmp:
        for m in modes:
            saturated = m == "saturated"
            levels = [int(x) for x in str(concurrency if saturated else latency_concurrency).split(",")]
            scale = 1.0 if saturated else float(time_scale)
            think_s = 0.0 if saturated else float(think_ms) / 1000
            baseline = Path(baseline_src).resolve() if baseline_src else None
            with _services(Path(tmp) / m, scale, baseline, int(workers), redis_url) as targets:
                click.echo(
                    f"{m}: one simulated replica (fast-test, time scale {scale:g}), {n_tokens}-token "
                    f"streams, think time up to {think_s * 1000:g} ms, {secs:g} s per measurement, "
                    f"{n_rounds} round(s); targets: {', '.join(t.name for t in targets)}"
                    + (f"; tidal gateways with --workers {workers}" if int(workers) > 1 else "")
                )
                for level in levels:
                    rows += _level(targets, m, level, secs, n_rounds, n_tokens, think_s)
    _print(rows)
    _versus_baseline(rows)
    return rows


def _staleness(target: _Target) -> str:
    """Each gateway process's shared-state staleness over the run so far: the median and the
    p99 bucket bound of the oldest the other processes' counts got before a refresh, and the mean
    (one scrape answers for every worker, its series labelled ``worker``)."""
    text = urllib.request.urlopen(target.url + "/metrics", timeout=10).read().decode()
    name = "tidal_gateway_shared_state_staleness_seconds"
    by_worker: dict[str, list[Any]] = {}
    for s in parse_samples(text):
        if s.name.startswith(name):
            by_worker.setdefault(s.labels.get("worker", "0"), []).append(s)
    seen: list[str] = []
    for worker, samples in sorted(by_worker.items()):
        buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == f"{name}_bucket")
        count = next((s.value for s in samples if s.name == f"{name}_count"), 0.0)
        total = next((s.value for s in samples if s.name == f"{name}_sum"), 0.0)
        if not count:
            continue

        def q(f: float, buckets: list[tuple[float, float]] = buckets, count: float = count) -> str:
            bound = next(le for le, n in buckets if n >= f * count)
            return f"<={bound * 1000:g}" if bound != float("inf") else ">5000"

        seen.append(
            f"worker {worker}: p50 {q(0.5)} ms, p99 {q(0.99)} ms, mean {total / count * 1000:.0f} ms over {count:.0f} syncs"
        )
    return "; ".join(seen) or "not reported"


def _level(
    targets: list[_Target], mode: str, level: int, secs: float, n_rounds: int, n_tokens: int, think_s: float
) -> list[dict[str, Any]]:
    samples: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for n in range(n_rounds):
        # Interleaved, so drift hits every target alike, and in a rotated order each round: the
        # same code measured first and second in one round differs by about 0.1 ms of TTFT.
        for target in targets[n % len(targets) :] + targets[: n % len(targets)]:
            samples[target.name].append(
                asyncio.run(_measure(target, level, secs, min(2.0, secs / 3), n_tokens, think_s))
            )
    rows: list[dict[str, Any]] = []
    for target in targets:
        got = samples[target.name]
        row = {
            key: _median([g[key] for g in got]) if isinstance(got[0][key], float) else got[0][key]
            for key in got[0]
        }
        row["mode"] = mode
        row["requests"] = sum(g["requests"] for g in got)
        row["workers"] = target.workers
        if target.workers > 1:
            row["shared_state_staleness"] = _staleness(target)
            click.echo(
                f"{target.name} (--workers {target.workers}) shared-state staleness: {row['shared_state_staleness']}"
            )
        rows.append(row)
    for r in rows:
        for q in ("p50", "p99"):
            added = paired_added(samples[r["target"]], samples["direct"], f"ttft_{q}_s")
            r[f"added_ttft_{q}_s"] = _median(added)
            r[f"added_ttft_{q}_rounds_s"] = added
    return rows


def paired_added(target: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> list[float]:
    """What ``target`` added to ``key`` over direct, round by round: each round's figure minus
    direct's in the same round. The rounds are interleaved, so a drift of the machine's speed
    moves both sides of a pair alike; the median of the pairs is steadier than the difference
    of the two medians, which can pair one side's slow round with the other's fast one."""
    return [t[key] - d[key] for t, d in zip(target, direct, strict=True)]


def _versus_baseline(rows: list[dict[str, Any]]) -> None:
    """With ``--baseline-src``: tidal's added TTFT p50 against the baseline's, per level, and
    the two's difference round by round (both were measured in each round, beside direct)."""
    for base in (r for r in rows if r["target"] == "tidal-baseline"):
        level = (base["mode"], base["concurrency"])
        ours = next(r for r in rows if r["target"] == "tidal" and (r["mode"], r["concurrency"]) == level)
        a, b = ours["added_ttft_p50_s"], base["added_ttft_p50_s"]
        pairs = zip(ours["added_ttft_p50_rounds_s"], base["added_ttft_p50_rounds_s"], strict=True)
        diffs = [x - y for x, y in pairs]
        ratio = f" ({a / b:.2f} x)" if b > 0 else ""
        click.echo(
            f"{level[0]}, {level[1]} streams: tidal adds {a * 1000:+.2f} ms to TTFT p50, "
            f"tidal-baseline {b * 1000:+.2f} ms{ratio}; tidal minus tidal-baseline per round: "
            + ", ".join(f"{d * 1000:+.2f}" for d in diffs)
            + f" ms (median {_median(diffs) * 1000:+.2f})"
        )


def _median(values: list[Any]) -> Any:
    nums = sorted(v for v in values if v is not None)
    return nums[len(nums) // 2] if nums else None


def _print(rows: list[dict[str, Any]]) -> None:
    from tidal.cli.bench import print_table

    peer = {(r["mode"], r["concurrency"]): r for r in rows if r["target"] == "vllm-router"}
    table = []
    for r in rows:
        p = peer.get((r["mode"], r["concurrency"]))
        table.append(
            {
                "mode": r["mode"],
                "target": r["target"],
                "streams": r["concurrency"],
                "procs": r.get("workers", 1) if r["target"].startswith("tidal") else "-",
                "ttft_p50_ms": f"{r['ttft_p50_s'] * 1000:.1f}",
                "ttft_p99_ms": f"{r['ttft_p99_s'] * 1000:.1f}",
                "added_p50_ms": f"{r['added_ttft_p50_s'] * 1000:+.1f}",
                "added_p99_ms": f"{r['added_ttft_p99_s'] * 1000:+.1f}",
                "tok_s": f"{r['tokens_per_s']:.0f}",
                "tok_per_cpu_s": f"{r['tokens_per_cpu_s']:.0f}" if r.get("tokens_per_cpu_s") else "-",
                "vs_vllm_router": (
                    f"{r['tokens_per_cpu_s'] / p['tokens_per_cpu_s']:.2f}x tok/cpu"
                    if p and r.get("tokens_per_cpu_s") and p.get("tokens_per_cpu_s")
                    else "-"
                ),
            }
        )
    print_table(table)
