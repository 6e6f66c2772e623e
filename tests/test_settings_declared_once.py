"""Each setting is declared once, in `tokenline.settings.SETTINGS`; every surface that repeats
it (the `Settings` fields, each stage's parser, `serve`'s stage command lines) must agree."""

from __future__ import annotations

import argparse
import dataclasses
import os
from unittest import mock

import pytest

from tokenline.cli import build_parser, settings_from
from tokenline.serve import stage_argv, stage_env
from tokenline.settings import BY_FLAG, SETTINGS, Settings, settings_of
from tokenline.transport import RingEndpoints

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")
#: flags of a command that are not settings (they never reach `Settings`)
NOT_SETTINGS = {"serve": {"--ipc-dir"}}


@pytest.fixture(autouse=True)
def _no_mirrors():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        yield


def _subparser(command: str) -> argparse.ArgumentParser:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.option_strings[0]: a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


def test_the_declarations_are_unique():
    assert len(BY_FLAG) == len(SETTINGS)
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)


def test_every_settings_field_is_declared_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert set(fields) == {s.field_name for s in SETTINGS}
    defaults = Settings()
    for setting in SETTINGS:
        if setting.stage_defaults is not None:
            continue  # each stage's own default; Settings keeps "none" (0) for the api
        expected = [] if setting.repeatable else setting.default
        assert setting.value(defaults) == expected, setting.flag


@pytest.mark.parametrize("command", [*STAGES, "serve"])
def test_each_parser_has_exactly_its_declared_flags(command):
    flags = _flags(_subparser(command))
    declared = {f"--{s.flag}": s for s in settings_of(command)}
    assert set(flags) - NOT_SETTINGS.get(command, set()) == set(declared)
    for name, setting in declared.items():
        action = flags[name]
        default = setting.default
        if setting.stage_defaults is not None:
            default = setting.stage_defaults[command]
        assert action.default == ([] if setting.repeatable else default), name
        assert setting.env in action.help, name
        assert action.choices == (list(setting.choices) if setting.choices else None), name


# settings whose text has a form of its own, by their kind: a value of that form
TEXT_SAMPLES = {
    "SpeculativeConfigText": '{"method": "ngram", "num_speculative_tokens": 3}',
    "TenantWeightsText": "team-a=1,team-b=3",
    "PoolerConfigText": '{"pooling_type": "MEAN", "normalize": false}',
    "KVTransferConfigText": '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
}


@pytest.mark.parametrize("command", [*STAGES, "serve"])
def test_each_mirror_reaches_settings(command):
    # a value unlike any default for every declared setting, through the environment only
    samples = {
        int: "7",
        float: "2.5",
        "parse_bytes": "1KiB",
        "parse_bool": "true",
        "parse_sizes": "1,2,64",
        **TEXT_SAMPLES,
    }
    for setting in settings_of(command):
        raw = samples.get(setting.kind, samples.get(getattr(setting.kind, "__name__", ""), "x"))
        if setting.choices:
            raw = setting.choices[-1]
        with mock.patch.dict(os.environ, {setting.env: raw}):
            parsed = settings_from(build_parser().parse_args([command]))
        expected = [raw] if setting.repeatable else setting.kind(raw)
        assert setting.value(parsed) == expected, setting.flag


def _everything_set() -> Settings:
    """Settings where every optional field has a value, so `serve` has something to pass."""
    values = {}
    for setting in SETTINGS:
        if setting.field_name == "endpoints" or setting.default is not None:
            continue
        if setting.repeatable:
            values[setting.field_name] = ["k1", "k2"]
        elif setting.kind is str:
            values[setting.field_name] = f"/{setting.flag}"
        elif setting.kind.__name__ in TEXT_SAMPLES:  # text of a form, checked when read
            values[setting.field_name] = setting.kind(TEXT_SAMPLES[setting.kind.__name__])
        else:
            values[setting.field_name] = setting.kind("3")
    values["compile"] = values["no_prefix_caching"] = True
    values["endpoints"] = RingEndpoints(**{s: f"ipc:///tmp/{s}.sock" for s in STAGES})
    return Settings(**values)


@pytest.mark.parametrize("stage", STAGES)
def test_serve_passes_each_stage_only_flags_it_takes_and_they_round_trip(stage):
    settings = _everything_set()
    argv = stage_argv(stage, settings)
    passed = {a for a in argv if a.startswith("--")}
    taken = {f"--{s.flag}" for s in settings_of(stage)}
    assert passed <= taken, passed - taken
    secrets = stage_env(stage, settings)  # the rest travels in the child's environment
    assert set(secrets) == {s.env for s in settings_of(stage) if s.secret}
    assert not passed & {f"--{s.flag}" for s in SETTINGS if s.secret}
    with mock.patch.dict(os.environ, secrets):
        parsed = settings_from(build_parser().parse_args(argv[argv.index(stage) :]))
    for setting in settings_of(stage):
        if setting.flag == "metrics-port":
            continue  # serve's own: port+1..3
        if setting.serve:
            assert setting.value(parsed) == setting.value(settings), setting.flag
