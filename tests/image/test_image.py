"""The built image, run the way the chart and the operator run it.

`tools/image build` makes the CPU variant from this checkout (see conftest.py); podman runs
it with runc as uid 10001 on a read-only root, every capability dropped, and only the
pod's volumes writable. Each pod shares one network namespace (a pause container's, as in
Kubernetes); the client talks to it from inside that namespace with the `openai` client.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

import kmock as kmock_lib
import pytest
import yaml
from image_testkit import Containers, client_in, podman

from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec

pytestmark = pytest.mark.timeout(1800)  # the first test also builds the image

#: The CPU image's ceiling, in bytes as `podman images` counts them (10^9 to a GB): about
#: 1.4 GB of Python packages (torch's 750 MB, its headers included) and 0.3 GB for the C and
#: C++ compilers torch.compile builds its kernels with at run time.
MAX_CPU_IMAGE_BYTES = 1_750_000_000
OWNER = manifests.Owner(name="chat", namespace="serving", uid="5d1c0a52-image-test")


def writable_dir(path: Path) -> str:
    """A pod volume: an empty directory the stages' uid and fsGroup can write."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, names.RUN_AS_USER, names.RUN_AS_USER)
    path.chmod(0o2770)
    return str(path)


def quiet_logs(logs: str) -> None:
    assert "Read-only file system" not in logs, logs
    assert "Permission denied" not in logs, logs
    assert "Traceback" not in logs, logs


def check_answers(result: dict[str, Any], logs: str) -> None:
    assert result["ready"], logs
    assert result["chat"]["finish_reason"] in ("stop", "length"), result
    assert result["chat"]["completion_tokens"] > 0, result
    assert result["stream"]["objects"] == ["chat.completion.chunk"], result
    assert result["stream"]["finish_reason"] in ("stop", "length"), result
    assert result["stream"]["chunks"] >= 2, result
    assert set(result["metrics"].values()) == {200}, result


# --- tokenline serve -----------------------------------------------------------------------


def test_serve_tiny_answers_a_chat_completion_and_a_stream(
    image: str, containers: Containers, tmp_path: Path
):
    """`docker run --read-only --tmpfs /tmp -v cache:/var/cache/tokenline IMAGE serve`."""
    _serve_tiny(image, containers, tmp_path, "serve")


def _serve_tiny(image: str, containers: Containers, tmp_path: Path, name: str, *flags: str):
    """`tokenline serve` of the tiny model in a container with ``flags``; its answers checked
    and the container still running after them."""
    name = containers.start(
        name,
        "--network=none",
        f"--volume={writable_dir(tmp_path / 'cache')}:{names.MODEL_CACHE_DIR}",
        f"--volume={writable_dir(tmp_path / 'tmp')}:/tmp",
        image,
        *("serve", "--model", "tiny", "--port", "8000"),
        *flags,
    )
    result = client_in(containers.pid(name), 8000, 8001, 8002, 8003)
    logs = containers.logs()
    print(json.dumps(result, indent=1))
    check_answers(result, logs)
    assert containers.running() == [name], logs
    quiet_logs(logs)


def test_serve_compiles_flex_attention_inside_the_image(
    image: str, containers: Containers, tmp_path: Path
):
    """The GPU's default attention, flex_attention compiled on first use, built and run by
    inductor inside the image (on a read-only root: its cache lives on the cache volume)."""
    _serve_tiny(
        image, containers, tmp_path, "serve-compiled", "--attention-backend", "flex", "--compile"
    )
    assert any(p.suffix == ".so" for p in (tmp_path / "cache" / "inductor").rglob("*")), (
        "inductor built no kernel"
    )


# --- the operator's pod: four stage containers and one IPC ring ---------------------------


def pod_containers(image: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Deployment's containers and volumes, as the operator's builders make them."""
    parsed = spec.parse(
        OWNER.name, {"model": {"name": "tiny"}, "engine": {"gpus": 0}}, default_image=image
    )
    config = manifests.config_map(OWNER, parsed)["data"]
    pod = manifests.deployment(OWNER, parsed)["spec"]["template"]["spec"]
    for container in pod["containers"]:
        resolved = {}
        for item in container["env"]:
            ref = item.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                resolved[item["name"]] = config[ref["key"]]
            elif "value" in item:
                resolved[item["name"]] = item["value"]
            else:
                raise AssertionError(f"an env source this test cannot resolve: {item}")
        container["resolved_env"] = resolved
    return pod["containers"], pod["volumes"]


def test_the_operators_pod_answers_end_to_end_over_the_ipc_ring(
    image: str, containers: Containers, tmp_path: Path
):
    pod, volumes = pod_containers(image)
    assert [c["name"] for c in pod] == list(names.STAGES)
    assert all(c["image"] == image and "command" not in c for c in pod), "entrypoint: image's"
    host = {v["name"]: writable_dir(tmp_path / "volumes" / v["name"]) for v in volumes}
    # The pod's network namespace, held by a pause container as the kubelet's sandbox does.
    pause = containers.start("pause", "--network=none", "--entrypoint=sleep", image, "infinity")
    for container in pod:
        flags = [f"--network=container:{pause}"]
        for mount in container["volumeMounts"]:
            if mount["mountPath"] == "/dev/shm":
                flags.append("--shm-size=1g")  # the runtime's own tmpfs, as a Memory emptyDir
                continue
            mode = ":ro" if mount.get("readOnly") else ""
            flags.append(f"--volume={host[mount['name']]}:{mount['mountPath']}{mode}")
        flags += [f"--env={k}={v}" for k, v in container["resolved_env"].items()]
        containers.start(container["name"], *flags, image, *container["args"])
    metrics_ports = [names.METRICS_PORTS[s] for s in names.STAGES if s != "api"]
    result = client_in(containers.pid(pause), names.API_PORT, *metrics_ports)
    logs = containers.logs()
    print(json.dumps(result, indent=1))
    check_answers(result, logs)
    # Every stage's inbox, as the pod's environment names it, is a socket in the ring volume.
    endpoints = {v for c in pod for k, v in c["resolved_env"].items() if k.endswith("_ENDPOINT")}
    assert endpoints and all(e.startswith(f"ipc://{names.RING_DIR}/") for e in endpoints)
    ring = sorted(os.listdir(host["ring"]))
    assert ring == sorted(e.rsplit("/", 1)[1] for e in endpoints)
    assert len(containers.running()) == 1 + len(pod), logs
    quiet_logs(logs)


# --- the operator's entrypoint --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except OSError:
        return 0


async def test_the_operator_entrypoint_serves_its_health_port(
    image: str, containers: Containers, tmp_path: Path, kmock: Any
):
    """The chart's operator container, against kmock's API server on the host's loopback
    (a kubeconfig stands in for the service account token the pod would mount)."""
    kmock.resources.load_bundled()
    resource = f"{names.GROUP}/{names.VERSION}/{names.PLURAL}"
    kmock.resources[resource] = kmock_lib.ResourceInfo(
        kind=names.KIND,
        singular=names.SINGULAR,
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )
    kube = tmp_path / "kube"
    kube.mkdir()
    (kube / "config").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "k", "cluster": {"server": str(kmock.servers[0].url)}}],
                "users": [{"name": "k", "user": {"token": "test-token"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}],
                "current-context": "k",
            }
        )
    )
    kube.chmod(0o755)
    (kube / "config").chmod(0o644)
    health, metrics = free_port(), free_port()
    start = asyncio.to_thread(
        containers.start,
        "operator",
        "--network=host",
        f"--volume={writable_dir(tmp_path / 'tmp')}:/tmp",
        f"--volume={kube}:/etc/kube:ro",
        "--env=KUBECONFIG=/etc/kube/config",
        f"--env=TOKENLINE_DEFAULT_IMAGE={image}",
        image,
        *("operator", f"--metrics-port={metrics}", f"--health-port={health}", "--log-level=info"),
    )
    await start
    status = {}
    for _ in range(120):
        status = {
            "health": await asyncio.to_thread(http_status, f"http://127.0.0.1:{health}/healthz"),
            "metrics": await asyncio.to_thread(http_status, f"http://127.0.0.1:{metrics}/metrics"),
        }
        if status == {"health": 200, "metrics": 200}:
            break
        await asyncio.sleep(0.5)
    logs = await asyncio.to_thread(containers.logs)
    assert status == {"health": 200, "metrics": 200}, logs
    assert await asyncio.to_thread(containers.running) == containers.names, logs
    quiet_logs(logs)


# --- what is in the image -------------------------------------------------------------------

#: What torch.compile builds its kernels with at run time (Triton's launcher on a GPU,
#: inductor's C++ on a CPU): a C and a C++ compiler, Python's headers and torch's.
COMPILE_NEEDS = {
    "a C compiler": re.compile(r"^usr/bin/((x86_64|aarch64)-linux-gnu-)?gcc(-[0-9.]+)?$"),
    "a C++ compiler": re.compile(r"^usr/bin/((x86_64|aarch64)-linux-gnu-)?g\+\+(-[0-9.]+)?$"),
    "Python's headers": re.compile(r"^usr/include/python3[.0-9]*/Python\.h$"),
    "torch's headers": re.compile(r"/site-packages/torch/include/torch/csrc/"),
}
#: Files that hold index settings or credentials: none may be in any layer, even deleted.
SECRET_PATHS = re.compile(
    r"(^|/)(pip\.conf|pip\.ini|\.pypirc|\.netrc|\.git-credentials|\.npmrc)$"
    r"|^root/\.(config/pip|cache/pip|docker|aws|ssh)/|^etc/xdg/pip/|^run/secrets/.|^wheels/."
)


def host_pip_settings() -> list[str]:
    """The values of this machine's pip settings (indexes, find-links, constraints)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    values = [
        line.split("=", 1)[1].strip().strip("'\"")
        for line in done.stdout.splitlines()
        if "=" in line and not line.split("=", 1)[0].endswith(("cert", "timeout", "check"))
    ]
    values += [v for k, v in os.environ.items() if k.startswith("PIP_") and "/" in v]
    words = {w for v in values for w in v.split() if len(w) > 6}
    words -= {"/etc/ssl/certs/ca-certificates.crt"}
    return [*sorted(words), "/var/cache/tokenline-image"]


def oci_layout(image: str, into: Path) -> tuple[dict, list[Path]]:
    podman("save", "--format=oci-dir", f"--output={into}", image, timeout=600)
    blob = lambda digest: into / "blobs" / digest.replace(":", "/")  # noqa: E731
    index = json.loads((into / "index.json").read_text())
    manifest = json.loads(blob(index["manifests"][0]["digest"]).read_text())
    config = json.loads(blob(manifest["config"]["digest"]).read_text())
    return config, [blob(layer["digest"]) for layer in manifest["layers"]]


def test_image_size_contents_and_layers(image: str, tmp_path: Path):
    size = int(podman("image", "inspect", "--format={{.Size}}", image))
    print(f"image {image}: {size / 1e9:.2f} GB")
    config, layers = oci_layout(image, tmp_path / "oci")

    # The contract the chart and the operator rely on.
    cfg = config["config"]
    assert cfg["User"] == f"{names.RUN_AS_USER}:{names.RUN_AS_USER}"
    assert cfg["Entrypoint"] == ["tokenline"]
    assert "Healthcheck" not in cfg, "probes live in the pod spec, not the image"
    assert names.MODEL_CACHE_DIR in cfg.get("Volumes", {})

    needles = [n.encode() for n in host_pip_settings()]
    host_ca = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
    host_ca_sha = hashlib.sha256(host_ca.read_bytes()).hexdigest() if host_ca.is_file() else ""
    history = json.dumps([config.get("history", []), cfg.get("Env", [])])
    for needle in needles:
        assert needle.decode() not in history, f"{needle!r} in the image's history or env"
    assert not re.search(r"://[^/\s:@\"]+:[^/\s@\"]+@", history), "credentials in a URL"

    final: dict[str, int] = {}
    leaks: list[str] = []
    for layer in layers:
        with tarfile.open(layer, mode="r:*") as tar:
            for member in tar:
                path = member.name.removeprefix("./")
                base = path.rsplit("/", 1)[-1]
                parent = path[: -len(base)]
                if base == ".wh..wh..opq":
                    final = {p: s for p, s in final.items() if not p.startswith(parent)}
                    continue
                if base.startswith(".wh."):
                    gone = parent + base.removeprefix(".wh.")
                    final = {p: s for p, s in final.items() if p != gone}
                    final = {p: s for p, s in final.items() if not p.startswith(gone + "/")}
                    continue
                if SECRET_PATHS.search(path):
                    leaks.append(f"{layer.name[:12]}: {path}")
                if not member.isfile():
                    final[path] = 0
                    continue
                final[path] = member.size
                if member.size > 2_000_000:
                    continue
                data = tar.extractfile(member).read()
                leaks += [f"{path}: {n.decode()}" for n in needles if n in data]
                if host_ca_sha and path != "etc/ssl/certs/ca-certificates.crt":
                    if hashlib.sha256(data).hexdigest() == host_ca_sha:
                        leaks.append(f"{path}: this machine's CA bundle")
    assert leaks == [], "index settings or credentials in a layer"

    missing = [what for what, found in COMPILE_NEEDS.items() if not any(map(found.search, final))]
    assert missing == [], f"torch.compile cannot build kernels in the image: no {missing}"

    tops: dict[str, int] = {}
    for path, bytes_ in final.items():
        match = re.match(r"(opt/tokenline/lib/python[^/]+/site-packages/[^/]+|[^/]+/[^/]+)", path)
        if match:
            tops[match.group(1)] = tops.get(match.group(1), 0) + bytes_
    for path, bytes_ in sorted(tops.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{bytes_ / 1e6:8.1f} MB  /{path}")
    assert size < MAX_CPU_IMAGE_BYTES, f"{size / 1e9:.2f} GB"
