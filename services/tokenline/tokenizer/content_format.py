"""How a message's content reaches the chat template (vLLM's ``--chat-template-content-format``).

``string``: one string, the text parts joined with a newline. ``openai``: the list of parts,
``[{"type": "text", "text": ...}]``, a plain string content becoming one part, as vLLM hands
them. ``auto``: ``openai`` when the template loops over a message's content
(``{% for part in message['content'] %}``), else ``string``: vLLM's detection, on the template's
syntax tree, following the names ``messages`` and its items are assigned to.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Literal

import jinja2
import jinja2.nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from tokenline import protocol

log = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]
CHOICES = ("auto", "string", "openai")


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key``."""
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or its ``key``), maybe filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    return _is_item(node, name, key) if key else _is_var(node, name)


def _names_of(root: jinja2.nodes.Template, name: str) -> Iterator[str]:
    """``name`` and every name assigned from it (``{% set msgs = messages[1:] %}``)."""
    yield name
    pending, seen = deque([name]), {name}
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if _reads(assign.node, current) and isinstance(target, jinja2.nodes.Name):
                if target.name not in seen:
                    seen.add(target.name)
                    pending.append(target.name)
                    yield target.name


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    lists = list(_names_of(root, "messages"))
    items = [
        loop.target.name
        for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, n) for n in lists)
    ]
    return any(
        _reads(loop.iter, item, "content")
        for loop in root.find_all(jinja2.nodes.For)
        for item in items
    )


def detect(template: str | None) -> ContentFormat:
    """``openai`` when ``template`` loops over a message's content parts, else ``string`` (also
    for no template, or one that does not parse: it fails on its own when a chat renders)."""
    if not template:
        return "string"
    try:
        compiled = _compile_jinja_template(template)  # transformers' environment and tags
        root = compiled.environment.parse(template)
    except Exception as exc:  # any template error: the chat reports it when it renders
        log.warning("could not read the chat template to detect its content format: %s", exc)
        return "string"
    return "openai" if _loops_over_content(root) else "string"


def resolve(given: str, template: str | None) -> ContentFormat:
    """The format in force: ``given``, or with ``auto`` the template's (logged, as vLLM does)."""
    if given in ("string", "openai"):
        return given  # type: ignore[return-value]
    if given != "auto":
        raise ValueError(f"--chat-template-content-format {given!r}: use auto, string or openai")
    found = detect(template)
    log.info(
        "chat template content format: %s (detected from the template; set "
        "--chat-template-content-format to choose)",
        found,
    )
    return found


def template_content(message: protocol.ChatMessage, fmt: ContentFormat) -> str | list[dict]:
    """``message``'s content as the template reads it in ``fmt``. A tool's result is always
    one text (as vLLM gives it): templates print it as it is, also those that loop over the
    parts of other messages."""
    if fmt == "string" or message.role == "tool":
        return message.content  # the api joined the parts with PART_SEPARATOR
    texts = [message.content] if message.parts is None else message.parts
    return [{"type": "text", "text": text} for text in texts]
