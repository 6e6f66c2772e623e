"""``--compile`` on CPU: a decoder's layers compiled whole by inductor, attention left outside.

Inductor traces the layers' own eager code (no second version of the model to keep exact) with
the weights frozen into the graph as constants: it packs the projections for oneDNN itself and
fuses the norms, rotary, activation and residual adds into a few generated kernels. Attention
stays out of the graph as one opaque custom op per layer (`attend`): it writes the paged KV pool
and reads the step's metadata, which change every step and, traced, would only be guards to
fail. The op finds the running step's backend and metadata in ``_STEP``, which `CompiledLayers`
sets for the length of the call (vLLM's forward context works the same way).

The graph is compiled for any number of token rows; torch specialises one row apart, so the
first prefill and the first decode step (warm_up.py) each compile once, before the stage is
ready. A step with LoRA deltas, or one whose model keeps auxiliary hidden states (EAGLE-3),
runs the same layers eagerly, over the plain weights (oneDNN's packed copies live inside the
graphs). Memory: each of the two graphs holds its own packed copy of the layers' weights,
beside the plain ones, so they take about three times their eager size.
"""

from __future__ import annotations

import threading

import torch
import torch.fx.experimental._config as shape_config

from tokenline.scheduler.attention import AttentionLayer
from tokenline.scheduler.layers.context import ForwardContext

_STEP = threading.local()  # .context: the ForwardContext of the step inside the graph


@torch.library.custom_op("tokenline::attend", mutates_args=())
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: int,
    scale: float | None,
    slides: bool,
) -> torch.Tensor:
    """The attention backend's ``forward`` for layer ``index`` of the running step."""
    context: ForwardContext = _STEP.context
    return context.attention.forward(
        q, k, v, AttentionLayer(index, scale, slides), context.metadata
    )


@attend.register_fake
def _(q, k, v, index, scale, slides):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _GraphAttention:
    """What the traced layers see as the attention backend: a call of `attend`."""

    def forward(self, q, k, v, layer: AttentionLayer, metadata) -> torch.Tensor:
        return attend(
            q.contiguous(), k.contiguous(), v.contiguous(), layer.index, layer.scale, layer.slides
        )


# The context the traced layers read: attention through `attend`, no LoRA rows.
_IN_GRAPH = ForwardContext(torch.empty(0), 0, _GraphAttention(), None)  # type: ignore[arg-type]


def _inductor_rounding_as_eager(graph: torch.fx.GraphModule, example_inputs: list):
    """Inductor, rounding each fused operation's result to the dtype eager torch would: a
    fused bf16 kernel otherwise keeps float32 between operations and drifts from the
    checkpoint's own (transformers') bf16 forward by more than bf16's rounding."""
    from torch._inductor.compile_fx import compile_fx

    with _inductor_config().patch(emulate_precision_casts=True):
        return compile_fx(graph, example_inputs)


def _inductor_config():
    """Inductor's settings, imported where something compiles: importing inductor takes
    seconds of a two-core scheduler's start, and only ``--compile`` needs it."""
    import torch._inductor.config

    return torch._inductor.config


def missing_compiler() -> str | None:
    """Why inductor cannot build CPU kernels in this process, or None when it can (or when
    this torch cannot say): it compiles C++ with the first compiler of its ``cpp.cxx`` list
    (``CXX``, else the platform's) that runs, and without one every compiled call fails."""
    try:
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler

        search = cpp_builder.get_cpp_compiler
    except (ImportError, AttributeError):  # an older torch: its first compile will tell
        return None
    try:
        search()
    except (InvalidCxxCompiler, OSError):  # none found; or CXX names what cannot run
        cxx = _inductor_config().cpp.cxx
        names = cxx if isinstance(cxx, tuple | list) else [cxx]
        tried = ", ".join(str(name) for name in names if name) or "none"
        return f"no C++ compiler runs here (tried: {tried})"
    return None


class CompiledLayers:
    """``layers`` (each called as ``layer(h, cos, sin, context)``) as one compiled function."""

    @staticmethod
    def supported() -> bool:
        """This torch has the compiler settings the graph needs (older ones lack them)."""
        return hasattr(_inductor_config(), "emulate_precision_casts") and hasattr(
            shape_config, "use_duck_shape"
        )

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self._layers = layers  # a module: its parameters are what freezing folds in
        self._inductor = _inductor_config()  # once, not in every step
        self._compiled = torch.compile(self._run, dynamic=True, backend=_inductor_rounding_as_eager)

    def _run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self._layers:
            h = layer(h, cos, sin, _IN_GRAPH)
        return h

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        outer = getattr(_STEP, "context", None)
        _STEP.context = context
        try:
            # Both read as dynamo traces (torch.compile's options= come too late), patched per
            # call so that no other graph is frozen: freezing, and no duck sizing, which
            # would tie the row count to any size or stride equal to it when first traced
            # (cos's stride is 2 * head_dim: a 128-row warm-up made a graph for 128 rows only)
            freezing = self._inductor.patch(freezing=True)
            with freezing, shape_config.patch(use_duck_shape=False):
                return self._compiled(h, cos, sin)
        finally:
            _STEP.context = outer
