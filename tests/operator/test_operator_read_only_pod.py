"""The four stages, run as the operator's pod runs them, on a read-only root filesystem.

Each container's args and environment come from the builders (ConfigMap keys resolved as
the kubelet does); the processes run in a private mount and network namespace where `/` is
read-only and only the pod's volume paths are writable tmpfs mounts. They must become ready
and serve a completion through the IPC ring. Needs `unshare` with user namespaces (skipped
where the machine has none).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tokenline_operator import names
from tokenline_operator.crd import spec
from tokenline_operator.objects import Owner
from tokenline_operator.pods import config
from tokenline_operator.pods import deployment as pods

pytestmark = pytest.mark.timeout(300)

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-3333-4c1b-9f44-2a4c1d6e7f80")
#: Where the stages run, inside the namespace; written before the root turns read-only.
RUNNER = """
import json, os, subprocess, sys, time, urllib.request

setup = json.load(open("/tmp/pod.json"))
pod = setup["containers"]
try:
    open("/.read-only-check", "w")
    sys.exit("the root filesystem is writable")
except OSError:
    pass
base = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
procs = []
for c in pod:
    log = open(f"/tmp/{c['name']}.log", "w")
    cmd = [sys.executable, "-m", "tokenline.cli", *c["args"]]
    env = {**base, **c["env"]}
    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/"))
result = {"ready": False}
deadline = time.monotonic() + 200
try:
    while time.monotonic() < deadline and not result["ready"]:
        if any(p.poll() is not None for p in procs):
            break  # a stage died: in a pod, a restart loop
        try:
            with urllib.request.urlopen("http://127.0.0.1:8000/ready", timeout=2) as r:
                result["ready"] = r.status == 200
        except Exception:
            time.sleep(1)
    if result["ready"]:
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(
            "http://127.0.0.1:8000/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            result["finish_reason"] = json.load(r)["choices"][0]["finish_reason"]
        result["metrics"] = {}
        for port in (8001, 8002, 8003):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                result["metrics"][port] = r.status
    result["ring"] = sorted(os.listdir(setup["ring"]))
    result["alive"] = [c["name"] for c, p in zip(pod, procs) if p.poll() is None]
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
result["logs"] = {c["name"]: open(f"/tmp/{c['name']}.log").read()[-3000:] for c in pod}
print("RESULT " + json.dumps(result))
"""


def _namespaces_available() -> bool:
    unshare = shutil.which("unshare")
    if not unshare or not shutil.which("chroot") or not shutil.which("ip"):
        return False
    probe = subprocess.run(
        [unshare, "-rmn", "sh", "-c", "mount -t tmpfs none /mnt && ip link set lo up"],
        capture_output=True,
        check=False,
        timeout=30,
    )
    return probe.returncode == 0


def _containers() -> list[dict[str, Any]]:
    parsed = spec.parse(
        OWNER.name, {"model": {"name": "tiny"}, "engine": {"gpus": 0}}, default_image="x"
    )
    data = config.config_map(OWNER, parsed)["data"]
    pod_spec = pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]
    found = []
    for container in pod_spec["containers"]:
        env = {}
        for item in container["env"]:
            ref = item.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                env[item["name"]] = data[ref["key"]]
            elif "value" in item:
                env[item["name"]] = item["value"]
        found.append(
            {
                "name": container["name"],
                "args": container["args"],
                "env": env,
                "writable": [m["mountPath"] for m in container["volumeMounts"]],
            }
        )
    return found


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not _namespaces_available(), reason="needs unshare with user namespaces")
def test_stages_serve_on_a_read_only_root_with_only_the_pods_volumes_writable(tmp_path: Path):
    containers = _containers()
    writable = sorted({path for c in containers for path in c["writable"]})
    (tmp_path / "pod.json").write_text(
        json.dumps({"containers": containers, "ring": names.RING_DIR})
    )
    (tmp_path / "run.py").write_text(RUNNER)
    root = tmp_path / "root"
    root.mkdir()
    # Mount points the image has: made on a tmpfs that then turns read-only itself, so the
    # machine's own /run and /var/cache stay untouched.
    parents = sorted({str(Path(p).parent) for p in writable} - {"/", "/dev"})
    lines = [
        "set -e",
        "ip link set lo up",  # a private network: the pod's ports collide with nothing
        f"R={root}",
        "mount --rbind / $R",
        "mount -o remount,bind,ro $R",
    ]
    for parent in parents:
        children = " ".join(f"$R{p}" for p in writable if str(Path(p).parent) == parent)
        lines += [
            f"mount -t tmpfs none $R{parent}",
            f"mkdir -p {children}",
            f"mount -o remount,ro $R{parent}",
        ]
    lines += [f"mount -t tmpfs -o size=2g none $R{p}" for p in writable]
    # A checkout (and its venv) under one of the pod's writable paths, /tmp for one, would be
    # hidden by that path's fresh tmpfs: it comes back read-only, as an image's code is.
    for code in sorted({str(REPO), sys.prefix}):
        if any(Path(code).is_relative_to(p) for p in writable):
            lines += [
                f"mkdir -p $R{code}",
                f"mount --bind {code} $R{code}",
                f"mount -o remount,bind,ro $R{code}",
            ]
    lines += [
        f"cp {tmp_path}/run.py {tmp_path}/pod.json $R/tmp/",
        f"exec chroot $R {sys.executable} /tmp/run.py",
    ]
    script = tmp_path / "inner.sh"
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        ["unshare", "-rmn", "sh", str(script)],
        capture_output=True,
        text=True,
        check=False,
        timeout=280,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        pytest.fail(textwrap.shorten(done.stdout + done.stderr, 3000))
    result = json.loads(lines[-1].removeprefix("RESULT "))
    logs = "\n".join(f"--- {k}\n{v}" for k, v in result["logs"].items())
    assert result["ready"], logs
    assert result["finish_reason"] in ("length", "stop"), logs
    assert result["metrics"] == {"8001": 200, "8002": 200, "8003": 200}
    assert result["ring"] == sorted(f"{stage}.sock" for stage in pods.ring_endpoints())
    assert result["alive"] == [c["name"] for c in containers], logs
    assert "Read-only file system" not in logs and "Traceback" not in logs, logs
