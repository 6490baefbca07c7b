"""The simulated replica over HTTP, driven by the official openai SDK."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.replicas.sim.conftest import RunningSim
from tidal.replicas.metrics import parse_load_snapshot
from tidal.replicas.wire.prom import parse_samples

pytestmark = pytest.mark.anyio


def client(sim: RunningSim, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_chat_streams_with_a_role_chunk_a_final_chunk_and_usage(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        stream = client(sim).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "priority": 3},
        )
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = [c for c in chunks if c.choices]
    assert len(body) == 1 + 12  # the role chunk, then one chunk per token
    assert [c.choices[0].finish_reason for c in body[1:]] == [None] * 11 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_chat_and_completions_without_streaming(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"], seed=3) as sim:
        c = client(sim)
        reply = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        again = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        comp = c.completions.create(model="tiny", prompt="once upon a time", max_tokens=3)
        two = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2
        )
    assert (
        reply.object == "chat.completion" and reply.usage is not None and reply.usage.completion_tokens == 5
    )
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
    assert again.choices[0].message.content == reply.choices[0].message.content  # deterministic per seed
    assert comp.object == "text_completion" and comp.usage is not None and comp.usage.completion_tokens == 3
    assert (
        [ch.index for ch in two.choices] == [0, 1]
        and two.usage is not None
        and two.usage.completion_tokens == 8
    )


def test_bad_input_gets_vllm_status_codes_and_error_shape(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        c = client(sim)
        with pytest.raises(openai.NotFoundError) as nf:
            c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert nf.value.body == {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=100000
            )
        assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as opts:
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                stream_options={"include_usage": True},
            )
        assert isinstance(opts.value.body, dict) and opts.value.body["param"] == "stream_options"
        with pytest.raises(openai.BadRequestError) as long:
            c.completions.create(model="tiny", prompt=" hello" * 5000, max_tokens=1)
        assert isinstance(long.value.body, dict) and long.value.body["param"] == "input_tokens"
        raw = httpx.post(
            sim.url + "/v1/chat/completions",
            content=b"{bad json",
            headers={"Content-Type": "application/json"},
        )
        assert raw.status_code == 400 and raw.json()["error"]["type"] == "Bad Request"
        assert httpx.get(sim.url + "/v1/chat/completions").status_code == 405
        assert httpx.get(sim.url + "/nowhere").status_code == 404
        huge = httpx.post(
            sim.url + "/v1/completions",
            content=b"x" * (17 * 1024 * 1024),
            headers={"Content-Type": "application/json"},
        )
        assert huge.status_code == 413


def test_runtime_lora_load_use_and_unload_never_reads_the_path(sim_server: Any, tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        ok = httpx.post(
            sim.url + "/v1/load_lora_adapter", json={"lora_name": "t42", "lora_path": str(missing)}
        )
        assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 't42' added successfully."
        again = httpx.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "t42", "lora_path": "/x"})
        assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
        models = client(sim).models.list()
        assert {m.id for m in models.data} == {"tiny", "t42"}
        reply = client(sim).chat.completions.create(
            model="t42", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "t42"
        infos = [
            s
            for s in parse_samples(httpx.get(sim.url + "/metrics").text)
            if s.name == "vllm:lora_requests_info"
        ]
        assert any(s.labels["max_lora"] == "2" for s in infos)
        gone = httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "t42"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert httpx.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "t42"}).status_code == 404
    assert not missing.exists()
    with sim_server(preset="tiny-cpu", runtime_lora=False) as sim:
        assert (
            httpx.post(
                sim.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}
            ).status_code
            == 404
        )


def test_a_client_disconnect_aborts_its_request(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=10) as h, h.stream("POST", sim.url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            assert sim.app.engine.num_running == 1
        # The connection is closed with ~4000 tokens to go: the request is aborted at once.
        wait_for(lambda: sim.app.engine.num_running == 0 and sim.app.engine.num_waiting == 0)
        snap = parse_load_snapshot(httpx.get(sim.url + "/metrics").text)
    assert snap.requests_finished == 0 and snap.kv_cache_usage == 0.0  # vLLM does not count aborts


def test_metrics_page_round_trips_to_the_engine_snapshot(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        c = client(sim)
        system = " ".join(f"rule {i}: be brief." for i in range(80))
        for _ in range(3):
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "go"}],
                max_tokens=4,
            )
        text = httpx.get(sim.url + "/metrics").text
    snap = parse_load_snapshot(text)
    assert snap == sim.app.engine.snapshot()
    assert snap.prefix_cache_hits > 0 and snap.requests_finished == 3
    names = {s.name for s in parse_samples(text)}
    assert {"process_cpu_seconds_total", "http_requests_total", "tidal_sim_steps_total"} <= names


def test_metrics_count_batch_and_interactive_requests_apart(sim_server: Any) -> None:
    """Batch lines (request id ``batch-...``) are counted and timed on their own."""
    with sim_server(preset="tiny-cpu", served_model_names=["tiny"]) as sim:
        c = client(sim)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        before = time.time()
        for i in range(2):
            c.completions.create(
                model="tiny",
                prompt="a batch line",
                max_tokens=2,
                extra_headers={"X-Request-Id": f"batch-b-q{i}"},
            )
        samples = {
            (s.name, s.labels.get("kind")): s.value
            for s in parse_samples(httpx.get(sim.url + "/metrics").text)
            if s.name.startswith("tidal_sim_")
        }
    assert samples[("tidal_sim_requests_total", "batch")] == 2
    assert samples[("tidal_sim_requests_total", "interactive")] == 1
    assert samples[("tidal_sim_last_arrival_timestamp_seconds", "batch")] >= before
    assert samples[("tidal_sim_last_arrival_timestamp_seconds", "interactive")] <= before
    for kind in ("batch", "interactive"):  # all answered: nothing left running or waiting
        assert samples[("tidal_sim_requests_running", kind)] == 0
        assert samples[("tidal_sim_requests_waiting", kind)] == 0


def test_error_rate_answers_500_before_any_output(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", error_rate=1.0) as sim:
        with pytest.raises(openai.InternalServerError):
            client(sim).chat.completions.create(
                model="tiny-cpu", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500


def test_answer_key_and_accuracy(sim_server: Any, tmp_path: Path) -> None:
    key = tmp_path / "key.jsonl"
    prompts = [f"What is {i} plus {i}?" for i in range(40)]
    key.write_text(
        "".join(
            json.dumps({"prompt": p, "answer": f"The answer is {2 * i}."}) + "\n"
            for i, p in enumerate(prompts)
        )
    )

    def ask(sim: RunningSim) -> list[bool]:
        c = client(sim)
        out = []
        for i, p in enumerate(prompts):
            r = c.chat.completions.create(
                model="tiny-cpu", messages=[{"role": "user", "content": p}], max_tokens=50
            )
            out.append(r.choices[0].message.content == f"The answer is {2 * i}.")
            assert r.choices[0].finish_reason == "stop"
        return out

    with sim_server(preset="tiny-cpu", answer_key=str(key), accuracy=1.0) as sim:
        assert all(ask(sim))
    with sim_server(preset="tiny-cpu", answer_key=str(key), accuracy=0.5, seed=1) as sim:
        first = ask(sim)
        assert ask(sim) == first  # deterministic per prompt and seed
        assert 8 <= sum(first) <= 32
    with sim_server(preset="tiny-cpu", answer_key=str(key), accuracy=0.0) as sim:
        assert not any(ask(sim))


def test_queue_limit_answers_503_and_counts_the_rejection(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", max_num_seqs=1, max_num_queued_reqs=1) as sim:
        body = {"prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=10) as h,
            h.stream("POST", sim.url + "/v1/completions", json=body) as running,
            h.stream("POST", sim.url + "/v1/completions", json=body) as queued,
        ):
            lines = running.iter_lines()  # keep it: a dropped iterator closes the stream
            next(lines)
            assert queued.status_code == 200
            wait_for(lambda: sim.app.engine.num_waiting == 1)
            refused = httpx.post(sim.url + "/v1/completions", json=body)
            assert refused.status_code == 503
        rej = [
            s
            for s in parse_samples(httpx.get(sim.url + "/metrics").text)
            if s.name == "vllm:admission_rejections_total"
        ]
        assert {s.labels["reason"]: s.value for s in rej}["max_num_queued_reqs"] == 1


def test_api_key_guards_v1_only(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", api_key="s3cret") as sim:
        assert httpx.get(sim.url + "/v1/models").status_code == 401
        assert (
            httpx.get(sim.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        )
        assert httpx.get(sim.url + "/health").status_code == 200


def test_embedding_preset_serves_embeddings_only(sim_server: Any) -> None:
    with sim_server(preset="e5-mistral-7b-h100", served_model_names=["e5"]) as sim:
        c = client(sim)
        res = c.embeddings.create(model="e5", input=["alpha beta", "alpha beta", "gamma"])
        vecs = [d.embedding for d in res.data]
        assert len(vecs) == 3 and len(vecs[0]) == 4096 and vecs[0] == vecs[1] != vecs[2]
        assert abs(sum(x * x for x in vecs[2]) - 1.0) < 1e-6
        assert res.usage.prompt_tokens > 0
        assert httpx.post(sim.url + "/v1/chat/completions", json={"messages": []}).status_code == 404


def test_tokenize_counts_like_the_prompt(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu") as sim:
        tok = httpx.post(sim.url + "/tokenize", json={"prompt": "hello world"}).json()
        reply = client(sim).completions.create(model="tiny-cpu", prompt="hello world", max_tokens=1)
    assert reply.usage is not None and tok["count"] == reply.usage.prompt_tokens == len(tok["tokens"])


def test_without_max_tokens_the_model_ends_its_answer_by_itself(sim_server: Any) -> None:
    with sim_server(preset="tiny-cpu", output_len_median=20) as sim:
        c = client(sim)
        lengths = []
        for i in range(8):
            r = c.chat.completions.create(
                model="tiny-cpu", messages=[{"role": "user", "content": f"question {i}"}]
            )
            assert r.choices[0].finish_reason == "stop" and r.usage is not None
            lengths.append(r.usage.completion_tokens)
        # Requests that set max_tokens get them all, unless natural stops are asked for everywhere.
        full = c.chat.completions.create(
            model="tiny-cpu", messages=[{"role": "user", "content": "q"}], max_tokens=400
        )
        assert full.usage is not None and full.usage.completion_tokens == 400
    assert all(0 < n < 400 for n in lengths) and len(set(lengths)) > 1
    with sim_server(preset="tiny-cpu", output_len_median=20, natural_stop_always=True) as sim:
        r = client(sim).chat.completions.create(
            model="tiny-cpu", messages=[{"role": "user", "content": "q"}], max_tokens=400
        )
        assert (
            r.choices[0].finish_reason == "stop" and r.usage is not None and r.usage.completion_tokens < 400
        )
