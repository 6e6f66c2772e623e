"""The scheduler of a pooling model (``--runner pooling``): embeddings and sequence
classification scores, computed with the same runner, paged KV cache, chunked prefill and batch
policy as generation, then pooled instead of decoded (engine.py). ``config.py`` reads what the
checkpoint asks, ``model.py`` puts the pooling head on a native decoder, ``stage.py`` is the
ring handler and ``start.py`` the process."""
