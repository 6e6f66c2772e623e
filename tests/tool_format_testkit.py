"""Tiny-model variants whose chat templates follow each tool-call format (mistral, pythonic,
qwen3_coder, deepseek_v3), so the format is read from the template and driven end to end
with random weights: ``tool_choice`` required or named makes the grammar write a call, and
the reply must parse back into a call valid for its schema.

Each template shows the tools with the instruction its family's template gives (the markers
the format is recognised by), and renders earlier calls in the format. Mistral's
``[TOOL_CALLS]`` is an added *special* token, as in Mistral's Hugging Face tokenizers;
DeepSeek's markers are added tokens that decode to text, as in DeepSeek-V3's.
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import openai

from tokenline.api.function_calling.marked_streams import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
)

_TURNS = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}<|assistant|>\n"
    "{{ calls(message['tool_calls']) }}<|end|>\n"
    "{% elif message['role'] == 'tool' %}<|user|>\nresult: {{ message['content'] }}<|end|>\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _template(instruction: str, calls_macro: str) -> str:
    tools = (
        "{% if tools %}<|system|>\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n"
        "{% endfor %}" + instruction + "<|end|>\n{% endif %}"
    )
    return "{% macro calls(tool_calls) %}" + calls_macro + "{% endmacro %}" + tools + _TURNS


TEMPLATES = {
    "mistral": _template(
        'To call functions, write [TOOL_CALLS] and a JSON list of {"name", "arguments"}.',
        "[TOOL_CALLS][{% for c in tool_calls %}"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
        '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]',
    ),
    "pythonic": _template(
        "To call functions, answer only with "
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), "
        "func_name2(params)]",
        "[{% for c in tool_calls %}{{ c.function.name }}("
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %})"
        "{% if not loop.last %}, {% endif %}{% endfor %}]",
    ),
    "qwen3_coder": _template(
        "To call a function: <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n"
        "</parameter>\n</function>\n</tool_call>",
        "{% for c in tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
        "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}"
        "</function>\n</tool_call>{% endfor %}",
    ),
    "deepseek_v3": _template(
        "To call functions: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜>{% for c in tool_calls %}<｜tool▁call▁begin｜>"
        "{{ c.type }}<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
        "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>"
        "{% if not loop.last %}\n{% endif %}{% endfor %}<｜tool▁calls▁end｜>",
    ),
}
# (markers, whether they are special tokens): Mistral's [TOOL_CALLS] is special, DeepSeek-V3's
# five call markers are added tokens that decode to text, as in their tokenizers
MARKERS: dict[str, tuple[list[str], bool]] = {
    "mistral": (["[TOOL_CALLS]"], True),
    "deepseek_v3": (
        [
            DEEPSEEK_CALLS_BEGIN,
            DEEPSEEK_CALLS_END,
            DEEPSEEK_CALL_BEGIN,
            DEEPSEEK_CALL_END,
            DEEPSEEK_SEP,
        ],
        False,
    ),
}


def write_format_model(tiny_dir: Path, out: Path, name: str) -> Path:
    """The tiny model at ``tiny_dir`` with format ``name``'s template (and marker tokens,
    embeddings grown to match), written to ``out``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    markers, special = MARKERS.get(name, ([], False))
    if special:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AddedToken(m, special=True) for m in markers]}
        )
    elif markers:
        tokenizer.add_tokens(markers)
    tokenizer.chat_template = TEMPLATES[name]
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def with_special_marker(tokenizer):
    """A copy of a transformers tokenizer with Mistral's ``[TOOL_CALLS]`` as a special added
    token (as in Mistral's Hugging Face tokenizers), and the marker's id."""
    import copy

    from tokenizers import AddedToken

    tokenizer = copy.deepcopy(tokenizer)
    marker = AddedToken("[TOOL_CALLS]", special=True, normalized=False)
    tokenizer.add_special_tokens({"additional_special_tokens": [marker]})
    return tokenizer, tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Rome", "Paris"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def assert_valid_calls(message, names: set[str]) -> None:
    """The message holds calls, each of a declared function, with arguments its schema
    accepts, and no markup in its content."""
    import json

    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, _SCHEMAS[call.function.name])
    assert not message.content


def check_forced_calls(client: openai.OpenAI, model: str, seeds=(0, 1, 2)) -> None:
    """required and named tool choices give valid calls on every seed, whole and streamed."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for seed in seeds:
        for choice, names in (
            ("required", {"get_weather", "get_time"}),
            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
        ):
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,  # random weights would call until max_tokens
                seed=seed,
                temperature=1.0,
                max_tokens=400,
            )
            assert reply.choices[0].finish_reason == "tool_calls", reply
            assert_valid_calls(reply.choices[0].message, names)
            assert len(reply.choices[0].message.tool_calls) == 1
    with client.chat.completions.stream(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=7,
        max_tokens=400,
    ) as stream:
        final = stream.get_final_completion()
    assert_valid_calls(final.choices[0].message, {"get_weather", "get_time"})


def check_history_renders(client: openai.OpenAI, model: str) -> dict:
    """A conversation holding a call and its result renders through the template; the
    reply's first call is sent back as the assistant turn."""
    first = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Time?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=400,
        seed=3,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    again = client.chat.completions.create(
        model=model,
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=400,
    )
    assert_valid_calls(again.choices[0].message, {"get_weather", "get_time"})
    return {"id": call.id}


def check_responses_call(client: openai.OpenAI, model: str) -> None:
    """The Responses API reads calls in the same format: a forced call is a function_call."""
    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "parameters": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    response = client.responses.create(
        model=model,
        input="Weather?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=400,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"], response.output
    import json

    jsonschema.validate(json.loads(calls[0].arguments), _SCHEMAS["get_weather"])


def stack_for(name: str, model_cache, launch_stack, tmp_path_factory):
    """A stack serving the ``name`` variant; its parser is read from the template. The
    model's directory is ``stack.model_dir``."""
    from tokenline import tiny_model

    model = write_format_model(
        tiny_model.ensure_cached(model_cache), tmp_path_factory.mktemp(name) / "model", name
    )
    stack = launch_stack("--model", str(model), "--served-model-name", name)
    stack.model_dir = model
    return stack
