"""The scheduler stage: continuous batching over a paged KV cache.

``sequence`` holds one request's state. ``policy`` (``BatchPolicy``) decides who is admitted,
runs, waits, pauses or is preempted, and is the one writer of sequence state: it applies each
step's results in one ``update_from_output`` call (pure Python, testable without a model).
``kv_cache`` does block accounting and prefix caching, on the policy's behalf. ``runner`` owns
the weights, the KV pool and the layer loop; ``attention/`` computes each layer's attention
behind one interface (``prepare(step)`` once per step, ``forward(q, k, v, layer, metadata)``
per layer), with the backend chosen once at start. ``step_inputs`` turns a step's chunks into
the flat batch the runner and the attention backend read; ``sampler`` turns logits into
tokens. ``engine`` (``Engine``) is the step loop that ties them: schedule, run the model,
sample, hand the output to the policy. ``speculative/`` proposes tokens ahead and decides which
of them one forward verified. ``stage`` connects the engine to the ring.
"""
