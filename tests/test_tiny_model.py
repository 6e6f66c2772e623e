"""The offline tiny model: deterministic, Hugging Face format, loaded like a real model."""

from __future__ import annotations

from tokenline import tiny_model
from tokenline.model_source import resolve


def test_building_twice_gives_the_same_bytes(tmp_path, model_cache):
    rebuilt = tiny_model.build(tmp_path / "again")
    cached = tiny_model.ensure_cached(model_cache)
    assert tiny_model.fingerprint(rebuilt) == tiny_model.fingerprint(cached)


def test_it_loads_through_from_pretrained_with_a_chat_template(model_cache):
    from transformers import AutoModelForCausalLM

    source = resolve("tiny", cache_dir=str(model_cache))
    model = AutoModelForCausalLM.from_pretrained(source.path)
    assert type(model).__name__ == "LlamaForCausalLM"
    tokenizer = source.load_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi 🙂"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>\nhi 🙂<|end|>\n<|assistant|>\n"
    assert tokenizer.decode(tokenizer("café 你好 🙂")["input_ids"]) == "café 你好 🙂"
    assert sorted(source.eos_token_ids()) == sorted(
        tokenizer.convert_tokens_to_ids(["<|end|>", "<|endoftext|>"])
    )
    assert source.max_model_len() == tiny_model.MAX_POSITIONS
