"""Speculative decoding: proposals for a sequence's next tokens (``ngram.py``), checked by the
target model in one forward, keeping exactly the tokens it would have produced
(``verify.py``). ``config.py`` reads vLLM's ``--speculative-config``."""
