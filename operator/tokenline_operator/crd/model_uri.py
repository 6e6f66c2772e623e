"""``spec.model.uri`` in the CRD: each scheme's rule, and what ``tokenline fetch`` refuses.

The CRD's rules (:data:`URI_RULES`) reject what CEL can express; :func:`uri_problems` reads
the same rules in Python and adds what the parser refuses, for the operator's own validation
(:mod:`.spec`) and for the status of a spec it cannot serve. LoRA adapters' URIs
(:mod:`.lora`) take the same rules. How a pod gets the model:
:mod:`tokenline_operator.pods.model`.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from tokenline.fetch import InvalidURI, parse_uri
from tokenline.fetch.uri import S3URI, HfURI, HttpsURI, LocalURI, ModelURI, OciURI, PvcURI

# Each regex is RE2 (CEL's ``matches``) and Python ``re`` at once: no lookaround, no backrefs.

_HF_PART = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HF_RE = rf"^hf://{_HF_PART}(/{_HF_PART})?/?(@[A-Za-z0-9][A-Za-z0-9._/-]{{0,254}})?$"
_S3_OPTION = r"(endpoint|region|path_style|anonymous)=[^&#]*"
S3_RE = rf"^s3://[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9](/[^?#]*)?(\?{_S3_OPTION}(&{_S3_OPTION})*)?$"
_DNS1123 = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
PVC_RE = rf"^pvc://{_DNS1123}(/[^?#]*)?$"
_OCI_HOST = (
    r"([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+(:[0-9]{1,5})?"  # a dotted host
    r"|[A-Za-z0-9-]+:[0-9]{1,5}"  # a host with a port
    r"|localhost(:[0-9]{1,5})?)"
)
_OCI_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_OCI_TAG = r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_OCI_DIGEST = r"@sha256:[0-9a-f]{64}"
OCI_RE = (
    rf"^oci://{_OCI_HOST}/{_OCI_COMPONENT}(/{_OCI_COMPONENT})*"
    rf"(({_OCI_TAG})({_OCI_DIGEST})?|{_OCI_DIGEST})$"
)
HTTPS_RE = r"^https?://[^/?#@\s]+(/[^/?#\s]*)*/[^/?#\s]+(\?[^#\s]*)?(#sha256=[0-9a-fA-F]{64})?$"
KNOWN_SCHEME_RE = r"^(hf|s3|pvc|oci|https?|file)://"
SCHEMES_HINT = (
    "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX[?endpoint=URL&region=R&path_style=true], "
    "pvc://CLAIM/PATH, oci://REGISTRY/REPO:TAG, https://HOST/MODEL.tar.gz[#sha256=HEX], or an "
    "absolute directory inside the pod"
)


def _cel(regex: str) -> str:
    """A CEL string literal holding ``regex`` (CEL reads backslash escapes in strings)."""
    return "'" + regex.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: (CEL rule, message) on ``spec.model.uri``, each with the scheme's form and an example.
URI_RULES: tuple[tuple[str, str], ...] = (
    (
        f"!self.contains('://') ? self.startsWith('/') : self.matches({_cel(KNOWN_SCHEME_RE)})",
        f"unknown scheme or relative path; use {SCHEMES_HINT}",
    ),
    (
        f"!self.startsWith('hf://') || self.matches({_cel(HF_RE)})",
        "hf:// URIs are hf://ORG/NAME[@REVISION] (letters, digits, '.', '_', '-'), e.g. "
        "hf://Qwen/Qwen3-0.6B@main",
    ),
    (
        "!self.startsWith('hf://') || !(self.contains('--') || self.contains('..'))",
        "'--' and '..' are not allowed in a Hugging Face repository id",
    ),
    (
        f"!self.startsWith('s3://') || self.matches({_cel(S3_RE)})",
        "s3:// URIs are s3://BUCKET/PREFIX with options endpoint, region, path_style, anonymous "
        "in the query, e.g. s3://models/qwen3?endpoint=http://minio.storage:9000; credentials "
        "come from spec.model.s3Secret, never the URI",
    ),
    (
        f"!self.startsWith('pvc://') || self.matches({_cel(PVC_RE)})",
        "pvc:// URIs are pvc://CLAIM/PATH with a PersistentVolumeClaim name, e.g. "
        "pvc://model-store/qwen3-0.6b",
    ),
    (
        f"!self.startsWith('oci://') || self.matches({_cel(OCI_RE)})",
        "oci:// URIs are oci://REGISTRY/REPOSITORY:TAG (or @sha256:DIGEST) with a registry host "
        "and a tag or digest, e.g. oci://ghcr.io/acme/qwen3-0.6b:v1",
    ),
    (
        "!(self.startsWith('https://') || self.startsWith('http://')) "
        f"|| self.matches({_cel(HTTPS_RE)})",
        "https:// URIs name one archive (.tar, .tar.gz, .tgz, .zip) without user:password, "
        "optionally pinned with #sha256=HEX, e.g. https://models.example.com/qwen3.tar.gz",
    ),
    (
        "!self.startsWith('file://') || self.matches('^file:///.+')",
        "file:// URIs need an absolute path, e.g. file:///opt/models/qwen3",
    ),
)


def uri_schema() -> dict[str, Any]:
    """``spec.model.uri``'s schema: a string, and a CEL rule with a message per scheme."""
    return {
        "type": "string",
        "description": (
            "Where the model comes from: "
            + SCHEMES_HINT
            + ". An init container fetches it once per pod (or checks it, for pvc://, oci:// "
            "and directories) before any stage starts; status.model and the ModelReady "
            "condition report it. Set exactly one of `name` and `uri`."
        ),
        "minLength": 1,
        "maxLength": 2048,
        "x-kubernetes-validations": [
            {"rule": rule, "message": message} for rule, message in URI_RULES
        ],
    }


def crd_rule_violations(uri: str) -> list[str]:
    """The messages of the CRD's rules ``uri`` breaks, evaluated in Python: each rule above is
    a conjunction of ``startsWith``/``contains``/``matches``, read here with the same regexes."""
    problems = []
    has_scheme = "://" in uri
    if (not has_scheme and not uri.startswith("/")) or (
        has_scheme and not re.match(KNOWN_SCHEME_RE, uri)
    ):
        problems.append(URI_RULES[0][1])
    checks = (
        ("hf://", HF_RE, 1),
        ("s3://", S3_RE, 3),
        ("pvc://", PVC_RE, 4),
        ("oci://", OCI_RE, 5),
        ("https://", HTTPS_RE, 6),
        ("http://", HTTPS_RE, 6),
        ("file://", r"^file:///.+", 7),
    )
    for prefix, regex, index in checks:
        if uri.startswith(prefix) and not re.search(regex, uri):
            problems.append(URI_RULES[index][1])
    if uri.startswith("hf://") and ("--" in uri or ".." in uri):
        problems.append(URI_RULES[2][1])
    return problems


def uri_problem(uri: str) -> str | None:
    """What ``tokenline fetch`` would refuse in ``spec.model.uri``, or None: the CRD's rules
    catch most of it, the parser the rest (a '..' segment, an endpoint that is no URL)."""
    try:
        parsed = parse_uri(uri)
    except InvalidURI as exc:
        return str(exc)
    if isinstance(parsed, LocalURI) and not parsed.path.startswith("/"):
        return f"model URI {uri!r}: a directory inside the pod must be an absolute path"
    return None


def uri_problems(uri: str) -> list[str]:
    """Everything refused in a model URI: the CRD's rules it breaks, or else, when it keeps
    them all, what the parser refuses (`uri_problem`)."""
    broken = crd_rule_violations(uri)
    if broken:
        return broken
    refused = uri_problem(uri)
    return [refused] if refused else []


def default_served_name(uri: ModelURI) -> str:
    """The name /v1/models lists when ``servedName`` is unset: the Hub id for hf://, else
    the last path component (the archive's name without its extension for https://)."""
    if isinstance(uri, HfURI):
        return uri.repo_id
    if isinstance(uri, S3URI):
        tail = uri.prefix or uri.bucket
    elif isinstance(uri, PvcURI):
        tail = uri.path or uri.claim
    elif isinstance(uri, OciURI):
        tail = uri.repository
    elif isinstance(uri, HttpsURI):
        tail = re.sub(r"(\.tar\.gz|\.tgz|\.tar|\.zip)$", "", uri.url.split("?", 1)[0])
    else:
        tail = uri.path
    return posixpath.basename(tail.rstrip("/")) or tail
