"""``POST /v1/chat/completions``: OpenAI-compatible chat, streamed (SSE) or not, through the proxy."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tidal.api.deps import InteractiveDep, PrincipalDep
from tidal.api.routes.openai_docs import PROXY_RESPONSES
from tidal.api.schemas import ChatCompletionRequest

__all__ = ["router"]

router = APIRouter(tags=["inference"])


@router.post(
    "/v1/chat/completions",
    summary="Create a chat completion (OpenAI-compatible; `stream: true` for SSE)",
    response_model=None,
    responses=PROXY_RESPONSES,
)
async def chat_completions(
    body: ChatCompletionRequest, principal: PrincipalDep, service: InteractiveDep, request: Request
) -> Response:
    return service.prepare("/v1/chat/completions", body, principal, request.headers)
