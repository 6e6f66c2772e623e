"""The agent frameworks people use, against the stack with the tiny model, across many seeds.

Each framework is used the way its docs show, with ordinary schemas: Pydantic models that
do not forbid extra keys, LangChain's non-strict tools, a function tool taking ``str``. The
tiny model writes random text, so a reply is never judged by its content: it must parse and
validate, carry no call markup in its text, and never be refused. A random model finds any
gap the grammars leave.

The schemas bound their strings where the frameworks let them (``max_length``); the ``str``
argument of the agents' tool is left unbounded on purpose, as users write it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

SEEDS = range(8)
MARKUP = ("<tool_call>", "</tool_call>")


class City(BaseModel):  # extra keys not forbidden: the ordinary Pydantic model
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)


class Forecast(BaseModel):
    city: City
    rain: bool
    days: list[int] = Field(max_length=3)


def _no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


@pytest.fixture
def base_url(stack) -> str:
    return f"{stack.api_url}/v1"


@pytest.fixture
def client(base_url) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# ── the OpenAI SDK ────────────────────────────────────────────────────────────────────────────
def test_openai_chat_parse_gives_a_valid_model_on_every_seed(client, stack):
    for seed in SEEDS:
        reply = client.chat.completions.parse(
            model=stack.model,
            messages=[{"role": "user", "content": "The forecast for Oslo, please."}],
            response_format=Forecast,
            seed=seed,
            max_tokens=400,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", seed
        assert isinstance(choice.message.parsed, Forecast)


def test_openai_responses_parse_gives_a_valid_model_on_every_seed(client, stack):
    for seed in SEEDS:
        response = client.responses.parse(
            model=stack.model,
            input="The forecast for Oslo, please.",
            text_format=Forecast,
            max_output_tokens=400,
            temperature=1.0,
            top_p=1.0 - seed / 100,  # the Responses API takes no seed: vary the sampling
        )
        assert response.status == "completed"
        assert isinstance(response.output_parsed, Forecast)


# ── openai-agents ─────────────────────────────────────────────────────────────────────────────
def _agent_run(
    base_url: str,
    model_name: str,
    api: str,
    seed: int,
    tool_choice: str,
    max_turns: int = 3,
    max_tokens: int | None = 300,
    ends: list[str] | None = None,
):
    """One openai-agents run; its result (None when it ran out of turns) and the tool's calls;
    ``ends`` (chat) collects each completion's finish_reason.

    One call a turn: the tiny model, free to chain parallel calls, would chain them until
    max_tokens. The tool takes an unbounded ``str``, which the tiny model may write until
    max_tokens cuts it; a run of several turns leaves it max_tokens=None (the context's room).
    """
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "rain"

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    if ends is not None:
        create = client.chat.completions.create

        async def recorded(*args, **kwargs):
            reply = await create(*args, **kwargs)
            ends.append(reply.choices[0].finish_reason)
            return reply

        client.chat.completions.create = recorded
    if api == "chat":
        model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
        extra = {"seed": seed}
    else:  # the Responses API takes no seed: greedy, so that a run is the same every time
        model = OpenAIResponsesModel(model=model_name, openai_client=client)
        extra = {}
    agent = Agent(
        name="forecaster",
        instructions="Look up the weather, then answer with a forecast.",
        tools=[get_weather],
        output_type=Forecast,
        model=model,
        model_settings=ModelSettings(
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=max_tokens,
            temperature=1.0 if api == "chat" else 0.0,
            extra_body=extra,
        ),
    )

    async def run():
        try:
            return await Runner.run(agent, "Forecast for Oslo?", max_turns=max_turns)
        except MaxTurnsExceeded:  # the model called the tool again each turn: its right
            return None
        finally:
            await client.close()

    return asyncio.run(run()), calls


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_str_tool_is_called_with_valid_arguments(base_url, stack, api):
    called = 0
    for seed in SEEDS[:4] if api == "chat" else [0]:
        ends: list[str] = []
        try:  # one turn, as long as the context allows: the call, then the tool runs
            result, calls = _agent_run(
                base_url,
                stack.model,
                api,
                seed,
                "required",
                max_turns=1,
                max_tokens=None,
                ends=ends if api == "chat" else None,
            )
        except Exception as exc:  # any refusal or unparsable reply fails the agent loop
            raise AssertionError(f"seed {seed}: {exc!r}") from exc
        assert result is None, seed
        if ends == ["length"] and not calls:
            continue  # the model wrote its str until the context ran out: a cut call, not run
        assert len(calls) == 1 and isinstance(calls[0], str), (seed, ends)
        called += 1
    assert called, "no seed's call was run"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_output_type_beside_tools_is_a_valid_final_output(base_url, stack, api):
    for seed in SEEDS[:4] if api == "chat" else [0]:
        try:
            result, calls = _agent_run(base_url, stack.model, api, seed, "none")
        except Exception as exc:
            raise AssertionError(f"seed {seed}: {exc!r}") from exc
        assert isinstance(result.final_output, Forecast) and not calls, seed


# ── LangChain ─────────────────────────────────────────────────────────────────────────────────
def _chat_model(base_url: str, model: str, seed: int):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=model,
        max_tokens=400,
        seed=seed,
        max_retries=0,
        timeout=120,
    )


class WeatherArgs(BaseModel):  # non-strict: extra keys not forbidden, as LangChain sends it
    city: str = Field(max_length=12)
    unit: Literal["c", "f"] = "c"


def test_langchain_bind_tools_non_strict_gives_valid_calls(base_url, stack):
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str = "c") -> str:
        """The weather in a city, in celsius (c) or fahrenheit (f)."""
        return "rain"

    @tool
    def get_population(city: City) -> int:
        """How many people live in a city."""
        return 1

    tools = [get_weather, get_population]
    schemas = {t.name: t.tool_call_schema.model_json_schema() for t in tools}
    for seed in SEEDS:
        for parallel in (False, True):
            model = _chat_model(base_url, stack.model, seed)
            bound = model.bind_tools(tools, tool_choice="any", parallel_tool_calls=parallel)
            message = bound.invoke("What is the weather in Oslo?")
            if message.response_metadata["finish_reason"] == "length":
                assert parallel, "one call fits max_tokens; parallel ones may chain past it"
                continue
            assert message.tool_calls and not message.invalid_tool_calls, message
            _no_markup(message.content)
            for call in message.tool_calls:
                jsonschema.validate(call["args"], schemas[call["name"]])
                assert set(call["args"]) <= set(schemas[call["name"]]["properties"])


def test_langchain_bind_tools_with_a_named_choice_gives_exactly_one_call(base_url, stack):
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str = "c") -> str:
        """The weather in a city, in celsius (c) or fahrenheit (f)."""
        return "rain"

    schema = get_weather.tool_call_schema.model_json_schema()
    for seed in SEEDS:  # parallel_tool_calls is left at its default, which is on
        bound = _chat_model(base_url, stack.model, seed).bind_tools(
            [get_weather], tool_choice="get_weather"
        )
        message = bound.invoke("What is the weather in Oslo?")
        assert [c["name"] for c in message.tool_calls] == ["get_weather"], (seed, message)
        assert message.response_metadata["finish_reason"] == "tool_calls"
        jsonschema.validate(message.tool_calls[0]["args"], schema)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output_gives_a_valid_model(base_url, stack, method):
    for seed in SEEDS:
        model = _chat_model(base_url, stack.model, seed)
        if method == "json_mode":  # the schema travels in the prompt; any object comes back
            structured = model.with_structured_output(None, method=method)
            document = structured.invoke("Give the forecast for Oslo as JSON.")
            assert isinstance(document, dict)
            continue
        structured = model.with_structured_output(Forecast, method=method)
        assert isinstance(structured.invoke("The forecast for Oslo, please."), Forecast)


# ── LiteLLM ───────────────────────────────────────────────────────────────────────────────────
def _litellm(base_url: str, model: str, seed: int, content: str, **kwargs):
    import litellm

    return litellm.completion(
        model=f"openai/{model}",
        api_base=base_url,
        api_key="unused",
        messages=[{"role": "user", "content": content}],
        seed=seed,
        max_tokens=400,
        num_retries=0,
        **kwargs,
    )


def test_litellm_with_a_pydantic_response_format_gives_a_valid_model(base_url, stack):
    for seed in SEEDS:
        reply = _litellm(
            base_url, stack.model, seed, "The forecast for Oslo, please.", response_format=Forecast
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        Forecast.model_validate(json.loads(choice.message.content))


def test_litellm_tool_calls_from_a_pydantic_schema_validate(base_url, stack):
    tool = {
        "type": "function",
        "function": {
            "name": "report",
            "description": "Report a city",
            "parameters": City.model_json_schema(),  # no additionalProperties, as LiteLLM sends
        },
    }
    for seed in SEEDS:
        reply = _litellm(
            base_url, stack.model, seed, "Report Oslo.", tools=[tool], tool_choice="required"
        )
        message = reply.choices[0].message
        assert message.tool_calls, seed
        _no_markup(message.content)
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            City.model_validate(arguments)
            assert set(arguments) <= set(City.model_fields)
