"""A thinking variant of the tiny model: ``<think>`` and ``</think>`` as added tokens of its
vocabulary (as Qwen3's and DeepSeek-R1's tokenizers hold them) and a chat template that follows
Qwen3's switches, so the reasoning split can be driven end to end with random weights.

The template knows ``enable_thinking`` (false: the prompt closes an empty block, so the answer
is plain), ``thinking_only`` (true: the prompt opens the block, as the templates of
thinking-only models do) and ``reasoning_effort`` (shown in a system turn, as gpt-oss's
template shows it, and, unless ``none``, opening the block as ``thinking_only`` does); an
assistant turn's ``reasoning_content`` is shown in its block.
"""

from __future__ import annotations

from pathlib import Path

START, END = "<think>", "</think>"

_ASSISTANT = (
    "<|assistant|>\n{% if message.get('reasoning_content') %}"
    "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|end|>\n"
)
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|system|>\nthink {{ reasoning_effort }}<|end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}" + _ASSISTANT + "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif (thinking_only is defined and thinking_only) or (reasoning_effort is defined "
    "and reasoning_effort != 'none') %}<think>\n{% endif %}"
    "{% endif %}"
)


def write_thinking_model(tiny_dir: Path, out: Path) -> Path:
    """The tiny model at ``tiny_dir`` with the two markers added (embeddings grown to match)
    and `TEMPLATE`, written to ``out``."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.add_tokens([START, END])  # not special: they decode to text, as in Qwen3's
    tokenizer.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
