"""Stage flags reach Settings from the command line and from their TOKENLINE_* mirrors, and
`serve` hands the scheduler's flags on to the scheduler process."""

from __future__ import annotations

import re

import pytest

from tokenline.cli import build_parser, main, settings_from
from tokenline.serve import stage_argv
from tokenline.settings.vllm_flags import VLLM_FLAGS, translate


def _settings(argv: list[str]):
    return settings_from(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["scheduler"], False),
        (["scheduler", "--compile"], True),
        (["scheduler", "--compile", "false"], False),
        (["serve", "--compile", "yes"], True),
    ],
)
def test_compile_flag(argv, expected):
    assert _settings(argv).compile is expected


def test_compile_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENLINE_COMPILE", "1")
    assert _settings(["scheduler"]).compile is True


def test_a_bad_boolean_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--compile", "maybe"])
    assert "'maybe' is not a boolean" in capsys.readouterr().err


def test_serve_passes_compile_to_the_scheduler_only():
    settings = _settings(["serve", "--compile"])
    assert "--compile" in stage_argv("scheduler", settings)
    assert "--compile" not in stage_argv("api", settings)
    assert "--compile" not in stage_argv("scheduler", _settings(["serve"]))
    # and the scheduler's own parser reads what serve wrote
    argv = stage_argv("scheduler", settings)
    assert _settings(argv[argv.index("scheduler") :]).compile is True


def test_lora_modules_take_several_values_after_one_flag_as_vllm_does():
    argv = ["scheduler", "--lora-modules", "a=/p/a", "b=/p/b", "--lora-modules", "c=s3://x/c"]
    assert _settings(argv).lora_modules == ["a=/p/a", "b=/p/b", "c=s3://x/c"]
    json_form = '{"name": "d", "path": "/p/d", "base_model_name": "tiny"}'
    assert _settings(["serve", "--lora-modules", json_form]).lora_modules == [json_form]
    # serve hands each on to the scheduler, which parses them back the same
    settings = _settings(["serve", "--lora-modules", "a=/p/a", "b=/p/b"])
    argv = stage_argv("scheduler", settings)
    assert _settings(argv[argv.index("scheduler") :]).lora_modules == ["a=/p/a", "b=/p/b"]


def test_a_lora_module_reads_in_either_of_vllm_s_forms():
    from tokenline.scheduler.start import lora_module

    assert lora_module("a=/p/a", "tiny") == ("a", "/p/a")
    assert lora_module('{"name": "b", "path": "hf://o/b", "base_model_name": "tiny"}', "tiny") == (
        "b",
        "hf://o/b",
    )
    for bad, says in [
        ("nameonly", "expected NAME=PATH_OR_URI"),
        ('{"name": "b"}', "expected NAME=PATH_OR_URI"),
        ('{"name": "b", "path": "/p", "rank": 8}', "unknown keys"),
        ('{"name": "b", "path": "/p", "base_model_name": "other"}', "not the served model"),
        ("{broken", "not JSON"),
    ]:
        with pytest.raises(SystemExit, match=says):
            lora_module(bad, "tiny")


def test_serve_takes_the_model_as_vllm_serve_does():
    assert _settings(["serve", "/models/qwen3"]).model == "/models/qwen3"
    assert _settings(["serve", "/models/qwen3", "--port", "9000"]).port == 9000
    assert _settings(["serve", "m", "--model", "m"]).model == "m"
    with pytest.raises(SystemExit, match="name the model once"):
        _settings(["serve", "a", "--model", "b"])
    assert _settings(["serve"]).model == "tiny"


@pytest.mark.parametrize("flag", sorted(VLLM_FLAGS))
def test_every_vllm_flag_in_the_table_is_read_or_refused_with_what_to_use(flag):
    entry = VLLM_FLAGS[flag]
    argv = ["serve", "m", flag, *(["x"] if entry.takes_value else []), "--port", "9001"]
    if entry.refused:
        with pytest.raises(SystemExit, match="not served by tokenline"):
            translate(argv)
        return
    translated, said = translate(argv)
    settings = _settings(translated)
    assert settings.port == 9001 and settings.model == "m"  # the rest of the line is intact
    assert said == ([f"{flag}: accepted; {entry.note}"] if entry.note else [])


def test_vllm_flags_mean_what_vllm_means():
    no_cache, _ = translate(["serve", "--no-enable-prefix-caching"])
    assert _settings(no_cache).no_prefix_caching
    assert _settings(translate(["serve", "--enable-log-requests"])[0]).log_level == "debug"
    assert not _settings(translate(["serve", "--enable-prefix-caching"])[0]).no_prefix_caching
    with pytest.raises(SystemExit, match="--chat-template"):
        translate(["serve", "--tokenizer=/p/tok"])  # the inline form, refused the same


def test_the_readme_maps_every_vllm_flag_the_table_reads():
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert all(f"| `{flag}` |" in readme for flag in VLLM_FLAGS)


def test_the_help_names_every_command_tokenline_runs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    choices = re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out).group(1)
    assert set(choices.split(",")) == {
        "serve", "api", "tokenizer", "scheduler", "detokenizer",
        "operator", "bench", "fetch", "tiny-model", "ring-keys",
    }  # fmt: skip


def test_a_command_with_flags_of_its_own_shows_its_own_help(capsys):
    with pytest.raises(SystemExit):
        main(["fetch", "--help"])
    assert "usage: tokenline fetch" in capsys.readouterr().out
