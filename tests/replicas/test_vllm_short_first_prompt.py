"""A real vLLM CPU replica started by the launcher answers a one-token prompt as its very first
request. On CPUs with AMX, vLLM's bfloat16 CPU attention runs AMX instructions that the worker
process never asked the kernel for, so it died of SIGILL unless an earlier, longer prompt had made
oneDNN ask first; the launcher's ``replicas/vllm_site`` asks at every process start."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.vllm


def test_the_first_request_may_be_a_one_token_prompt(vllm_factory: Any) -> None:
    (replica,) = vllm_factory.start(1)
    for prompt in ("hi", "a b c d e f g h " * 20, "ok"):
        r = httpx.post(
            replica.url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    replica.stop()
