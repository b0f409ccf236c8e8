"""Bounded in-flight writes: per-instance caps on open write sessions and on bytes in
``writing``, and the cap on the lifetime a request may ask for, against a real server."""

from __future__ import annotations

import os

import pytest
from prometheus_client import generate_latest

from kvcm.config import ConfigError
from kvcm.errors import KvcmError
from kvcm.testing import make_test_config, serve_in_thread
from tests.helpers import add_group, error_code, finish, register, start, wait_for, write

pytestmark = pytest.mark.both_stores

BLOCK = 2048  # two specs of 1024 bytes (helpers.SPECS)
SESSIONS_KEY = "cache.max_open_sessions_per_instance"
BYTES_KEY = "cache.max_writing_bytes_per_instance"


def caps(sessions: int = 100, blocks: int = 1000, **cache: float) -> dict[str, dict[str, float]]:
    return {"cache": {"session_check_ms": 50, "delete_poll_ms": 20, "max_open_sessions_per_instance": sessions,
                      "max_writing_bytes_per_instance": blocks * BLOCK, **cache}}


def refusal(fn, *args, **kwargs) -> KvcmError:
    with pytest.raises(KvcmError) as info:
        fn(*args, **kwargs)
    return info.value


def files_under(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


def test_abandoned_sessions_cannot_starve_another_instance_of_the_group():
    # A 20-block quota shared by two instances; "greedy" starts 3-block writes and never finishes.
    with serve_in_thread(overrides=caps(sessions=3)) as srv, srv.client() as c:
        add_group(c, "g", ["default-file"], capacity=20 * BLOCK)
        register(c, "greedy", group="g")
        register(c, "polite", group="g")
        refused = None
        for n in range(10):  # without the cap all 10 would start and take the whole quota
            try:
                start(c, [100 + 3 * n, 101 + 3 * n, 102 + 3 * n], "greedy", write_timeout_seconds=600)
            except KvcmError as exc:
                refused = exc
                break
        assert refused is not None and n == 3, "the 4th open session must be refused"
        assert refused.code.name == "QUOTA_EXCEEDED" and SESSIONS_KEY in str(refused)
        # 9 blocks held in writing; the rest of the quota is still the other instance's to use
        write(c, list(range(1, 12)), "polite")
        assert srv.app.cache.usage("g")["by_instance"]["polite"]["bytes"] == 11 * BLOCK
        srv.app.cache.check()


def test_bytes_cap_refuses_and_names_its_key():
    with serve_in_thread(overrides=caps(blocks=5)) as srv, srv.client() as c:
        register(c, "a")
        start(c, [1, 2, 3], "a")
        exc = refusal(start, c, [4, 5, 6], "a")
        assert exc.code.name == "QUOTA_EXCEEDED" and BYTES_KEY in str(exc)
        start(c, [4, 5], "a")  # exactly up to the cap is fine
        assert error_code(start, c, [6], "a") == "QUOTA_EXCEEDED"
        assert srv.app.cache.inflight.of("a") == (2, 5 * BLOCK)
        text = generate_latest(srv.app.metrics.registry).decode()
        assert f'kvcm_writing_bytes{{instance="a"}} {5.0 * BLOCK}' in text
        assert 'kvcm_write_sessions_open{instance="a"} 2.0' in text
        assert f'kvcm_write_refused_total{{cap="{BYTES_KEY}"}} 2.0' in text


def test_refusal_allocates_nothing():
    with serve_in_thread(overrides=caps(sessions=2)) as srv, srv.client() as c:
        add_group(c, "g", ["default-file"], capacity=4 * BLOCK)
        register(c, "a", group="g")
        start(c, [1, 2], "a")
        start(c, [3, 4], "a")
        usage, files = srv.app.cache.usage("g"), files_under(srv.data_dir)
        sessions = len(srv.app.cache.sessions)
        # the group is full too: the cap answers first, so no allocation was even tried
        assert SESSIONS_KEY in str(refusal(start, c, [5, 6, 7], "a"))
        assert error_code(start, c, [1, 2], "a") == "QUOTA_EXCEEDED"  # even one with nothing new
        assert srv.app.cache.usage("g") == usage
        assert files_under(srv.data_dir) == files
        assert len(srv.app.cache.sessions) == sessions
        meta = c.call("get_cache_meta", {"instance_id": "a", "block_keys": [5, 6, 7]})
        assert "writing" not in str(meta)  # no record was written for the refused keys
        srv.app.cache.check()


def test_finish_expiry_and_remove_release():
    with serve_in_thread(overrides=caps(sessions=2, blocks=4)) as srv, srv.client() as c:
        register(c, "a")
        kept = start(c, [1, 2], "a")
        start(c, [3, 4], "a", write_timeout_seconds=0.3)
        assert error_code(start, c, [5], "a") == "QUOTA_EXCEEDED"
        finish(c, kept, instance="a")
        assert srv.app.cache.inflight.of("a") == (1, 2 * BLOCK)
        wait_for(lambda: srv.app.cache.inflight.of("a") == (0, 0))
        assert srv.app.cache.inflight.of("a") == (0, 0)  # the short session expired
        # removing a writing copy frees its bytes now; its session stays open until finished
        doomed = start(c, [5, 6, 7, 8], "a")
        c.call("remove_cache", {"instance_id": "a", "block_keys": [5, 6]})
        assert srv.app.cache.inflight.of("a") == (1, 2 * BLOCK)
        start(c, [9, 10], "a")
        finish(c, doomed, instance="a")
        assert srv.app.cache.inflight.of("a") == (1, 2 * BLOCK)
        wait_for(lambda: srv.app.cache.deleter.pending() == 0)  # check() wants a quiet server
        srv.app.cache.check()


def test_counts_are_recovered_after_a_restart(tmp_path):
    data = str(tmp_path / "data")
    with serve_in_thread(data_dir=data, overrides=caps(sessions=3, blocks=6)) as srv, srv.client() as c:
        register(c, "a")
        register(c, "b")
        first = start(c, [1, 2], "a")
        start(c, [3, 4], "a")
        start(c, [5], "b")
        write(c, [6, 7], "a")  # finished: holds nothing
        before = srv.app.cache.inflight.snapshot()
    assert before == {"a": [2, 4 * BLOCK], "b": [1, BLOCK]}
    with serve_in_thread(data_dir=data, overrides=caps(sessions=3, blocks=6)) as srv, srv.client() as c:
        assert srv.app.cache.inflight.snapshot() == before
        srv.app.cache.check()
        assert error_code(start, c, [8, 9, 10], "a") == "QUOTA_EXCEEDED"  # 4 + 3 blocks > 6
        finish(c, first, instance="a")
        assert srv.app.cache.inflight.of("a") == (1, 2 * BLOCK)
        start(c, [8, 9, 10], "a")
        srv.app.cache.check()


def test_lifetime_past_the_cap_is_refused():
    with serve_in_thread(overrides=caps(max_write_timeout_seconds=60)) as srv, srv.client() as c:
        register(c, "a")
        exc = refusal(start, c, [1], "a", write_timeout_seconds=61)
        assert exc.code.name == "INVALID_ARGUMENT" and "cache.max_write_timeout_seconds" in str(exc)
        assert srv.app.cache.inflight.of("a") == (0, 0)
        session = start(c, [1], "a", write_timeout_seconds=60)
        with srv.app.cache.store.read() as view:
            assert srv.app.cache.sessions.get(view, session["write_session_id"]).timeout == 60
        start(c, [2], "a")  # 0 / missing: the default lifetime


def test_default_lifetime_cap_and_config_checks(tmp_path):
    with serve_in_thread(overrides=caps()) as srv, srv.client() as c:
        register(c, "a")
        assert error_code(start, c, [1], "a", write_timeout_seconds=7 * 86400) == "INVALID_ARGUMENT"
        start(c, [1], "a", write_timeout_seconds=600)
    endpoint = f"ipc://{tmp_path}/rpc"
    bad = [{"write_timeout_seconds": 60, "max_write_timeout_seconds": 30},
           {"max_write_timeout_seconds": 8 * 86400},
           {"max_open_sessions_per_instance": 0},
           {"max_writing_bytes_per_instance": 0}]
    for cache in bad:
        with pytest.raises(ConfigError):
            make_test_config(str(tmp_path), endpoint, {"cache": cache})


def test_a_start_that_never_commits_holds_nothing():
    # The start joins an outer transaction that then fails: its holds must be undone with it
    # (the server is idle meanwhile, so this thread may drive the manager directly).
    with serve_in_thread(overrides=caps(sessions=1)) as srv, srv.client() as c:
        register(c, "a")
        cache = srv.app.cache
        with pytest.raises(RuntimeError), cache.store.write() as _txn:
            cache.start_write_cache("a", [1, 2], None)
            assert cache.inflight.of("a") == (1, 2 * BLOCK)  # counted before the commit ...
            raise RuntimeError("group aborts")
        assert cache.inflight.of("a") == (0, 0)  # ... and uncounted when it never comes
        start(c, [1, 2], "a")
        cache.check()
