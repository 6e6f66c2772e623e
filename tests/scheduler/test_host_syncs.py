"""A decode step waits for the device once: the copy of its sampled tokens (and of the
logprobs that were asked for, in the same copy).

Every call that makes the host wait for a GPU is counted when it reads a tensor that lives on
the model's device: ``tolist``, ``item``, ``cpu``, ``numpy``, ``nonzero`` and a tensor's truth or
number value. On this CPU machine "on the device" is tracked the way a GPU would make it so: the
weights and the KV pool start there, and whatever an operation computes from a device tensor,
or a tensor moved with ``.to``, is on the device too (a torch function mode follows every
operation). Host-built inputs (block tables, masks built from them) are not, until copied.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

WAITS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


class DeviceTracking(TorchFunctionMode):
    """Counts host waits on device tensors, and follows device-ness through every op."""

    def __init__(self, on_device: list[torch.Tensor]) -> None:
        super().__init__()
        self.ids = {id(t) for t in on_device}
        self.kept = list(on_device)  # ids stay unique while the test runs
        self.waits: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # flex_attention traces its kernel call, even eager
            return func(*args, **kwargs)
        inputs = [*args, *kwargs.values()]
        device = any(id(t) in self.ids for value in inputs for t in _tensors(value))
        if device and func in WAITS:
            self.waits[func.__name__] += 1
        out = func(*args, **kwargs)
        if device or func is torch.Tensor.to:
            for t in _tensors(out):
                self.ids.add(id(t))
                self.kept.append(t)
        return out


SAMPLED = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
    "every-field": SamplingParams(
        max_tokens=40,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={7: 2.0, 11: -3.0},
        min_tokens=30,
        logprobs=3,
        ignore_eos=False,
    ),
}


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
@pytest.mark.parametrize("kind", list(SAMPLED))
def test_a_decode_step_waits_for_the_device_once(tiny_source, backend, kind):
    runner = ModelRunner(
        tiny_source,
        RunnerOptions(
            device="cpu", dtype="float32", kv_cache_memory=2**21, attention_backend=backend
        ),
    )
    engine = Engine(runner, EngineLimits(256), tiny_source.eos_token_ids())
    for i in range(6):
        prompt = [(7 * i + 3 * j) % 250 + 5 for j in range(8 + i)]
        engine.add(f"r{i}", prompt, SAMPLED[kind])
    engine.step()  # the prompts
    tracking = DeviceTracking([*runner.model.parameters(), runner.kv_cache])
    steps = 10
    with tracking:
        for _ in range(steps):
            outputs = engine.step()
            assert len(outputs) == 6  # every step here decodes all six
    assert tracking.waits == Counter({"tolist": steps}), tracking.waits
