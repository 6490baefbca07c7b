"""Bad input gets a clear OpenAI-shaped 4xx through the official SDK, never a 500 or a hang."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import ACME_KEY, DEV_KEY, Gateway

MSG = [{"role": "user", "content": "hi"}]


def _shape(body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


def _post(
    gw: Gateway, payload: bytes | dict[str, Any], key: str | None = DEV_KEY, **headers: str
) -> httpx.Response:
    hdrs = {"Content-Type": "application/json", **headers}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    kw: dict[str, Any] = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    return httpx.post(gw.url + "/v1/chat/completions", headers=hdrs, timeout=30, **kw)


RAW_CASES = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None),
    ("wrong type: messages", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("wrong type: max_tokens", {"model": "tiny", "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("wrong type: stream", {"model": "tiny", "messages": MSG, "stream": "perhaps"}, 400, "stream"),
    ("missing messages", {"model": "tiny"}, 400, "messages"),
    ("missing model", {"messages": MSG}, 400, "model"),
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages"),
    ("bad role", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("negative max_tokens", {"model": "tiny", "messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (
        "remote media URL",
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}],
                }
            ],
        },
        400,
        "messages.0.content",
    ),
    ("refused field", {"model": "tiny", "messages": MSG, "logits_processors": ["os.system"]}, 400, None),
]


@pytest.mark.parametrize(("case", "payload", "status", "param"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_malformed_requests_are_openai_shaped_400s(
    offline_gateway: Gateway, case: str, payload: Any, status: int, param: str | None
) -> None:
    r = _post(offline_gateway, payload)
    assert r.status_code == status, r.text
    err = _shape(r.json())
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_sdk_errors_for_model_cap_keys_and_features(offline_gateway: Gateway) -> None:
    dev = openai.OpenAI(base_url=offline_gateway.url + "/v1", api_key=DEV_KEY, max_retries=0)
    acme = openai.OpenAI(base_url=offline_gateway.url + "/v1", api_key=ACME_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        dev.chat.completions.create(model="gpt-9", messages=MSG)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    # The chat feature caps prompt + max_tokens at 2048 tokens; the message names the cap.
    with pytest.raises(openai.BadRequestError) as big:
        acme.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 3000}])
    assert big.value.code == "context_length_exceeded" and "2048" in big.value.message
    with pytest.raises(openai.BadRequestError) as big2:
        acme.chat.completions.create(model="tiny", messages=MSG, max_tokens=5000)
    assert "2048" in big2.value.message
    for key in ("wrong-key", ""):
        with pytest.raises(openai.AuthenticationError) as auth:
            openai.OpenAI(
                base_url=offline_gateway.url + "/v1", api_key=key or "x", max_retries=0
            ).chat.completions.create(
                model="tiny",
                messages=MSG,  # type: ignore[arg-type]
            )
        assert auth.value.code == "invalid_api_key"
    # acme may use "chat" only: another tenant's regulated feature is forbidden.
    with pytest.raises(openai.PermissionDeniedError) as denied:
        acme.chat.completions.create(model="tiny", messages=MSG, extra_headers={"X-Tidal-Feature": "claims"})  # type: ignore[arg-type]
    assert denied.value.code == "feature_not_allowed"
    with pytest.raises(openai.BadRequestError) as unknown:
        dev.chat.completions.create(model="tiny", messages=MSG, extra_headers={"X-Tidal-Feature": "nope"})  # type: ignore[arg-type]
    assert unknown.value.param == "X-Tidal-Feature"


def test_missing_key_body_too_large_and_admin_only(offline_gateway: Gateway) -> None:
    r = _post(offline_gateway, {"model": "tiny", "messages": MSG}, key=None)
    assert r.status_code == 401 and _shape(r.json())["code"] == "invalid_api_key"
    r = _post(offline_gateway, b"{" + b" " * (5 * 1024 * 1024) + b"}")
    assert r.status_code == 413 and _shape(r.json())["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        for _ in range(6):
            yield b" " * (1024 * 1024)

    r = httpx.post(
        offline_gateway.url + "/v1/chat/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {DEV_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and _shape(r.json())["code"] == "request_too_large"
    r = httpx.get(offline_gateway.url + "/admin/load", headers={"Authorization": f"Bearer {DEV_KEY}"})
    assert r.status_code == 403 and _shape(r.json())["type"] == "permission_error"


def test_an_unreachable_replica_is_a_502_not_a_500(offline_gateway: Gateway) -> None:
    dev = openai.OpenAI(base_url=offline_gateway.url + "/v1", api_key=DEV_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        dev.chat.completions.create(model="tiny", messages=MSG, stream=True)  # type: ignore[arg-type]
    assert err.value.status_code == 502 and err.value.code == "upstream_failed"
    with pytest.raises(openai.APIStatusError) as err2:
        dev.completions.create(model="support-v1", prompt="x")  # the adapter's path does not exist
    assert err2.value.status_code in (502, 503)
