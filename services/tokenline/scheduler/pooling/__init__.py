"""The scheduler of a pooling model (``--runner pooling``): embeddings and sequence
classification scores. A decoder is computed with the same runner, paged KV cache, chunked
prefill and batch policy as generation, then pooled instead of decoded (engine.py, its head
from model.py); a BERT-style encoder runs each input whole, batched, through transformers'
module (encoder.py, encoder_engine.py). ``config.py`` reads what the checkpoint asks,
``stage.py`` is the ring handler and ``start.py`` the process."""
