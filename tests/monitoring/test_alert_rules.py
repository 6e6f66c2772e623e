"""The alert rules pass `promtool check rules`, and `promtool test rules` exercises every alert:
each one fires when it should, stays quiet while pending, and the unit tests notice when an
alert is broken."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from monitoring_support import ALERTS_FILE

UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")


def alert_rules() -> list[dict]:
    return [
        rule
        for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules(promtool: str):
    proc = run(promtool, "check", "rules", str(ALERTS_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


def test_promtool_test_rules(promtool: str):
    proc = run(promtool, "test", "rules", str(UNIT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_issue_alerts_exist():
    names = {rule["alert"] for rule in alert_rules()}
    assert names == {
        "TokenlineLeakedUids",
        "TokenlineStageDown",
        "TokenlineTimeToFirstTokenHigh",
        "TokenlineErrorRatioHigh",
        "TokenlineKVCacheSaturated",
        "TokenlineWaitingQueueGrowing",
        "TokenlineKVTransferFailing",
    }
    leaked = next(rule for rule in alert_rules() if rule["alert"] == "TokenlineLeakedUids")
    assert leaked["for"] == "5m"
    assert "up{" in next(r["expr"] for r in alert_rules() if r["alert"] == "TokenlineStageDown")


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    for rule in alert_rules():
        assert True in cases.get(rule["alert"], []), f"{rule['alert']}: no firing case"
        assert False in cases.get(rule["alert"], []), f"{rule['alert']}: no quiet case"


def _mutated(tmp_path: Path, alert: str, change: dict[str, str]) -> Path:
    """A copy of the unit tests and of the rules, in the same layout, with one rule changed."""
    rules = yaml.safe_load(ALERTS_FILE.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule.update(change)
    rules_copy = tmp_path / ALERTS_FILE.relative_to(ALERTS_FILE.parents[3])
    rules_copy.parent.mkdir(parents=True)
    rules_copy.write_text(yaml.safe_dump(rules, sort_keys=False))
    tests_copy = tmp_path / "tests" / "monitoring" / UNIT_TESTS.name
    tests_copy.parent.mkdir(parents=True)
    tests_copy.write_text(UNIT_TESTS.read_text())
    return tests_copy


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alert_rules()])
@pytest.mark.parametrize(
    "change",
    [{"expr": "vector(1) == 0"}, {"for": "0s"}],
    ids=["never-fires", "fires-without-waiting"],
)
def test_unit_tests_catch_a_broken_alert(promtool: str, tmp_path: Path, alert: str, change: dict):
    proc = run(promtool, "test", "rules", str(_mutated(tmp_path, alert, change)))
    assert proc.returncode != 0, f"{alert} with {change} still passes its unit tests"
    assert alert in proc.stdout + proc.stderr
