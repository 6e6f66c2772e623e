"""The layers native model families are built from (``models/``): each allocates this rank's
share of its weights from a `Placement`, loads it from the checkpoint itself, and runs with as
few kernels as the computation allows (a CPU decode step is dominated by their dispatch).

- ``placement.py``: device, dtype, tensor-parallel rank; `ModelRefused`
- ``linear.py``: column-, row-parallel and fused projections
- ``embedding.py``: vocabulary-split embedding and LM head
- ``norm.py``: RMSNorm (Llama-style and Gemma-style)
- ``rotary.py``: rotary tables from the family's own module
- ``attention.py``: q/k/v, norms, rotary, the attention backend, output projection
- ``mlp.py``: the gated MLP; ``moe.py``: router and stacked experts
- ``context.py``: what a forward's layers read of the step
"""
