"""The path that runs the model is visible, and a model without every capability still serves.

A second stack serves a Granite model (no native module: transformers' own modules with
tokenline's paged attention) whose tokenizer the grammar library cannot read (a word-level
vocabulary with a WordPiece decoder). Through all four processes it answers plain requests with
transformers' own greedy tokens, says on /v1/models which code runs it, and refuses only the
requests that need a grammar, with a 400 that says why; the main stack's tiny Llama runs on its
native module.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

GRANITE = {"embedding_multiplier": 12.0, "attention_multiplier": 0.1, "residual_multiplier": 0.2}
WORDS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"] + [f"w{i}" for i in range(296)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_wordlevel_granite(path: Path) -> torch.nn.Module:
    """Random Granite weights with a word-level tokenizer, in Hugging Face format."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.GraniteConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        logits_scaling=8.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, **GRANITE,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GraniteForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("wordlevel-granite")
    return path, write_wordlevel_granite(path)


@pytest.fixture(scope="module")
def granite_stack(launch_stack, granite):
    stack = launch_stack("--model", str(granite[0]), "--served-model-name", "granite")
    yield stack
    stack.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _model_card(stack) -> dict:
    with urllib.request.urlopen(f"{stack.api_url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]


def test_models_says_which_code_runs_the_model(stack, granite_stack):
    card = _model_card(stack)
    assert (card["architecture"], card["model_impl"]) == ("LlamaForCausalLM", "tokenline")
    card = _model_card(granite_stack)
    assert (card["architecture"], card["model_impl"]) == ("GraniteForCausalLM", "transformers")


def test_transformers_modules_serve_transformers_greedy_tokens(granite_stack, granite):
    _, model = granite
    prompt = [1, 17, 42, 99, 7, 150, 230]
    status, body = _post(
        f"{granite_stack.api_url}/v1/completions",
        {"model": "granite", "prompt": prompt, "max_tokens": 10, "temperature": 0,
         "ignore_eos": True},
    )  # fmt: skip
    assert status == 200, body
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None
        )
    # the text leaves special tokens out, as the detokenizer does
    expected = " ".join(WORDS[i] for i in out[0, len(prompt) :].tolist() if i >= 4)
    assert body["choices"][0]["text"].strip() == expected
    assert body["usage"]["completion_tokens"] == 10


def test_a_tokenizer_the_grammar_library_cannot_read_refuses_only_grammars(granite_stack):
    url = granite_stack.api_url
    status, body = _post(
        f"{url}/v1/chat/completions",
        {"model": "granite", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4},
    )
    assert status == 200, body
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refusals = {
        "response_format": (
            "/v1/completions",
            {"model": "granite", "prompt": "w1", "max_tokens": 4, "response_format": schema},
        ),
        "tools": (
            "/v1/chat/completions",
            {
                "model": "granite",
                "messages": [{"role": "user", "content": "w1"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            },
        ),
    }
    for param, (path, request) in refusals.items():
        status, body = _post(url + path, request)
        assert status == 400, body
        assert body["error"]["param"] == param
        assert "cannot read its tokenizer" in body["error"]["message"]
    with urllib.request.urlopen(f"{url}/ready", timeout=10) as response:
        assert response.status == 200
