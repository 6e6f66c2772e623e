"""LoRA adapters served beside the base model, batched (punica / S-LoRA style).

- ``adapters.py``: reads a PEFT adapter directory (or any URI model delivery fetches) into
  host tensors, checked against the base model and ``--max-lora-rank``;
- ``slots.py``: which adapters exist, which are in host memory (LRU, ``--max-cpu-loras``) and
  which occupy one of the ``--max-loras`` device slots; no tensors, so the policy can use it;
- ``apply.py``: the stacked per-layer weights of the slots and the batched low-rank math the
  runner adds to its fused projections.

The runner only ever sees "which slot each token uses", never adapter names.
"""
