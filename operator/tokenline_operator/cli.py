"""`tokenline operator`: run the InferenceService operator."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

import kopf

from . import handlers
from .controller import resync
from .metrics import OperatorMetrics

T = TypeVar("T")


def _env(name: str, parse: Callable[[str], T], default: T) -> T:
    """The flag's default from its environment variable, when that is set and not empty."""
    value = os.environ.get(name)
    return parse(value) if value else default


def _port(parser: argparse.ArgumentParser, flag: str, env: str, default: int, what: str) -> None:
    """A port the operator listens on: the same rules for every such flag (0 turns it off, the
    environment may set the default), and help that names both."""
    parser.add_argument(
        flag,
        type=int,
        default=_env(env, int, default),
        help=f"Port of {what} (0 disables). Env: {env}. Default: {default}.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenline operator",
        description="Reconcile InferenceService objects (tokenline.dev/v1alpha1) into the "
        "Deployments, Services and autoscalers that serve them.",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=None,
        help="Watch only this namespace (repeatable; kopf glob patterns work). Default: all "
        "namespaces. Env: TOKENLINE_WATCH_NAMESPACES (comma-separated).",
    )
    parser.add_argument(
        "--default-image",
        default=os.environ.get("TOKENLINE_DEFAULT_IMAGE"),
        help="Image for InferenceServices that name none (the chart passes the operator's "
        "own). Env: TOKENLINE_DEFAULT_IMAGE.",
    )
    _port(
        parser,
        "--metrics-port",
        "TOKENLINE_METRICS_PORT",
        8080,
        "the operator's Prometheus /metrics",
    )
    _port(parser, "--health-port", "TOKENLINE_HEALTH_PORT", 8081, "the liveness endpoint /healthz")
    parser.add_argument(
        "--discovery-interval",
        type=float,
        default=_env("TOKENLINE_DISCOVERY_INTERVAL", float, resync.DEFAULT_INTERVAL),
        help="Seconds between looks at API discovery, which notice optional CRDs "
        "(InferencePool, KEDA, Prometheus operator) installed or removed after an "
        "InferenceService was reconciled (0 disables). Env: TOKENLINE_DISCOVERY_INTERVAL. "
        f"Default: {resync.DEFAULT_INTERVAL:g}.",
    )
    parser.add_argument(
        "--image-volumes",
        default=os.environ.get("TOKENLINE_IMAGE_VOLUMES", "auto"),
        choices=["auto", "on", "off"],
        help="Mount oci:// models as image volumes (the ImageVolume feature): auto when the "
        "API server is 1.35 or newer; off copies the model out of the image in an init "
        "container instead. Env: TOKENLINE_IMAGE_VOLUMES. Default: auto.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TOKENLINE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="Env: TOKENLINE_LOG_LEVEL. Default: info.",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("TOKENLINE_LOG_FORMAT", "plain"),
        choices=["plain", "full", "json"],
        help="Env: TOKENLINE_LOG_FORMAT. Default: plain.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the operator until SIGINT/SIGTERM; the exit status is 0 on a clean stop."""
    args = build_parser().parse_args(argv)
    namespaces = args.namespace or [
        ns.strip()
        for ns in os.environ.get("TOKENLINE_WATCH_NAMESPACES", "").split(",")
        if ns.strip()
    ]

    kopf.configure(
        debug=args.log_level == "debug",
        verbose=args.log_level in ("debug", "info"),
        quiet=args.log_level == "error",
        log_format=kopf.LogFormat[args.log_format.upper()],
    )
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.listen(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    kopf.run(
        registry=handlers.registry,
        standalone=True,  # one replica; no peering objects needed (see the chart's strategy)
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(
            metrics=metrics,
            default_image=args.default_image,
            discovery_interval=args.discovery_interval,
            image_volumes=args.image_volumes,
        ),
    )
    return 0
