"""`tokenline bench`: an OpenAI-compatible streaming load generator.

Modules, one job each:

- ``workload``: prompt and output length distributions, synthetic prompts, Poisson arrivals;
- ``config``: what a run is asked to do (targets and load shape);
- ``sse``: Server-Sent Events decoding and OpenAI stream chunk reading;
- ``request``: one streamed request, timed with ``time.perf_counter``;
- ``load``: the request loop (fixed concurrency or request rate) and round interleaving;
- ``records``: per-request and per-run results, JSON-ready;
- ``report``: statistics and the printed tables;
- ``plot``: the PNG (matplotlib, Agg backend);
- ``cli``: argument parsing and ``main``.
"""
