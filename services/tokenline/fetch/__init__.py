"""Model delivery: hf://, s3://, pvc://, oci://, https:// and local directories.

    from tokenline.fetch import fetch, parse_uri
    result = fetch("hf://Qwen/Qwen3-0.6B@main", "/models/qwen3")   # -> FetchResult
    result.path, result.revision, result.digest, result.size

Modules, one job each: ``uri`` holds the URI types and ``parse`` reads them from text (no
I/O); ``manifest`` describes files and the completion marker; ``verify`` hashes; ``progress``
rate-limits log lines and defines ``tokenline_model_fetch_bytes_total``; ``retry`` is the
backoff policy; ``download`` is the resumable, verifying downloader; ``httpio``, ``hf``, ``s3``
and ``https`` are the sources; ``archive`` unpacks; ``lock`` and ``storage`` are the local
side; ``session`` is one remote fetch, and ``api`` puts it together with the schemes read in
place (``result`` is what a fetch returns); ``command`` is ``tokenline fetch``.
"""

from tokenline.fetch.api import fetch
from tokenline.fetch.errors import FetchError, InvalidURI
from tokenline.fetch.manifest import FileEntry, read_marker
from tokenline.fetch.parse import parse_uri
from tokenline.fetch.progress import MODEL_FETCH_BYTES
from tokenline.fetch.result import FetchResult
from tokenline.fetch.uri import ModelURI, cache_name, is_remote, redact

__all__ = [
    "MODEL_FETCH_BYTES",
    "FetchError",
    "FetchResult",
    "FileEntry",
    "InvalidURI",
    "ModelURI",
    "cache_name",
    "fetch",
    "is_remote",
    "main",
    "parse_uri",
    "read_marker",
    "redact",
]


def main(argv=None) -> int:
    """``tokenline fetch URI DIR`` (imported lazily: argparse setup is not needed by fetch())."""
    from tokenline.fetch.command import main as command_main

    return command_main(argv)
