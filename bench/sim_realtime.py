"""The real-time half of ``tidal bench sim``: one ``tidal sim`` process under many streams.

Starts the simulated replica as its own process, keeps ``streams`` streaming chat completions
open for ``seconds`` (each client sends the next request when its stream ends), then reads the
server's own step accounting from ``/metrics`` (``tidal_sim_step_model_seconds_total`` against
``tidal_sim_step_actual_seconds_total``): how far real step times drift from the cost model.
Clients only count SSE events, so the load generator stays cheap.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import aiohttp

from tidal.replicas.launcher import sim_process
from tidal.replicas.wire.prom import parse_samples
from tidal.replicas.wire.sse import SSEDecoder

__all__ = ["realtime_check"]


async def _client(url: str, body: bytes, stop_at: float, stats: dict[str, Any]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as session:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            first = last = None
            events = 0
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    stats["errors"] += 1
                    await resp.read()
                    await asyncio.sleep(0.1)
                    continue
                decoder = SSEDecoder()
                async for piece in resp.content.iter_any():
                    n = len(decoder.feed(piece))
                    if n:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        last = now
                        events += n
            stats["requests"] += 1
            stats["events"] += events
            if first is not None:
                stats["ttft"].append(first - t0)
            # events = role chunk + tokens + usage + [DONE]: tokens = events - 3
            tokens = events - 3
            if first is not None and last is not None and tokens > 1:
                stats["tpot"].append((last - first) / (tokens - 1))


def _sim_counters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in parse_samples(text):
        if s.name.startswith("tidal_sim_") or s.name == "process_cpu_seconds_total":
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def _run(url: str, streams: int, seconds: float, max_tokens: int, prompt_words: int) -> dict[str, Any]:
    words = " ".join(f"word{i % 97}" for i in range(prompt_words))
    body = json.dumps(
        {
            "model": "sim",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    stats: dict[str, Any] = {"requests": 0, "events": 0, "errors": 0, "ttft": [], "tpot": []}
    async with aiohttp.ClientSession() as s:
        before = _sim_counters(await (await s.get(url + "/metrics")).text())
    stats["load"] = os.getloadavg()[0]
    stop_at = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(
        *(_client(url + "/v1/chat/completions", body, stop_at, stats) for _ in range(streams))
    )
    wall = time.perf_counter() - t0
    async with aiohttp.ClientSession() as s:
        after = _sim_counters(await (await s.get(url + "/metrics")).text())
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    stats["wall"] = wall
    stats["load"] = max(stats["load"], os.getloadavg()[0])
    stats["delta"] = d
    return stats


def realtime_check(
    *, preset: str, streams: int = 256, seconds: float = 30.0, max_tokens: int = 256, prompt_words: int = 400
) -> dict[str, Any]:
    """Run the check and return one result row."""
    proc = sim_process(preset, args=["--served-model-name", "sim", "--max-num-seqs", str(max(streams, 1))])
    proc.start()
    try:
        proc.wait_ready(60)
        stats = asyncio.run(_run(proc.url, streams, seconds, max_tokens, prompt_words))
    finally:
        proc.stop()
    d = stats["delta"]
    steps = d.get("tidal_sim_steps_total", 0.0)
    model_s = d.get("tidal_sim_step_model_seconds_total", 0.0)
    actual_s = d.get("tidal_sim_step_actual_seconds_total", 0.0)
    late = d.get("tidal_sim_step_lateness_seconds_total", 0.0)
    tokens = stats["events"] - 3 * stats["requests"]
    tpot = sorted(stats["tpot"])
    mean_step = model_s / steps if steps else float("nan")
    client_tpot = sum(tpot) / len(tpot) if tpot else float("nan")
    return {
        "check": f"real time: one tidal sim ({preset}), {streams} concurrent streams",
        "streams": streams,
        "wall_seconds": round(stats["wall"], 1),
        "requests": stats["requests"],
        "errors": stats["errors"],
        "tokens_per_second": round(tokens / stats["wall"]) if stats["wall"] else 0,
        "steps": int(steps),
        "model_step_ms": round(mean_step * 1e3, 2),
        "actual_step_ms": round(actual_s / steps * 1e3, 2) if steps else float("nan"),
        "step_timing_error_pct": round((actual_s / model_s - 1) * 100, 2) if model_s else float("nan"),
        "mean_lateness_ms": round(late / steps * 1e3, 2) if steps else float("nan"),
        "server_cpu_s_per_wall_s": round(d.get("process_cpu_seconds_total", 0.0) / stats["wall"], 2),
        "server_cpu_us_per_token": round(d.get("process_cpu_seconds_total", 0.0) / tokens * 1e6, 1)
        if tokens
        else 0,
        "client_tpot_ms": round(client_tpot * 1e3, 2),
        "load_avg_1m": round(stats["load"], 2),
        "client_tpot_error_pct": round((client_tpot / mean_step - 1) * 100, 2)
        if steps and tpot
        else float("nan"),
    }
