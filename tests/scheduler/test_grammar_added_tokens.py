"""A forced tool call whose markers are added tokens of the vocabulary, as Qwen's tokenizers
hold ``<tool_call>`` and ``</tool_call>`` (added, not special: they decode to text).

llguidance's own reading of a tokenizer makes every added token special, so its mask offered
``<tool_call>`` as one token and its matcher then refused it: every ``tool_choice: required``
request ended in an error. The grammar tokenizer keeps added text tokens as text.
"""

from __future__ import annotations

import json

import pytest
from scheduler_testkit import drain

from tokenline import model_source
from tokenline.api.function_calling.formats import HERMES
from tokenline.api.function_calling.grammars import plan_tools
from tokenline.api.openai.tools import Tool
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.grammar import GrammarCompiler
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

MARKERS = ["<tool_call>", "</tool_call>"]
WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
)


@pytest.fixture(scope="module")
def marked_model(tiny_source, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tool-markers")
    tokenizer = AutoTokenizer.from_pretrained(tiny_source.path)
    tokenizer.add_tokens(MARKERS)  # not special, as in Qwen's tokenizer
    model = LlamaForCausalLM.from_pretrained(tiny_source.path)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model_source.ModelSource(spec="marked", path=str(out))


def test_forced_call_with_added_marker_tokens(marked_model) -> None:
    tokenizer = marked_model.load_tokenizer()
    open_id = tokenizer.convert_tokens_to_ids(MARKERS[0])
    runner = ModelRunner(
        marked_model, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**22)
    )
    engine = Engine(
        runner,
        EngineLimits(512),
        marked_model.eos_token_ids(),
        grammars=GrammarCompiler(tokenizer),
    )
    plan = plan_tools([WEATHER], "required", False, None, HERMES)
    for seed in range(4):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, grammar=plan.grammar)
        engine.add(f"s{seed}", tokenizer("weather in")["input_ids"], params)
    out = drain(engine)
    for uid, ids in out.tokens.items():
        assert out.reasons[uid] == "stop", (uid, out.reasons[uid], tokenizer.decode(ids))
        assert ids[0] == open_id  # the marker's own token, as the model would write it
        parsed = HERMES.parse(tokenizer.decode(ids, skip_special_tokens=True))
        assert [c.name for c in parsed.calls] == ["get_weather"] and not parsed.content
        assert set(json.loads(parsed.calls[0].arguments)) == {"city"}
