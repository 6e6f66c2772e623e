"""spec.engine.extraArgs: a vllm serve command line carried into the pods, read by the stages'
own parser before any pod is made; a flag it refuses is a Degraded condition, not a pod that
crash-loops. (Each container parsing its flags with the real CLI: test_operator_cli_contract.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, absent, eventually, inference_service, stored

from tokenline.settings import BY_FLAG
from tokenline_operator import names
from tokenline_operator.crd import extra_args, spec
from tokenline_operator.objects import Owner
from tokenline_operator.pods import deployment as pods

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-3333-4c1b-9f44-2a4c1d6e7f80")
API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
MERGE = {"Content-Type": "application/merge-patch+json"}


def _parse(args: list[str], **engine: Any) -> spec.Spec:
    raw = {"model": {"name": "tiny"}, "engine": {"gpus": 0, "extraArgs": args, **engine}}
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def _args(parsed: spec.Spec) -> dict[str, list[str]]:
    containers = pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]["containers"]
    return {c["name"]: c["args"] for c in containers}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--block-size", "many"], "argument --block-size: invalid int value: 'many'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["serve"], "unrecognized arguments: serve"),  # a value without its flag
        (["--tokenizer", "/t"], "--tokenizer is vLLM's and not served by tokenline"),
        (["--max-model-len", "4096"], "--max-model-len: set spec.engine.maxModelLen instead"),
        (["--lora-modules", "a=/p/a"], "set spec.model.lora"),
        (["--ssl-certfile", "/c.pem"], "set spec.server.tlsSecret"),
        (["--port", "9000"], "the pod's ports are fixed"),
        (["--served-model-name", "other"], "the first name must be 'tiny'"),
        (["--max-lor", "2"], "unrecognized arguments"),  # no abbreviations: the name or nothing
    ],
)
def test_a_flag_the_stages_would_refuse_is_an_invalid_spec(args, says):
    with pytest.raises(spec.SpecError, match="spec.engine.extraArgs: .*" + re.escape(says)):
        _parse(args)


def test_each_container_gets_the_flags_its_stage_takes():
    parsed = _parse(
        [
            "--served-model-name", "tiny", "gpt-4o",
            "--enable-auto-tool-choice",  # accepted, nothing to pass on
            "--tool-call-parser", "hermes",
            "--block-size=32",
            "--chat-template", "{{ messages[0]['content'] }}",
            "--chat-template-content-format", "openai",
        ]
    )  # fmt: skip
    args = _args(parsed)
    names_ = ["--served-model-name", "tiny", "gpt-4o"]
    template = ["--chat-template", "{{ messages[0]['content'] }}"]
    assert args["api"][-7:] == [*names_, "--tool-call-parser", "hermes", *template]
    assert args["scheduler"][-6:] == [*names_, "--block-size=32", *template]
    content = ["--chat-template-content-format", "openai"]
    assert args["tokenizer"][-7:] == [*names_, *template, *content]
    assert args["detokenizer"][-5:] == [*names_, *template]
    assert "--enable-auto-tool-choice" not in str(args)


def test_without_extra_args_the_pods_are_unchanged():
    raw = {"model": {"name": "tiny"}, "engine": {"gpus": 0}}
    parsed = spec.parse(OWNER.name, raw, default_image="tokenline:test")
    assert _args(parsed) == _args(_parse([]))


def test_every_flag_the_pod_sets_is_refused_in_extra_args():
    """What the operator writes into a container (args or TOKENLINE_* variables) is a field of
    the spec or set by the pod; extraArgs may not set it a second time."""
    raw = {
        "model": {"name": "tiny", "lora": {"adapters": [{"name": "a", "uri": "/a"}]}},
        "engine": {"gpus": 0},
        "server": {"apiKeySecret": {"name": "k"}, "tlsSecret": {"name": "t"}},
        "router": {"kvEvents": {"enabled": True}},
    }
    parsed = spec.parse(OWNER.name, raw, default_image="tokenline:test")
    by_env = {s.env: s for s in BY_FLAG.values()}
    written = set()
    for container in pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]["containers"]:
        written |= {a[2:] for a in container["args"] if a.startswith("--")}
        written |= {by_env[e["name"]].flag for e in container["env"] if e["name"] in by_env}
    assert written, "nothing found: the test reads the pod wrongly"
    for flag in sorted(written):
        if BY_FLAG[flag].crd is None:
            assert flag in extra_args.POD_SETS, f"--{flag} is set by the pod but not refused"


# ── against the Kubernetes API emulator: a condition, and no pod ─────────────────────────────
@pytest.mark.timeout(60)
async def test_a_bad_flag_degrades_the_service_and_makes_no_pod(cluster, operator):
    body = inference_service(engine={"gpus": 0, "extraArgs": ["--block-size", "many"]})
    response = await cluster.post(API, json=body)
    assert response.ok, await response.text()

    def degraded() -> dict:
        obj = stored(cluster, IS_RESOURCE)
        (cond,) = [c for c in obj["status"]["conditions"] if c["type"] == "Degraded"]
        assert cond["status"] == "True"
        return cond

    cond = await eventually(degraded)
    assert cond["reason"] == "InvalidSpec"
    assert "argument --block-size: invalid int value: 'many'" in cond["message"]
    assert absent(cluster, "apps/v1/deployments", "chat")

    # fixed: the pods come, with the flag on the scheduler's command line
    fixed = {"spec": {"engine": {"extraArgs": ["--block-size", "32"]}}}
    response = await cluster.patch(f"{API}/chat", json=fixed, headers=MERGE)
    assert response.ok, await response.text()
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    (scheduler,) = [
        c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"
    ]
    assert scheduler["args"][-2:] == ["--block-size", "32"]
