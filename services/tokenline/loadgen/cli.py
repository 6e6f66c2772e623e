"""`tokenline bench`: arguments, progress bar, report, JSON and plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from tokenline.loadgen.config import BenchConfig, TargetConfig, normalize_base_url
from tokenline.loadgen.isolation import parse_pids
from tokenline.loadgen.load import run_benchmark
from tokenline.loadgen.records import RequestRecord
from tokenline.loadgen.report import format_report, result_json
from tokenline.loadgen.workload import LengthDist

DEFAULT_URL = "http://127.0.0.1:8000"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_extra_body(group: argparse._ArgumentGroup, flag: str, bodies: str) -> None:
    """A JSON object merged into ``bodies`` (each server has its own)."""
    group.add_argument(
        flag,
        type=_json_object,
        default={},
        metavar="JSON",
        help=f"JSON object merged into {bodies}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenline bench",
        description="Streaming load generator for OpenAI-compatible servers. Prompts are "
        "random words; output length is fixed with max_tokens (and ignore_eos).",
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        "--base-url",
        dest="url",
        default=DEFAULT_URL,
        help=f"server base URL (default {DEFAULT_URL})",
    )
    target.add_argument("--model", help="model name (default: first id at /v1/models)")
    target.add_argument("--label", default="ours", help="name in the report (default ours)")
    target.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    _add_extra_body(target, "--extra-body", "every request body")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    load.add_argument(
        "--num-requests",
        type=_positive_int,
        default=48,
        help="requests per target per round (default 48)",
    )
    load.add_argument(
        "--concurrency",
        type=_positive_int,
        help="requests in flight: fixed without --request-rate (default 16), "
        "a cap with it (default none)",
    )
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        metavar="RPS",
        help="open loop: Poisson arrivals at RPS requests/s",
    )
    load.add_argument(
        "--prompt-len",
        type=_length,
        default=LengthDist(32, 32),
        metavar="N|LOW:HIGH",
        help="prompt length in words, fixed or uniform "
        "(default 32; the server's usage gives tokens)",
    )
    load.add_argument(
        "--output-len",
        type=_length,
        default=LengthDist(64, 64),
        metavar="N|LOW:HIGH",
        help="output tokens (max_tokens), fixed or uniform (default 64)",
    )
    load.add_argument(
        "--shared-prefix-len",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="every prompt starts with the same N words, then its own --prompt-len words "
        "(default 0: distinct prompts)",
    )
    load.add_argument(
        "--prefix-groups",
        type=_positive_int,
        default=1,
        metavar="K",
        help="K different shared prefixes, requests spread evenly over them (default 1)",
    )
    load.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        metavar="T",
        help="conversations of T user messages of --prompt-len words (chat endpoint): each "
        "request resends the conversation so far, replies included, plus a new message; "
        "--num-requests counts requests (default 1)",
    )
    load.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="send the same words every round (default: each round after the first gets new "
        "words of the same lengths, so that a prefix cache cannot hold a whole prompt)",
    )
    load.add_argument("--temperature", type=float, help="sent when given")
    load.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    load.add_argument(
        "--rounds",
        type=_positive_int,
        help="times each target runs the workload; with --compare the order is "
        "A B, B A, ... (default 1, or 2 with --compare)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrecorded requests per target before measuring (default 1)",
    )
    load.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        help="seconds a request may wait for its next byte (default 300)",
    )
    load.add_argument(
        "--no-usage",
        action="store_true",
        help="do not ask for stream_options.include_usage; count chunks",
    )

    compare = parser.add_argument_group("compare")
    compare.add_argument("--compare", metavar="URL", help="second server, run interleaved")
    compare.add_argument("--compare-model", help="model name on the second server")
    compare.add_argument(
        "--compare-label", default="theirs", help="name in the report (default theirs)"
    )
    compare.add_argument(
        "--compare-ignore-eos",
        action="store_true",
        help="send ignore_eos: true to the second server too (off by "
        "default: `transformers serve` rejects unknown fields)",
    )
    compare.add_argument(
        "--pids",
        type=parse_pids,
        default=[],
        metavar="PID,...",
        help="processes of the first server, stopped (SIGSTOP) with their descendants while "
        "the second is measured (`tokenline serve`'s pid stands for its stages)",
    )
    compare.add_argument(
        "--compare-pids",
        type=parse_pids,
        default=[],
        metavar="PID,...",
        help="processes of the second server, stopped with their descendants while the first "
        "is measured (a server that polls while idle otherwise takes CPU from the one under load)",
    )
    _add_extra_body(compare, "--compare-extra-body", "the second server's request bodies")

    out = parser.add_argument_group("output")
    out.add_argument(
        "--json-out",
        type=Path,
        metavar="PATH",
        help="write the full result and every request record as JSON",
    )
    out.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG (matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration; raises ValueError for contradictory arguments."""
    if args.warmup < 0:
        raise ValueError("--warmup must be 0 or more")
    targets = [
        TargetConfig(
            label=args.label,
            base_url=normalize_base_url(args.url),
            model=args.model,
            ignore_eos=not args.no_ignore_eos,
            extra_body=args.extra_body,
            pids=args.pids,
        )
    ]
    if args.compare:
        if args.compare_label == args.label:
            raise ValueError("--label and --compare-label must differ")
        targets.append(
            TargetConfig(
                label=args.compare_label,
                base_url=normalize_base_url(args.compare),
                model=args.compare_model,
                ignore_eos=args.compare_ignore_eos,
                extra_body=args.compare_extra_body,
                pids=args.compare_pids,
            )
        )
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 16
    rounds = args.rounds or (2 if args.compare else 1)
    return BenchConfig(
        targets=targets,
        endpoint=args.endpoint,
        num_requests=args.num_requests,
        concurrency=concurrency,
        request_rate=args.request_rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        shared_prefix_len=args.shared_prefix_len,
        prefix_groups=args.prefix_groups,
        turns=args.turns,
        reword_rounds=not args.repeat_prompts,
        seed=args.seed,
        rounds=rounds,
        warmup=args.warmup,
        timeout=args.timeout,
        temperature=args.temperature,
        include_usage=not args.no_usage,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    """Run `tokenline bench`. Returns 0 when every measured request succeeded, 1 otherwise
    (the report, JSON and plot are still written); argument errors exit with 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    total = config.rounds * len(config.targets) * config.num_requests
    failures = 0
    with tqdm(total=total, unit="req", disable=not config.progress, file=sys.stderr) as bar:

        def on_done(record: RequestRecord) -> None:
            nonlocal failures
            failures += not record.ok
            bar.update(1)
            if failures:
                bar.set_postfix(failed=failures)

        def on_phase(label: str, round_: int) -> None:
            bar.set_description(
                f"{label} warm-up" if round_ < 0 else f"{label} round {round_ + 1}/{config.rounds}"
            )

        try:
            result = asyncio.run(run_benchmark(config, on_done=on_done, on_phase=on_phase))
        except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError) as exc:
            bar.close()
            print(f"tokenline bench: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    print(format_report(result))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result_json(result), indent=1) + "\n")
        print(f"\nwrote {args.json_out}")
    if args.plot is not None:
        from tokenline.loadgen.plot import write_plot

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        write_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if failures == 0 else 1
