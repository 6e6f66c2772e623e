"""--trust-remote-code is accepted, and no model's own code is ever run: a model that needs it
is refused at start, naming its architecture and the families tokenline runs, never with a
traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from tokenline.model_source import NATIVE_ARCHITECTURES, own_code_refusal, resolve
from tokenline.settings.vllm_flags import translate

CUSTOM = {
    "architectures": ["InternLM2ForCausalLM"],
    "model_type": "internlm2",
    "auto_map": {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
    },
}


def _model_dir(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    # the code it asks for: were it run, it would say so
    (tmp_path / "configuration_internlm2.py").write_text("raise SystemExit('REMOTE CODE RAN')\n")
    return str(tmp_path)


def test_the_families_named_are_those_the_scheduler_runs():
    from tokenline.scheduler.models import NATIVE

    assert tuple(sorted(NATIVE)) == NATIVE_ARCHITECTURES


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (CUSTOM, "InternLM2ForCausalLM (model_type 'internlm2') needs the model's own code"),
        # a known model_type whose checkpoint names its own class
        ({**CUSTOM, "model_type": "llama"}, "InternLM2ForCausalLM (model_type 'llama') needs"),
        ({"architectures": ["FooLM"], "model_type": "foo"}, "not a model transformers"),
    ],
)
def test_a_model_that_needs_its_own_code_is_refused_naming_what_runs(tmp_path, config, says):
    source = resolve(_model_dir(tmp_path, config))
    for load in (source.load_config, source.load_tokenizer):
        with pytest.raises(SystemExit) as refused:
            load()
        message = str(refused.value)
        assert says in message
        assert all(family in message for family in NATIVE_ARCHITECTURES)


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        # a leftover auto_map beside a class transformers has (Phi-3's checkpoints carry one)
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "auto_map": {"A": "b.C"}},
        {"model_type": "qwen2"},  # no architectures: the model_type's own class
    ],
)
def test_models_transformers_or_tokenline_has_modules_for_are_not_refused(config):
    assert own_code_refusal(config) is None


def test_a_model_without_architectures_still_loads(tmp_path):
    LlamaConfig(num_hidden_layers=2, max_position_embeddings=512).save_pretrained(tmp_path)
    assert resolve(str(tmp_path)).max_model_len() == 512


def test_a_stage_started_with_trust_remote_code_stops_with_the_reason_not_a_traceback(tmp_path):
    model = _model_dir(tmp_path, CUSTOM)
    argv, said = translate(["tokenizer", "--model", model, "--trust-remote-code"])
    assert argv == ["tokenizer", "--model", model]  # accepted: it changes nothing
    assert "no model's own code is ever run" in said[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    endpoints = []
    for stage in ("api", "tokenizer", "scheduler", "detokenizer"):
        endpoints += [f"--{stage}-endpoint", f"ipc://{tmp_path}/{stage}.sock"]
    argv = [sys.executable, "-m", "tokenline.cli", "tokenizer", "--model", model]
    done = subprocess.run(
        [*argv, "--trust-remote-code", "--metrics-port", "0", *endpoints],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "REMOTE CODE RAN" not in done.stderr
    assert "InternLM2ForCausalLM (model_type 'internlm2') needs the model's own code" in done.stderr
