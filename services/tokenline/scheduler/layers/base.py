"""The base of every layer: an ``nn.Module`` that costs what a plain object costs to call and
to read.

A CPU decode step of a small model makes hundreds of layer calls and thousands of attribute
reads, and is dominated by such host work (benchmarks/README.md). ``nn.Module.__call__`` runs two
more Python frames and its hook checks on every call, and a parameter or submodule is read
through ``nn.Module.__getattr__`` (it lives in ``_parameters`` or ``_modules``, not in the
instance's dict). tokenline registers no hooks on its layers, so their calls go straight to
``forward``, and every parameter and submodule is also kept in the instance's dict, where an
attribute read finds it first. Registration is unchanged: ``named_parameters``, ``state_dict``
and loading see the same module tree.
"""

from __future__ import annotations

import torch


class Layer(torch.nn.Module):
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Parameter | torch.nn.Module):
            self.__dict__[name] = value

    def __delattr__(self, name: str) -> None:
        registered = name in self._parameters or name in self._modules
        super().__delattr__(name)
        if registered:
            self.__dict__.pop(name, None)
