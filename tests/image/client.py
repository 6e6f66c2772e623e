"""Talk to a stack in a container's network namespace: run under `nsenter --net=...`.

Usage: client.py API_PORT METRICS_PORT... ; prints one line, ``RESULT <json>``.
Waits for /ready, then sends a chat completion and a streaming one with the official
``openai`` client, then reads every metrics port.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import openai


def main() -> None:
    api, *metrics = (int(arg) for arg in sys.argv[1:])
    base = f"http://127.0.0.1:{api}"
    result: dict = {"ready": False}
    start = time.monotonic()
    deadline = start + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as reply:
                if reply.status == 200:
                    result["ready"] = True
                    break
        except Exception as exc:
            result["last_error"] = repr(exc)
        time.sleep(1)
    result["ready_after_s"] = round(time.monotonic() - start, 1)
    if result["ready"]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60)
        messages = [{"role": "user", "content": "Say hello."}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        result["chat"] = {
            "finish_reason": chat.choices[0].finish_reason,
            "content": chat.choices[0].message.content,
            "completion_tokens": chat.usage.completion_tokens,
        }
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, stream=True
            )
        )
        result["stream"] = {
            "chunks": len(chunks),
            "objects": sorted({c.object for c in chunks}),
            "finish_reason": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
            "content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        }
        result["metrics"] = {}
        for port in metrics:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                result["metrics"][str(port)] = r.status
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
