"""``tidal demo``: a day of one GPU pool, in a few minutes, that an operator can watch.

It starts the whole platform (``tidal up`` on the embedded fleet, tuned so each mechanism acts
within the demo's minutes) and plays a scenario through the gateway:

1. **night** -- little chat; an OpenAI batch, an eval, an embedding backfill and a summaries job
   fill the trough, on the batch pool and on the interactive replicas the gate lends to batch;
   the canary build at weight 0 is scored on the eval set and rolled back.
2. **evening ramp** -- chat grows towards an evening peak the fleet's calendar announces; the
   autoscaler adds a replica *before* the ramp starts.
3. **spike** -- a burst far above capacity: the gate pauses batch on the shared replicas, what
   cannot wait overflows to the external provider, and the regulated feature never does.
4. **calm** -- the gate gives the replicas back to batch.

Live progress in the terminal (rich); at the end ``DIR/demo.json`` (samples, phases and an
``events`` list of ``{"t_s", "kind", "detail"}``) and ``DIR/report.html`` (plots over time and
the table of events).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from tidal.replicas.wire.prom import Sample

__all__ = ["demo"]

CHAT_MODEL = "llama-3.1-8b-instruct"
EMBED_MODEL = "e5-mistral-7b-instruct"
STARTUP_ALLOWANCE_S = 40.0  # tidal up's start, before the night begins (a busy machine is slower)
# (name, share of the scenario)
PHASES = [("night", 0.35), ("evening ramp", 0.3), ("spike", 0.15), ("calm", 0.2)]


@dataclass(frozen=True)
class Plan:
    """The scenario's sizes: ``quick`` is about a minute of scenario, the full one five."""

    seconds: float
    night_rps: float = 1.0
    peak_rps: float = 6.0
    spike_rps: float = 40.0
    regulated_share: float = 0.1  # of the spike's requests, on the regulated feature
    batch_lines: int = 60
    batch_every_s: float = 5.0
    backfill_docs: int = 48
    summary_docs: int = 8

    def phase_bounds(self, night_s: float | None = None) -> list[tuple[str, float, float]]:
        """(phase, start, end) in seconds from the night's start; ``night_s`` overrides the
        night's planned length (it lasts until the calendar's evening peak)."""
        out, t = [], 0.0
        for name, share in PHASES:
            length = night_s if name == "night" and night_s is not None else share * self.seconds
            out.append((name, t, t + length))
            t += length
        return out


def _fleet(plan: Plan, ramp_at: datetime) -> dict[str, Any]:
    """The embedded fleet, on free ports, with each mechanism quick enough for the demo."""
    from tidal.cli.platform import embedded_fleet

    data = embedded_fleet()
    interactive = data["pools"]["interactive"]
    # Two requests at a time per replica: the spike queues at the gateway within a second.
    interactive.update(max_inflight_per_replica=2, min_inflight_per_replica=2)
    ramp_s = PHASES[1][1] * plan.seconds
    # The canary replica counts in the pool: 3 run at start, the evening peak needs a 4th.
    interactive["autoscale"] = {
        "min_replicas": 2,
        "max_replicas": 4,
        "capacity_rps_per_replica": plan.peak_rps / 3.5,
        "cold_start_s": 5,
        "decision_interval_s": 1,
        "scale_down_stabilisation_s": 3600,
        # The calendar knows the evening peak: replicas come up before it, not after.
        "events": [
            {
                "name": "evening-peak",
                "start": ramp_at.isoformat(),
                "end": (ramp_at + timedelta(seconds=ramp_s + PHASES[2][1] * plan.seconds)).isoformat(),
                "expected_rps": plan.peak_rps,
                "lead_s": max(5.0, 0.5 * PHASES[0][1] * plan.seconds),
            }
        ],
    }
    data["gate"]["hold_s"] = 2
    return data


# -- what the platform says ---------------------------------------------------------------------


def _samples(text: str) -> list[Sample]:
    """A ``/metrics`` page's samples; none for a page that is missing or cut short."""
    from tidal.replicas.wire.prom import parse_samples

    with contextlib.suppress(ValueError):
        return list(parse_samples(text))
    return []


def _mean(samples: list[Sample], name: str, **labels: str) -> float | None:
    from tidal.replicas.wire.prom import sample_total

    count = sample_total(samples, name + "_count", **labels)
    return sample_total(samples, name + "_sum", **labels) / count if count else None


@dataclass
class Watch:
    """Samples the platform twice a second and turns changes into events."""

    started: float
    data_dir: Path | None = None  # the platform's, where the scheduler records canary outcomes
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "night"
    chat_sent: int = 0
    _prev: dict[str, Any] = field(default_factory=dict)
    _rolled_back_seen: bool = False
    _last_overflow_event: float = -math.inf

    def t(self) -> float:
        return time.monotonic() - self.started

    def event(self, kind: str, detail: str) -> None:
        self.events.append({"t_s": round(self.t(), 2), "kind": kind, "detail": detail})

    def observe(self, load: dict[str, Any], sched: str, gateway: str, worker: str) -> dict[str, Any]:
        from tidal.replicas.wire.prom import sample_total

        s_sched, s_gw, s_worker = _samples(sched), _samples(gateway), _samples(worker)
        pool = (load.get("pools") or {}).get("interactive") or {}
        t = self.t()
        lines = sample_total(s_worker, "tidal_worker_lines_total")
        prev = self._prev
        dt = t - prev["t_s"] if prev else 0.0
        sample = {
            "t_s": round(t, 2),
            "phase": self.phase,
            "chat_rps": self._chat_rate(t),
            "chat_sent": self.chat_sent,
            "ttft_p95_s": pool.get("ttft_p95_s"),
            "queue_wait_p95_s": pool.get("queue_wait_p95_s"),
            "kv_usage": pool.get("kv_cache_usage_max"),
            "gate_paused": sample_total(s_sched, "tidal_gate_paused", pool="interactive"),
            "replicas_desired": sample_total(
                s_sched, "tidal_autoscaler_desired_replicas", pool="interactive"
            ),
            "replicas_ready": sample_total(s_sched, "tidal_autoscaler_ready_replicas", pool="interactive"),
            "canary_share": sample_total(s_sched, "tidal_canary_share_ratio", group="canary"),
            "batch_lines": lines,
            "batch_lines_per_s": max(0.0, lines - prev.get("batch_lines", lines)) / dt if dt > 0 else 0.0,
            "overflowed": sample_total(s_gw, "tidal_admission_outcomes_total", outcome="overflowed"),
            "overflowed_regulated": sample_total(
                s_gw, "tidal_admission_outcomes_total", outcome="overflowed", feature="regulated-chat"
            ),
            "refused_regulated": sample_total(
                s_gw, "tidal_admission_outcomes_total", outcome="rejected_429", feature="regulated-chat"
            ),
            # Pauses the lane confirmed, seconds on average (the scheduler's histogram)
            "pause_confirm_s": _mean(
                s_sched, "tidal_gate_actuation_seconds", pool="interactive", action="pause"
            ),
        }
        if prev:
            self._changes(prev, sample, s_sched)
        self.samples.append(sample)
        self._prev = sample
        return sample

    def _chat_rate(self, t: float) -> float:
        """Chat requests sent per second over the last two seconds or so."""
        base = self.samples[-4] if len(self.samples) >= 4 else (self.samples[0] if self.samples else None)
        if base is None or t <= base["t_s"]:
            return 0.0
        return float((self.chat_sent - base["chat_sent"]) / (t - base["t_s"]))

    def _canary_detail(self, labels: dict[str, str]) -> str:
        """The scheduler's recorded reason, with the eval scores, when it can be read."""
        detail = f"group {labels.get('group')}: {labels.get('reason')}"
        if self.data_dir is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                path = self.data_dir / "scheduler" / "canary-outcomes.json"
                done = json.loads(path.read_text())["pools"]["interactive"]
                detail = f"group {done['group']} rolled back on its {done['reason']}"
        return detail

    def _changes(self, prev: dict[str, Any], now: dict[str, Any], sched: list[Sample]) -> None:
        if now["gate_paused"] > prev["gate_paused"]:
            self.event("gate_paused", f"batch paused on the shared interactive replicas ({self.phase})")
        elif now["gate_paused"] < prev["gate_paused"]:
            self.event("gate_resumed", f"the shared interactive replicas lent to batch again ({self.phase})")
        if now["replicas_desired"] > prev["replicas_desired"] > 0:
            self.event(
                "scaled_up",
                f"autoscaler: interactive {prev['replicas_desired']:.0f} -> {now['replicas_desired']:.0f} "
                f"replicas ({self.phase})",
            )
        if now["replicas_ready"] > prev["replicas_ready"] > 0:
            self.event("replica_ready", f"interactive: {now['replicas_ready']:.0f} replicas ready")
        if not self._rolled_back_seen:
            for s in sched:
                if (
                    s.name == "tidal_canary_outcomes_total"
                    and s.labels.get("outcome") == "rolled_back"
                    and s.value
                ):
                    self._rolled_back_seen = True
                    self.event("canary_rolled_back", self._canary_detail(s.labels))
        if now["overflowed"] > prev["overflowed"] and self.t() - self._last_overflow_event >= 2.0:
            self._last_overflow_event = self.t()
            self.event(
                "overflowed",
                f"{now['overflowed']:.0f} requests sent to the external provider so far; regulated-chat: "
                f"{now['overflowed_regulated']:.0f} overflowed, {now['refused_regulated']:.0f} refused (429)",
            )


# -- the scenario -------------------------------------------------------------------------------


async def _chat(session: Any, url: str, key: str, feature: str, n: int, counts: dict[str, int]) -> None:
    import aiohttp

    body = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": f"demo {feature} {n} {secrets.token_hex(3)}"}],
        "max_tokens": 48,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}", "X-Tidal-Feature": feature}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            async for _ in resp.content:
                pass
            counts[str(resp.status)] = counts.get(str(resp.status), 0) + 1
    except (aiohttp.ClientError, TimeoutError):
        counts["error"] = counts.get("error", 0) + 1


def _rate(plan: Plan, t: float, bounds: list[tuple[str, float, float]]) -> tuple[str, float]:
    for name, start, end in bounds:
        if start <= t < end:
            if name == "evening ramp":
                return name, plan.night_rps + (plan.peak_rps - plan.night_rps) * (t - start) / (end - start)
            if name == "spike":
                return name, plan.spike_rps
            return name, plan.night_rps
    return "calm", plan.night_rps


async def _traffic(
    p: Any, plan: Plan, watch: Watch, bounds: list[tuple[str, float, float]], total: float
) -> dict[str, int]:
    import aiohttp

    counts: dict[str, int] = {}
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        n = 0
        next_at = 0.0
        while (t := watch.t()) < total:
            phase, rate = _rate(plan, t, bounds)
            if phase != watch.phase:
                watch.phase = phase
                watch.event("phase", f"{phase} begins ({rate:.0f} chat requests/s)")
            if t >= next_at:
                regulated = phase == "spike" and (n % round(1 / plan.regulated_share) == 0)
                feature = "regulated-chat" if regulated else "chat"
                task = asyncio.create_task(_chat(session, p.url, p.key, feature, n, counts))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                watch.chat_sent = n
                next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, min(0.05, next_at - watch.t())))
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    return counts


async def _batch_work(p: Any, plan: Plan, watch: Watch, until: float) -> list[dict[str, str]]:
    """The night's batch: an eval, an embedding backfill and summaries at once, and an OpenAI
    batch every ``plan.batch_every_s`` until ``until`` (the spike's end), so batch fills the
    trough and meets the spike."""
    import httpx
    import openai

    from tidal.defaults import DEFAULT_FLEET_PATH

    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=p.key, max_retries=3)
    submitted: list[dict[str, str]] = []

    async def one_batch(n: int) -> None:
        lines = "".join(
            json.dumps(
                {
                    "custom_id": f"night-{n}-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": CHAT_MODEL,
                        "messages": [{"role": "user", "content": f"summarise ticket {i} of batch {n}"}],
                        "max_tokens": 64,
                    },
                }
            )
            + "\n"
            for i in range(plan.batch_lines)
        ).encode()
        f = await client.files.create(file=(f"night-{n}.jsonl", lines), purpose="batch")
        b = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        submitted.append({"kind": "batch", "id": b.id})
        if n == 0:
            watch.event(
                "batch_submitted",
                f"OpenAI batch {b.id}: {plan.batch_lines} chat lines (one every {plan.batch_every_s:g} s "
                "until the spike ends)",
            )

    async with client:
        docs = [
            (
                "eval",
                CHAT_MODEL,
                DEFAULT_FLEET_PATH.with_name("eval-set.jsonl").read_bytes(),
                {"scorer": "exact"},
            ),
            (
                "embedding_backfill",
                EMBED_MODEL,
                "".join(
                    json.dumps({"id": f"doc-{i}", "text": f"catalogue entry {i}"}) + "\n"
                    for i in range(plan.backfill_docs)
                ).encode(),
                {},
            ),
            (
                "summaries",
                CHAT_MODEL,
                "".join(
                    json.dumps({"id": f"report-{i}", "text": "the quarterly numbers " * 60}) + "\n"
                    for i in range(plan.summary_docs)
                ).encode(),
                {},
            ),
        ]
        for kind, model, data, options in docs:
            f = await client.files.create(file=(f"{kind}.jsonl", data), purpose="user_data")
            resp = await client.post(
                "/jobs",
                body={"kind": kind, "input_file_id": f.id, "model": model, "options": options},
                cast_to=httpx.Response,
            )
            job = resp.json()
            submitted.append({"kind": kind, "id": job["id"]})
            watch.event("job_submitted", f"{kind} job {job['id']} on {model}")
        n = 0
        while watch.t() < until:
            await one_batch(n)
            n += 1
            await asyncio.sleep(max(0.0, min(plan.batch_every_s, until - watch.t())))
    return submitted


async def _final_states(p: Any, submitted: list[dict[str, str]]) -> list[dict[str, Any]]:
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=p.url + "/v1", headers={"Authorization": f"Bearer {p.key}"}) as c:
        for s in submitted:
            path = f"/batches/{s['id']}" if s["kind"] == "batch" else f"/jobs/{s['id']}"
            with contextlib.suppress(httpx.HTTPError, ValueError):
                got = (await c.get(path, timeout=10)).json()
                counts = (
                    got.get("request_counts") or (got.get("current_batch") or {}).get("request_counts") or {}
                )
                out.append({**s, "status": got.get("status"), "request_counts": counts})
    return out


async def _sample(p: Any, watch: Watch, until: float, show: Any) -> None:
    import httpx

    admin = {"Authorization": f"Bearer {p.admin_key}"}
    async with httpx.AsyncClient(timeout=5.0) as c:
        while watch.t() < until:

            async def get(url: str, headers: dict[str, str] | None = None) -> str:
                try:
                    return (await c.get(url, headers=headers)).text
                except httpx.HTTPError:
                    return ""

            load_text, sched, gw, worker = await asyncio.gather(
                get(p.url + "/admin/load", admin),
                get(p.scheduler_url + "/metrics"),
                get(p.url + "/metrics"),
                get(p.worker_metrics_url + "/metrics"),
            )
            try:
                load = json.loads(load_text) if load_text else {}
            except ValueError:
                load = {}
            show(watch.observe(load, sched, gw, worker))
            await asyncio.sleep(0.5)


def _summary(watch: Watch, bounds: list[tuple[str, float, float]], counts: dict[str, int]) -> dict[str, Any]:
    starts = {name: start for name, start, _ in bounds}
    first: dict[str, float] = {}
    for e in watch.events:
        first.setdefault(e["kind"], e["t_s"])
    paused_after_spike = [
        e["t_s"] - starts["spike"]
        for e in watch.events
        if e["kind"] == "gate_paused" and e["t_s"] >= starts["spike"]
    ]
    last = watch.samples[-1] if watch.samples else {}
    out: dict[str, Any] = {
        "chat requests by status": dict(sorted(counts.items())),
        "gate paused after the spike began": (
            f"{paused_after_spike[0]:.1f} s (once the queue wait p95 passed the gate's threshold; "
            f"the lane confirmed a pause in {last.get('pause_confirm_s') or 0:.2f} s on average)"
            if paused_after_spike
            else "not seen"
        ),
        "scaled up before the evening ramp": (
            f"{starts['evening ramp'] - first['scaled_up']:.1f} s before"
            if "scaled_up" in first and first["scaled_up"] <= starts["evening ramp"]
            else (
                f"{first['scaled_up'] - starts['evening ramp']:.1f} s after"
                if "scaled_up" in first
                else "not seen"
            )
        ),
        "canary": next(
            (e["detail"] for e in watch.events if e["kind"] == "canary_rolled_back"), "not decided"
        ),
        "overflowed to the external provider": f"{last.get('overflowed', 0):.0f} requests",
        "regulated-chat overflowed": f"{last.get('overflowed_regulated', 0):.0f} (refused with 429: "
        f"{last.get('refused_regulated', 0):.0f})",
        "batch lines done by the workers": f"{last.get('batch_lines', 0):.0f}",
    }
    return out


def _work_line(states: list[dict[str, Any]]) -> str:
    """E.g. ``12 batches (11 completed, 1 in_progress); eval completed; ...``."""
    batches = [w["status"] for w in states if w["kind"] == "batch"]
    by = ", ".join(f"{batches.count(st)} {st}" for st in sorted(set(map(str, batches))))
    jobs = "; ".join(f"{w['kind']} {w['status']}" for w in states if w["kind"] != "batch")
    return f"{len(batches)} batches ({by}); {jobs}"


def _display(plan: Plan, quiet: bool) -> tuple[Any, Any]:
    """A live view (rich, in a terminal) or plain event lines (anywhere else)."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    console = Console()
    if quiet or not console.is_terminal:
        return None, None

    def render(watch: Watch, sample: dict[str, Any]) -> Table:
        table = Table(title=f"tidal demo: {sample['phase']} (at {sample['t_s']:.0f} s)")
        table.add_column("signal")
        table.add_column("now")

        def f(v: Any, unit: str = "") -> str:
            return f"{v:.2f}{unit}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"

        rows = [
            ("chat requests/s", f(sample["chat_rps"])),
            ("TTFT p95", f(sample["ttft_p95_s"], " s")),
            ("queue wait p95", f(sample["queue_wait_p95_s"], " s")),
            ("KV usage", f(sample["kv_usage"])),
            ("batch gate", "PAUSED" if sample["gate_paused"] else "open (lent to batch)"),
            (
                "interactive replicas",
                f"{sample['replicas_ready']:.0f} ready / {sample['replicas_desired']:.0f} desired",
            ),
            ("batch lines/s", f(sample["batch_lines_per_s"])),
            ("canary share", f(sample["canary_share"])),
            ("overflowed", f"{sample['overflowed']:.0f} (regulated {sample['overflowed_regulated']:.0f})"),
        ]
        for r in rows:
            table.add_row(*r)
        for e in watch.events[-6:]:
            table.add_row(f"[dim]{e['t_s']:.1f} s {e['kind']}", f"[dim]{e['detail']}")
        return table

    live = Live(console=console, refresh_per_second=4)
    return live, render


def run_demo(out_dir: Path, quick: bool, seconds: float | None = None, quiet: bool = False) -> dict[str, Any]:
    """Play the scenario on a fresh ``tidal up``; write ``demo.json`` and ``report.html``."""
    import yaml

    from tidal.cli.demo_report import render_report
    from tidal.cli.platform import local_platform

    plan = Plan(seconds=seconds or (60.0 if quick else 300.0))
    bounds = plan.phase_bounds()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "platform"
    # The calendar's evening peak begins when the night ends (tidal up's start allowed for).
    ramp_at = datetime.now(UTC) + timedelta(seconds=STARTUP_ALLOWANCE_S + bounds[1][1])
    fleet_path = out_dir / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(_fleet(plan, ramp_at), sort_keys=False))
    live, render = _display(plan, quiet)

    def say(msg: str) -> None:
        if live is None:
            click.echo(msg)

    with local_platform(fleet_path, work, log=say) as p:
        # The night lasts until the calendar's evening peak: the timeline is anchored to it.
        bounds = plan.phase_bounds(night_s=max(5.0, (ramp_at - datetime.now(UTC)).total_seconds()))
        total = bounds[-1][2]
        watch = Watch(started=time.monotonic(), data_dir=p.data_dir)
        printed = 0

        def show(sample: dict[str, Any]) -> None:
            nonlocal printed
            if live is not None:
                live.update(render(watch, sample))
            else:
                for e in watch.events[printed:]:
                    click.echo(f"  {e['t_s']:6.1f} s  {e['kind']:<18} {e['detail']}")
                printed = len(watch.events)

        async def scenario() -> tuple[dict[str, int], list[dict[str, Any]]]:
            sampler = asyncio.create_task(_sample(p, watch, total + 1.0, show))
            work = asyncio.create_task(_batch_work(p, plan, watch, until=bounds[2][2]))
            counts = await _traffic(p, plan, watch, bounds, total)
            submitted = await work
            await sampler
            return counts, await _final_states(p, submitted)

        with live or contextlib.nullcontext():
            counts, work_states = asyncio.run(scenario())
    phases = [{"name": name, "t_s": round(start, 2)} for name, start, _ in bounds]
    result = {
        "quick": quick,
        "duration_s": round(total, 2),
        "setup": (
            "tidal up on the embedded fleet (simulated replicas): interactive pool of 2-3 replicas at 2 "
            "requests each, a canary build at weight 0, a batch pool, a spot pool, an embedding pool, an "
            f"external provider stand-in; chat {plan.night_rps:g} requests/s at night, rising to "
            f"{plan.peak_rps:g} in the evening, a spike of {plan.spike_rps:g} "
            f"({plan.regulated_share:.0%} on the regulated feature)"
        ),
        "phases": phases,
        "events": watch.events,
        "summary": {**_summary(watch, bounds, counts), "batch work at the end": _work_line(work_states)},
        "batch_work": work_states,
        "samples": watch.samples,
    }
    (out_dir / "demo.json").write_text(json.dumps(result, indent=1))
    (out_dir / "report.html").write_text(render_report(result))
    return result


@click.command()
@click.option("--quick", is_flag=True, help="About a minute of scenario instead of five.")
@click.option(
    "--out",
    "out_dir",
    default=Path("demo-out"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where demo.json, report.html and the platform's logs go.",
)
@click.option("--seconds", default=None, type=click.FloatRange(20, 3600), help="The scenario's length.")
@click.option("--quiet", is_flag=True, help="Print events as lines instead of the live view.")
def demo(quick: bool, out_dir: Path, seconds: float | None, quiet: bool) -> None:
    """Watch the platform work: night batch, an evening ramp met ahead of time, a spike that
    pauses batch and overflows, a bad canary rolled back. Writes DIR/report.html and DIR/demo.json.

    Example: tidal demo --quick --out demo-out
    """
    result = run_demo(out_dir, quick, seconds, quiet)
    click.echo("")
    for k, v in result["summary"].items():
        click.echo(f"  {k}: {v}")
    click.echo(f"\nreport: {out_dir / 'report.html'}   data: {out_dir / 'demo.json'}")
