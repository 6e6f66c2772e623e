"""--chat-template-content-format, as vLLM means it: ``string`` joins a message's text parts,
``openai`` hands the template the list of parts, ``auto`` reads from the template which it
wants; /tokenize renders as generation does."""

from __future__ import annotations

import copy
import time

import pytest

from tokenline import protocol
from tokenline.api.openai.chat import ChatMessageIn
from tokenline.tiny_model import CHAT_TEMPLATE
from tokenline.tokenizer.content_format import detect, resolve, template_content
from tokenline.tokenizer.stage import PromptEncoder, TokenizerStage

# A template that only reads parts, as multimodal models' templates do: each part in brackets
PARTS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "found"),
    [
        (CHAT_TEMPLATE, "string"),  # the tiny model's: content printed whole
        (PARTS_TEMPLATE, "openai"),
        # through names assigned from messages, filters and attribute access
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}"
            "{% for c in m.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        # both shapes handled (Gemma's, Llama 4's): a loop over content still counts
        (
            "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for x in other['content'] %}{% endfor %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}", "string"),  # does not parse: fails on its own when used
        (None, "string"),
    ],
)
def test_auto_detects_whether_the_template_loops_over_content_parts(template, found):
    assert detect(template) == found
    assert resolve("auto", template) == found


def test_a_format_given_is_the_format_used():
    assert resolve("openai", CHAT_TEMPLATE) == "openai"
    assert resolve("string", PARTS_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="use auto, string or openai"):
        resolve("parts", CHAT_TEMPLATE)


def _wire(content) -> protocol.ChatMessage:
    return ChatMessageIn(role="user", content=content).to_wire()


def test_the_template_sees_content_in_the_format_vllm_hands_it():
    parts = _wire([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    plain, null = _wire("a b"), _wire(None)
    assert template_content(parts, "string") == "a\nb"
    assert template_content(parts, "openai") == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert template_content(plain, "string") == "a b"
    assert template_content(plain, "openai") == [{"type": "text", "text": "a b"}]
    assert template_content(null, "string") == ""
    assert template_content(null, "openai") == []  # vLLM: null content is no part


@pytest.fixture(scope="module")
def parts_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = PARTS_TEMPLATE
    return tokenizer


def _prompt(stage: TokenizerStage, messages, call: bool = False) -> str:
    if call:
        message = protocol.TokenizeCall(uid="c", messages=messages)
    else:
        sampling = protocol.SamplingParams(max_tokens=4)
        message = protocol.Generate(uid="g", sampling=sampling, timeout_s=30, messages=messages)
    (out,) = stage.handle_batch([(time.monotonic(), message)])
    ids = out.ids if call else out.prompt_ids
    return stage.encoder.hf_tokenizer.decode(ids)


def test_openai_renders_each_part_and_tokenize_reports_the_same(parts_tokenizer):
    stage = TokenizerStage(PromptEncoder(parts_tokenizer, 1024, "openai"))
    messages = [_wire([{"type": "text", "text": "north"}, {"type": "text", "text": "road"}])]
    rendered = _prompt(stage, messages)
    assert "[north][road]" in rendered
    assert _prompt(stage, messages, call=True) == rendered  # /tokenize: the same tokens
    assert "[river]" in _prompt(stage, [_wire("river")])  # a string is one part


def test_string_hands_a_parts_template_one_string(parts_tokenizer):
    # what tokenline did before the flag, and vLLM's string format: the template loops over
    # the characters of the joined text "ab\nc", none of which has a text
    stage = TokenizerStage(PromptEncoder(parts_tokenizer, 1024, "string"))
    messages = [_wire([{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}])]
    assert "<|user|>[][][][]<|assistant|>" in _prompt(stage, messages)


def test_serve_hands_the_flag_to_the_tokenizer_stage():
    from tokenline.cli import build_parser, main, settings_from
    from tokenline.serve import stage_argv

    args = build_parser().parse_args(["serve", "--chat-template-content-format", "openai"])
    settings = settings_from(args)
    argv = stage_argv("tokenizer", settings)
    assert argv[argv.index("--chat-template-content-format") + 1] == "openai"
    assert "--chat-template-content-format" not in stage_argv("api", settings)
    with pytest.raises(SystemExit):  # not one of vLLM's three
        main(["tokenizer", "--chat-template-content-format", "parts"])
