"""Real KV bytes at the URIs kvcm hands out, written and read back the way a connector does
(not collected: no ``test_`` prefix).

Every (instance, key, spec) gets its own pattern, so bytes read from a wrong slot, a punched
hole or a recreated file never pass for the right ones."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from kvcm.backends.storage.file import resolve_file_uri
from kvcm.backends.storage.shm import resolve_shm_uri


def storage_roots(c: Any) -> dict[str, str]:
    """``{storage name: root_path}`` of the ``file`` storages and ``shm_dir`` of ``shm`` ones."""
    out = {}
    for s in c.call("list_storage")["storage"]:
        spec = s["storage_spec"]
        out[s["global_unique_name"]] = spec.get("root_path") or spec.get("shm_dir") or ""
    return out


def resolve(uri: str, roots: Mapping[str, str]) -> tuple[str, int, int]:
    """``(path, offset, size)`` of a ``file://`` or ``shm://`` URI."""
    host = uri.split("/")[2]
    if uri.startswith("file://"):
        return resolve_file_uri(uri, roots[host])
    return resolve_shm_uri(uri, roots[host])


def pattern(instance: str, key: int, spec: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{instance}/{key}/{spec}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def write_location(location: Mapping[str, Any], instance: str, key: int, roots: Mapping[str, str]) -> None:
    """Write every spec of one location (from ``start_write_cache``) with its pattern."""
    for spec in location["location_specs"]:
        path, offset, size = resolve(spec["uri"], roots)
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, pattern(instance, key, spec["name"], size), offset)
        finally:
            os.close(fd)


def write_session(session: Mapping[str, Any], instance: str, keys: Iterable[int], roots: Mapping[str, str]) -> None:
    for key, location in zip(keys, session["locations"]):
        write_location(location, instance, key, roots)


def read_problems(c: Any, instance: str, keys: Iterable[int], roots: Mapping[str, str]) -> list[str]:
    """What is wrong with reading ``keys`` back: not served, file missing, or other bytes."""
    keys = sorted(keys)
    problems: list[str] = []
    for i in range(0, len(keys), 1000):
        batch = keys[i:i + 1000]
        found = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get",
                                              "block_keys": batch})["locations"]
        for key, location in zip(batch, found):
            problems.extend(_read_one(instance, key, location, roots))
    return problems


def _read_one(instance: str, key: int, location: Mapping[str, Any], roots: Mapping[str, str]) -> list[str]:
    problems = []
    for spec in location["location_specs"]:
        if not spec["uri"]:
            return [f"{instance}/{key}: not served"]
        path, offset, size = resolve(spec["uri"], roots)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except FileNotFoundError:
            problems.append(f"{instance}/{key}/{spec['name']}: {path} is gone")
            continue
        if data != pattern(instance, key, spec["name"], size):
            problems.append(f"{instance}/{key}/{spec['name']}: other bytes at {spec['uri']}")
    return problems


def served(c: Any, instance: str, keys: Iterable[int]) -> set[int]:
    keys = sorted(keys)
    out: set[int] = set()
    for i in range(0, len(keys), 1000):
        batch = keys[i:i + 1000]
        found = c.call("get_cache_location", {"instance_id": instance, "query_type": "batch_get",
                                              "block_keys": batch})["locations"]
        out |= {k for k, loc in zip(batch, found) if loc["location_specs"][0]["uri"]}
    return out


def container_files(root: str) -> set[str]:
    """Every file under ``root`` relative to it, except kvcm's dot files (lock, health probe):
    an independent listing, not the storage's own."""
    out = set()
    for directory, _, names in os.walk(root):
        for name in names:
            if not name.startswith("."):
                out.add(os.path.relpath(os.path.join(directory, name), root))
    return out
