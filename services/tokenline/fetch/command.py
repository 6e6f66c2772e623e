"""``tokenline fetch URI DIR``: the init container's command, and a tool for laptops.

Exit status 0 when the model is complete in DIR (fetched now or already there), 2 for a URI
that cannot work as written, 1 for any other failure. The last line on stdout is the result as
JSON; with --termination-log the same JSON (or the failure) goes to that file, where Kubernetes
picks it up as the container's termination message for the operator to copy into
``status.model``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from tokenline.fetch.api import fetch
from tokenline.fetch.errors import FetchError, InvalidURI
from tokenline.fetch.retry import Backoff


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenline fetch",
        description="Download a model (hf://, s3://, https://) into DIR, verified and resumable; "
        "or check one that is read in place (pvc://, oci://, a directory).",
    )
    parser.add_argument(
        "uri",
        help="hf://ORG/NAME[@REV], s3://BUCKET/PREFIX, https://.../X.tar.gz, "
        "pvc://CLAIM/PATH, oci://REGISTRY/REPO:TAG or a directory",
    )
    parser.add_argument("dir", nargs="?", help="the model directory (required for downloads)")
    parser.add_argument("--force", action="store_true", help="fetch again even if complete")
    parser.add_argument("--include", action="append", metavar="GLOB", help="only these files")
    parser.add_argument("--exclude", action="append", metavar="GLOB", help="not these files")
    parser.add_argument(
        "--lock-timeout",
        type=float,
        default=float(os.environ.get("TOKENLINE_FETCH_LOCK_TIMEOUT", 6 * 3600)),
        help="seconds to wait for another fetcher of the same DIR (default 6 h)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=float(os.environ.get("TOKENLINE_FETCH_PROGRESS_INTERVAL", 5.0)),
        help="seconds between progress lines (default 5)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=int(os.environ.get("TOKENLINE_FETCH_RETRIES", 8)),
        help="consecutive failed attempts without progress before giving up (default 8)",
    )
    parser.add_argument(
        "--termination-log",
        default=os.environ.get("TOKENLINE_FETCH_TERMINATION_LOG"),
        metavar="PATH",
        help="also write the result or failure as JSON here (/dev/termination-log in a Pod)",
    )
    return parser


def _write_termination(path: str | None, body: dict[str, Any]) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(json.dumps(body)[:4000])  # Kubernetes keeps at most 4096 bytes
    except OSError as exc:
        logging.getLogger("tokenline.fetch").warning("cannot write %s: %s", path, exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
        )
    try:
        result = fetch(
            args.uri,
            args.dir,
            force=args.force,
            include=args.include,
            exclude=args.exclude,
            lock_timeout=args.lock_timeout,
            progress_interval=args.progress_interval,
            backoff=Backoff(attempts=max(1, args.retries)),
        )
    except FetchError as exc:
        print(f"tokenline fetch: error: {exc}", file=sys.stderr)
        _write_termination(
            args.termination_log, {"state": "Failed", "reason": exc.reason, "message": str(exc)}
        )
        return 2 if isinstance(exc, InvalidURI) else 1
    body = result.status() | {
        "path": str(result.path),
        "files": len(result.files),
        "downloaded": result.downloaded,
        "cached": result.cached,
    }
    _write_termination(args.termination_log, result.status())
    print(json.dumps(body))
    return 0
