"""`tokenline serve`: the four stages as local child processes, supervised.

Children run in their own sessions (so a terminal's Ctrl-C reaches only the supervisor, which
then drains them with one SIGTERM) and die with the supervisor (PR_SET_PDEATHSIG), so no
orphan survives. A stage that dies is restarted; the api notices its connections drop and
fails that stage's in-flight requests cleanly. The IPC socket directory is removed on exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from tokenline import protocol
from tokenline.model_source import resolve
from tokenline.settings import Settings, settings_of
from tokenline.transport import RingEndpoints

log = logging.getLogger("tokenline.serve")
START_ORDER = ("scheduler", "detokenizer", "tokenizer", "api")  # slowest to load first
READY_TIMEOUT_S = 300.0
RESTART_BACKOFF_S = 1.0  # the first wait for a stage that dies soon after it started
RESTART_BACKOFF_MAX_S = 30.0
CRASH_LOOP_WINDOW_S = 30.0  # a stage that ran this long before dying restarts at once
SUPERVISE_INTERVAL_S = 0.05


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stage_argv(stage: str, settings: Settings) -> list[str]:
    """The child's command line: every flag `stage` takes that has a value (`SETTINGS`), but
    the secrets, which travel in `stage_env`."""
    argv = [sys.executable, "-m", "tokenline.cli", stage]
    for setting in settings_of(stage):
        if setting.secret:
            continue
        if setting.flag == "metrics-port":
            value = metrics_port(stage, settings.port)  # serve's own scheme: port+1..3
        elif not setting.serve:
            continue  # not a serve flag (the scheduler's own metrics and device choices)
        else:
            value = setting.value(settings)
        if value is None:
            continue  # the stage's own default (often one that depends on the device)
        if setting.switch:
            if value:
                argv.append(f"--{setting.flag}")
        elif setting.repeatable:
            for item in value:  # Child.start drops TOKENLINE_* from the environment
                argv += [f"--{setting.flag}", str(item)]
        else:
            argv += [f"--{setting.flag}", str(value)]
    return argv


class SecretError(ValueError):
    """A secret that its environment mirror cannot carry unchanged."""


def stage_env(stage: str, settings: Settings) -> dict[str, str]:
    """The secret settings `stage` takes, as their ``TOKENLINE_*`` mirrors: only the child's
    own user (and root) can read its environment, while its command line is world-readable
    in /proc and ``ps``."""
    env = {}
    for setting in settings_of(stage):
        if not setting.secret:
            continue
        value = setting.value(settings)
        if not value:
            continue
        items = [str(v) for v in value] if setting.repeatable else [str(value)]
        for item in items:
            # the mirror is comma-separated and stripped (cli.py): such a value would arrive
            # as other keys, each of them accepted
            if "," in item or item != item.strip() or not item:
                raise SecretError(
                    f"a --{setting.flag} value holds a comma or starts or ends with white "
                    f"space, which `tokenline serve` cannot hand to the {stage} stage; "
                    "put it in a file named by --api-key-file instead"
                )
        env[setting.env] = ",".join(items)
    return env


def metrics_port(stage: str, api_port: int) -> int:
    return api_port + {"tokenizer": 1, "scheduler": 2, "detokenizer": 3}[stage]


@dataclass
class Child:
    stage: str
    argv: list[str]
    secrets: dict[str, str] = field(default_factory=dict, repr=False)  # `stage_env`
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    quick_deaths: int = 0

    def backoff(self) -> float:
        """No wait after a stage that ran a while (one crash costs only its restart), doubling
        waits for one that keeps dying young (a crash loop must not spin)."""
        if time.monotonic() - self.started_at >= CRASH_LOOP_WINDOW_S:
            self.quick_deaths = 0
            return 0.0
        self.quick_deaths += 1
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (self.quick_deaths - 1))

    def start(self) -> None:
        self.started_at = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
        env.update(self.secrets)
        self.process = subprocess.Popen(
            self.argv, start_new_session=True, preexec_fn=_die_with_parent, env=env
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def probe_context(settings: Settings) -> ssl.SSLContext | None:
    """How serve's readiness probe talks to its api: plain HTTP, or HTTPS that trusts only the
    api's own certificate.

    The probe dials 127.0.0.1, a name a deployment's certificate rarely carries (it names the
    host clients use), so the hostname check is off for this probe alone; the certificate
    itself is the only trust anchor, so the handshake still proves that the api answering
    holds that certificate's key. Partial chains are allowed so that a CA-issued leaf (whose
    root is not in the file) is an anchor on its own."""
    if not settings.ssl_certfile:
        return None
    context = ssl.create_default_context(cafile=settings.ssl_certfile)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.check_hostname = False
    return context


def wait_ready(
    url: str, children: list[Child], timeout: float, context: ssl.SSLContext | None = None
) -> bool:
    """Whether ``url`` answers 200 within ``timeout``; False at once when a child dies."""
    deadline = time.monotonic() + timeout
    failure: OSError | None = None
    while time.monotonic() < deadline:
        if not all(c.alive() for c in children):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as response:
                if response.status == 200:
                    return True
        except OSError as exc:
            failure = exc
        time.sleep(0.2)
    if failure is not None:  # a certificate the probe cannot verify shows here, not as a hang
        log.error("the api's %s answered last with: %s", url, failure)
    return False


def serve(settings: Settings, ipc_dir: str | None = None) -> int:
    try:
        secrets = {stage: stage_env(stage, settings) for stage in START_ORDER}
    except SecretError as exc:
        log.error("%s", exc)
        return 2
    # Build or locate the model once, before four processes race for it.
    source = resolve(settings.model, settings.model_cache_dir, settings.revision)
    log.info("model %s at %s", source.spec, source.path)
    owned_dir = None
    if ipc_dir is None:
        owned_dir = ipc_dir = tempfile.mkdtemp(prefix="tokenline-")
    settings.endpoints = RingEndpoints.in_directory(ipc_dir)
    children = [Child(stage, stage_argv(stage, settings), secrets[stage]) for stage in START_ORDER]

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for child in children:
            child.start()
        scheme = "https" if settings.ssl_certfile else "http"
        api_url = f"{scheme}://127.0.0.1:{settings.port}"
        context = probe_context(settings)
        if not wait_ready(f"{api_url}/ready", children, READY_TIMEOUT_S, context):
            if not stopping:
                log.error("the stages did not become ready; see the log lines above")
                return 1
        else:
            print(f"tokenline is serving {settings.model_name!r}", flush=True)
            print(f"  api         {api_url}/v1  (metrics {api_url}/metrics)", flush=True)
            for stage in ("tokenizer", "scheduler", "detokenizer"):
                port = metrics_port(stage, settings.port)
                print(f"  {stage:<11} metrics http://127.0.0.1:{port}/metrics", flush=True)
            print(f"  ring        {ipc_dir}", flush=True)
        while not stopping:
            for child in children:
                if not child.alive() and not stopping:
                    code = child.process.returncode if child.process else None
                    backoff = child.backoff()
                    log.error(
                        "%s exited with %s; restarting it in %.1fs", child.stage, code, backoff
                    )
                    time.sleep(backoff)
                    if stopping:  # a signal during the back-off: a child started now
                        break  # would miss the SIGTERM that the others got
                    child.restarts += 1
                    child.start()
            time.sleep(SUPERVISE_INTERVAL_S)
        return 0
    finally:
        _stop_all(children, settings.drain_timeout + 10)
        for stage in protocol.STAGES:  # a killed stage's socket file
            path = settings.endpoints.of(stage).removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        if owned_dir:
            shutil.rmtree(owned_dir, ignore_errors=True)


def _stop_all(children: list[Child], timeout: float) -> None:
    for child in children:
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; killing it", child.stage)
            child.process.kill()
            child.process.wait()
