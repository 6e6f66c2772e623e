"""Session fixtures: the tiny model (built once), engines over it, transformers' own greedy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tokenline import model_source, tiny_model
from tokenline.model_source import ModelSource
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.grammar import GrammarCompiler
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.speculative import config as speculative_config
from tokenline.scheduler.waiting import Scheduling

MiB = 2**20


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny model's matmuls are too small to share; two threads on a busy 2-core
    machine spin against each other and make a step 10-30x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One directory per session, shared with tests/detokenizer: ensure_cached builds it once.
    return tmp_path_factory.getbasetemp() / "tiny-model-cache"


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    cache = _tiny_cache(tmp_path_factory)
    tiny_model.ensure_cached(cache)
    return model_source.resolve("tiny", cache_dir=str(cache))


@pytest.fixture(scope="session")
def tokenizer(tiny_source: ModelSource):
    return tiny_source.load_tokenizer()


@pytest.fixture(scope="session")
def encode(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer(text)["input_ids"]


@pytest.fixture(scope="session")
def eos_ids(tiny_source: ModelSource) -> list[int]:
    return tiny_source.eos_token_ids()


@pytest.fixture(scope="session")
def bytes_per_block(tiny_source: ModelSource) -> int:
    runner = ModelRunner(
        tiny_source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=MiB)
    )
    return runner.bytes_per_token * runner.block_size


@pytest.fixture(scope="session")
def make_engine(
    tiny_source: ModelSource, eos_ids: list[int], bytes_per_block: int
) -> Callable[..., Engine]:
    """An engine over the tiny model on the CPU in float32; ``kv_blocks`` sizes a tiny pool.

    ``dense_decode=False`` runs decode attention the way a GPU does (gathered from the pool);
    ``speculative`` is a --speculative-config JSON; ``kv_transfer`` makes it a prefill or a
    decode pod's engine."""

    def make(
        kv_blocks: int | None = None,
        kv_cache_memory: int = 8 * MiB,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = tiny_model.MAX_POSITIONS,
        eos: list[int] | None = None,
        dense_decode: bool = True,
        prefix_caching: bool = True,
        grammars: bool = False,
        attention_backend: str = "auto",
        speculative: str | None = None,
        scheduling: Scheduling = Scheduling(),
        kv_transfer: KVTransferConfig | None = None,
        dtype: str = "float32",
    ) -> Engine:
        memory = kv_blocks * bytes_per_block if kv_blocks is not None else kv_cache_memory
        runner = ModelRunner(
            tiny_source,
            RunnerOptions(
                device="cpu",
                dtype=dtype,
                kv_cache_memory=memory,
                dense_decode=dense_decode,
                attention_backend=attention_backend,
            ),
        )
        if kv_blocks is not None:
            assert runner.num_blocks == kv_blocks
        limits = EngineLimits(max_model_len, max_num_seqs, max_num_batched_tokens)
        compiler = GrammarCompiler(tiny_source.load_tokenizer()) if grammars else None
        eos = eos_ids if eos is None else eos
        return Engine(
            runner,
            limits,
            eos,
            prefix_caching,
            grammars=compiler,
            speculative=speculative_config.parse(speculative),
            scheduling=scheduling,
            kv_transfer=kv_transfer,
        )

    return make


@pytest.fixture(scope="session")
def hf_greedy(tiny_source: ModelSource) -> Callable[[list[int], int], list[int]]:
    """transformers' ``generate(do_sample=False)`` with the model's own generation config.

    It stops after any EOS id of the generation config, EOS included, like the engine does.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float32)
    model.eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
                )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return generate
