"""How the tokenizer stage renders chats beyond the template itself (which ``--chat-template``
in `api` names, as every stage reads it): the shape a message's content reaches it in.
"""

from __future__ import annotations

from tokenline.settings.declaration import Setting

CHAT_RENDERING: tuple[Setting, ...] = (
    Setting(
        "chat-template-content-format",
        default="auto",
        help="how a message's content reaches the chat template, as vLLM's flag: string (text "
        'parts joined with a newline), openai (the list of parts, [{"type": "text", '
        '"text": ...}]), or auto: openai when the template loops over a message\'s content, '
        "else string",
        stages=frozenset({"tokenizer"}),
        choices=("auto", "string", "openai"),
    ),
)
