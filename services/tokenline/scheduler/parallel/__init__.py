"""Tensor parallelism for the runner: one process per device, each holding a shard.

- ``group``: the torch.distributed group, its timed collectives and the rank-0 metrics;
- ``shard``: which slice of each weight a rank holds, and the sharded layer pieces;
- ``loading``: building the model on the meta device and reading only the rank's slices;
- ``runner``: the sharded runner; rank 0 mirrors each call to the workers;
- ``worker``: the worker processes' loop, their spawning and the watchdog.
"""
