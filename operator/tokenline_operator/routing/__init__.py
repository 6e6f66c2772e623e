"""How requests reach the stage pods: the Service and NetworkPolicy (:mod:`.network`), and the
Gateway API InferencePool with its endpoint picker (:mod:`.inference_pool`, configured by
:mod:`.picker_config`).
"""
