"""An instance removed and registered again before the deleter purged its old blocks: the purge
takes the whole namespace, so the new instance's data plane waits for it (a retryable
SERVICE_NOT_READY) rather than writing blocks the purge would take too."""

from __future__ import annotations

import pytest

from kvcm.testing import serve_in_thread

SPECS = [{"name": "tp0", "size": 4096}]



def test_a_block_written_after_a_re_registration_survives_the_old_instances_purge(tmp_path):
    """Removing an instance queues a purge of its namespace for the deleter; an instance of the
    same id registered before that purge ran must not have its new blocks purged with the old."""
    from kvcm.errors import Code, Unavailable

    instance = {"instance_group": "default", "instance_id": "again", "block_size": 16, "location_spec_infos": SPECS}
    overrides = {"cache": {"delete_poll_ms": 3_600_000}, "reclaim": {"enabled": False}}  # the test runs the deleter
    with serve_in_thread(data_dir=str(tmp_path / "d"), overrides=overrides) as server, server.client() as c:
        c.call("register_instance", instance)
        _write(c, [1, 2])
        c.call("remove_instance", {"instance_id": "again"})
        c.call("register_instance", instance)
        with pytest.raises(Unavailable) as info:  # until the purge has run
            _write(c, [5])
        assert info.value.code is Code.SERVICE_NOT_READY and "purged" in info.value.message
        server.app.cache.background_once()
        _write(c, [5])
        server.app.cache.background_once()
        found = c.call("get_cache_location", {"instance_id": "again", "query_type": "batch_get",
                                              "block_keys": [1, 2, 5]})["locations"]
        assert [loc["type"] for loc in found] == ["unspecified", "unspecified", "file"]


def _write(c, keys):
    started = c.call("start_write_cache", {"instance_id": "again", "block_keys": keys})
    c.call("finish_write_cache", {"instance_id": "again", "write_session_id": started["write_session_id"],
                                  "success_blocks": {"offset": len(keys)}})
