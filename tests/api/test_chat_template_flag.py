"""--chat-template (a file, or the template itself) replaces the model's: chats render with it,
and /tokenize counts what a chat completion reports."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokenline.model_source import template_text

TEMPLATE = (
    "{% for message in messages %}PINNED {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}PINNED assistant:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


def test_a_file_or_the_text_itself_and_nothing_else(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert template_text(str(path)) == TEMPLATE
    assert template_text(TEMPLATE) == TEMPLATE
    assert template_text(None) is None
    with pytest.raises(SystemExit, match="no such file, and not a template"):
        template_text(str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def pinned(launch_stack, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "pinned.jinja"
    path.write_text(TEMPLATE)
    stack = launch_stack("--chat-template", str(path))
    yield stack
    stack.stop()


def _count(url: str) -> dict:
    body = {"messages": MESSAGES, "return_token_strs": True}
    return httpx.post(f"{url}/tokenize", json=body, timeout=30).json()


def test_chats_render_with_the_pinned_template(pinned, stack):
    counted = _count(pinned.api_url)
    assert "PIN" in "".join(counted["token_strs"])
    assert counted["count"] != _count(stack.api_url)["count"]  # not the model's template
    client = openai.OpenAI(base_url=f"{pinned.api_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == counted["count"]
