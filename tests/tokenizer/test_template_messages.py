"""What the chat template is handed, held to what vLLM hands it and to transformers'
``apply_chat_template`` over the same messages: tools in OpenAI's key order, a tool's result
as one text, every role's ``name``, a call without arguments as an empty object."""

from __future__ import annotations

import copy
import json
import time

from tool_format_testkit import WEATHER

from tokenline import protocol
from tokenline.api.function_calling.grammars import shown_tools
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.tools import Tool
from tokenline.tokenizer.stage import PromptEncoder, TokenizerStage, _template_message

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _rendered(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt the tokenizer stage builds for a chat completion of ``messages``."""
    wire = ChatCompletionRequest(model="tiny", messages=messages).wire_messages()
    shown = shown_tools([Tool.model_validate(t) for t in tools]) if tools else None
    generate = protocol.Generate(
        uid="u",
        sampling=protocol.SamplingParams(max_tokens=4),
        timeout_s=30,
        messages=wire,
        tools=shown,
    )
    stage = TokenizerStage(PromptEncoder(tokenizer, 4096))
    (out,) = stage.handle_batch([(time.monotonic(), generate)])
    return tokenizer.decode(out.prompt_ids)


def test_tools_reach_the_template_as_transformers_renders_them(tiny_tokenizer):
    """Keys in OpenAI's order (name, description, parameters), as models were trained on
    them: a template writing ``tool | tojson`` shows the same text."""
    want = tiny_tokenizer.apply_chat_template(
        ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert _rendered(tiny_tokenizer, ASK, [WEATHER]) == want
    (shown,) = shown_tools([Tool.model_validate(WEATHER)])
    assert list(shown["function"]) == ["name", "description", "parameters"]


def test_a_tool_result_is_one_text_whatever_the_content_format(tiny_tokenizer):
    """A template that loops over a user's parts still prints a tool's content as it is."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}<tool>{{ m['content'] }}</tool>"
        "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
        "{% endfor %}"
    )
    stage = TokenizerStage(PromptEncoder(tokenizer, 4096, "openai"))
    messages = ChatCompletionRequest(
        model="tiny",
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "12:00"}]},
        ],
    ).wire_messages()
    generate = protocol.Generate(
        uid="u", sampling=protocol.SamplingParams(max_tokens=4), timeout_s=30, messages=messages
    )
    (out,) = stage.handle_batch([(time.monotonic(), generate)])
    assert "<tool>12:00</tool>" in tokenizer.decode(out.prompt_ids)


def test_every_roles_name_and_empty_arguments_reach_the_template_as_vllm_hands_them():
    messages = ChatCompletionRequest(
        model="tiny",
        messages=[
            {"role": "user", "content": "hi", "name": "alice"},
            {
                "role": "assistant",
                "content": None,
                "name": "bot",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}},
                    {"id": "c2", "type": "function", "function": {"name": "at", "arguments": "{}"}},
                ],
            },
        ],
    ).wire_messages()
    user, assistant = (_template_message(m) for m in messages)
    assert (user["name"], assistant["name"]) == ("alice", "bot")
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{}, {}]
    assert json.dumps(assistant["tool_calls"][0]["function"]["arguments"]) == "{}"


def test_a_responses_message_of_several_text_parts_reads_as_chats_does():
    """Parts joined as chat joins them (vLLM too), not run together: "a", "b" is "a\\nb"."""
    from tokenline.api.openai.responses import ResponsesRequest
    from tokenline.api.openai.responses_as_chat import messages_of

    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    body = ResponsesRequest(model="tiny", input=[{"role": "user", "content": parts}])
    (message,) = messages_of(body)
    assert message["content"] == "a\nb"
