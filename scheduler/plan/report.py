"""A plan as text (``tidal plan``) and as an HTML report with plots (``tidal plan --html FILE``).

The HTML is one self-contained file: tables and matplotlib figures embedded as PNG (``data:``
URLs), no script, no external resource. matplotlib comes with the ``bench`` and ``dev`` extras.

Example::

    print(render_text(plan))
    Path("plan.html").write_text(render_html(plan))
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from tidal.scheduler.plan.planner import Plan

__all__ = ["render_html", "render_text"]

_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def _f(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _pct(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{a / b - 1:+.1%}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _option_rows(d: dict[str, Any]) -> list[list[str]]:
    cur = d["prices"]["currency"]
    rows = [
        [
            "tp",
            "per_node",
            "kv_tokens",
            "largest_batch",
            "batch_cap",
            "req_s_at_slo",
            "replicas",
            "ttft_p95 pred/replay",
            "tpot_p95 pred/replay",
            f"{cur}/Mtok",
            "break_even",
        ]
    ]
    for o in d["options"]:
        if o.get("error"):
            rows.append(
                [
                    str(o["tp"]),
                    str(o["replicas_per_node"]),
                    _f(o["kv_tokens_per_replica"]),
                    "-",
                    "-",
                    "-",
                    "-",
                    "infeasible",
                    "-",
                    "-",
                    "-",
                ]
            )
            continue
        rows.append(
            [
                str(o["tp"]),
                str(o["replicas_per_node"]),
                _f(o["kv_tokens_per_replica"]),
                _f(o["largest_batch_at_context_mix"]),
                _f(o["batch_cap_at_slo"]),
                _f(o["requests_per_s_at_slo"]),
                _f(o["recommended_replicas"]),
                f"{_f(o['predicted_ttft_p95_s'])} / {_f(o['replay_ttft_p95_s'])} s",
                f"{_f((o['predicted_tpot_p95_s'] or 0) * 1e3)} / {_f((o['replay_tpot_p95_s'] or 0) * 1e3 if o['replay_tpot_p95_s'] else None)} ms",
                _f(o["cost_per_million_tokens"]),
                _f(o["break_even_utilisation"]),
            ]
        )
    return rows


def render_text(plan: Plan) -> str:
    """The plan as the terminal shows it."""
    d = plan.as_dict()
    w = d["workload"]
    out = [
        f"== {d['model']} on {d['gpu']}: weights {d['weights']}, KV {d['kv_dtype']}",
        f"KV per token: {d['kv_bytes_per_token']:,} bytes ({d['kv_bytes_per_token_bf16']:,} in BF16, "
        f"{d['kv_bytes_per_token_fp8']:,} in FP8); 500 GiB of free HBM hold {d['kv_tokens_in_500_gb']:,} tokens",
        f"workload: {w['label']}; mean prompt {w['mean_prompt_tokens']:,.0f}, output {w['mean_output_tokens']:,.0f} "
        f"tokens; planned for a peak of {w['peak_rps']:.3g} req/s (warm buffer {d['warm_buffer']:.0%})",
        f"SLO: TTFT p95 <= {d['slo']['ttft_p95_s']:g} s, TPOT p95 <= {d['slo']['tpot_p95_s'] * 1e3:g} ms; "
        f"prices: {d['prices']['source']}",
        "",
        _table(_option_rows(d)),
    ]
    for o in d["options"]:
        if o.get("error"):
            out.append(f"TP={o['tp']}: {o['error']}")
        elif "prediction_error" in o:
            e = o["prediction_error"]
            out.append(
                f"TP={o['tp']}: prediction vs replay on {o['recommended_replicas']} replicas: TTFT p95 {e['ttft_p95']:+.1%}, "
                f"TPOT p95 {e['tpot_p95']:+.1%}"
            )
        if o.get("week"):
            wk = o["week"]
            out.append(
                f"TP={o['tp']}: week: {min(wk['replicas_per_hour'])}-{wk['peak_replicas']} replicas; reserve {wk['reserved_replicas']}, "
                f"{wk['on_demand_replica_hours']:g} on-demand and {wk['spot_replica_hours']:g} spot replica-hours; "
                f"{wk['gpu_hours']:,.0f} GPU-hours, {wk['cost_per_week']:,.0f} {d['prices']['currency']} a week"
            )
    if d["recommended_tp"] is not None:
        out.append(f"\ncheapest per token: TP={d['recommended_tp']}")
    tc = d.get("tp_comparison")
    if tc:
        a, b = tc["one_big"], tc["several_small"]
        out += [
            "",
            f"{tc['gpus']} GPUs of a node: {a['layout']} against {b['layout']}",
            _table(
                [
                    ["layout", "req_s", "ttft_p95", "tpot_p95", "kv_tokens/replica", "lost_if_1_gpu_fails"],
                    *[
                        [
                            s["layout"],
                            _f(s["requests_per_s"]),
                            _f(s["ttft_p95_s_at_recommended_size"]),
                            _f((s["tpot_p95_s_at_recommended_size"] or 0) * 1e3) + " ms",
                            _f(s["kv_tokens_per_replica"]),
                            f"{_f(s['capacity_lost_when_one_gpu_fails'])} req/s ({s['share_of_node_lost_when_one_gpu_fails']:.0%} of the node)",
                        ]
                        for s in (a, b)
                    ],
                ]
            ),
        ]
    eff = d["effects"]
    if eff["rows"]:
        base = next(o for o in d["options"] if o["tp"] == eff["base_tp"])
        rows = [
            [
                f"what-if (TP={eff['base_tp']})",
                "kv_tokens",
                "batch_cap",
                "req_s_at_slo",
                "vs_base",
                "cost/Mtok",
                "vs_base",
            ]
        ]
        rows.append(
            [
                "base plan",
                _f(base["kv_tokens_per_replica"]),
                _f(base["batch_cap_at_slo"]),
                _f(base["requests_per_s_at_slo"]),
                "",
                _f(base["cost_per_million_tokens"]),
                "",
            ]
        )
        for e in eff["rows"]:
            rows.append(
                [
                    e["name"],
                    _f(e["kv_tokens_per_replica"]),
                    _f(e["batch_cap_at_slo"]),
                    _f(e["requests_per_s_at_slo"]) if not e.get("error") else "infeasible",
                    _pct(e["requests_per_s_at_slo"], base["requests_per_s_at_slo"])
                    if not e.get("error")
                    else "-",
                    _f(e["cost_per_million_tokens"]),
                    _pct(e["cost_per_million_tokens"], base["cost_per_million_tokens"]),
                ]
            )
        out += ["", _table(rows)]
    lc = d.get("long_context_pool")
    if lc:
        line = f"\nlong-context pool (above {lc['threshold_tokens']:,} tokens): {lc['share_of_requests']:.1%} of requests"
        if lc.get("requests_per_s_at_slo"):
            line += (
                f"; {lc['requests_per_s_at_slo']:g} req/s per TP={lc['tp']} replica at TTFT p95 <= "
                f"{lc['slo']['ttft_p95_s']:g} s: {lc['replicas_at_peak']} replicas at the peak"
            )
            if "main_pool_replicas_at_peak" in lc:
                line += (
                    f", beside {lc['main_pool_replicas_at_peak']} for the rest "
                    f"(one pool for all: {lc['single_pool_replicas_at_peak']})"
                )
        elif lc.get("error"):
            line += f"; {lc['error']}"
        out.append(line)
    for n in d["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out)


# -- HTML --------------------------------------------------------------------------------------


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _figures(plan: Plan) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan.as_dict()
    figs: list[tuple[str, str]] = []
    ok = [o for o in plan.options if o.feasible]
    slo = plan.request.slo
    if ok:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for o in ok:
            if o.weekly:
                ax.step(range(168), o.weekly.replicas_per_hour, where="post", label=f"TP={o.tp}")
                ax.axhline(o.weekly.reserved_replicas, ls=":", lw=1, color=ax.lines[-1].get_color())
        ax.set_xticks(range(0, 168, 24), _DAYS)
        ax.set_ylabel("replicas")
        ax.set_title("Replicas per hour of the week (with the warm buffer); dotted: reserved")
        ax.legend()
        figs.append(("Replicas over the week", _png(fig)))

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for o in ok:
            assert o.capacity is not None
            pts = o.capacity.measured.points
            axes[0].plot([p.rate_rps for p in pts], [p.ttft_p95_s for p in pts], "o-", label=f"TP={o.tp}")
            axes[1].plot(
                [p.rate_rps for p in pts], [p.tpot_p95_s * 1e3 for p in pts], "o-", label=f"TP={o.tp}"
            )
            for ax in axes:
                ax.axvline(o.requests_per_s_at_slo, ls=":", lw=1, color=ax.lines[-1].get_color())
        axes[0].axhline(slo.ttft_p95_s, color="red", lw=1)
        axes[1].axhline(slo.tpot_p95_s * 1e3, color="red", lw=1)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("TTFT p95 (s)")
        axes[1].set_ylabel("TPOT p95 (ms)")
        for ax in axes:
            ax.set_xlabel("requests/s on one replica")
            ax.legend()
        fig.suptitle("Capacity measurement: replays of one replica (red: SLO; dotted: capacity)")
        figs.append(("Capacity measurement", _png(fig)))

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for o in ok:
            if not o.latency_by_size:
                continue
            ns = [n for n, _, _ in o.latency_by_size]
            line = axes[0].plot(ns, [a for _, a, _ in o.latency_by_size], "o-", label=f"TP={o.tp} predicted")
            axes[1].plot(ns, [b * 1e3 for _, _, b in o.latency_by_size], "o-", label=f"TP={o.tp} predicted")
            if o.replayed:
                c = line[0].get_color()
                axes[0].plot(
                    [o.recommended_replicas],
                    [o.replayed.ttft_p95_s],
                    "x",
                    ms=10,
                    color=c,
                    label=f"TP={o.tp} replay",
                )
                axes[1].plot(
                    [o.recommended_replicas],
                    [o.replayed.tpot_p95_s * 1e3],
                    "x",
                    ms=10,
                    color=c,
                    label=f"TP={o.tp} replay",
                )
        axes[0].axhline(slo.ttft_p95_s, color="red", lw=1)
        axes[1].axhline(slo.tpot_p95_s * 1e3, color="red", lw=1)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("TTFT p95 (s)")
        axes[1].set_ylabel("TPOT p95 (ms)")
        for ax in axes:
            ax.set_xlabel("replicas at the peak rate")
            ax.legend(fontsize=7)
        fig.suptitle("Fleet model by fleet size; x: replay at the recommended size")
        figs.append(("Predicted latency by fleet size", _png(fig)))

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for o in ok:
            for ax, stats_attr in ((axes[0], "ttft_samples"), (axes[1], "tpot_samples")):
                for which, stats, style in (("predicted", o.predicted, "-"), ("replay", o.replayed, "--")):
                    if stats is None:
                        continue
                    xs = sorted(getattr(stats, stats_attr))
                    if not xs:
                        continue
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    scale = 1e3 if stats_attr == "tpot_samples" else 1.0
                    ax.plot([x * scale for x in xs], ys, style, label=f"TP={o.tp} {which}")
        axes[0].set_xscale("log")
        axes[0].set_xlabel("TTFT (s)")
        axes[1].set_xlabel("TPOT (ms)")
        for ax in axes:
            ax.axhline(0.95, color="grey", lw=0.5)
            ax.set_ylabel("share of requests")
            ax.legend(fontsize=7)
        fig.suptitle("At the recommended size: fleet model against the replay")
        figs.append(("Latency distributions", _png(fig)))

    eff = d["effects"]["rows"]
    if eff:
        base = next(o for o in d["options"] if o["tp"] == d["effects"]["base_tp"])
        names = ["base plan"] + [e["name"] for e in eff]
        caps = [base["requests_per_s_at_slo"]] + [e["requests_per_s_at_slo"] for e in eff]
        fig, ax = plt.subplots(figsize=(9, 2.8))
        ax.barh(names, caps)
        ax.set_xlabel("requests/s per replica within the SLO")
        ax.set_title(f"Effect of precision and context caps (TP={d['effects']['base_tp']})")
        ax.invert_yaxis()
        figs.append(("Effects", _png(fig)))
    return figs


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(plan: Plan) -> str:
    """The plan as one self-contained HTML page with its plots."""
    d = plan.as_dict()
    title = f"Capacity plan: {d['model']} on {d['gpu']}"
    text = render_text(plan)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:24px;max-width:1100px}"
        "table{border-collapse:collapse;font-size:13px;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#f0f0f0}pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto}"
        ".warn{color:#a00}img{max-width:100%}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if d["prices"]["example"]:
        parts.append("<p class='warn'>Costs use the shipped EXAMPLE prices, not quotes.</p>")
    parts.append(
        f"<p>KV per token: <b>{d['kv_bytes_per_token']:,}</b> bytes ({d['kv_dtype'].upper()} KV); "
        f"500 GiB hold <b>{d['kv_tokens_in_500_gb']:,}</b> tokens. Workload: {html.escape(d['workload']['label'])}, "
        f"peak {d['workload']['peak_rps']:.3g} req/s. SLO: TTFT p95 &le; {d['slo']['ttft_p95_s']:g} s, "
        f"TPOT p95 &le; {d['slo']['tpot_p95_s'] * 1e3:g} ms.</p>"
    )
    parts.append("<h2>Options</h2>" + _html_table(_option_rows(d)))
    for name, src in _figures(plan):
        parts.append(f"<h2>{html.escape(name)}</h2><img alt='{html.escape(name)}' src='{src}'>")
    parts.append("<h2>The plan as text</h2><pre>" + html.escape(text) + "</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
