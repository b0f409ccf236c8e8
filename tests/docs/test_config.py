"""Config precedence, validation and `kvcm config show`."""

from __future__ import annotations

import pytest

from kvcm.cli import main
from kvcm.config import ConfigError, load, overrides_from_pairs, to_toml


def test_defaults():
    cfg = load(environ={})
    assert cfg.server.endpoint == "tcp://127.0.0.1:6381"
    assert cfg.store.data_dir == "./kvcm-data" and cfg.store.sync is True
    assert cfg.http.port == 6382


def test_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "kvcm.toml"
    path.write_text('[server]\nendpoint = "ipc:///tmp/a"\nmax_keys = 10\n[store]\nsync = false\n')
    cfg = load(str(path), environ={})
    assert (cfg.server.endpoint, cfg.server.max_keys, cfg.store.sync) == ("ipc:///tmp/a", 10, False)
    cfg = load(str(path), environ={"KVCM_SERVER_MAX_KEYS": "20"})
    assert cfg.server.max_keys == 20 and cfg.server.endpoint == "ipc:///tmp/a"
    cfg = load(str(path), environ={"KVCM_SERVER_MAX_KEYS": "20"}, overrides=overrides_from_pairs(["server.max_keys=30"]))
    assert cfg.server.max_keys == 30


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[server]\nendpiont = 'x'\n", "server.endpiont"),
        ("[sever]\nendpoint = 'x'\n", "sever"),
        ("[server]\nmax_keys = 'many'\n", "server.max_keys"),
        ("[store]\nlock_shards = 3\n", "store.lock_shards"),
        ("[store]\nsync = 'perhaps'\n", "store.sync"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load(str(path), environ={})


def test_unknown_env_variable_fails():
    with pytest.raises(ConfigError, match="KVCM_SERVER_NOPE"):
        load(environ={"KVCM_SERVER_NOPE": "1"})
    with pytest.raises(ConfigError, match="KVCM_BOGUS"):
        load(environ={"KVCM_BOGUS": "1"})


def test_list_settings_from_env():
    cfg = load(environ={"KVCM_EVENTS_SOURCES": '[{"source_id": "a"}]'})
    assert cfg.events.sources == ('{"source_id": "a"}',)


def test_toml_roundtrip(tmp_path):
    cfg = load(environ={}, overrides={"server": {"max_keys": "7"}})
    path = tmp_path / "out.toml"
    path.write_text(to_toml(cfg))
    assert load(str(path), environ={}) == cfg


def test_config_show_cli(capsys, monkeypatch):
    monkeypatch.setenv("KVCM_STORE_DATA_DIR", "/srv/kvcm")
    assert main(["config", "show", "--set", "server.max_keys=5"]) == 0
    out = capsys.readouterr().out
    assert 'data_dir = "/srv/kvcm"' in out and "max_keys = 5" in out


def test_config_error_exit_code(capsys):
    assert main(["config", "show", "--set", "server.nope=1"]) == 2
    assert "server.nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    "pair, needle",
    [
        ("store.map_size=1024", "store.map_size"),
        ("server.poll_ms=0", "server.poll_ms"),
        ("http.max_connections=0", "http.max_connections"),
        ("cache.lost_scan_s=-1", "cache.lost_scan_s"),
        ("reclaim.duty_cycle=2", "reclaim.duty_cycle"),
        ("auth.max_pending_checks=0", "auth.max_pending_checks"),
        ("auth.failed_login_window_s=0", "auth.failed_login_window_s"),
        ("events.probe_interval_s=0", "events.probe_interval_s"),
        ("events.push_budget_ms_per_s=0", "events.push_budget_ms_per_s"),
        ("server.hash_kernel=c", "server.hash_kernel"),
        ("log.level=chatty", "log.level"),
    ],
)
def test_every_section_of_checks_is_applied(pair, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load(environ={}, overrides=overrides_from_pairs([pair]))
