"""Speculative decoding: proposals for a sequence's next tokens (``ngram.py``, a draft model in
``draft.py``, an EAGLE-3 head in ``eagle3.py``), checked by the target model in one forward,
keeping exactly the tokens it would have produced (``verify.py``). ``config.py`` reads vLLM's
``--speculative-config``."""
