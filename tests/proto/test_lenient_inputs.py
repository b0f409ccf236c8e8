"""Lenient inputs on the RPC port: a value of the wrong kind is refused naming its path, never
coerced (a null key read as key 0, a URI of a scheme kvcm never hands out accepted)."""

from __future__ import annotations

import pytest

from kvcm.errors import InvalidArgument
from kvcm.testing import serve_in_thread

SPECS = [{"name": "tp0", "size": 4096}]


@pytest.fixture(scope="module")
def kv():
    with serve_in_thread() as server, server.client() as c:
        c.call("register_instance", {"instance_group": "default", "instance_id": "li", "block_size": 16,
                                     "location_spec_infos": SPECS})
        yield c


def test_a_null_block_key_is_refused_not_read_as_zero(kv):
    with pytest.raises(InvalidArgument, match=r"block_keys\[0\]"):
        kv.call("get_cache_location", {"instance_id": "li", "query_type": "prefix_match", "block_keys": [None]})


def test_a_finish_echoing_a_foreign_uri_is_refused_and_the_session_stays_open(kv):
    started = kv.call("start_write_cache", {"instance_id": "li", "block_keys": [11]})
    good = started["locations"][0]
    bad = {**good, "location_specs": [{"name": "tp0", "uri": "gopher://evil/x?blkid=0&size=4096"}]}
    with pytest.raises(InvalidArgument, match=r"locations\[0\]\.location_specs\[0\]\.uri.*scheme"):
        kv.call("finish_write_cache", {"instance_id": "li", "write_session_id": started["write_session_id"],
                                       "success_blocks": {"offset": 1}, "locations": [bad]})
    with pytest.raises(InvalidArgument, match="locations"):
        kv.call("finish_write_cache", {"instance_id": "li", "write_session_id": started["write_session_id"],
                                       "success_blocks": {"offset": 1}, "locations": [{"what": 1}]})
    done = kv.call("finish_write_cache", {"instance_id": "li", "write_session_id": started["write_session_id"],
                                          "success_blocks": {"offset": 1}, "locations": [good]})
    assert done["served"] == 1

