"""``GET /v1/models``: the fleet's models and LoRA adapters, OpenAI-shaped."""

from __future__ import annotations

from fastapi import APIRouter

from tidal.api.deps import PrincipalDep, StateDep
from tidal.api.errors import APIError
from tidal.api.schemas import ModelCard, ModelList

__all__ = ["router"]

router = APIRouter(tags=["inference"])


def _cards(state: StateDep, tenant: str) -> list[ModelCard]:
    """The models and the adapters ``tenant`` may use (one bound to other tenants is not listed)."""
    fleet = state.fleet
    cards = [ModelCard(id=m.name, max_model_len=m.max_model_len) for m in fleet.models]
    cards += [ModelCard(id=a.name, parent=a.base_model) for a in fleet.adapters if a.serves(tenant)]
    return cards


@router.get("/v1/models", summary="List the models and adapters the fleet serves", response_model=ModelList)
async def list_models(state: StateDep, principal: PrincipalDep) -> ModelList:
    return ModelList(data=_cards(state, principal.tenant))


@router.get("/v1/models/{model_id:path}", summary="One model or adapter", response_model=ModelCard)
async def get_model(model_id: str, state: StateDep, principal: PrincipalDep) -> ModelCard:
    for card in _cards(state, principal.tenant):
        if card.id == model_id:
            return card
    raise APIError(
        404, f"The model '{model_id[:200]}' does not exist.", param="model", code="model_not_found"
    )
