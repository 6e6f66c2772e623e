"""Models with real models' shapes and random weights, written here (nothing is downloaded), for
benchmarks at the sizes people serve rather than the tiny model's.

Each has its model's config (SmolLM2-135M: Llama, 30 layers, 576 wide, 9 query and 3 KV heads,
49,152 tokens, tied embeddings; Qwen3-0.6B: 28 layers, 1024 wide, 16 and 8 heads of 128, q/k
norms, 151,936 tokens), seeded random weights, no EOS (both servers of a comparison generate
exactly the tokens asked for), and a byte-level BPE tokenizer with exactly the model's
vocabulary: the tiny model's, trained on its corpus, then grown by merging pairs of its tokens
until every id the model can sample decodes to text.

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/real_shapes.py --shape qwen3-0.6b --out /tmp/qwen3-shape
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {
    "smollm2-135m": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
}


def tokenizer_of_size(vocab_size: int):
    """The tiny model's tokenizer, grown to ``vocab_size`` ids by merges of its own tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tokenline import tiny_model

    base = tiny_model.build_tokenizer()
    data = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    specials = {added["content"] for added in data.get("added_tokens", [])}
    # pairs of the trained tokens only: the new tokens stay short (a token of merged merges
    # would grow without bound), and 700 tokens make half a million pairs
    tokens = [t for t in sorted(vocab, key=vocab.get) if t not in specials]
    pairs = ((left, right) for right in tokens for left in tokens)
    while len(vocab) < vocab_size:  # the special tokens are in the vocabulary already
        left, right = next(pairs)
        if left + right in vocab:
            continue
        vocab[left + right] = len(vocab)
        merges.append([left, right] if isinstance(merges[0], list) else f"{left} {right}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token="<|end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = tiny_model.CHAT_TEMPLATE
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def write(shape: str, out: Path, dtype: str = "bfloat16") -> Path:
    import torch
    import transformers

    config_name, model_name, fields = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, config_name)(**fields, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(eos_token_id=None)
    model.save_pretrained(out)
    tokenizer_of_size(fields["vocab_size"]).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    print(write(args.shape, Path(args.out), args.dtype))


if __name__ == "__main__":
    main()
