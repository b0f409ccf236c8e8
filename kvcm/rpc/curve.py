"""CURVE encryption for kvcm's ZeroMQ sockets, and ZAP authorization of client public keys.

Keys live in zmq.auth certificate files (``kvcm keys generate``): ``NAME.key`` holds a public
key, ``NAME.key_secret`` the key pair. Keys are z85 text (40 characters).

Server side (:class:`CurveServer`): a private ZeroMQ context whose ZAP handler (pyzmq's
``ThreadAuthenticator``) admits client keys, any key or those of a directory of public
certificates, plus the key of the server's own in-process client (the HTTP side port's).
Server sockets must be created on that context, set up by :meth:`CurveServer.setup` before they
bind. ``ZAP_ENFORCE_DOMAIN`` is set on them: without it libzmq lets every CURVE client in while
no ZAP handler is running, which would turn an allow-list into allow-any.

Client side (:func:`apply_client`): the server's public key plus a key pair of the client's own
(an ephemeral one when none is given, which only an any-key server admits).

A refused client gets no error from ZeroMQ: its handshake just fails and libzmq keeps retrying,
so a caller only ever sees a timeout. Refusals by key are counted here (``on_reject``) and logged
at WARNING, rate-limited and without key material; handshakes that fail earlier (a plaintext
client, a wrong server key) never reach ZAP and are not counted.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, TypeVar

import zmq
from zmq.auth import load_certificate, load_certificates
from zmq.utils import z85

from kvcm.errors import InvalidArgument

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvcm.curve")
# pyzmq's authenticator logs every client key at DEBUG; our own logger for it stays above that.
_zap_log = logging.getLogger("kvcm.curve.zap")
_zap_log.setLevel(logging.INFO)

DOMAIN = b"kvcm"  # the ZAP domain of every kvcm server socket
_KEY_LEN = 40  # z85 text of a 32-byte key
_WARN_EVERY_S = 10.0  # refusals repeat every reconnect interval: one log line per this period


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as z85 bytes. The secret key stays out of ``repr``."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


def _z85_key(value: str | bytes, what: str) -> bytes:
    """``value`` as 40 bytes of z85 (a raw 32-byte key is encoded); else InvalidArgument."""
    raw = value.encode("ascii", "replace") if isinstance(value, str) else bytes(value)
    raw = raw.strip()
    if len(raw) == 32 and isinstance(value, bytes):
        return z85.encode(raw)
    try:
        ok = len(raw) == _KEY_LEN and len(z85.decode(raw)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise InvalidArgument(f"{what} is not a CURVE key (expected 40 characters of z85)")
    return raw


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair of a secret certificate file (``NAME.key_secret``); clear errors otherwise."""
    name = os.fspath(path)
    try:
        public, secret = load_certificate(name)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read CURVE certificate {name}: {exc}") from None
    if secret is None:
        raise InvalidArgument(f"{name} holds a public key only; a secret certificate (NAME.key_secret) is needed")
    keys = KeyPair(_z85_key(public, f"public key in {name}"), _z85_key(secret, f"secret key in {name}"))
    if zmq.curve_public(keys.secret) != keys.public:
        raise InvalidArgument(f"{name}: its public key does not belong to its secret key")
    _warn_if_readable(name)
    return keys


def _warn_if_readable(name: str) -> None:
    try:
        mode = os.stat(name).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("CURVE secret certificate %s is readable by other users (mode %o); chmod 600 it",
                    name, stat.S_IMODE(mode))


def load_public_key(value: str | bytes | os.PathLike[str]) -> bytes:
    """A public key given as z85 text/bytes, a raw 32-byte key, or a certificate file path."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and os.path.isfile(value)):
        name = os.fspath(value)
        try:
            public, _ = load_certificate(name)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"cannot read CURVE certificate {name}: {exc}") from None
        return _z85_key(public, f"public key in {name}")
    if isinstance(value, str) and len(value.strip()) != _KEY_LEN:
        raise InvalidArgument(f"CURVE server key {value[:200]!r} is neither a certificate file nor a z85 key")
    return _z85_key(value, "CURVE server key")


def client_keypair(value: str | os.PathLike[str] | tuple[str | bytes, str | bytes] | KeyPair | None) -> KeyPair:
    """A client key pair from a secret certificate file or a ``(public, secret)`` pair; None
    makes an ephemeral one."""
    if value is None:
        return KeyPair.generate()
    if isinstance(value, KeyPair):
        return value
    if isinstance(value, tuple):
        if len(value) != 2:
            raise InvalidArgument("CURVE client keys must be a (public, secret) pair")
        keys = KeyPair(_z85_key(value[0], "CURVE client public key"), _z85_key(value[1], "CURVE client secret key"))
        if zmq.curve_public(keys.secret) != keys.public:
            raise InvalidArgument("CURVE client public key does not belong to its secret key")
        return keys
    return load_keypair(value)


_PUBLIC_BANNER = """#   ZeroMQ CURVE Public Certificate (kvcm keys generate)
#   Give it to whoever must trust this key: a server's allowed clients directory, or a client
#   that connects to this server.

"""
_SECRET_BANNER = """#   ZeroMQ CURVE **Secret** Certificate (kvcm keys generate)
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

"""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def create_certificates(directory: str, name: str) -> tuple[str, str, KeyPair]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) in zmq.auth's format.

    Returns both paths and the pair. Existing files are never overwritten. The secret file is
    created 0600 (not chmod-ed afterwards), so it is never readable by others, even briefly."""
    if not _NAME.match(name):
        raise InvalidArgument(f"key name {name[:200]!r} must be 1-100 chars of [A-Za-z0-9._-]")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    keys = KeyPair.generate()
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise InvalidArgument(f"{path} exists; remove it or choose another --name")
    curve = f'curve\n    public-key = "{keys.public.decode()}"\n'
    _write_new(secret_path, _SECRET_BANNER + "metadata\n" + curve + f'    secret-key = "{keys.secret.decode()}"\n', 0o600)
    _write_new(public_path, _PUBLIC_BANNER + "metadata\n" + curve, 0o644)
    return public_path, secret_path, keys


def _write_new(path: str, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(text)
    os.chmod(path, mode)  # the umask may have taken bits off the public file's mode


def apply_server(sock: zmq.Socket[bytes], keys: KeyPair) -> None:
    """Make ``sock`` a CURVE server (call before bind); ZAP decides which clients get in."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (AttributeError, zmq.ZMQError):  # an older libzmq: CurveServer starts ZAP before binding
        log.warning("this libzmq cannot enforce ZAP; CURVE clients depend on the ZAP handler running")


def apply_client(sock: zmq.Socket[_Frame], server_key: bytes, keys: KeyPair) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_key`` (before connect)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


_Frame = TypeVar("_Frame")  # what a socket's receives give: bytes, or asyncio's futures


class CurveOptions(TypedDict, total=False):
    """The CURVE keyword arguments of :class:`kvcm.Client` (an in-process client of a CURVE server)."""

    curve_server_key: bytes
    curve_client_keys: KeyPair


class KeyGate:
    """The ZAP verdict on one client key: pyzmq's credentials-provider hook, run on its thread.

    ``allowed`` None admits every key; else a key must be in it. Refusals are counted.
    """

    def __init__(self, allowed: set[bytes] | None, on_reject: Callable[[], None] | None = None) -> None:
        self.allowed = allowed
        self.rejected = 0
        self._on_reject = on_reject
        self._lock = threading.Lock()
        self._warned_at = -_WARN_EVERY_S
        self._since_warning = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if self.allowed is None or key in self.allowed:
            return True
        self._refused()
        return False

    def _refused(self) -> None:
        with self._lock:
            self.rejected += 1
            self._since_warning += 1
            now = time.monotonic()
            due = now - self._warned_at >= _WARN_EVERY_S
            if due:
                count, self._since_warning, self._warned_at = self._since_warning, 0, now
        if self._on_reject is not None:
            self._on_reject()
        if due:
            log.warning("CURVE: refused %d connection attempt(s) from client keys not in the allowed clients "
                        "directory (%d in total)", count, self.rejected)


def allowed_keys(directory: str) -> set[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory``."""
    if not os.path.isdir(directory):
        raise InvalidArgument(f"CURVE allowed clients directory {directory} does not exist")
    try:
        return set(load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read CURVE client certificates in {directory}: {exc}") from None


class CurveServer:
    """A CURVE-encrypted server's keys, private context and ZAP handler (see the module docstring).

    :param allowed_dir: directory of allowed client public certificates; None admits any key.
    Keys in the directory are read once, here: adding or removing one needs a restart.
    """

    def __init__(self, keys: KeyPair, allowed_dir: str | None = None, on_reject: Callable[[], None] | None = None) -> None:
        self.keys = keys
        # The server's own in-process clients use this pair: admitted whatever the directory
        # says, and never written anywhere.
        self.internal = KeyPair.generate()
        allowed = None if allowed_dir is None else allowed_keys(allowed_dir) | {self.internal.public}
        self.gate = KeyGate(allowed, on_reject)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None  # the ThreadAuthenticator, once started

    def start(self) -> CurveServer:
        """Start the ZAP handler; server sockets must not bind before this."""
        # Imported here: it pulls in asyncio, which clients (importing this module) do not need.
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self.context, log=_zap_log)
        auth.configure_curve_callback(DOMAIN.decode(), credentials_provider=self.gate)
        auth.start()
        self._auth = auth
        return self

    def setup(self, sock: zmq.Socket[bytes]) -> None:
        """``socket_setup`` for a server socket on :attr:`context`."""
        apply_server(sock, self.keys)

    def client_options(self) -> CurveOptions:
        """``Client`` keyword arguments for the server's own in-process client."""
        return {"curve_server_key": self.keys.public, "curve_client_keys": self.internal}

    def stop(self) -> None:
        """Idempotent; after every server socket on the context is closed (term waits for them)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self.context.closed:
            self.context.term()


def serve_curve(secret_key_file: str, allowed_clients_dir: str, registry: CollectorRegistry) -> CurveServer | None:
    """CURVE for a node's RPC port (``server.curve_secret_key_file``; every stage of a node, leader
    or follower, binds the same way), started; None (plaintext) without a key file. Refused
    connections count in ``kvcm_curve_rejected_clients`` of the Prometheus ``registry``."""
    if not secret_key_file:
        return None
    from prometheus_client import Counter

    rejected = Counter("kvcm_curve_rejected_clients", "CURVE connection attempts refused by client key",
                       registry=registry)
    curve = CurveServer(load_keypair(secret_key_file), allowed_clients_dir or None, on_reject=rejected.inc)
    admits = f"client keys in {allowed_clients_dir}" if allowed_clients_dir else "any client key"
    log.info("CURVE on: server public key %s, admitting %s", curve.keys.public.decode(), admits)
    return curve.start()
