"""A real-world ``vllm serve`` command line, run unchanged through ``tokenline serve``: the model
named positionally, aliases, LoRA modules in both of vLLM's syntaxes after one flag, a custom
chat template that shows tools and reads content parts, a generation config with temperature
and top_p, TLS with a self-signed certificate made at test time, and flags that change nothing
here. Each part behaves as vLLM documents it, seen through the official client over HTTPS. One
stack for the module (over plain HTTP where there is no `openssl` to make the certificate).
"""

from __future__ import annotations

import json
import shutil
import urllib.request

import httpx
import pytest
from api_testkit import self_signed_certificate
from openai import OpenAI
from test_lora_e2e import write_adapter

NAMES = ["tiny-chat", "gpt-4o-mini"]
# A deployment's own template: tools listed up front, each content part in brackets (a loop
# over message['content']: --chat-template-content-format auto reads it as openai)
TEMPLATE = (
    "{% if tools %}TOOLS:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}\n"
    "{% endif %}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def vllm_line(launch_stack, model_cache, tmp_path_factory):
    from tokenline.model_source import resolve

    base = resolve("tiny", cache_dir=str(model_cache)).path
    adapters = tmp_path_factory.mktemp("adapters")
    sql = write_adapter(base, adapters / "sql", seed=2)
    other = write_adapter(base, adapters / "other", seed=3)
    config_dir = tmp_path_factory.mktemp("generation")
    (config_dir / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64})
    )
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    tls, cert = [], None
    if shutil.which("openssl"):
        cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
        tls = ["--ssl-certfile", cert, "--ssl-keyfile", key]
    stack = launch_stack(
        "tiny",
        "--served-model-name", *NAMES,
        "--enable-lora",
        "--lora-modules", f"sql={sql}", json.dumps({"name": "other", "path": str(other)}),
        "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--generation-config", str(config_dir),
        "--override-generation-config", '{"top_p": 0.9}',
        "--trust-remote-code",
        "--enable-prefix-caching",
        "--disable-log-requests",
        "--max-model-len", "1024",
        *tls,
        ca_file=cert,
    )  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(vllm_line) -> httpx.Client:
    """Trusts the stack's certificate, and only it."""
    with httpx.Client(verify=vllm_line.ssl_context() or True, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def client(vllm_line, http) -> OpenAI:
    return OpenAI(
        base_url=f"{vllm_line.api_url}/v1", api_key="unused", http_client=http, max_retries=0
    )


def test_serve_passes_tls_to_its_api_and_the_openai_client_speaks_https(vllm_line, client):
    if vllm_line.ca_file is None:
        pytest.skip("needs openssl to make a certificate")
    assert vllm_line.api_url.startswith("https://")
    assert [m.id for m in client.models.list().data][:2] == NAMES
    reply = client.chat.completions.create(
        model=NAMES[1], messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    # a client that does not trust the certificate refuses it, and plain HTTP gets no answer
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{vllm_line.api_url}/health")
    with pytest.raises(OSError):
        plain = vllm_line.api_url.replace("https://", "http://")
        urllib.request.urlopen(f"{plain}/health", timeout=5).read()


def test_models_lists_every_alias_then_both_adapters(vllm_line, http):
    cards = http.get(f"{vllm_line.api_url}/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards[:2]] == [(name, None) for name in NAMES]
    assert sorted((c["id"], c["parent"]) for c in cards[2:]) == [
        ("other", "tiny-chat"),
        ("sql", "tiny-chat"),
    ]
    assert cards[0]["root"] == cards[1]["root"] == "tiny"
    # the generation config's sampling values, the override over them; max_new_tokens is
    # max_tokens (vLLM 0.32's get_diff_sampling_param), from a directory a cap as well
    assert cards[0]["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}


def test_each_alias_and_each_adapter_answers_under_its_own_name(client):
    for name in [*NAMES, "sql", "other"]:
        reply = client.completions.create(model=name, prompt="the river", max_tokens=3)
        assert reply.model == name
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_custom_template_renders_tools_and_parts_and_tokenize_agrees(vllm_line, http, client):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "north"}, {"type": "text", "text": "road"}],
        }
    ]
    body = {"model": "gpt-4o-mini", "messages": messages, "tools": TOOLS}
    counted = http.post(f"{vllm_line.api_url}/tokenize", json=body).json()
    text = http.post(
        f"{vllm_line.api_url}/detokenize",
        json={"model": "gpt-4o-mini", "tokens": counted["tokens"]},
    ).json()["prompt"]
    assert "TOOLS: get_weather" in text and "[north][road]" in text
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert reply.model == "gpt-4o-mini"
    assert reply.usage.prompt_tokens == counted["count"]
