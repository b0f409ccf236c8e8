"""The pytest plugin as a user's suite sees it: the installed ``kvcm`` entry point, the ``kvcm``
marker (with ``--strict-markers``) and ``kvcm_server_factory``, run by pytester in a fresh session."""

from __future__ import annotations

import json
import os

pytest_plugins = ["pytester"]


def test_marker_configures_the_server_and_is_registered(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.kvcm(overrides={"cache": {"write_timeout_seconds": 7}}, http=False)
        def test_configured(kvcm_server):
            assert kvcm_server.http_port is None
            assert kvcm_server.app.config.cache.write_timeout_seconds == 7
            with kvcm_server.client() as kv:
                assert kv.call("check_health")["status"] == "ok"

        def test_default(kvcm_server):
            assert isinstance(kvcm_server.http_port, int)
            assert kvcm_server.app.config.cache.write_timeout_seconds != 7
        """
    )
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=2)


def test_marker_is_listed_in_markers(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.kvcm(overrides=None, http=True)*"])


def test_factory_starts_configured_servers_and_stops_them_at_teardown(pytester, tmp_path):
    record = tmp_path / "servers.json"
    pytester.makepyfile(
        f"""
        import json

        def test_two(kvcm_server_factory):
            a = kvcm_server_factory(overrides={{"reclaim": {{"enabled": False}}}})
            b = kvcm_server_factory(http=False)
            assert a.endpoint != b.endpoint and a.data_dir != b.data_dir
            assert a.app.reclaimer is None and b.app.reclaimer is not None
            assert isinstance(a.http_port, int) and b.http_port is None
            for server in (a, b):
                with server.client() as kv:
                    assert kv.call("check_health")["status"] == "ok"
            with open({str(record)!r}, "w") as fh:
                json.dump([s.endpoint for s in (a, b)], fh)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    endpoints = json.loads(record.read_text())
    for endpoint in endpoints:  # a clean stop removes the ipc socket
        assert endpoint.startswith("ipc://")
        assert not os.path.exists(endpoint.removeprefix("ipc://")), endpoint


def test_bad_options_fail_the_test_with_one_line(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.kvcm(overides={"cache": {}})
        def test_typo(kvcm_server):
            pass

        @pytest.mark.kvcm(http="no")
        def test_http_not_bool(kvcm_server):
            pass

        @pytest.mark.kvcm(overrides={"cache": 5})
        def test_section_not_a_map(kvcm_server):
            pass

        def test_factory_unknown_key(kvcm_server_factory):
            kvcm_server_factory(overrides={"cache": {"no_such_key": 1}})

        @pytest.mark.kvcm(overrides={"reclaim": {"interval_s": "fast"}})
        def test_marker_bad_value(kvcm_server):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=4, failed=1)
    out = result.stdout.str()
    for line in ("@pytest.mark.kvcm: unknown option(s) overides (valid: overrides, http)",
                 "@pytest.mark.kvcm: http must be True or False, got 'no'",
                 "@pytest.mark.kvcm: overrides['cache'] must map config keys to values, got 5",
                 "kvcm server config: unknown config key cache.no_such_key",
                 "kvcm server config: reclaim.interval_s"):
        assert line in out, line
    assert "kvcm/config.py" not in out  # the user's mistake, not a traceback into kvcm
