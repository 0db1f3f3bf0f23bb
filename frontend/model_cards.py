"""GET /v1/models: vLLM's model cards (its ModelCard and ModelPermission fields), each served
name of each model, then the models' LoRA adapters with the model as their `parent`."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from tritium.frontend.model_registry import ModelRegistry, model_not_found

logger = logging.getLogger(__name__)

# vLLM says "vllm"; the models here are served by Tritium (or by whatever Triton model answers).
OWNED_BY = "tritium"


def model_card(name: str, created: int, root: str | None, parent: str | None,
               max_model_len: int | None) -> dict[str, Any]:
    """One model's card, as vLLM's ModelCard: `parent` is null for a base model and the base
    model's name for a LoRA adapter; `root` the model's path (an adapter's: its directory)."""
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY, "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": [permission]}


async def model_cards(registry: ModelRegistry) -> list[dict[str, Any]]:
    """Every served name of every ready model, then its adapters (asked of the model now: a
    reload can change them). An adapter runs with its model's max_model_len, so it has that too
    (vLLM's adapter cards say null). A name already listed is not listed again."""
    created, cards, listed = int(time.time()), [], set()
    for triton_name in await registry.ready_models():
        names = registry.public_names(triton_name)
        try:
            model = await registry.get(triton_name)
        except Exception as e:  # noqa: BLE001 - listed all the same, as Triton reports it ready
            logger.warning("model %s: listed without its details (%s)", triton_name, e)
            cards += [model_card(n, created, None, None, None) for n in names if n not in listed]
            listed.update(names)
            continue
        await registry.describe(model)
        for name in names:
            if name not in listed:
                cards.append(model_card(name, created, model.root, None, model.max_model_len))
                listed.add(name)
        for adapter, directory in model.lora_modules.items():
            if adapter not in listed:
                cards.append(model_card(adapter, created, directory, names[0], model.max_model_len))
                listed.add(adapter)
    return cards


async def one_model_card(registry: ModelRegistry, name: str) -> dict[str, Any]:
    """GET /v1/models/{name}: its card, or a 404 in vLLM's words."""
    for card in await model_cards(registry):
        if card["id"] == name:
            return card
    raise model_not_found(name)

