"""API keys: every route the OpenAPI schema lists, with no key, a wrong key and a right key;
the key file's rotation; the flags; and no key in any log line (in-process, no stack)."""

from __future__ import annotations

import logging
import os

import pytest
from api_testkit import ADMITTED, app_with, client_for

from tokenline.api.http.auth import OPEN_PATHS, ApiKeys, KeyFileError, parse_key_file
from tokenline.cli import build_parser, settings_from
from tokenline.serve import SecretError, stage_argv, stage_env

KEY = "sk-right-0123456789"
OTHER_KEY = "sk-second-key"
WRONG = "sk-wrong-0123456789"


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every operation FastAPI publishes, plus the schema itself."""
    found = [("GET", "/openapi.json")]
    for path, operations in app.openapi()["paths"].items():
        found += [(method.upper(), path) for method in operations]
    return found


@pytest.fixture
def keyed():
    app, _ = app_with(api_keys=[KEY, OTHER_KEY])
    return app, client_for(app)


def _call(client, method: str, path: str, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"json": {}} if method == "POST" else {}
    return client.request(method, path, headers=headers, **body)


def test_the_schema_lists_the_openai_routes(keyed):
    app, _ = keyed
    paths = {path for _, path in _routes(app)}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= paths
    assert OPEN_PATHS <= paths


@pytest.mark.parametrize("key", [None, WRONG, "", KEY + "x", KEY[:-1]])
def test_every_route_but_the_probes_refuses_a_missing_or_wrong_key(keyed, key):
    app, client = keyed
    for method, path in _routes(app):
        response = _call(client, method, path, key)
        if path in OPEN_PATHS:
            assert response.status_code != 401, (method, path)
            continue
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
        assert KEY not in response.text and (not key or key not in response.text)


@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
def test_every_route_serves_a_right_key(keyed, key):
    app, client = keyed
    for method, path in _routes(app):
        response = _call(client, method, path, key)
        assert response.status_code != 401, (method, path)
        assert response.status_code < 500, (method, path, response.text)
    models = _call(client, "GET", "/v1/models", key).json()
    assert models["data"][0]["id"] == "tiny"


def test_the_bearer_scheme_is_case_insensitive_and_other_schemes_are_refused(keyed):
    _, client = keyed
    assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    for header in (f"Basic {KEY}", KEY, "Bearer", "Bearer  "):
        response = client.get("/v1/models", headers={"Authorization": header})
        assert response.status_code == 401, header


def test_without_keys_every_route_is_open():
    app, _ = app_with()
    client = client_for(app)
    assert client.get("/v1/models").status_code == 200
    assert client.get("/openapi.json").status_code == 200


def test_a_refused_request_never_reaches_admission(keyed):
    app, client = keyed
    body = {"model": "tiny", "prompt": "x"}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert app.state.ring_client.opened == []
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == ADMITTED


def test_no_key_appears_in_any_log_line(tmp_path, caplog):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated by hand\n{KEY}\n")
    caplog.set_level(logging.DEBUG)
    app, _ = app_with(api_keys=[OTHER_KEY], api_key_file=str(key_file))
    client = client_for(app)
    for key in (None, WRONG, KEY, OTHER_KEY):
        _call(client, "GET", "/v1/models", key)
    clock = Clock()
    keys = ApiKeys([OTHER_KEY], str(key_file), clock=clock)
    key_file.unlink()
    clock.now += 2
    assert keys.accepts(KEY)
    text = caplog.text
    assert "1 API key(s) in force" in text and "keeping its last 1 key(s)" in text
    for secret in (KEY, OTHER_KEY, WRONG):
        assert secret not in text


# ── the key file ───────────────────────────────────────────────────────────────────────────────
def test_key_file_lines():
    assert parse_key_file("a\n\n  # note\n  b  \n#c\r\nd\r\n") == ["a", "b", "d"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _secret_volume(root, keys: list[str], version: int) -> None:
    """Write keys the way kubelet updates a Secret volume: a new timestamped directory, then
    one atomic rename of the ``..data`` symlink; ``api-keys`` links through ``..data``."""
    version_dir = root / f"..v{version}"
    version_dir.mkdir()
    (version_dir / "api-keys").write_text("\n".join(keys) + "\n")
    tmp_link = root / "..data_tmp"
    tmp_link.symlink_to(version_dir.name)
    os.replace(tmp_link, root / "..data")
    if not (root / "api-keys").is_symlink():
        (root / "api-keys").symlink_to("..data/api-keys")


def test_a_rotated_secret_takes_effect_without_a_restart(tmp_path):
    _secret_volume(tmp_path, ["sk-old"], 1)
    clock = Clock()
    keys = ApiKeys([], str(tmp_path / "api-keys"), clock=clock)
    assert keys.accepts("sk-old") and not keys.accepts("sk-new")
    _secret_volume(tmp_path, ["sk-new"], 2)
    clock.now += 0.5  # checked at most once a second
    assert keys.accepts("sk-old")
    clock.now += 1.0
    assert keys.accepts("sk-new") and not keys.accepts("sk-old")


def test_an_edit_in_place_of_the_same_size_is_seen(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-aaaa\n")
    clock = Clock()
    keys = ApiKeys([], str(path), clock=clock)
    stat = path.stat()
    path.write_text("sk-bbbb\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    clock.now += 2
    assert keys.accepts("sk-bbbb") and not keys.accepts("sk-aaaa")


def test_a_vanished_key_file_keeps_its_last_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-kept\n")
    clock = Clock()
    keys = ApiKeys(["sk-fixed"], str(path), clock=clock)
    path.unlink()
    clock.now += 2
    assert keys.accepts("sk-kept") and keys.accepts("sk-fixed")


def test_an_empty_key_file_locks_everyone_out(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# no keys yet\n")
    keys = ApiKeys([], str(path))
    assert keys.enabled and not keys.accepts("") and not keys.accepts("anything")


def test_an_unreadable_key_file_stops_startup(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read the API key file"):
        ApiKeys([], str(tmp_path / "absent"))


# ── flags ──────────────────────────────────────────────────────────────────────────────────────
def _settings(argv: list[str]):
    return settings_from(build_parser().parse_args(argv))


def test_api_key_flags_and_their_environment_mirror(monkeypatch):
    assert _settings(["api"]).api_keys == []
    assert _settings(["api", "--api-key", "a", "--api-key", "b"]).api_keys == ["a", "b"]
    monkeypatch.setenv("TOKENLINE_API_KEY", "x, y,,")
    monkeypatch.setenv("TOKENLINE_API_KEY_FILE", "/secrets/keys")
    assert _settings(["api"]).api_keys == ["x", "y"]
    assert _settings(["api"]).api_key_file == "/secrets/keys"
    assert _settings(["api", "--api-key", "z"]).api_keys == ["z"]  # the flag wins


def test_keys_are_not_in_the_settings_repr():
    assert KEY not in repr(_settings(["api", "--api-key", KEY]))


def test_serve_hands_keys_and_limits_to_the_api_only(monkeypatch):
    settings = _settings(
        [
            "serve",
            "--api-key",
            KEY,
            "--api-key",
            OTHER_KEY,
            "--api-key-file",
            "/k",
            "--max-n",
            "4",
            "--max-body-size",
            "1MiB",
        ]
    )
    api = stage_argv("api", settings)
    assert "--api-key" not in api and not any(KEY in a or OTHER_KEY in a for a in api)
    assert api[api.index("--api-key-file") + 1] == "/k"
    assert stage_env("api", settings) == {"TOKENLINE_API_KEY": f"{KEY},{OTHER_KEY}"}
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        assert KEY not in " ".join(stage_argv(stage, settings))
        assert stage_env(stage, settings) == {}
    for name, value in stage_env("api", settings).items():  # as the child starts
        monkeypatch.setenv(name, value)
    parsed = _settings(api[api.index("api") :])
    assert parsed.api_keys == [KEY, OTHER_KEY] and parsed.api_key_file == "/k"
    assert parsed.max_n == 4 and parsed.max_body_size == 2**20


@pytest.mark.parametrize("key", ["a,b", " padded", "trailing\t"])
def test_serve_refuses_a_key_its_children_would_read_as_other_keys(key):
    settings = _settings(["serve", "--api-key", key])
    with pytest.raises(SecretError, match="--api-key-file"):
        stage_env("api", settings)
