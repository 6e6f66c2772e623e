"""Two combinations of spec fields: a disaggregation role with less tensor parallelism than
the engine's (its GPUs), and server.tlsSecret with an InferencePool (refused, or no pool)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenline_operator.controller import manifests
from tokenline_operator.crd import definition, spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.routing import inference_pool

OWNER = Owner(name="chat", namespace="serving", uid="uid-chat")
ROUTED = Capabilities(inference_pool=True)
TLS = {"tlsSecret": {"name": "llm-tls"}}


def parse(**fields: Any) -> spec.Spec:
    raw = {"model": {"name": "Qwen/Qwen3-0.6B"}, **fields}
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def scheduler_gpus(deployment: dict[str, Any]) -> Any:
    pod = deployment["spec"]["template"]["spec"]
    scheduler = next(c for c in pod["containers"] if c["name"] == "scheduler")
    return scheduler["resources"].get("limits", {}).get("nvidia.com/gpu")


# --- 6: a role's GPUs follow its tensor parallelism, down as well as up -------------------


@pytest.mark.parametrize(("prefill", "decode"), [(1, 2), (2, 1), (1, 4)])
def test_each_role_requests_one_gpu_per_rank_of_its_own(prefill, decode):
    roles = {
        "prefill": {"replicas": 1, "tensorParallelSize": prefill},
        "decode": {"replicas": 1, "tensorParallelSize": decode},
    }
    engine = {"tensorParallelSize": 2, "gpus": 2}
    built = manifests.children(OWNER, parse(engine=engine, disaggregation=roles), ROUTED)
    assert scheduler_gpus(built["PrefillDeployment"]) == prefill
    assert scheduler_gpus(built["DecodeDeployment"]) == decode


def test_a_role_on_the_cpu_stays_there():
    roles = {"prefill": {"replicas": 1, "tensorParallelSize": 2}, "decode": {"replicas": 1}}
    built = manifests.children(OWNER, parse(engine={"gpus": 0}, disaggregation=roles), ROUTED)
    assert scheduler_gpus(built["PrefillDeployment"]) is None


# --- 7: TLS and an InferencePool -----------------------------------------------------------


def test_tls_with_an_inference_pool_asked_for_is_refused_saying_what_to_do():
    with pytest.raises(spec.SpecError, match=r"set routing\.inferencePool\.enabled to false"):
        parse(server=TLS, routing={"inferencePool": {"enabled": True}})


def test_the_crd_refuses_it_too():
    rules = definition.SPEC["x-kubernetes-validations"]
    (rule,) = [r for r in rules if "tlsSecret" in r["rule"] and "inferencePool" in r["rule"]]
    assert "routing.inferencePool.enabled to false" in rule["message"]


def test_tls_alone_makes_no_pool_even_where_the_cluster_serves_one():
    parsed = parse(server=TLS)
    assert not inference_pool.routing_enabled(parsed, ROUTED)


@pytest.mark.parametrize("enabled", [False, None])
def test_tls_with_the_pool_off_or_unset_is_accepted(enabled):
    routing = {} if enabled is None else {"inferencePool": {"enabled": enabled}}
    parsed = parse(server=TLS, routing=routing)
    assert spec.tls_enabled(parsed)


def test_a_plain_http_api_is_still_routed_by_default():
    assert inference_pool.routing_enabled(parse(), ROUTED)
