"""The tiny model's tokenizer for the in-memory ring, and ``--seed`` to replay one scenario."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", type=int, default=None, help="replay one ring simulation seed")


@pytest.fixture(scope="session")
def sim_tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The scripted runner's tensors are tiny: threads only add overhead."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
