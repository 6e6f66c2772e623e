"""``GET /v1/models``: the served model and each LoRA adapter on it, as vLLM lists them."""

from __future__ import annotations

from tokenline.api.endpoints.base import Endpoint


class Models(Endpoint):
    def cards(self) -> list[dict]:
        state = self.request.app.state
        cards = state.lora_names.cards(state.started)
        for card in cards:
            # what requests that leave these fields out get (--generation-config and
            # --override-generation-config); {} where the API's own defaults apply
            card["sampling_defaults"] = dict(state.request_defaults.values)
        scheduler = self.ring_client.health.statuses.get("scheduler")
        if scheduler is not None and scheduler.model_impl:  # which code runs the base model
            for card in cards:
                if card["parent"] is None:  # each of the base model's names
                    card["architecture"] = scheduler.architecture
                    card["model_impl"] = scheduler.model_impl
                    # vLLM's --runner, and what a pooling model computes (--convert)
                    card["runner"] = "generate" if scheduler.pooling is None else "pooling"
                    if scheduler.pooling is not None:
                        card["task"] = scheduler.pooling.task
        return cards

    def list(self) -> dict:
        return {"object": "list", "data": self.cards()}

    def get(self, model_id: str) -> dict:
        self.check_model(model_id)
        return next(c for c in self.cards() if c["id"] == self.model_name)
