"""``GET /v1/models``: the served model and each LoRA adapter on it, as vLLM lists them."""

from __future__ import annotations

from tokenline.api.endpoints.base import Endpoint


class Models(Endpoint):
    def cards(self) -> list[dict]:
        return self.request.app.state.adapters.cards(self.request.app.state.started)

    def list(self) -> dict:
        return {"object": "list", "data": self.cards()}

    def get(self, model_id: str) -> dict:
        self.check_model(model_id)
        return next(c for c in self.cards() if c["id"] == self.model_name)
