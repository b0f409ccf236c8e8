"""This host's identity and key, which outlive every data dir: what lets kvcm prove a storage
root's earlier owner is gone.

A storage marker is signed with its data dir's ``marker.key``; once that data dir is deleted the
key is gone too, and nothing the marker says can be checked any more. So kvcm also signs every
marker with a *host key*, kept outside every data dir (``$KVCM_STATE_DIR``, else
``$XDG_STATE_HOME/kvcm``, else ``~/.local/state/kvcm``: ``host.key``, mode 0600, made once), and
records the host's machine id in it. A marker that verifies under the host key was written by a
kvcm running here as this user; only then does kvcm believe the data dir path and host the
marker names, and look whether that data dir still lives (see ``ownership.owner_gone``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from kvcm.backends.storage.safe_files import create_unique, open_regular

log = logging.getLogger("kvcm.backends.storage")

STATE_ENV = "KVCM_STATE_DIR"
HOST_KEY_FILE = "host.key"
#: Where the machine id is read, first found wins (systemd's, then D-Bus's copy).
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def machine_id() -> str:
    """This host's machine id; without one, ``hostname:<name>`` (stable across restarts)."""
    for path in MACHINE_ID_FILES:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with open(path, encoding="ascii") as f:
                text = f.read(128).strip()
            if text:
                return text
    return f"hostname:{socket.gethostname()}"


def state_dir() -> str:
    explicit = os.environ.get(STATE_ENV)
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "kvcm")


def host_key(create: bool = True) -> bytes:
    """The host key (b"" when it cannot be read or made: markers are then not host-signed, and
    a root they mark can only be released by hand, never taken over)."""
    try:
        return load_key(state_dir(), HOST_KEY_FILE, create)
    except OSError as exc:
        log.warning("no host key in %s (%s): storage roots of deleted data dirs cannot be taken over", state_dir(), exc)
        return b""


def load_key(directory: str, name: str, create: bool = True) -> bytes:
    """The key ``directory/name``, made on first use when ``create`` (b"" when there is none).
    Made under a random name and linked into place, so a crash never leaves a half key and two
    makers agree on one."""
    path = os.path.join(directory, name)
    key = _read_key(path)
    if key or not create:
        return key
    os.makedirs(directory, 0o700, exist_ok=True)
    tmp, fd = create_unique(f"{path}.tmp.")
    try:
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another maker won: its key counts
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        text = os.read(fd, 256).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) < 16:
        raise OSError(f"the key {path} is not one kvcm wrote; move it away (kvcm makes a new one)")
    return key


class TakeoverStats:
    """``kvcm_storage_takeovers_total``: storage roots taken over from a data dir proven gone.
    Process-wide (a takeover happens inside a backend's open, which knows no app); register it
    on a metrics registry with ``registry.register(TAKEOVERS)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kvcm_storage_takeovers", "Storage roots taken over from a data dir proven gone")
        family.add_metric([], self.count)
        yield family


TAKEOVERS = TakeoverStats()
