"""Helpers the tests share (not collected: no ``test_`` prefix): time scaling, polling, free
ports, a hand-moved clock, registering an instance, reading URIs."""

from __future__ import annotations

import glob
import os
import socket
import time
import uuid
from typing import Any

import pytest

from kvcm.errors import KvcmError

#: Scales the tests' waits on a slow machine (``KVCM_TEST_TIME_FACTOR=3``); never a pass condition.
TIME_FACTOR = float(os.environ.get("KVCM_TEST_TIME_FACTOR", "1"))

SPECS = [{"name": "tp0", "size": 1024}, {"name": "tp1", "size": 1024}]
DEPLOYMENT = {"model_name": "m", "dtype": "fp16"}


class Clock:
    """A monotonic clock a test moves by hand (``clock.now += 0.5``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def register(c, instance_id="inst", group="default", block_size=4, specs=None, spec_groups=None,
             deployment: dict[str, Any] | None = DEPLOYMENT) -> dict[str, Any]:
    """``register_instance`` (``deployment`` None: none sent)."""
    params = {"instance_group": group, "instance_id": instance_id, "block_size": block_size,
              "location_spec_infos": specs or SPECS}
    if deployment is not None:
        params["model_deployment"] = deployment
    if spec_groups:
        params["location_spec_groups"] = spec_groups
    return c.call("register_instance", params)


def start(c, keys=None, instance="inst", tokens=None, **extra) -> dict[str, Any]:
    params: dict[str, Any] = {"instance_id": instance, **extra}
    if keys is not None:
        params["block_keys"] = keys
    if tokens is not None:
        params["token_ids"] = tokens
    return c.call("start_write_cache", params)


def finish(c, session, success=None, instance="inst") -> dict[str, Any]:
    n = len(session["locations"])
    mask = success if success is not None else {"offset": n}
    return c.call("finish_write_cache", {"instance_id": instance, "write_session_id": session["write_session_id"],
                                         "success_blocks": mask})


def write(c, keys, instance="inst", **extra) -> dict[str, Any]:
    session = start(c, keys, instance, **extra)
    finish(c, session, instance=instance)
    return session


def locate(c, keys=None, query="prefix_match", instance="inst", tokens=None, **extra) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"instance_id": instance, "query_type": query, **extra}
    if keys is not None:
        params["block_keys"] = keys
    if tokens is not None:
        params["token_ids"] = tokens
    return c.call("get_cache_location", params)["locations"]


def error_code(fn, *args, **kwargs) -> str:
    with pytest.raises(KvcmError) as info:
        fn(*args, **kwargs)
    return info.value.code.name


def add_group(c, name, candidates, capacity=0, per_type=None, delay_ms=0) -> None:
    quota: dict[str, Any] = {"capacity": capacity}
    if per_type:
        quota["quota_config"] = [{"storage_type": t, "capacity": cap} for t, cap in per_type.items()]
    c.call("create_instance_group", {"instance_group": {
        "name": name, "storage_candidates": candidates, "quota": quota,
        "reclaim_strategy": {"delay_before_delete_ms": delay_ms, "used_percentage": 1.0}}})


def add_file_storage(c, name, root) -> None:
    c.call("add_storage", {"storage": {"global_unique_name": name, "storage_type": "file",
                                       "storage_spec": {"root_path": str(root)}}})


def shm_prefix() -> str:
    return f"kvcmtest{uuid.uuid4().hex[:8]}."


def add_shm_storage(c, name, prefix, segment_size=1 << 20) -> None:
    c.call("add_storage", {"storage": {"global_unique_name": name, "storage_type": "shm",
                                       "storage_spec": {"prefix": prefix, "segment_size": segment_size}}})


def remove_shm(prefix: str) -> None:
    for path in glob.glob(f"/dev/shm/{prefix}*"):
        os.unlink(path)


def wait_for(cond, timeout=10.0, interval=0.05) -> Any:
    """Poll ``cond`` until truthy and return its last value (no timed assertion: the timeout
    only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until(cond, timeout=10.0, interval=0.02, what="condition not met in time") -> None:
    """Poll ``cond`` until truthy; AssertionError ``what`` past ``timeout`` x TIME_FACTOR."""
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(interval)


def one_leader(endpoints: dict[str, str], timeout: float = 20.0) -> str:
    """The name of the node (of ``endpoints``: name -> endpoint) that leads, once exactly one
    says so in ``check_health``; a node that does not answer is not it."""
    from kvcm import Client

    found: list[str] = []

    def one() -> bool:
        found.clear()
        for name, endpoint in endpoints.items():
            try:
                with Client(endpoint, timeout=1.0, retries=0) as c:
                    if c.call("check_health")["is_leader"]:
                        found.append(name)
            except KvcmError:
                pass
        return len(found) == 1
    wait_until(one, timeout=timeout, what="exactly one leader")
    return found[0]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uris(location: dict[str, Any]) -> list[str]:
    return [s["uri"] for s in location["location_specs"]]


def hard_close(sock: Any) -> None:
    """Shut a socket down, then close it: a close alone leaves another thread's recv on it blocked."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
