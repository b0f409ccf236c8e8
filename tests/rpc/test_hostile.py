"""Hostile input against a real kvcm: every malformed category plus random byte flips.

The server must answer or count every message, stay up, and serve a valid request afterwards.
"""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from kvcm.errors import Code
from kvcm.proto import wire
from kvcm.testing import serve_in_thread

MAX_BYTES = 16384
MAX_KEYS = 64


def _valid_requests() -> list[bytes]:
    reqs = [
        ("check_health", {}),
        ("get_instance_info", {"instance_id": "inst"}),
        ("list_storage", {}),
        ("register_instance", {"instance_group": "default", "instance_id": "inst", "block_size": 16,
                               "location_spec_infos": [{"name": "tp0", "size": 1024}]}),
        ("get_instance_group", {"name": "default"}),
    ]
    return [wire.pack_request(i + 1, m, p) for i, (m, p) in enumerate(reqs)]


def _categories() -> list[list[bytes]]:
    """Each entry is one multipart message (without the ROUTER identity)."""
    deep = b"\x91" * 5000 + b"\xc0"
    out: list[list[bytes]] = [
        [b"\xc1"],  # never-used msgpack byte
        [b""],  # empty payload: a frame error
        [b"", b"", b"x"],  # REQ-style with an extra frame
        [b"a", b"b", b"c", b"d"],  # too many frames
        [msgpack.packb({"not": "an array"})],
        [msgpack.packb([0, 1, "check_health"])],  # wrong length
        [msgpack.packb([9, 1, "check_health", []])],  # wrong kind
        [msgpack.packb([0, -1, "check_health", []])],  # bad msgid
        [msgpack.packb([0, "1", "check_health", []])],
        [msgpack.packb([0, 1, 42, []])],  # method not a string
        [msgpack.packb([0, 1, "check_health", "params"])],
        [msgpack.packb([0, 1, "check_health", [1, 2]])],
        [msgpack.packb([0, 1, "no_such_method", []])],
        [msgpack.packb([0, 1, "get_instance_info", [{"instance_id": 5}]])],  # wrong field type
        [msgpack.packb([0, 1, "register_instance", [{"instance_id": "x", "block_size": "big"}]])],
        [wire.pack_request(1, "get_cache_location", {"instance_id": "inst", "block_keys": list(range(MAX_KEYS + 1))})],
        [wire.pack_request(1, "check_health", {"pad": b"x" * (MAX_BYTES + 1)})],  # oversize
        [b"\xdd\xff\xff\xff\xff"],  # array32 claiming 4G items
        [b"\xdf\xff\xff\xff\xff"],  # map32 likewise
        [b"\xc6\xff\xff\xff\xff"],  # bin32 likewise
        [deep],  # deep nesting
        [msgpack.packb([0, 1, "check_health", [{"x": msgpack.ExtType(5, b"abc")}]])],  # ext type
        [msgpack.packb([0, 1, "check_health", [{1: 2}]])],  # int map key
        [b"\x94\x00\x01\xa1"],  # truncated
        [wire.pack_request(1, "check_health", {}) + b"trailing"],
        [b"\xa3\xff\xfe\xfd"],  # invalid utf-8 str
    ]
    return out


def _expects_reply(frames: list[bytes]) -> bool:
    if len(frames) == 1 and frames[0]:
        payload = frames[0]
    elif len(frames) == 2 and frames[0] == b"" and frames[1]:
        payload = frames[1]
    else:
        return False  # dropped and counted as a frame error
    if len(payload) > MAX_BYTES:
        return True
    try:
        return wire.parse_request(payload).msgid is not None
    except wire.BadEnvelope:
        return True


def _flip(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def test_ten_thousand_hostile_messages():
    run_hostile(10_500, seed=1234)


@pytest.mark.slow
def test_soak_hostile_messages():
    """Run by scripts/soak: ten times the default volume, another seed."""
    run_hostile(105_000, seed=99)


def run_hostile(total: int, seed: int) -> None:
    rng = random.Random(seed)
    overrides = {"server": {"max_message_bytes": MAX_BYTES, "max_keys": MAX_KEYS}}
    with serve_in_thread(overrides=overrides) as server:
        messages: list[list[bytes]] = []
        categories = _categories()
        while len(messages) < total * 4 // 10:
            messages.extend(categories)
        valid = _valid_requests()
        while len(messages) < total:
            messages.append([_flip(rng.choice(valid), rng)])
        rng.shuffle(messages)

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        expected = sum(_expects_reply(m) for m in messages)
        dropped = len(messages) - expected
        got = 0
        window = 0
        for frames in messages:
            sock.send_multipart(frames)
            window += _expects_reply(frames)
            while window > 50 and sock.poll(2000):
                reply = msgpack.unpackb(sock.recv(), strict_map_key=False)
                assert reply[0] == 1 and (reply[2] is None or isinstance(reply[2]["code"], int))
                got += 1
                window -= 1
        while got < expected and sock.poll(5000):
            sock.recv()
            got += 1
        assert got == expected
        bad_frames = server.app.metrics.bad_messages.labels("frames")._value.get()
        assert bad_frames == dropped
        # Still serving, and still correct.
        with server.client() as c:
            assert c.call("check_health")["status"] == "ok"
            sock.send(wire.pack_request(4242, "no_such_method", {}))
            assert sock.poll(5000)
            msgid, err, _ = wire.parse_response(sock.recv())
            assert msgid == 4242 and err["code"] == Code.METHOD_NOT_FOUND
        sock.close(0)
