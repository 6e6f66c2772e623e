"""``GET /v1/models``: the one model this server serves, as OpenAI lists models."""

from __future__ import annotations

from tokenline.api.endpoints.base import Endpoint


class Models(Endpoint):
    def card(self) -> dict:
        return {
            "id": self.pipeline.model,
            "object": "model",
            "created": self.request.app.state.started,
            "owned_by": "tokenline",
        }

    def list(self) -> dict:
        return {"object": "list", "data": [self.card()]}

    def get(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.card()
