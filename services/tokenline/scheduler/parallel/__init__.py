"""Tensor parallelism for the runner: one process per device, each holding a shard.

- ``group``: the torch.distributed group, its timed collectives and the rank-0 metrics;
- the model's layers hold their own shard and do their own collectives (``scheduler/layers``),
  and the loader reads only a rank's slices (``models/weights.py``);
- ``runner``: the sharded runner; rank 0 mirrors each call to the workers;
- ``worker``: the worker processes' loop, their spawning and the watchdog.
"""
