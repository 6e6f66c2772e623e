"""Embeddings per second: tokenline (a running `tokenline serve`, over HTTP) against
sentence-transformers' ``encode`` on the same random-weight model, in the same run.

Two models, written here with seeded random weights in sentence-transformers' layout (nothing
is downloaded):

- ``qwen3-embedding``: a Qwen3-Embedding-0.6B-shaped decoder (28 layers, 1024 wide, 16 query
  and 8 KV heads of 128, last-token pooling, normalised), the tiny model's tokenizer grown to
  151,669 ids (real_shapes.py); tokenline runs it paged and chunked (scheduler/pooling/engine.py);
- ``bert-base``: a BERT-base-shaped encoder (12 layers, 768 wide, 12 heads, 512 positions,
  mean pooling, normalised), a WordPiece tokenizer of 30,522 pieces (tests/pooling_testkit.py);
  tokenline runs it through transformers' module, whole inputs batched (encoder.py).

``--size tiny`` writes both at toy sizes, to prove the script in seconds. Each text is
``--tokens`` words drawn at random (no two alike, so no prefix cache hit helps tokenline).
Batch 1: ``--requests`` requests of one input each, one after another (tokenline: one HTTP
request each; sentence-transformers: one ``encode`` call each). Batch 64: ``--batches``
requests (or ``encode`` calls) of 64 inputs each. Both sides run on ``--device`` in ``--dtype``
(on a CPU with ``--threads`` each, else their own defaults), never at the same time; the
stack's extra flags follow ``--``: on a CPU tokenline's step budget is generation's 128
tokens unless ``-- --max-num-batched-tokens 8192`` lets a step hold 64 inputs, as
sentence-transformers' batch does. The largest difference between the two sides' vectors is
printed as a check that both computed the same thing.

    .venv/bin/python benchmarks/embeddings.py --size tiny --requests 8 --batches 2 \\
        --tokens 32 --threads 1 --out /tmp/embeddings-tiny
    .venv/bin/python benchmarks/embeddings.py --size real --device cpu --threads 8 \\
        --requests 50 --batches 4 --tokens 128 --out benchmarks/results/embeddings-cpu \\
        -- --max-num-batched-tokens 8192
    .venv/bin/python benchmarks/embeddings.py --size real --device cuda --dtype bfloat16 \\
        --requests 200 --batches 20 --tokens 128 --out benchmarks/results/embeddings
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from real_shapes import tokenizer_of_size
from soak import free_port_block, wait_ready

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pooling_testkit import BERT_WORDS, bert_tokenizer, write_sentence_transformers_files

BATCH = 64
SHAPES = {
    "qwen3-embedding": {
        "real": dict(
            vocab_size=151669,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        ),
        "tiny": dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
        ),
    },
    "bert-base": {
        "real": dict(
            vocab_size=30522,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=512,
        ),
        "tiny": dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
        ),
    },
}


def write_model(name: str, size: str, out: Path) -> Path:
    """``name`` at ``size`` in sentence-transformers' layout under ``out`` (kept between runs)."""
    import torch
    import transformers

    if (out / "modules.json").exists():
        return out
    fields = SHAPES[name][size]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if name == "bert-base":
        tokenizer = bert_tokenizer(fields["vocab_size"], fields["max_position_embeddings"])
        config = transformers.BertConfig(**fields, pad_token_id=0, type_vocab_size=2)
        model = transformers.BertModel(config)
        mode = "MEAN"
    else:
        tokenizer = tokenizer_of_size(fields["vocab_size"])
        config = transformers.Qwen3Config(**fields, pad_token_id=tokenizer.pad_token_id)
        model = transformers.Qwen3Model(config)
        mode = "LAST"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    limit = min(fields["max_position_embeddings"], 8192)
    write_sentence_transformers_files(out, mode, True, fields["hidden_size"], limit)
    return out


def texts_of(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(BERT_WORDS, k=words)) for _ in range(count)]


def measure(encode, batches: list[list[str]]) -> tuple[float, list]:
    """Inputs per second over ``batches``, one ``encode`` call each, and the vectors."""
    encode(batches[0])  # warm: the first call's allocations and kernels are not timed
    started = time.perf_counter()
    vectors = [encode(batch) for batch in batches]
    elapsed = time.perf_counter() - started
    return sum(map(len, batches)) / elapsed, [v for batch in vectors for v in batch]


def tokenline_rates(model: Path, args, batch1, batch64) -> tuple[dict, list]:
    port = free_port_block()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tokenline.cli", "serve", "--model", str(model)]
    argv += ["--served-model-name", "m", "--port", str(port), "--log-level", "warning"]
    argv += ["--device", args.device, "--dtype", args.dtype, *args.serve_args]
    if args.threads:
        argv += ["--torch-threads", str(args.threads)]
    log = open(args.out / f"serve-{model.name}.log", "w")
    serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, 900, serve)
        with httpx.Client(base_url=url, timeout=600) as http:

            def encode(texts: list[str]) -> list[list[float]]:
                reply = http.post("/v1/embeddings", json={"model": "m", "input": texts})
                reply.raise_for_status()
                return [d["embedding"] for d in reply.json()["data"]]

            one, vectors = measure(encode, batch1)
            many, _ = measure(encode, batch64)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
    return {1: one, BATCH: many}, vectors


def sentence_transformers_rates(model: Path, args, batch1, batch64) -> tuple[dict, list]:
    import torch
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = {} if args.dtype == "auto" else {"model_kwargs": {"dtype": getattr(torch, args.dtype)}}
    oracle = SentenceTransformer(str(model), device=device, **kwargs)

    def encode(texts: list[str]) -> list:
        return list(oracle.encode(texts, batch_size=len(texts), convert_to_numpy=True))

    one, vectors = measure(encode, batch1)
    many, _ = measure(encode, batch64)
    return {1: one, BATCH: many}, vectors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "real"), default="real")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--threads", type=int, help="CPU threads of both sides (--torch-threads)")
    parser.add_argument("--tokens", type=int, default=128, help="words per text (about tokens)")
    parser.add_argument("--requests", type=int, default=100, help="batch-1 requests timed")
    parser.add_argument("--batches", type=int, default=10, help="batch-64 requests timed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/embeddings"))
    parser.add_argument("serve_args", nargs="*", help="extra `tokenline serve` flags (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        model = write_model(name, args.size, args.out / "models" / f"{name}-{args.size}")
        # one text more than timed for each warm-up call; no text twice
        singles = texts_of(args.requests + 1, args.tokens, seed=1)
        batch1 = [[t] for t in singles]
        many = texts_of(BATCH * (args.batches + 1), args.tokens, seed=2)
        batch64 = [many[i : i + BATCH] for i in range(0, len(many), BATCH)]
        ours, got = tokenline_rates(model, args, batch1, batch64)
        theirs, want = sentence_transformers_rates(model, args, batch1, batch64)
        gap = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
        for batch in (1, BATCH):
            rows.append(
                {
                    "model": name,
                    "size": args.size,
                    "batch": batch,
                    "tokenline_per_s": round(ours[batch], 1),
                    "sentence_transformers_per_s": round(theirs[batch], 1),
                    "ratio": round(ours[batch] / theirs[batch], 2),
                    "max_abs_diff": gap,
                }
            )
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| model | batch | tokenline emb/s | sentence-transformers emb/s | ratio | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['size']}) | {r['batch']} | {r['tokenline_per_s']} | "
            f"{r['sentence_transformers_per_s']} | {r['ratio']} | {r['max_abs_diff']:.1e} |"
        )
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
