"""The operator's settings are the declared ones (`tokenline.settings.SETTINGS`): every
TOKENLINE_* variable a container gets is a setting its stage takes, every CRD field that
sets one is named by that setting's declaration and defaults to the flag's default, and the
chart's CRD and values schema are the ones built from them."""

from __future__ import annotations

from typing import Any

import pytest

from tokenline.settings import BY_FLAG, DEFAULT_METRICS_PORTS, SETTINGS, settings_of
from tokenline_operator import chartgen, names
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import spec
from tokenline_operator.objects import Owner
from tokenline_operator.pods import config
from tokenline_operator.pods import deployment as pods

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-2222-4c1b-9f44-2a4c1d6e7f80")
BY_ENV = {s.env: s for s in SETTINGS}
#: what the pod spec, not a stage flag, is made of
NOT_SETTINGS = {
    # uri: the operator's (a fetch init container); the stages get the directory as --model
    # lora: the operator's too (a ConfigMap of adapters, the LoRA flags on the pods)
    "model": {"hfTokenSecret", "s3Secret", "cache", "uri", "lora"},
    # extraArgs: flags for the stages' command lines, checked by their parser (extra_args.py)
    "engine": {"gpus", "extraArgs"},
    "server": {"startupTimeoutSeconds", "apiKeySecret", "tlsSecret"},
    "scheduling": set(),
}
SECTIONS = {
    "model": crd.MODEL,
    "engine": crd.ENGINE,
    "server": crd.SERVER,
    "scheduling": crd.SCHEDULING,
}
EVERYTHING: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-0.6B", "servedName": "qwen3", "revision": "main"},
    "engine": {
        "gpus": 1,
        "dtype": "bfloat16",
        "maxModelLen": 4096,
        "kvCacheMemory": "8GiB",
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 4096,
        "compile": True,
        "enforceEager": True,
        "prefixCaching": False,
        "prefixCachingHashAlgo": "sha256_cbor",
        "speculative": '{"method": "ngram", "num_speculative_tokens": 4}',
    },
    "server": {
        "apiKeySecret": {"name": "keys"},
        "tlsSecret": {"name": "tls"},
        "allowedOrigins": ["https://app.example.com"],
    },
    "scheduling": {"policy": "priority", "tenantWeights": "team-a=1,team-b=3"},
}


def test_every_crd_field_of_a_setting_is_declared():
    declared = {s.crd.path for s in SETTINGS if s.crd}
    for section, schema in SECTIONS.items():
        fields = {f"{section}.{name}" for name in schema["properties"]}
        others = {f"{section}.{name}" for name in NOT_SETTINGS[section]}
        assert fields - others == {c for c in declared if c.startswith(f"{section}.")}
        assert others <= fields, "a field named as not a setting has gone"


def test_each_crd_field_takes_its_flags_default_and_choices():
    sections = crd.spec_schema()["properties"]
    for setting in SETTINGS:
        if setting.crd is None:
            continue
        field = sections[setting.crd.section]["properties"][setting.crd.name]
        default = (not setting.default) if setting.crd.inverted else setting.default
        # a declaration may say its field has no default: the operator derives the value
        # (prefixCachingHashAlgo: sha256_cbor with router.kvEvents, else the flag's)
        derived = "default" in setting.crd.schema and setting.crd.schema["default"] is None
        if derived:
            assert setting.flag in config._DERIVED, f"{setting.flag}: who decides its value?"
        if setting.crd.required or default is None or setting.repeatable or derived:
            assert "default" not in field, setting.flag
        else:
            assert field["default"] == default, setting.flag
        if setting.choices:
            assert field["enum"] == list(setting.choices), setting.flag
        section = sections[setting.crd.section]
        required = section.get("required", [])
        if setting.crd.alternative:
            # exactly one of the two: a CEL rule, and not in `required`
            assert setting.crd.name not in required, setting.flag
            assert setting.crd.alternative in section["properties"], setting.flag
            rules = [r["rule"] for r in section.get("x-kubernetes-validations", [])]
            rule = f"has(self.{setting.crd.name}) != has(self.{setting.crd.alternative})"
            assert rule in rules, setting.flag
        else:
            assert (setting.crd.name in required) is setting.crd.required, setting.flag


def test_the_chart_ships_the_crd_built_from_the_declarations():
    assert chartgen.stale_files(chartgen.DEFAULT_CHART) == []


def test_the_pods_ports_are_the_flags_defaults():
    assert names.API_PORT == BY_FLAG["port"].default
    assert names.METRICS_PORTS == DEFAULT_METRICS_PORTS


def test_the_config_map_holds_the_crd_settings_of_each_stage():
    for stage in ("api", "tokenizer", "scheduler", "detokenizer"):
        keys = {*config.STAGE_SETTINGS["common"], *config.STAGE_SETTINGS[stage]}
        assert keys == {s.env for s in settings_of(stage) if s.crd}, stage
    parsed = spec.parse(OWNER.name, EVERYTHING, default_image="tokenline:test")
    data = config.config_map_data(parsed)
    assert set(data) == {s.env for s in SETTINGS if s.crd}


@pytest.mark.parametrize("body", [{"model": {"name": "tiny"}}, EVERYTHING])
def test_each_container_gets_only_settings_its_stage_takes(body):
    parsed = spec.parse(OWNER.name, body, default_image="tokenline:test")
    pod_spec = pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]
    for container in pod_spec["containers"]:
        stage = container["args"][0]
        for item in container["env"]:
            name = item["name"]
            if name.startswith("TOKENLINE_"):
                assert name in BY_ENV, f"{stage}: {name} is not a declared setting"
                assert stage in BY_ENV[name].stages, f"{stage} does not take {name}"
        for arg in container["args"][1:]:
            if arg.startswith("--"):
                assert stage in BY_ENV["TOKENLINE_" + arg[2:].upper().replace("-", "_")].stages
