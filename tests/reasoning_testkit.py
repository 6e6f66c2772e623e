"""A thinking variant of the tiny model: ``<think>`` and ``</think>`` as added tokens of its
vocabulary (as Qwen3's and DeepSeek-R1's tokenizers hold them) and a chat template that follows
Qwen3's switches, so the reasoning split can be driven end to end with random weights.

The template knows ``enable_thinking`` (false: the prompt closes an empty block, so the answer
is plain), ``thinking_only`` (true: the prompt opens the block, as the templates of
thinking-only models do) and ``reasoning_effort`` (shown in a system turn, as gpt-oss's
template shows it, and, unless ``none``, opening the block as ``thinking_only`` does); an
assistant turn's ``reasoning_content`` is shown in its block.

`R1_TEMPLATE` follows DeepSeek-R1's instead: its generation prompt opens the block itself
(``<｜Assistant｜><think>\n``) and an earlier turn's thinking is cut from its content, so auto
reads ``deepseek_r1``. With ``markers_as_tokens`` false the markers stay out of the vocabulary:
the model spells them in pieces, and the split is made on text.
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


R1_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] or '' %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<｜Assistant｜>{{ content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def write_thinking_model(
    tiny_dir: Path, out: Path, template: str = TEMPLATE, markers_as_tokens: bool = True
) -> Path:
    """The tiny model at ``tiny_dir`` with the two markers added (embeddings grown to match;
    unless ``markers_as_tokens`` is false) and ``template``, written to ``out``."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    if markers_as_tokens:  # not special: they decode to text, as in Qwen3's and R1's
        tokenizer.add_tokens([START, END])
    tokenizer.chat_template = template
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
