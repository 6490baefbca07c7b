"""``POST /v1/embeddings``: OpenAI-compatible embeddings through the proxy."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tidal.api.deps import InteractiveDep, PrincipalDep
from tidal.api.routes.openai_docs import PROXY_RESPONSES
from tidal.api.schemas import EmbeddingRequest

__all__ = ["router"]

router = APIRouter(tags=["inference"])


@router.post(
    "/v1/embeddings",
    summary="Create embeddings (OpenAI-compatible)",
    response_model=None,
    responses=PROXY_RESPONSES,
)
async def embeddings(
    body: EmbeddingRequest, principal: PrincipalDep, service: InteractiveDep, request: Request
) -> Response:
    return service.prepare("/v1/embeddings", body, principal, request.headers)
