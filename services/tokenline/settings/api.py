"""The api stage's HTTP server: where it listens, deadlines and admission, keys and CORS, the
limits of one request, tool calls, TLS.
"""

from __future__ import annotations

from tokenline.settings.declaration import API, CrdField, Setting, parse_bytes

#: A browser origin as the Origin header spells it (`scheme://host[:port]`: lower case, no
#: path, no trailing slash), or `*`; anything else never equals a request's Origin.
ORIGIN_PATTERN = (
    r"^(\*|[a-z][a-z0-9+.-]*://"
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*|\[[0-9a-f:.]+\])"
    r"(:[0-9]{1,5})?)$"
)
#: Most origins the CRD allows (the list is compared per request).
MAX_ALLOWED_ORIGINS = 64

API_SERVER: tuple[Setting, ...] = (
    Setting("host", default="0.0.0.0", help="address the HTTP server binds", stages=API),
    Setting("port", int, 8000, help="HTTP port (serve: stage metrics on port+1..3)", stages=API),
    Setting(
        "request-timeout",
        float,
        600.0,
        help="per-request deadline, seconds",
        stages=API,
        crd=CrdField(
            "server.requestTimeoutSeconds",
            "Per-request deadline.",
            {"type": "integer", "minimum": 1},
        ),
    ),
    Setting(
        "slow-client-timeout",
        float,
        30.0,
        help="seconds a paused stream may stay unread before it is aborted",
        stages=API,
        crd=CrdField(
            "server.slowClientTimeoutSeconds",
            "How long a paused stream may stay unread before it is aborted.",
            {"type": "integer", "minimum": 1},
        ),
    ),
    Setting(
        "max-waiting",
        int,
        256,
        help="waiting requests before new ones get 429",
        stages=API,
        crd=CrdField(
            "server.maxWaiting", "Waiting requests before the API answers 429/503.", {"minimum": 0}
        ),
    ),
    Setting(
        "api-key",
        help="require `Authorization: Bearer KEY` on every route but /health, /ready and "
        "/metrics; repeat for several keys. Prefer --api-key-file: a command line is visible "
        "to local users",
        stages=API,
        attr="api_keys",
        repeatable=True,
        metavar="KEY",
        secret=True,
    ),
    Setting(
        "allowed-origin",
        help="a browser origin (https://app.example.com, or * for any) whose pages may call "
        "the api: answers CORS preflights and adds Access-Control-Allow-* headers; repeat for "
        "several. Off by default",
        stages=API,
        attr="allowed_origins",
        repeatable=True,
        metavar="ORIGIN",
        crd=CrdField(
            "server.allowedOrigins",
            "Browser origins whose pages may call the API (CORS), e.g. "
            "https://app.example.com, or * for any; unset or empty: no CORS headers. "
            "Write each as the browser sends it: lower case, no path or trailing slash, "
            "no default port.",
            {
                "maxItems": MAX_ALLOWED_ORIGINS,
                "items": {
                    "type": "string",
                    "description": "An origin, scheme://host[:port], or *.",
                    "pattern": ORIGIN_PATTERN,
                },
            },
        ),
    ),
    Setting(
        "api-key-file",
        help="file of API keys, one per line (# comments and blank lines ignored); re-read "
        "when it changes, so a rotated Kubernetes Secret applies without a restart",
        stages=API,
    ),
    Setting(
        "max-body-size",
        parse_bytes,
        8 * 2**20,
        help="largest request body, e.g. 8MiB; larger ones get 413 before they are read",
        stages=API,
    ),
    Setting("max-n", int, 16, help="most choices (`n`) one request may ask for", stages=API),
    Setting(
        "max-tokens-limit",
        int,
        131_072,
        help="largest max_tokens a request may ask for",
        stages=API,
    ),
    Setting("max-stop-strings", int, 16, help="most `stop` strings per request", stages=API),
    Setting(
        "max-stop-string-length", int, 1024, help="longest `stop` string, characters", stages=API
    ),
    Setting("max-stop-token-ids", int, 256, help="most `stop_token_ids` per request", stages=API),
    Setting("max-messages", int, 2048, help="most chat `messages` per request", stages=API),
    Setting(
        "max-prompt-chars",
        int,
        2**20,
        help="longest completions prompt, or all chat message contents together, in characters",
        stages=API,
    ),
    Setting(
        "max-logprobs",
        int,
        20,
        help="largest `top_logprobs` (chat) or `logprobs`",
        stages=API,
    ),
    Setting(
        "tool-call-parser",
        default="auto",
        help="the tool-call format the model writes, which `tools` replies are parsed in and "
        "`tool_choice` required or named constrains to (vLLM's names): hermes (<tool_call> "
        "JSON: Qwen, Hermes), llama3_json (Llama 3.1-3.3), mistral ([TOOL_CALLS]), pythonic "
        "([f(x=1)]: Llama 3.2 and 4), qwen3_coder (<function=...> XML), deepseek_v3 "
        "(<｜tool▁calls▁begin｜>), or auto: read from the chat template (hermes when it shows "
        "none of them)",
        stages=API,
        choices=(
            "auto",
            "hermes",
            "llama3_json",
            "mistral",
            "pythonic",
            "qwen3_coder",
            "deepseek_v3",
        ),
    ),
    Setting(
        "chat-template",
        help="the chat template to render chats with instead of the model's: a Jinja file's "
        "path or the template itself (vLLM's flag); /tokenize renders with it too",
    ),
    Setting(
        "generation-config",
        default="auto",
        help="where a request's left-out sampling fields (temperature, top_p, top_k, min_p, "
        "repetition, presence and frequency penalties, max_tokens as max_new_tokens) get their "
        "values: auto (the model's generation_config.json, as vLLM), vllm (the API's own "
        "defaults), or a directory holding a generation_config.json (its max_new_tokens also "
        "caps every request)",
        stages=API,
    ),
    Setting(
        "override-generation-config",
        help='JSON over the generation config\'s sampling values, e.g. {"temperature": 0.5}; '
        "its max_new_tokens caps every request's max_tokens, null unsets a value",
        stages=API,
    ),
    Setting(
        "reasoning-parser",
        default="auto",
        help="how a chat reply's thinking is kept apart from its answer (message.reasoning): "
        "qwen3 (<think> opened by the model or the prompt), deepseek_r1 (everything before "
        "</think>), none, or auto: read from the chat template (none when it shows no <think>)",
        stages=frozenset({"scheduler", "detokenizer"}),  # the split, and grammars after it
        crd=CrdField(
            "server.reasoningParser",
            "How a chat reply's thinking is kept apart from its answer (vLLM's parser names).",
        ),
        choices=("auto", "none", "qwen3", "deepseek_r1"),
    ),
    # api only; serve's supervisor probes /ready over HTTPS with the certificate
    Setting(
        "ssl-certfile",
        help="PEM certificate (chain): serve HTTPS instead of HTTP",
        stages=API,
    ),
    Setting(
        "ssl-keyfile",
        help="PEM private key of --ssl-certfile (if not in that file)",
        stages=API,
    ),
)
