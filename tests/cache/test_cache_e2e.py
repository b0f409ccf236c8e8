"""End to end, as connectors use kvcm: one client process registers, starts a write, writes real
bytes at the ``file`` and ``shm`` URIs it was given and finishes; another process finds the blocks
with ``prefix_match`` and reads identical bytes; after ``remove_cache`` and the group's delete
delay the space is back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcm.testing import serve_in_subprocess
from tests.helpers import (
    add_file_storage,
    add_group,
    add_shm_storage,
    remove_shm,
    shm_prefix,
    wait_for,
)

CLIENT = r"""
import hashlib, json, os, sys
from kvcm.client import Client
from kvcm.backends.storage.registry import resolve_file_uri, resolve_shm_uri

endpoint, role, instance, group = sys.argv[1:5]
tokens = list(range(1000, 1000 + 4 * 6))  # 6 full blocks of 4 tokens

def payload(uri_index, spec, size):
    seed = f"{instance}/{uri_index}/{spec}".encode()
    return (hashlib.sha256(seed).digest() * (size // 32 + 1))[:size]

def resolve(uri, roots):
    if uri.startswith("file://"):
        return resolve_file_uri(uri, roots[uri.split("/")[2]])
    return resolve_shm_uri(uri)

with Client(endpoint) as c:
    roots = {s["global_unique_name"]: s["storage_spec"].get("root_path", "") for s in c.call("list_storage")["storage"]}
    if role == "write":
        c.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
               "location_spec_infos": [{"name": "tp0", "size": 4096}, {"name": "tp1", "size": 8192}],
               "model_deployment": {"model_name": "m", "dtype": "fp16"}})
        started = c.call("start_write_cache", {"instance_id": instance, "token_ids": tokens})
        for i, loc in enumerate(started["locations"]):
            for spec in loc["location_specs"]:
                path, offset, size = resolve(spec["uri"], roots)
                fd = os.open(path, os.O_RDWR)
                try:
                    os.pwrite(fd, payload(i, spec["name"], size), offset)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        c.call("finish_write_cache", {"instance_id": instance, "write_session_id": started["write_session_id"],
               "success_blocks": {"offset": len(started["locations"])}})
        print(json.dumps({"written": len(started["locations"])}))
    else:
        found = c.call("get_cache_location", {"instance_id": instance, "query_type": "prefix_match",
                                                "token_ids": tokens + [1, 2]})["locations"]
        same = 0
        for i, loc in enumerate(found):
            for spec in loc["location_specs"]:
                path, offset, size = resolve(spec["uri"], roots)
                fd = os.open(path, os.O_RDONLY)
                try:
                    same += os.pread(fd, size, offset) == payload(i, spec["name"], size)
                finally:
                    os.close(fd)
        print(json.dumps({"found": len(found), "identical_specs": same, "types": sorted({l["type"] for l in found})}))
"""


def _client(endpoint, role, instance, group):
    out = subprocess.run([sys.executable, "-c", CLIENT, endpoint, role, instance, group], check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disk_bytes(paths):
    return sum(os.stat(p).st_blocks * 512 for p in paths if os.path.exists(p))


def _files(root):
    """Block files (not kvcm's lock and ownership marker)."""
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names if not f.startswith(".kvcm-")]


@pytest.fixture
def shm():
    prefix = shm_prefix()
    yield prefix
    remove_shm(prefix)


def test_write_bytes_then_read_them_from_another_process(tmp_path, shm):
    disk = tmp_path / "disk"
    with serve_in_subprocess(extra_args=["--set", "cache.delete_poll_ms=20"]) as server, server.client() as c:
        add_file_storage(c, "disk", disk)
        add_shm_storage(c, "mem", shm)
        add_group(c, "files", ["disk"], delay_ms=300)
        add_group(c, "mems", ["mem"], delay_ms=300)
        for instance, group, kind in (("e2e-file", "files", "file"), ("e2e-shm", "mems", "shm")):
            assert _client(server.endpoint, "write", instance, group) == {"written": 6}
            read = _client(server.endpoint, "read", instance, group)
            assert read == {"found": 6, "identical_specs": 12, "types": [kind]}
        shm_files = [f"/dev/shm/{name}" for name in os.listdir("/dev/shm")
                     if name.startswith(shm) and not name[len(shm):].startswith(("lock", "kvcm-storage"))]
        assert _disk_bytes(_files(disk)) >= 6 * (4096 + 8192)
        assert _disk_bytes(shm_files) >= 6 * (4096 + 8192)

        tokens = list(range(1000, 1000 + 24))
        for instance in ("e2e-file", "e2e-shm"):
            c.call("remove_cache", {"instance_id": instance, "token_ids": tokens})
        for group in ("files", "mems"):
            wait_for(lambda g=group: c.call("get_cache_meta", {"instance_id": "e2e-file" if g == "files" else "e2e-shm",
                                                                "token_ids": tokens})["metas"][0]["status"] == "not_found")
        # after the delay the deleter freed the slots: the bytes are gone from disk and from /dev/shm
        assert wait_for(lambda: _disk_bytes(_files(disk)) == 0), _files(disk)
        assert wait_for(lambda: _disk_bytes(shm_files) == 0)
        assert _client(server.endpoint, "read", "e2e-file", "files")["found"] == 0
