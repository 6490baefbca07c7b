"""``POST /v1/completions``: OpenAI-compatible text completion through the proxy."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tidal.api.deps import InteractiveDep, PrincipalDep
from tidal.api.routes.openai_docs import PROXY_RESPONSES
from tidal.api.schemas import CompletionRequest

__all__ = ["router"]

router = APIRouter(tags=["inference"])


@router.post(
    "/v1/completions",
    summary="Create a text completion (OpenAI-compatible; `stream: true` for SSE)",
    response_model=None,
    responses=PROXY_RESPONSES,
)
async def completions(
    body: CompletionRequest, principal: PrincipalDep, service: InteractiveDep, request: Request
) -> Response:
    return service.prepare("/v1/completions", body, principal, request.headers)
