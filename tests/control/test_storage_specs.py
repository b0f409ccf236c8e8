"""``get_storage_specs``: a data-plane user learns the client-visible part of its instance's
storages (what resolving a URI needs), never another tenant's, and never a credential, whatever
the storage type holds in its spec."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvcm.api.control import CLIENT_SPEC_FIELDS
from kvcm.backends.storage import registry
from kvcm.backends.storage.external import ExternalStorage
from kvcm.backends.storage.specs import SpecReader
from kvcm.client import IDEMPOTENT_METHODS, METHODS, Client
from kvcm.errors import Code, KvcmError
from kvcm.testing import RunningServer, serve_in_thread
from tests.helpers import remove_shm, shm_prefix

ADMIN_PW = "specs-Admin-pw"
SERVER_ON = {"auth": {"enabled": True, "admin_user": "admin", "admin_password": ADMIN_PW}}
SECRET = "s3cr3t-do-not-show"


class TokenStore(ExternalStorage):
    """A URI-only store whose spec carries credentials, as a real one might."""

    type_name = "tokenstore"
    scheme = "tokenstore"

    @classmethod
    def _read_fields(cls, name: str, reader: SpecReader) -> None:
        reader.text("endpoint", "127.0.0.1:1")
        reader.text("access_token")
        reader.text("password")

    def _new_uris(self, count: int, size: int) -> list[str]:
        return [f"tokenstore://{self.name}/{i}?size={size}" for i in range(count)]


def spec_of(kind: str, root: str, prefix: str) -> dict[str, Any]:
    return {
        "file": {"root_path": f"{root}/file"},
        "shm": {"prefix": prefix, "segment_size": 1 << 20},
        "3fs": {"mountpoint": "/mnt/3fs", "root_dir": "kv", "probe_address": "127.0.0.1:9"},
        "mooncake": {"metadata_connstring": f"http://kv:{SECRET}@meta:8080/metadata", "probe_address": "127.0.0.1:9"},
        "tairmempool": {"domain": "pool.local", "service_discovery_url": f"http://sd/?token={SECRET}"},
        "tokenstore": {"access_token": SECRET, "password": SECRET},
    }[kind]


STORAGES = {f"st-{kind}": kind for kind in ("file", "shm", "3fs", "mooncake", "tairmempool", "tokenstore")}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[RunningServer, Client, Client, Client]]:
    """Groups ga (every storage type) and gb, instance ia in ga and ib in gb; clients of the
    admin, alice (ga) and bob (gb)."""
    root = tempfile.mkdtemp(prefix="kvcm-specs-")
    prefix = shm_prefix()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.STORAGE_BACKENDS, "tokenstore", TokenStore)
        with serve_in_thread(overrides=SERVER_ON) as srv:
            admin = srv.client(auth={"user": "admin", "password": ADMIN_PW})
            for name, kind in STORAGES.items():
                admin.call("add_storage", {"storage": {"global_unique_name": name, "storage_type": kind,
                                                       "storage_spec": spec_of(kind, root, prefix)}})
            admin.call("create_instance_group", {"instance_group": {"name": "ga", "storage_candidates": list(STORAGES)}})
            admin.call("create_instance_group", {"instance_group": {"name": "gb", "storage_candidates": ["st-file"]}})
            admin.call("add_account", {"user_name": "alice", "password": "alice-pw", "groups": ["ga"]})
            admin.call("add_account", {"user_name": "bob", "password": "bob-pw", "groups": ["gb"]})
            alice = srv.client(auth={"user": "alice", "password": "alice-pw"})
            bob = srv.client(auth={"user": "bob", "password": "bob-pw"})
            for c, instance, group in ((alice, "ia", "ga"), (bob, "ib", "gb")):
                c.call("register_instance", {"instance_group": group, "instance_id": instance, "block_size": 4,
                                             "location_spec_infos": [{"name": "tp0", "size": 64}]})
            try:
                yield srv, admin, alice, bob
            finally:
                for c in (admin, alice, bob):
                    c.close()
                remove_shm(prefix)
                shutil.rmtree(root, ignore_errors=True)


def test_a_data_plane_user_gets_the_client_visible_specs_in_candidate_order(server: Any) -> None:
    _, _, alice, _ = server
    reply = alice.call("get_storage_specs", {"instance_id": "ia"})
    got = {s["global_unique_name"]: s for s in reply["storages"]}
    assert [s["global_unique_name"] for s in reply["storages"]] == list(STORAGES)
    assert got["st-file"]["storage_type"] == "file"
    assert got["st-file"]["storage_spec"]["root_path"].endswith("/file")
    assert got["st-shm"]["storage_spec"]["shm_dir"] == "/dev/shm"
    for name, kind in STORAGES.items():
        assert set(got[name]) == {"global_unique_name", "storage_type", "storage_spec"}
        assert list(got[name]["storage_spec"]) == list(CLIENT_SPEC_FIELDS.get(kind, ())), name


def test_no_secret_or_unlisted_field_ever_appears(server: Any) -> None:
    _, admin, alice, _ = server
    raw = msgspec.json.encode(alice.call("get_storage_specs", {"instance_id": "ia"}))
    assert SECRET.encode() not in raw
    for field in (b"access_token", b"password", b"probe_address", b"metadata_connstring", b"service_discovery_url",
                  b"capacity_bytes", b"storage_id", b"endpoint"):
        assert field not in raw, field
    # register_instance, a data-plane call too, shows the same cut specs in storage_configs
    again = alice.call("register_instance", {"instance_group": "ga", "instance_id": "ia", "block_size": 4,
                                             "location_spec_infos": [{"name": "tp0", "size": 64}]})
    assert again["created"] is False
    raw_reg = msgspec.json.encode(again["storage_configs"])
    assert SECRET.encode() not in raw_reg
    for field in (b"access_token", b"password", b"probe_address", b"metadata_connstring", b"service_discovery_url"):
        assert field not in raw_reg, field
    assert [s["storage_spec"] for s in again["storage_configs"]] == \
        [s["storage_spec"] for s in alice.call("get_storage_specs", {"instance_id": "ia"})["storages"]]
    # The admin's list_storage does hold them: the replies above filtered, not the store.
    assert SECRET.encode() in msgspec.json.encode(admin.call("list_storage"))


def test_another_tenants_instance_answers_as_a_missing_one(server: Any) -> None:
    _, _, alice, bob = server
    for c, other in ((alice, "ib"), (bob, "ia")):
        with pytest.raises(KvcmError) as exc:
            c.call("get_storage_specs", {"instance_id": other}, retry=False)
        assert exc.value.code is Code.INSTANCE_NOT_EXIST
    with pytest.raises(KvcmError) as missing:
        bob.call("get_storage_specs", {"instance_id": "nobody"}, retry=False)
    assert missing.value.code is Code.INSTANCE_NOT_EXIST
    assert [s["global_unique_name"] for s in bob.call("get_storage_specs", {"instance_id": "ib"})["storages"]] \
        == ["st-file"]


def test_requests_are_validated_strictly(server: Any) -> None:
    _, _, alice, _ = server
    for params, needle in (({"instance_id": "ia", "instance_idd": "x"}, "instance_idd"),
                           ({}, "instance_id"), ({"instance_id": 7}, "instance_id")):
        with pytest.raises(KvcmError) as exc:
            alice.call("get_storage_specs", params, retry=False)
        assert exc.value.code is Code.INVALID_ARGUMENT and needle in exc.value.message, exc.value.message


def test_the_method_is_a_read_only_data_plane_method(server: Any) -> None:
    srv = server[0]
    method = srv.app.dispatcher.methods["get_storage_specs"]
    assert not method.admin and not method.writes and method.idempotent
    assert "get_storage_specs" in METHODS and "get_storage_specs" in IDEMPOTENT_METHODS


MINIMAL = {"file": {"root_path": "/tmp/x"}, "shm": {}, "3fs": {"mountpoint": "/m", "root_dir": "r"},
           "mooncake": {}, "tairmempool": {"domain": "d"}}


@pytest.mark.parametrize("kind", sorted(registry.STORAGE_BACKENDS))
def test_the_whitelist_covers_every_type_and_names_real_fields(kind: str) -> None:
    spec = registry.normalize_spec(kind, "n", MINIMAL[kind])
    assert kind in CLIENT_SPEC_FIELDS
    assert set(CLIENT_SPEC_FIELDS[kind]) <= set(spec), set(CLIENT_SPEC_FIELDS[kind]) - set(spec)
    risky = [f for f in CLIENT_SPEC_FIELDS[kind] if any(w in f for w in ("token", "password", "secret", "url",
                                                                             "connstring", "probe", "capacity"))]
    assert not risky
