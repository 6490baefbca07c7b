"""Conformance: one script of requests against real vLLM on the CPU and ``tidal sim --preset tiny-cpu``.

Both serve the model name ``tiny``; the simulator counts tokens with the tiny model's own
tokenizer (``--tokenizer``), so usage and prefix-cache numbers can be compared exactly. For each
step of the script we compare status codes, response key sets, the SSE chunk structure, error
shapes, the metric families with their types and label names, and how far the same requests
move ``vllm:prefix_cache_hits_total``. What may differ is the short ALLOW list below.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal.replicas.launcher import sim_process
from tidal.replicas.wire.prom import parse_samples

pytestmark = pytest.mark.vllm

# What may differ between the two, and why (keep it short).
ALLOW_METRIC_FAMILIES = {
    # The simulator's own real-time accounting (modelled vs actual step time); vLLM has none.
    "tidal_sim_steps_total",
    "tidal_sim_step_model_seconds_total",
    "tidal_sim_step_actual_seconds_total",
    "tidal_sim_step_lateness_seconds_total",
    # Requests by kind of work (batch lines by their request id), for the gate benchmark.
    "tidal_sim_requests_total",
    "tidal_sim_last_arrival_timestamp_seconds",
    "tidal_sim_requests_running",
    "tidal_sim_requests_waiting",
}
# Values that are random or depend on the build (ids, timestamps, fingerprints, generated text)
# are never compared; only key sets and structure are.


def _keys(obj: Any) -> Any:
    """The shape of a JSON value: dict keys (recursively), list shapes, value kinds."""
    if isinstance(obj, dict):
        return {k: _keys(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_keys(v) for v in obj]
    if obj is None:
        return None
    return type(obj).__name__


def _sse(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return out


def _structure(chunks: list[Any]) -> dict[str, Any]:
    """A stream's structure: role chunk, content chunks, final chunk, usage chunk, terminator.

    vLLM coalesces several tokens into one chunk when its output loop runs behind, so how many
    content chunks there are (and whether any precede the final one) is not compared.
    """
    shapes = [c if c == "[DONE]" else _keys(c) for c in chunks]
    out: dict[str, Any] = {"last": shapes[-1]}
    body = [c for c in chunks[:-1] if c != "[DONE]"]
    with_choices = [c for c in body if c.get("choices")]
    role = [c for c in with_choices if "role" in c["choices"][0].get("delta", {})]
    out["role"] = _keys(role[0]) if role else None
    final = [c for c in with_choices if c["choices"][0].get("finish_reason")]
    out["final"] = _keys(final[-1]) if final else None
    out["after_final"] = [_keys(c) for c in body[body.index(final[-1]) + 1 :]] if final else None
    middle = {json.dumps(_keys(c)) for c in with_choices if c not in role and c not in final}
    out["content"] = middle
    return out


class Script:
    """Runs the same requests against one server and records what came back."""

    def __init__(self, url: str, adapter_path: str, salt: str) -> None:
        self.url = url
        self.adapter_path = adapter_path
        self.salt = salt
        self.client = httpx.Client(base_url=url, timeout=60)

    def post(self, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
        if content is not None:
            return self.client.post(path, content=content, headers={"Content-Type": "application/json"})
        return self.client.post(path, json=body)

    def families(self) -> dict[str, tuple[str, frozenset[str]]]:
        """Each family as its ``# TYPE`` line names it (counters with ``_total``), with its type
        and label names (``le`` aside)."""
        out: dict[str, tuple[str, set[str]]] = {}
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            name = family.name + "_total" if family.type == "counter" else family.name
            _, labels = out.setdefault(name, (family.type, set()))
            labels.update(k for s in family.samples for k in s.labels if k != "le")
        return {name: (kind, frozenset(labels)) for name, (kind, labels) in out.items()}

    def counter(self, name: str) -> float:
        text = self.client.get("/metrics").text
        return sum(s.value for s in parse_samples(text) if s.name == name)

    def run(self) -> dict[str, Any]:
        r: dict[str, Any] = {}
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
            "ignore_eos": True,
        }
        r["models"] = self.client.get("/v1/models")
        r["health"] = self.client.get("/health")
        r["chat"] = self.post("/v1/chat/completions", chat)
        r["chat_stream"] = self.post("/v1/chat/completions", {**chat, "stream": True})
        r["chat_stream_usage"] = self.post(
            "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}
        )
        comp = {"model": "tiny", "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}
        r["completion"] = self.post("/v1/completions", comp)
        r["completion_stream"] = self.post("/v1/completions", {**comp, "stream": True})
        r["completion_stream_usage"] = self.post(
            "/v1/completions", {**comp, "stream": True, "stream_options": {"include_usage": True}}
        )
        r["priority"] = self.post("/v1/chat/completions", {**chat, "priority": 7})
        # Errors.
        r["unknown_model"] = self.post("/v1/chat/completions", {**chat, "model": "no-such-model"})
        r["bad_json"] = self.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [')
        r["stream_options_without_stream"] = self.post(
            "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}
        )
        r["max_tokens_zero"] = self.post("/v1/chat/completions", {**chat, "max_tokens": 0})
        r["max_tokens_too_big"] = self.post("/v1/chat/completions", {**chat, "max_tokens": 100000})
        r["messages_not_a_list"] = self.post("/v1/chat/completions", {"model": "tiny", "messages": "hi"})
        r["prompt_too_long"] = self.post("/v1/completions", {"model": "tiny", "prompt": "hello " * 5000})
        # LoRA: load, list, use, unload.
        name = f"conf-{self.salt}"
        r["lora_load"] = self.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.adapter_path}
        )
        r["lora_load_again"] = self.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.adapter_path}
        )
        r["lora_load_missing_path"] = self.post("/v1/load_lora_adapter", {"lora_name": name + "x"})
        r["lora_models"] = self.client.get("/v1/models")
        r["lora_chat"] = self.post("/v1/chat/completions", {**chat, "model": name})
        r["lora_unload"] = self.post("/v1/unload_lora_adapter", {"lora_name": name})
        r["lora_unload_again"] = self.post("/v1/unload_lora_adapter", {"lora_name": name})
        # Prefix caching: a long shared system prompt (several 128-token CPU blocks), three users.
        system = f"[{self.salt}] " + " ".join(f"rule {i}: answer briefly and politely." for i in range(60))
        hits0, queries0 = (
            self.counter("vllm:prefix_cache_hits_total"),
            self.counter("vllm:prefix_cache_queries_total"),
        )
        for user in ("first question", "second question", "third question"):
            resp = self.post(
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "max_tokens": 2,
                },
            )
            assert resp.status_code == 200, resp.text
        r["prefix_hits_delta"] = self.counter("vllm:prefix_cache_hits_total") - hits0
        # A client that disconnects mid-stream: its request is aborted (and not counted as done).
        done0 = self.counter("vllm:request_success_total")
        body = {**comp, "max_tokens": 3000, "stream": True, "prompt": f"{self.salt} go"}
        with self.client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            r["abort_first_line"] = next(lines)[:6]
        deadline = time.monotonic() + 20
        while self.counter("vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)
        r["abort_running_after"] = self.counter("vllm:num_requests_running")
        r["abort_finished_delta"] = self.counter("vllm:request_success_total") - done0
        r["prefix_queries_delta"] = self.counter("vllm:prefix_cache_queries_total") - queries0
        r["families"] = self.families()
        return r


@pytest.fixture(scope="module")
def sim_tiny(tiny_model_root: Any) -> Iterator[Any]:
    proc = sim_process(
        "tiny-cpu", args=["--served-model-name", "tiny", "--tokenizer", str(tiny_model_root / "model")]
    )
    proc.start()
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


def _error_shape(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        return (resp.status_code, resp.text)
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return (resp.status_code, _keys(body))
    return (resp.status_code, sorted(err), err.get("type"), err.get("param"), err.get("code"))


def test_simulator_answers_like_real_vllm(vllm_replica: Any, sim_tiny: Any, tiny_model_root: Any) -> None:
    salt = secrets.token_hex(4)
    adapter = str(tiny_model_root / "adapters" / "lora-0")
    real = Script(vllm_replica.url, adapter, salt).run()
    sim = Script(sim_tiny.url, adapter, salt).run()
    problems: list[str] = []

    def same(what: str, a: Any, b: Any) -> None:
        if a != b:
            problems.append(f"{what}:\n  vllm: {a}\n  sim:  {b}")

    for key in ("models", "chat", "completion", "priority", "lora_models", "lora_chat"):
        same(f"{key} status", real[key].status_code, sim[key].status_code)
        same(f"{key} keys", _keys(real[key].json()), _keys(sim[key].json()))
    same(
        "health",
        (real["health"].status_code, real["health"].text),
        (sim["health"].status_code, sim["health"].text),
    )
    for key in ("chat_stream", "chat_stream_usage", "completion_stream", "completion_stream_usage"):
        same(f"{key} status", real[key].status_code, sim[key].status_code)
        same(f"{key} content-type", real[key].headers["content-type"], sim[key].headers["content-type"])
        rs, ss = _structure(_sse(real[key])), _structure(_sse(sim[key]))
        if not rs["content"] or not ss["content"]:
            rs["content"] = ss["content"] = None  # coalesced on one side (see _structure)
        same(f"{key} chunks", rs, ss)
    for key in ("chat", "completion"):
        same(f"{key} usage", real[key].json()["usage"], sim[key].json()["usage"])
    same("lora_chat model", real["lora_chat"].json()["model"], sim["lora_chat"].json()["model"])
    for key in (
        "unknown_model",
        "bad_json",
        "stream_options_without_stream",
        "max_tokens_zero",
        "max_tokens_too_big",
        "messages_not_a_list",
        "prompt_too_long",
        "lora_load_again",
        "lora_load_missing_path",
        "lora_unload_again",
    ):
        same(f"{key} error", _error_shape(real[key]), _error_shape(sim[key]))
    for key in ("unknown_model", "stream_options_without_stream", "max_tokens_too_big", "lora_load_again"):
        same(f"{key} message", real[key].json()["error"]["message"], sim[key].json()["error"]["message"])
    for key in ("lora_load", "lora_unload"):
        same(
            f"{key}",
            (real[key].status_code, real[key].text.replace(salt, "")),
            (sim[key].status_code, sim[key].text.replace(salt, "")),
        )
    # The same requests move the prefix-cache counters the same way.
    same("prefix_cache_hits delta", real["prefix_hits_delta"], sim["prefix_hits_delta"])
    same("prefix_cache_queries delta", real["prefix_queries_delta"], sim["prefix_queries_delta"])
    for key in ("abort_first_line", "abort_running_after", "abort_finished_delta"):
        same(key, real[key], sim[key])
    assert real["abort_running_after"] == 0
    assert real["prefix_hits_delta"] >= 2 * 128, "the script should hit the prefix cache on real vLLM"
    # Metric families, their types and label names.
    rf, sf = real["families"], {k: v for k, v in sim["families"].items() if k not in ALLOW_METRIC_FAMILIES}
    same("metric families only in vLLM", sorted(set(rf) - set(sf)), [])
    same("metric families only in the simulator", sorted(set(sf) - set(rf)), [])
    for name in sorted(set(rf) & set(sf)):
        same(f"metric {name} type and labels", rf[name], sf[name])
    assert not problems, "\n".join(problems)


# -- KV events: the same request script, the same event stream ---------------------------------------


class _Recorder:
    """A KV-event sink that keeps every batch in order (through our subscriber: it also proves the
    subscriber follows real vLLM's PUB and replay sockets)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.resets: list[bool] = []

    def apply(self, batch: Any) -> None:
        self.batches.append(batch)

    def reset(self, *, complete: bool) -> None:
        self.resets.append(complete)
        self.batches.clear()

    def synced(self, at: float) -> None:
        pass


def _kv_event_stream(proc: Any, adapter_path: str, salt: str) -> tuple[list[Any], int, list[bool]]:
    """Run the KV-event script against ``proc``; every event it published, in order, and how
    many batches carried them."""
    import asyncio
    import threading

    from tidal.replicas.wire.kv_events import KVEventSubscriber

    pub, replay = proc.kv_events_addresses()
    rec = _Recorder()
    ready = threading.Event()
    stop = threading.Event()

    def follow() -> None:
        async def main() -> None:
            sub = KVEventSubscriber(pub, rec, replay_endpoint=replay, topic=proc.kv_events.topic)
            task = asyncio.create_task(sub.run())
            while not sub.stats.connected:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # the slow joiner: the SUB socket is subscribed by now
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            task.cancel()

        asyncio.run(main())

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert ready.wait(30), "no replay answer from the publisher"
    client = httpx.Client(base_url=proc.url, timeout=120)

    def complete(prompt: str, n: int = 3, model: str = "tiny") -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    # 276, 236, 356 and 316 tokens: with 7 usable blocks of 128 the fifth request must evict.
    words = {
        w: f"{salt} " + " ".join(f"{w} {i}" for i in range(40)) for w in ("alpha", "beta", "gamma", "delta")
    }
    complete(words["alpha"])  # 2 full blocks stored
    complete(words["alpha"])  # a prefix hit: nothing new
    complete(words["beta"])
    complete(words["gamma"])
    complete(words["delta"], n=190)  # evicts; a block fills while decoding; evicts again
    time.sleep(0.5)
    assert client.post("/reset_prefix_cache").json() == {"success": True}
    r = client.post("/v1/load_lora_adapter", json={"lora_name": f"kv-{salt}", "lora_path": adapter_path})
    assert r.status_code == 200, r.text
    complete(words["alpha"], model=f"kv-{salt}")  # the reset goes out with this step's events
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": words["beta"]}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    client.post("/v1/unload_lora_adapter", json={"lora_name": f"kv-{salt}"})
    time.sleep(1.5)
    stop.set()
    thread.join(10)
    events = [e for b in rec.batches for e in b.events]
    return events, len(rec.batches), rec.resets


def _shape(events: list[Any]) -> list[tuple[Any, ...]]:
    """Each event with its block hashes named by first appearance (b0, b1, ...), so a removal
    names the block it removes whatever the hash values are."""
    from tidal.replicas.wire.kv_events import BlockRemoved, BlockStored

    names: dict[Any, str] = {}

    def name(h: Any) -> str:
        return names.setdefault(h, f"b{len(names)}")

    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(
                (
                    "stored",
                    tuple(name(h) for h in e.block_hashes),
                    None if e.parent_block_hash is None else name(e.parent_block_hash),
                    len(e.token_ids),
                    e.block_size,
                    e.lora_id is not None,
                    e.lora_name is not None,
                    e.medium,
                    None if e.extra_keys is None else len(e.extra_keys),
                    e.group_idx,
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(("removed", tuple(name(h) for h in e.block_hashes), e.medium))
        else:
            out.append((type(e).__name__,))
    return out


@pytest.fixture(scope="module")
def kv_pair(vllm_factory: Any, tiny_model_root: Any) -> Iterator[tuple[Any, Any]]:
    """Real vLLM and the simulator with 8 KV blocks of 128 tokens, KV events and dev mode on."""
    small = ("--max-model-len", "512", "--num-gpu-blocks-override", "8")
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    sim = sim_process(
        "tiny-cpu",
        args=["--served-model-name", "tiny", "--tokenizer", str(tiny_model_root / "model"), *small],
        kv_events=True,
        env=dev,
    )
    sim.start()
    try:
        (real,) = vllm_factory.start(1, extra_args=small, env=dev, kv_events=True)
        sim.wait_ready(60)
        yield real, sim
    finally:
        sim.stop()


def test_simulator_publishes_the_kv_events_real_vllm_publishes(kv_pair: Any, tiny_model_root: Any) -> None:
    real, sim = kv_pair
    salt = secrets.token_hex(3)
    adapter = str(tiny_model_root / "adapters" / "lora-0")
    rv, rb, rr = _kv_event_stream(real, adapter, salt)
    sv, sb, sr = _kv_event_stream(sim, adapter, salt)
    print(f"\nKV events: vLLM {len(rv)} in {rb} batches, simulator {len(sv)} in {sb} batches")
    for e in _shape(rv):
        print("  ", e)
    assert rr == [True] and sr == [True]  # each replay buffer reached back to sequence 0
    # Same stores and removals, in the same order, naming the same blocks.
    assert _shape(sv) == _shape(rv)
    kinds = [s[0] for s in _shape(rv)]
    assert {"stored", "removed", "AllBlocksCleared"} <= set(kinds), kinds
    # And the same hashes wherever the blocks hold the same tokens (prompt blocks; generated
    # tokens differ between the two models).
    from tidal.replicas.wire.kv_events import BlockStored

    same = 0
    for a, b in zip(rv, sv, strict=True):
        if isinstance(a, BlockStored) and isinstance(b, BlockStored) and a.token_ids == b.token_ids:
            assert a.block_hashes == b.block_hashes and a.parent_block_hash == b.parent_block_hash
            same += 1
    assert same >= 5
