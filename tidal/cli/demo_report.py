"""The HTML report of ``tidal demo``: plots over time as inline SVG (no plotting library, no
network: the file opens anywhere) and the table of what happened when."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["render_report"]

# (title, unit, [(sample key, legend)])
CHARTS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("TTFT p95, interactive pool", "s", [("ttft_p95_s", "TTFT p95")]),
    ("Queue wait p95 at the gateway", "s", [("queue_wait_p95_s", "queue wait p95")]),
    ("KV-cache usage (busiest interactive replica)", "", [("kv_usage", "KV usage")]),
    ("Batch gate (1 = batch paused on the shared replicas)", "", [("gate_paused", "gate")]),
    (
        "Interactive replicas",
        "",
        [
            ("replicas_desired", "desired (autoscaler)"),
            ("replicas_ready", "ready"),
            ("chat_rps", "chat req/s / 4"),
        ],
    ),
    ("Batch lines per second (workers)", "lines/s", [("batch_lines_per_s", "batch lines/s")]),
    ("Canary group's share of traffic", "", [("canary_share", "canary weight share")]),
    (
        "Requests overflowed to the external provider",
        "",
        [("overflowed", "all features"), ("overflowed_regulated", "regulated-chat")],
    ),
]
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
EVENT_COLOURS = {
    "gate_paused": "#d62728",
    "gate_resumed": "#2ca02c",
    "scaled_up": "#1f77b4",
    "canary_rolled_back": "#ff7f0e",
    "overflowed": "#9467bd",
}
W, H, PAD_L, PAD_B, PAD_T = 900, 170, 56, 24, 10


def _chart(
    title: str,
    unit: str,
    series: list[tuple[str, str]],
    samples: Sequence[dict[str, Any]],
    events: Sequence[dict[str, Any]],
    phases: Sequence[dict[str, Any]],
    t_end: float,
) -> str:
    def value(s: dict[str, Any], key: str) -> float | None:
        v = s.get(key)
        if key == "chat_rps" and isinstance(v, (int, float)):
            v = v / 4
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    ys = [v for s in samples for k, _ in series if (v := value(s, k)) is not None]
    top = max([*ys, 1e-9]) * 1.1
    span = max(t_end, 1e-9)

    def x(t: float) -> float:
        return PAD_L + (W - PAD_L - 8) * t / span

    def y(v: float) -> float:
        return PAD_T + (H - PAD_T - PAD_B) * (1 - v / top)

    parts = [f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img">']
    for i, ph in enumerate(phases):
        end = phases[i + 1]["t_s"] if i + 1 < len(phases) else t_end
        shade = "#f4f4f4" if i % 2 == 0 else "#ffffff"
        parts.append(
            f'<rect x="{x(ph["t_s"]):.1f}" y="{PAD_T}" width="{max(0.0, x(end) - x(ph["t_s"])):.1f}" '
            f'height="{H - PAD_T - PAD_B}" fill="{shade}"/>'
        )
        parts.append(
            f'<text x="{x(ph["t_s"]) + 3:.1f}" y="{H - PAD_B - 4}" font-size="10" fill="#888">'
            f"{html.escape(ph['name'])}</text>"
        )
    parts.append(
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - 8}" y2="{H - PAD_B}" stroke="#999"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#999"/>'
        f'<text x="{PAD_L - 4}" y="{PAD_T + 8}" font-size="10" text-anchor="end">{top:.3g}{unit and " " + unit}</text>'
        f'<text x="{PAD_L - 4}" y="{H - PAD_B}" font-size="10" text-anchor="end">0</text>'
    )
    for tick in range(0, int(span) + 1, max(1, int(span // 8) or 1)):
        parts.append(
            f'<text x="{x(tick):.1f}" y="{H - 8}" font-size="10" text-anchor="middle">{tick} s</text>'
        )
    for e in events:
        colour = EVENT_COLOURS.get(e["kind"])
        if colour:
            parts.append(
                f'<line x1="{x(e["t_s"]):.1f}" y1="{PAD_T}" x2="{x(e["t_s"]):.1f}" y2="{H - PAD_B}" '
                f'stroke="{colour}" stroke-dasharray="3,3"><title>{html.escape(e["kind"])} at '
                f"{e['t_s']:.1f} s</title></line>"
            )
    legend = []
    for i, (key, label) in enumerate(series):
        points = [(x(s["t_s"]), y(val)) for s in samples if (val := value(s, key)) is not None]
        colour = COLOURS[i % len(COLOURS)]
        if points:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{path}"/>')
        legend.append(f'<span style="color:{colour}">&#9632; {html.escape(label)}</span>')
    parts.append("</svg>")
    return (
        f'<section class="chart"><h3>{html.escape(title)}</h3><div class="legend">{" ".join(legend)}</div>'
        + "".join(parts)
        + "</section>"
    )


def render_report(result: dict[str, Any]) -> str:
    """The whole page for a ``tidal demo`` result (``demo.json``'s content)."""
    samples, events, phases = result["samples"], result["events"], result["phases"]
    t_end = float(result["duration_s"])
    charts = "\n".join(_chart(t, u, s, samples, events, phases, t_end) for t, u, s in CHARTS)
    rows = "\n".join(
        f'<tr class="event {html.escape(e["kind"])}"><td>{e["t_s"]:.1f} s</td><td>{html.escape(e["kind"])}</td>'
        f"<td>{html.escape(str(e['detail']))}</td></tr>"
        for e in events
    )
    summary = "\n".join(
        f"<li><b>{html.escape(k.replace('_', ' '))}</b>: {html.escape(str(v))}</li>"
        for k, v in result["summary"].items()
    )
    legend = " ".join(
        f'<span style="color:{c}">&#9474; {html.escape(k)}</span>' for k, c in EVENT_COLOURS.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Tidal demo report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 960px; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }} h3 {{ font-size: 13px; margin: 14px 0 2px; }}
.legend {{ font-size: 12px; }} table {{ border-collapse: collapse; font-size: 13px; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }}
td:first-child {{ white-space: nowrap; }}
</style></head>
<body>
<h1>Tidal demo: a day of one GPU pool, {"quick run" if result.get("quick") else "full run"} ({t_end:.0f} s)</h1>
<p>{html.escape(result.get("setup", ""))}</p>
<h2>What it showed</h2>
<ul id="summary">{summary}</ul>
<h2>What happened when</h2>
<table id="events"><thead><tr><th>time</th><th>event</th><th>detail</th></tr></thead>
<tbody>
{rows}
</tbody></table>
<h2>Over time</h2>
<p class="legend">Event lines: {legend}. Shaded bands are the scenario's phases.</p>
{charts}
</body></html>
"""
