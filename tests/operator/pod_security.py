"""The Kubernetes Pod Security Standards, "baseline" and "restricted", as a pod spec checker.

Written from https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the
controls of the latest policy version), so the tests can hold every pod the operator and the
chart render to what `pod-security.kubernetes.io/enforce: restricted` admits. A plain module
(tests/operator and tests/chart import it; tests have no packages).
"""

from __future__ import annotations

from typing import Any

#: Capabilities baseline lets a container add (the container runtimes' default set).
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
#: The only capability restricted lets a container add (after dropping ALL).
RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}
#: Volume sources restricted allows; everything else (hostPath, nfs, …) is refused.
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod.get(field) or []:
            found.append((f"{field}[{container.get('name', '?')}]", container))
    return found


def _apparmor_ok(profile: dict[str, Any] | None) -> bool:
    return profile is None or profile.get("type") in ("RuntimeDefault", "Localhost")


def baseline_violations(pod: dict[str, Any], metadata: dict[str, Any] | None = None) -> list[str]:
    """What in ``pod`` (a PodSpec) and its ``metadata`` the baseline policy forbids."""
    problems = []
    pod_sc = pod.get("securityContext") or {}
    containers = _containers(pod)
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("HostProcess: spec.securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"Host namespaces: spec.{field}")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            problems.append(f"HostPath volumes: volume {volume.get('name')}")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            problems.append(f"Sysctls: {sysctl.get('name')}")
    if not _apparmor_ok(pod_sc.get("appArmorProfile")):
        problems.append("AppArmor: spec.securityContext.appArmorProfile")
    for key, value in ((metadata or {}).get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            problems.append(f"AppArmor: annotation {key}")
    contexts = [("spec.securityContext", pod_sc)]
    contexts += [
        (f"{where}.securityContext", c.get("securityContext") or {}) for where, c in containers
    ]
    for where, sc in contexts:
        selinux = sc.get("seLinuxOptions") or {}
        if (
            selinux.get("type", "") not in SELINUX_TYPES
            or selinux.get("user")
            or selinux.get("role")
        ):
            problems.append(f"SELinux: {where}.seLinuxOptions")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append(f"Seccomp: {where}.seccompProfile Unconfined")
    for where, container in containers:
        sc = container.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            problems.append(f"HostProcess: {where}")
        if sc.get("privileged"):
            problems.append(f"Privileged containers: {where}")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            problems.append(f"Capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"Host ports: {where} port {port.get('name')}")
        if not _apparmor_ok(sc.get("appArmorProfile")):
            problems.append(f"AppArmor: {where}.appArmorProfile")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"/proc mount type: {where}")
    return problems


def restricted_violations(pod: dict[str, Any], metadata: dict[str, Any] | None = None) -> list[str]:
    """What in ``pod`` (a PodSpec) the restricted policy forbids (baseline included)."""
    problems = baseline_violations(pod, metadata)
    pod_sc = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        sources = set(volume) - {"name"}
        if not sources or sources - RESTRICTED_VOLUME_TYPES:
            problems.append(f"Volume types: volume {volume.get('name')} uses {sorted(sources)}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("Running as non-root user: spec.securityContext.runAsUser is 0")
    for where, container in _containers(pod):
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(
                f"Privilege escalation: {where} must set allowPrivilegeEscalation false"
            )
        # runAsNonRoot: true on the pod covers a container that leaves it unset, never one
        # that sets it false.
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"Running as non-root: {where} (runAsNonRoot is not true)")
        if sc.get("runAsUser") == 0:
            problems.append(f"Running as non-root user: {where}.runAsUser is 0")
        profile = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        if profile.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"Seccomp: {where} has no RuntimeDefault or Localhost profile")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"Capabilities: {where} must drop ALL")
        added = set(capabilities.get("add") or [])
        if added - RESTRICTED_CAPABILITIES:
            problems.append(f"Capabilities: {where} adds {sorted(added)}")
    return problems


def hardening_violations(pod: dict[str, Any]) -> list[str]:
    """What this project asks beyond the standard: a non-root group, a read-only root."""
    problems = []
    pod_sc = pod.get("securityContext") or {}
    for where, container in _containers(pod):
        sc = container.get("securityContext") or {}
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
        if not user or not group:
            problems.append(f"{where}: runs without a non-root runAsUser and runAsGroup")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: the root filesystem is writable")
        for mount in container.get("volumeMounts") or []:
            if mount.get("subPath") or mount.get("subPathExpr"):
                problems.append(f"{where}: subPath mount {mount['name']} never sees updates")
    if pod_sc.get("fsGroup") == 0 or 0 in (pod_sc.get("supplementalGroups") or []):
        problems.append("spec.securityContext: the root group")
    return problems
