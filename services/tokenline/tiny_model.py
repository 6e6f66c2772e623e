"""The offline tiny model: a deterministic Llama with seeded random weights and a byte-level BPE.

It is written in Hugging Face format and loaded through the same ``from_pretrained`` path as a
real model, so every stage and every test runs without a GPU or a download. Its output is
gibberish by design; its shapes, tokenizer and chat template are real.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path

TINY_VERSION = "v2"
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Tools as Qwen's template shows them: listed in the system turn inside <tools></tools>, calls
# as <tool_call> JSON (api/tool_parsers.py's hermes format), results as <tool_response> in a
# user turn. Without tools every message renders as it did before tools were learned.
# Hugging Face renders templates with trim_blocks: a newline right after a tag is an expression.
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to answer. Their signatures, inside "
    "<tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nTo call a function, write its name and arguments as a JSON "
    "object inside <tool_call></tool_call>:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)
_TOOL_CALLS = (
    "<|assistant|>\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|end|>\n"
)
_TOOL_RESULT = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>\n"
    "{% else %}{{ '\\n' }}{% endif %}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|end|>\n{% endif %}"
)
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}" + _TOOLS_PREAMBLE + "<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported role ' ~ message['role'] ~ "
    "'; use system, user, assistant or tool') }}"
    "{% endif %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # shown with the tools
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    + _TOOL_CALLS
    + "{% elif message['role'] == 'tool' %}"
    + _TOOL_RESULT
    + "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_POSITIONS = 2048

_WORDS = (
    "the a model token stream request reply stage queue batch cache block prompt answer "
    "server client socket ring abort pause resume deadline metric latency throughput kernel "
    "graph tensor layer head attention value key query decode prefill sample seed temperature "
    "river mountain city garden window paper light music north south east west morning night "
    "quick brown fox jumps over lazy dog hello world please thank you yes no maybe always never "
    "café naïve résumé über straße 你好 世界 日本語 テスト 한국어 привет мир 🙂 🚀 ✓"
).split()


def _corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return out


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out_dir: str | os.PathLike, num_key_value_heads: int = 2) -> Path:
    """Write the tiny model to ``out_dir`` (created); the same bytes on every run.

    ``num_key_value_heads`` (a divisor of its 4 attention heads) makes GQA variants, for the
    tensor-parallel tests: 1 KV head is fewer than 2 ranks, and must be replicated."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    eot_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=end_id,
        pad_token_id=eot_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # Seeded, slightly larger-than-default weights give a peaked (less uniform) distribution,
    # so greedy and sampled decoding differ visibly in tests.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
    model.generation_config = GenerationConfig(eos_token_id=[end_id, eot_id], pad_token_id=eot_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_cached(cache_dir: str | os.PathLike) -> Path:
    """The tiny model's directory under ``cache_dir``, built once under a file lock.

    Several stages start at once and all need it; the first builds it into a temporary
    directory and renames it into place, the others wait on the lock and reuse it.
    """
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-{TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    with open(root / f".tiny-{TINY_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
            try:
                build(tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def fingerprint(model_dir: str | os.PathLike) -> str:
    """A hash of every file in the model directory (for determinism checks)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
