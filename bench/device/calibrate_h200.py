"""Check the simulator on a real H200: real vLLM with random weights, the calibration points, and
the figures beside the published and simulated ones.

For each shape -- Llama-3.1-8B in BF16 and Llama-3.1-70B with FP8 weights, both on one H200
(presets ``llama-3.1-8b-h200`` and ``llama-3.1-70b-fp8-h200-tp1``) -- the script

1. writes a model directory locally: the model's ``config.json`` (for FP8, a
   ``quantization_config`` of an FP8 checkpoint, so vLLM allocates FP8 weights: 70 GB, not the
   141 GB a BF16 70B needs) and a word-level tokenizer whose 128,256 tokens are ``t0`` ...
   ``t128255``. Nothing is downloaded: ``vllm serve --load-format dummy`` fills the weights
   with random values, so the timing is the real model's and the text is noise;
2. starts ``vllm serve`` on it and waits for ``/health``;
3. runs the calibration points through the OpenAI API with prompts given as token ids
   (``ignore_eos``: every request generates exactly its ``max_tokens``):

   * ``latency``: 8 requests of 32 prompt tokens and 128 output tokens at once, as vLLM's nightly
     ``latency_*`` tests (their figure: end-to-end ms of the batch; the median of 5 runs);
   * ``throughput``: 200 requests at once with the ShareGPT-shaped lengths the simulator's
     calibration uses (:func:`replicas.sim.calibrate.sharegpt_lengths`), requests/s;
   * ``closed-loop c=N``: N clients, each sending its next request when the last one ends
     (2,000 prompt and 200 output tokens), mean TTFT, mean inter-token latency, output tokens/s;

4. replays the same experiments on the simulated replica in virtual time (same engine limits),
   and writes each point's published figure (vLLM CI on H200, where there is one), simulated
   figure and measured figure to ``--out`` (default ``bench/device/results/``), one JSON file
   per run, and prints them as a table.

Run it on a machine with one H200 and vLLM installed (GPU build)::

    python -m tidal.bench.device.calibrate_h200                  # both shapes, ~15 minutes
    python -m tidal.bench.device.calibrate_h200 --shapes 8b --quick
    python -m tidal.bench.device.calibrate_h200 --dry-run        # write the model dirs, print the vLLM
                                                            # commands and the simulated figures
    python -m tidal.bench.device.calibrate_h200 --target http://127.0.0.1:8000 --shapes 8b
                                                            # points against a running server
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from tidal.replicas.sim.calibrate import sharegpt_lengths
from tidal.replicas.sim.cost import ModelSpec
from tidal.replicas.sim.presets import Preset, get_preset
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster

__all__ = [
    "SHAPES",
    "Point",
    "Shape",
    "main",
    "measure_point",
    "points_for",
    "simulate_point",
    "vllm_command",
    "write_model_dir",
]

VOCAB = 128256
BOS, EOS = 128000, 128009
RESULTS = Path(__file__).resolve().parent / "results"
# vLLM's nightly CI on an H200 (buildkite vllm/performance-benchmark 9515); see calibrate.py.
PUBLISHED_8B = {"latency": 833.4, "throughput": 22.6}


@dataclass(frozen=True)
class Shape:
    """One model shape on one GPU: the preset the simulator uses and the vLLM engine limits."""

    key: str
    preset: str
    fp8_weights: bool
    max_model_len: int = 8192
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    clients: tuple[int, ...] = (1, 16, 64)
    published: dict[str, float] = field(default_factory=dict)

    @property
    def spec(self) -> ModelSpec:
        return get_preset(self.preset).model

    def sim_preset(self) -> Preset:
        """The preset with this run's engine limits (what the server is started with)."""
        return replace(
            get_preset(self.preset),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )


SHAPES: dict[str, Shape] = {
    "8b": Shape("8b", "llama-3.1-8b-h200", False, published=PUBLISHED_8B),
    "70b-fp8": Shape("70b-fp8", "llama-3.1-70b-fp8-h200-tp1", True, clients=(1, 8, 32)),
}


@dataclass(frozen=True)
class Point:
    """One experiment: ``kind`` is latency, throughput or closed-loop."""

    name: str
    kind: str
    unit: str
    clients: int = 0
    prompt: int = 0
    output: int = 0
    metric: str = ""  # closed-loop: ttft_ms, itl_ms or output_tok_s


def points_for(shape: Shape, *, quick: bool = False) -> list[Point]:
    pts = [
        Point("latency bs8 32/128 (e2e ms)", "latency", "ms"),
        Point("throughput 200 ShareGPT-shaped (req/s)", "throughput", "req/s"),
    ]
    for c in shape.clients[:2] if quick else shape.clients:
        for metric, unit in (("ttft_ms", "ms"), ("itl_ms", "ms"), ("output_tok_s", "tok/s")):
            pts.append(
                Point(f"closed-loop c={c} 2000/200: {metric}", "closed-loop", unit, c, 2000, 200, metric)
            )
    return pts


# -- the model directory ------------------------------------------------------------------------


def model_config(shape: Shape) -> dict[str, Any]:
    """A Llama ``config.json`` of the shape (vLLM reads the architecture and sizes from it)."""
    m = shape.spec
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_model_len,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }
    if shape.fp8_weights:
        # An FP8 checkpoint's declaration (as Meta's and Neural Magic's FP8 Llamas): vLLM creates
        # the linear layers' weights in FP8 (per-tensor scales, dynamic activation scales); the
        # embeddings and LM head stay BF16, as the simulator's FP8 presets assume.
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return cfg


def write_model_dir(shape: Shape, directory: Path) -> Path:
    """Write ``config.json``, ``generation_config.json`` and the word-level tokenizer; no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(shape), indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False})
    )
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": f"t{i}",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in (BOS, EOS)
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": f"t{BOS}",
                "eos_token": f"t{EOS}",
                "unk_token": "t0",
                "model_max_length": shape.max_model_len,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": f"t{BOS}", "eos_token": f"t{EOS}", "unk_token": "t0"})
    )
    return directory


def vllm_command(shape: Shape, model_dir: Path, port: int, vllm_bin: str = "vllm") -> list[str]:
    """``vllm serve`` of the shape on one GPU with random weights and the simulator's engine limits."""
    return [
        vllm_bin,
        "serve",
        str(model_dir),
        "--served-model-name",
        "calib",
        "--tokenizer",
        str(model_dir),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "1",
        "--max-model-len",
        str(shape.max_model_len),
        "--max-num-seqs",
        str(shape.max_num_seqs),
        "--max-num-batched-tokens",
        str(shape.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(shape.gpu_memory_utilization),
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


# -- the simulator's figures --------------------------------------------------------------------


def _unique_prompt(i: int, n: int) -> list[int]:
    # Distinct prompts (no prefix-cache hits between them), as in replicas/sim/calibrate.py.
    return [(i * 7919 + j * 104729) % 120000 + 1000 for j in range(n)]


def _sim_at_once(preset: Preset, lengths: Sequence[tuple[int, int]]) -> list[SimResult]:
    cluster = VirtualCluster(preset, 1)
    out: list[SimResult] = []
    for i, (p, o) in enumerate(lengths):
        cluster.submit(
            0, SimRequest(f"r{i}", max_tokens=o, prompt_token_ids=_unique_prompt(i, p), on_finish=out.append)
        )
    cluster.run()
    return out


def _sim_closed_loop(preset: Preset, clients: int, prompt: int, output: int, rounds: int) -> dict[str, float]:
    cluster = VirtualCluster(preset, 1)
    measured: list[SimResult] = []
    counter = [0]

    def send(c: VirtualCluster, client: int, rnd: int) -> None:
        counter[0] += 1

        def done(res: SimResult) -> None:
            if rnd > 0:
                measured.append(res)
            if rnd + 1 < rounds:
                c.at(c.now, lambda cc: send(cc, client, rnd + 1))

        ids = _unique_prompt(counter[0] + 10_000, prompt)
        c.submit(0, SimRequest(f"c{client}-{rnd}", max_tokens=output, prompt_token_ids=ids, on_finish=done))

    for k in range(clients):
        cluster.at(0.0, functools.partial(send, client=k, rnd=0))
    cluster.run()
    return _closed_loop_figures([(r.ttft or 0.0, r.tpot or 0.0, r.e2e) for r in measured], clients, output)


def _closed_loop_figures(
    rows: Sequence[tuple[float, float, float]], clients: int, output: int
) -> dict[str, float]:
    return {
        "ttft_ms": statistics.fmean(r[0] for r in rows) * 1e3,
        "itl_ms": statistics.fmean(r[1] for r in rows) * 1e3,
        "output_tok_s": clients * output / statistics.fmean(r[2] for r in rows),
    }


def simulate_point(shape: Shape, point: Point, *, rounds: int = 3) -> float:
    """The point replayed on the simulated replica (virtual time)."""
    preset = shape.sim_preset()
    if point.kind == "latency":
        return max(r.finish_time for r in _sim_at_once(preset, [(32, 128)] * 8)) * 1e3
    if point.kind == "throughput":
        res = _sim_at_once(preset, sharegpt_lengths(200))
        return len(res) / max(r.finish_time for r in res)
    return _sim_closed_loop(preset, point.clients, point.prompt, point.output, rounds)[point.metric]


# -- the real server's figures ------------------------------------------------------------------


@dataclass
class _Timing:
    start: float
    first: float | None = None
    end: float = 0.0
    tokens: int = 0


async def _complete(
    session: aiohttp.ClientSession, url: str, model: str, ids: list[int], max_tokens: int
) -> _Timing:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = _Timing(time.perf_counter())
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if chunk.get("choices"):
                if t.first is None:
                    t.first = now
                t.end = now
            usage = chunk.get("usage")
            if usage:
                t.tokens = int(usage.get("completion_tokens") or 0)
    if t.first is None or t.tokens != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {t.tokens}")
    return t


async def _at_once(url: str, model: str, lengths: Sequence[tuple[int, int]], offset: int) -> float:
    """Seconds from sending all requests at once to the last one finishing."""
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        t0 = time.perf_counter()
        done = await asyncio.gather(
            *(_complete(s, url, model, _unique_prompt(offset + i, p), o) for i, (p, o) in enumerate(lengths))
        )
    return max(t.end for t in done) - t0


async def _closed_loop(
    url: str, model: str, clients: int, prompt: int, output: int, rounds: int
) -> dict[str, float]:
    rows: list[tuple[float, float, float]] = []
    counter = [50_000]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            for rnd in range(rounds):
                counter[0] += 1
                t = await _complete(s, url, model, _unique_prompt(counter[0], prompt), output)
                assert t.first is not None
                if rnd > 0:
                    rows.append(
                        (t.first - t.start, (t.end - t.first) / max(1, t.tokens - 1), t.end - t.start)
                    )

        await asyncio.gather(*(client() for _ in range(clients)))
    return _closed_loop_figures(rows, clients, output)


async def measure_point(url: str, model: str, point: Point, *, repeats: int = 5, rounds: int = 3) -> float:
    """The point measured on the server at ``url`` (warmed up first)."""
    if point.kind == "latency":
        await _at_once(url, model, [(32, 128)] * 8, 0)  # warm-up
        runs = [await _at_once(url, model, [(32, 128)] * 8, 100 * (k + 1)) * 1e3 for k in range(repeats)]
        return statistics.median(runs)
    if point.kind == "throughput":
        lengths = sharegpt_lengths(200)
        return len(lengths) / await _at_once(url, model, lengths, 10_000)
    return (await _closed_loop(url, model, point.clients, point.prompt, point.output, rounds))[point.metric]


# -- the run ------------------------------------------------------------------------------------


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


def _served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _run_points(url: str, shape: Shape, pts: Sequence[Point], quick: bool) -> dict[str, float]:
    model = _served_model(url)
    out: dict[str, float] = {}
    closed: dict[int, dict[str, float]] = {}
    for p in pts:
        if p.kind == "closed-loop":
            if p.clients not in closed:
                closed[p.clients] = asyncio.run(
                    _closed_loop(url, model, p.clients, p.prompt, p.output, 2 if quick else 3)
                )
            out[p.name] = closed[p.clients][p.metric]
        else:
            out[p.name] = asyncio.run(measure_point(url, model, p, repeats=2 if quick else 5))
        print(f"  {p.name}: {out[p.name]:.4g} {p.unit}", flush=True)
    return out


def _table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':<8} {'point':<44} {'published':>10} {'simulated':>10} {'measured':>10} {'sim_err':>8}"
    ]
    for r in rows:

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.4g}"

        err = "-" if r["sim_error_pct"] is None else f"{r['sim_error_pct']:+.1f}%"
        lines.append(
            f"{r['shape']:<8} {r['point']:<44} {f(r['published']):>10} {f(r['simulated']):>10} "
            f"{f(r['measured']):>10} {err:>8}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8b,70b-fp8", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the results JSON goes")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tidal-device"), help="model dirs and logs")
    ap.add_argument("--vllm-bin", default=shutil.which("vllm") or "vllm", help="the vllm command")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--start-timeout", type=float, default=1200.0, help="seconds to wait for /health")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and clients")
    ap.add_argument(
        "--dry-run", action="store_true", help="write model dirs, print commands and simulated figures"
    )
    ap.add_argument(
        "--target", default=None, help="measure against this running server instead of starting vLLM"
    )
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown} (known: {', '.join(SHAPES)})")
    rows: list[dict[str, Any]] = []
    for key in keys:
        shape = SHAPES[key]
        pts = points_for(shape, quick=args.quick)
        model_dir = write_model_dir(shape, args.workdir / f"model-{key}")
        cmd = vllm_command(shape, model_dir, args.port, args.vllm_bin)
        print(f"== {key} ({shape.preset}): {' '.join(cmd)}", flush=True)
        measured: dict[str, float] = {}
        if args.target:
            measured = _run_points(args.target.rstrip("/"), shape, pts, args.quick)
        elif not args.dry_run:
            log = (args.workdir / f"vllm-{key}.log").open("wb")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{args.port}"
            try:
                deadline = time.monotonic() + args.start_timeout
                while not _healthy(url):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"vLLM did not come up; see {log.name}")
                    time.sleep(2)
                measured = _run_points(url, shape, pts, args.quick)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
        rounds = 2 if args.quick else 3
        sims: dict[int, dict[str, float]] = {}
        for p in pts:
            if p.kind == "closed-loop":
                if p.clients not in sims:
                    sims[p.clients] = _sim_closed_loop(
                        shape.sim_preset(), p.clients, p.prompt, p.output, rounds
                    )
                sim = sims[p.clients][p.metric]
            else:
                sim = simulate_point(shape, p)
            got = measured.get(p.name)
            rows.append(
                {
                    "shape": key,
                    "preset": shape.preset,
                    "point": p.name,
                    "unit": p.unit,
                    "published": shape.published.get(p.kind) if p.kind != "closed-loop" else None,
                    "simulated": round(sim, 4),
                    "measured": None if got is None else round(got, 4),
                    "sim_error_pct": None if got is None or not got else round((sim / got - 1) * 100, 2),
                }
            )
    print(_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    kind = "dry-run" if args.dry_run and not args.target else ("target" if args.target else "h200")
    path = args.out / f"calibration-{kind}-{stamp}.json"
    meta = {
        "when": stamp,
        "mode": kind,
        "host": os.uname().nodename,
        "shapes": {k: asdict(SHAPES[k]) for k in keys},
        "published_source": "vLLM nightly CI, buildkite vllm/performance-benchmark 9515 (H200)",
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
