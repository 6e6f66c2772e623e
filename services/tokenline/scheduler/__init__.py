"""The scheduler/runner stage: continuous batching over a paged KV cache.

``sequence`` holds one request's state, ``kv_cache`` does block accounting, ``policy`` decides
who runs, waits, pauses or is preempted (pure Python, testable without a model), ``runner`` owns
tensors and the model forward, ``sampler`` turns logits into tokens, ``engine`` ties them into
one step, and ``stage`` connects the engine to the ring.
"""
