"""BERT-style encoders (bidirectional attention): each input run whole, never chunked and
with no KV cache to keep, through transformers' own module (``AutoModel`` for embeddings,
``AutoModelForSequenceClassification`` for a classifier or cross-encoder) over a right-padded
batch with its attention mask, SDPA where the family has it.

An embedding model's last hidden states are pooled here as the checkpoint asks (CLS, MEAN over
the input's own tokens, LAST), in float32; a classifier's head pools for itself (BERT's pooler
over [CLS]) and its logits come back raw. ``finish_embedding`` then cuts and normalises as on
the decoder path.
"""

from __future__ import annotations

import inspect
import logging

import torch

from tokenline.cores import usable_cores
from tokenline.model_source import ModelSource
from tokenline.scheduler.layers.placement import ModelRefused
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.runner import RunnerOptions, checkpoint_dtype, pick_device, pick_dtype

log = logging.getLogger(__name__)

# RoBERTa's positions start after its padding index: two of its 514 are never an input's
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def encoder_positions(config) -> int:
    """How many tokens one input may hold: the position embeddings the encoder has."""
    positions = int(getattr(config, "max_position_embeddings", 0) or 512)
    if getattr(config, "model_type", "") in _OFFSET_POSITIONS:
        positions -= int(config.pad_token_id or 0) + 1
    return positions


class EncoderRunner:
    """An encoder on ``options``' device and dtype; `forward` pools a batch of inputs."""

    implementation = "transformers"

    def __init__(self, source: ModelSource, options: RunnerOptions, setup: PoolingSetup) -> None:
        self.device = pick_device(options.device)
        if self.device.type == "cpu":  # the other stages keep a core, as the decoder runner
            torch.set_num_threads(options.torch_threads or max(1, usable_cores() - 1))
        checkpoint = checkpoint_dtype(source) if options.dtype == "auto" else None
        self.dtype = pick_dtype(options.dtype, self.device, checkpoint)
        self.setup = setup
        try:
            self.model = self._load(source)
        except ModelRefused as exc:
            raise SystemExit(f"{source.spec}: {exc}") from None
        self.config = self.model.config
        positions = encoder_positions(self.config)
        self.max_model_len = min(options.max_model_len or positions, positions)
        if options.max_model_len and options.max_model_len > positions:
            log.warning(
                "--max-model-len %d: the encoder has %d positions; longer inputs are refused",
                options.max_model_len,
                positions,
            )
        self.pad_id = int(getattr(self.config, "pad_token_id", None) or 0)
        # DistilBERT and others have no segments: a pair's types are not theirs to read
        self.reads_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        log.info(
            "runner: %s, %s (transformers, %s attention) on %s/%s, inputs up to %d tokens",
            source.spec,
            type(self.model).__name__,
            self.config._attn_implementation,
            self.device,
            self.dtype,
            self.max_model_len,
        )

    def _load(self, source: ModelSource) -> torch.nn.Module:
        from transformers import AutoModel, AutoModelForSequenceClassification

        source.refuse_own_code()
        family = AutoModelForSequenceClassification if self.setup.task == "classify" else AutoModel
        kwargs = {"revision": source.revision, "dtype": self.dtype, "output_loading_info": True}
        try:
            model, info = family.from_pretrained(source.path, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError) as exc:  # a family without SDPA: its own attention
            log.info("%s: no SDPA attention (%s); its default attention runs", source.spec, exc)
            model, info = family.from_pretrained(source.path, **kwargs)
        # an embedder never reads BERT's pooler; any other weight made up would serve noise
        missing = sorted(
            k for k in info["missing_keys"] if self.setup.task == "classify" or "pooler." not in k
        )
        if missing:
            raise ModelRefused(
                f"{self.setup.architecture}: the checkpoint has no weights for {', '.join(missing)}"
                f" (--convert {self.setup.task}: {type(model).__name__}); serve a checkpoint "
                "that has them, or the task it was trained for"
            )
        return model.to(self.device).eval()

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        if self.setup.task == "classify":
            return int(self.config.num_labels)
        return int(self.config.hidden_size)

    @torch.inference_mode()
    def forward(self, inputs: list[tuple[list[int], list[int] | None]]) -> torch.Tensor:
        """Each (ids, token type ids) input's pooled row (classify: its logits), float32 on
        the host, one row an input in order."""
        lengths = [len(ids) for ids, _ in inputs]
        width = max(lengths)
        ids = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        types = None
        if self.reads_types and any(t is not None for _, t in inputs):
            types = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, (tokens, segments) in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
            if types is not None and segments is not None:
                types[row, : len(segments)] = torch.tensor(segments)
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if types is not None:
            kwargs["token_type_ids"] = types
        out = self.model(**{k: v.to(self.device) for k, v in kwargs.items()})
        if self.setup.task == "classify":
            return out.logits.float().cpu()
        return self._pool(out.last_hidden_state.float(), mask.to(self.device), lengths).cpu()

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        kind = self.setup.pooling_type
        if kind == "CLS":
            return hidden[:, 0]
        if kind == "MEAN":  # the input's own rows, never the padding
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1)
        last = torch.tensor(lengths, device=hidden.device) - 1
        return hidden[torch.arange(len(lengths), device=hidden.device), last]

    def warm_up(self, max_num_batched_tokens: int) -> None:
        """One forward at the step's largest single input, so the first request does not
        pay for the kernels' first run."""
        tokens = max(1, min(max_num_batched_tokens, self.max_model_len))
        self.forward([([self.pad_id] * tokens, None)])
