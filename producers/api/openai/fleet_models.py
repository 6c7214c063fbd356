"""``GET /v1/models``: the models the fleet serves, from its workers' heartbeat records.

Each live worker announces its model (``workers/fleet/service.py``); a record that names no
model, or whose ``role`` is ``prepare`` (a tier that prepares media and runs no model), is
no model of the fleet's. A worker silent for five leases has its record pruned, so a model
whose last worker died leaves the list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Depends

from vlmq.producers.api.context import ApiContext, context
from vlmq.producers.api.errors import ApiError, error_responses
from vlmq.producers.api.openai.objects import Model, ModelList
from vlmq.producers.api.openai.route import OpenAIRoute

__all__ = ["fleet_models", "router"]

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

# Worker records that run no model.
_MODEL_LESS_ROLES = frozenset({"prepare"})


def fleet_models(records: Mapping[str, Mapping[str, Any]]) -> list[Model]:
    """The models named by worker heartbeat records, by id."""
    found: dict[str, Model] = {}
    for record in records.values():
        name = record.get("model")
        if not isinstance(name, str) or not name or record.get("role") in _MODEL_LESS_ROLES:
            continue
        heard = int(float(record.get("at") or 0))
        model = found.setdefault(name, Model(id=name, created=heard))
        model.created = min(model.created, heard)
        model.workers += 1
        modalities = record.get("modalities") or []
        model.modalities = sorted({*model.modalities, *map(str, modalities)})
    return [found[name] for name in sorted(found)]


@router.get("/models", responses=error_responses(401, 429, 503))
def list_models(ctx: ApiContext = Depends(context)) -> ModelList:
    """The models the fleet's live workers serve (OpenAI's model list)."""
    return ModelList(data=fleet_models(ctx.client.state.workers.all()))


@router.get("/models/{model_id:path}", responses=error_responses(401, 404, 429, 503))
def retrieve_model(model_id: str, ctx: ApiContext = Depends(context)) -> Model:
    """One model the fleet serves (404 ``model_not_found`` when no live worker does)."""
    for model in fleet_models(ctx.client.state.workers.all()):
        if model.id == model_id:
            return model
    raise ApiError(404, "model_not_found", "no live worker serves this model", param="model")
