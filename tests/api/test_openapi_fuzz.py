"""Schemathesis over every operation of the gateway's OpenAPI (chat, completions, embeddings,
models, files, batches, jobs, admin), as the admin, as a tenant and with a key never issued:
no 500, and every error OpenAI-shaped. The number of cases run is printed.

(Driven through Hypothesis directly: schemathesis' pytest fixture integration does not run
under this pytest.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.api.harness import ACME_KEY, ADMIN_KEY, Gateway

# Examples per operation and key: the admin reaches every validator, a tenant the tenant's
# paths (admin ones end in 403), a wrong key only authentication.
ROLES = {
    "admin": (ADMIN_KEY, 25),
    "tenant": (ACME_KEY, 12),
    "wrong key": ("sk-never-issued-0123456789abcdef", 6),
}
PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
PUBLIC = ("/healthz", "/metrics")  # no key needed: liveness and Prometheus
EVERY = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/v1/jobs",
    "/admin/replicas",
    "/admin/load",
}


def _error_shape(response: Any, label: str) -> None:
    """An error body is ``{"error": {message, type, param, code}}`` with a message, as OpenAI's."""
    try:
        body = response.json()
    except (json.JSONDecodeError, ValueError):
        raise AssertionError(f"{label}: {response.status_code} is not JSON: {response.text[:200]}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, (label, response.status_code, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, (label, err)
    assert isinstance(err["message"], str) and err["message"], (label, err)


@pytest.mark.parametrize("role", list(ROLES))
def test_no_operation_answers_500_and_every_error_is_openai_shaped(
    offline_gateway: Gateway, role: str
) -> None:
    key, examples = ROLES[role]
    schema = schemathesis.openapi.from_url(offline_gateway.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= EVERY
    cases = 0
    statuses: dict[int, int] = {}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            nonlocal cases
            cases += 1
            response = case.call(headers={"Authorization": f"Bearer {key}"}, timeout=30)
            code = response.status_code
            statuses[code] = statuses.get(code, 0) + 1
            # This gateway's replica refuses connections: a request that passes every check of
            # the gateway gets the documented 502 (503 when no replica may take it); any other
            # server error is a bug.
            allowed_5xx = (502, 503) if case.operation.path in PROXIED and role != "wrong key" else ()
            assert code < 500 or code in allowed_5xx, (case.operation.label, code, response.text[:500])
            if code >= 400:
                _error_shape(response, case.operation.label)
            if role == "wrong key" and case.operation.path not in PUBLIC:
                assert code == 401, (case.operation.label, code)
            elif role == "tenant" and case.operation.path.startswith("/admin"):
                assert code == 403, (case.operation.label, code)

        check()
    print(
        f"\nschemathesis as {role}: {cases} cases over {len(operations)} operations; statuses {dict(sorted(statuses.items()))}"
    )
    assert cases >= len(operations)
