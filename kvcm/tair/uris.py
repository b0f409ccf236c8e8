"""kvcm's ``file`` and ``shm`` URIs in Tair's form, both ways: the whole path in the URI.

kvcm names a block's file relative to its storage's directory
(``file://nfs_01/s4096/<id>-0.kv?blkid=3&size=4096``), so one URI holds on every host whatever
the mount point. Tair's NFS backend instead joins the storage's ``root_path`` and the file name
into the URI path (and its manager sets the storage's name as the host, which Tair's transfer
SDK uses to pick the storage); Tair's file transfer opens that path as it is and reads or writes
``size`` bytes at ``blkid × size``. So on the Tair surface the directory goes into the path:
``file://nfs_01/mnt/nfs/kv/s4096/<id>-0.kv?blkid=3&size=4096``, and a ``shm`` URI likewise
(``shm://<storage><shm_dir>/<segment>?offset=O&size=S``). 3FS, Mooncake and MemPool URIs are
already in Tair's form and pass unchanged.

The directories come from ``get_storage_specs`` of the calling instance (``list_storage`` when a
location names a storage the group no longer lists), cached per storage name for
:data:`ROOTS_TTL_S`: a reply costs a dictionary look-up per URI, and an RPC only when a name is
new or its entry expired. A URI coming back (``finishWriteCache.locations``) is translated to
kvcm's form and refused unless it names a file kvcm's own form can name under that storage's
directory: nothing outside the root, no ``..``, nothing kvcm would not have created; a URI of
another scheme must be one kvcm's storages hand out.

The directories are kept per caller (:class:`CallerRoots`): each set of credentials learns, and
sees, only what its own ``get_storage_specs`` shows, so one tenant's ``root_path`` never reaches
another tenant, not even in an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from kvcm.errors import InvalidArgument, KvcmError, ServerError
from kvcm.proto.tair import as_list, as_map, as_maps
from kvcm.proto.uris import parse_block_uri
from kvcm.proto.wire import Decoded, DecodedMap

#: How long a learned directory is trusted: a storage whose root_path is updated (a remount) is
#: seen in Tair's URIs at most this late; a name not cached, or expired, costs one RPC.
ROOTS_TTL_S = 2.0

#: kvcm storage type -> the spec field naming its directory.
DIR_FIELD = {"file": "root_path", "shm": "shm_dir"}
#: At most this many translated URIs are remembered (a few MB): a lookup's reply repeats the URIs
#: of hot prefixes, and a remembered one costs a dictionary look-up instead of a new string.
MEMO_MAX = 16384
#: The callers whose directories are kept at once (past it all are forgotten and asked again);
#: each with credentials remembers a quarter of :data:`MEMO_MAX` translations.
MAX_CALLERS = 16
#: What a URI path cannot carry unescaped (Tair's URIs are not escaped).
_UNSAFE = frozenset("?#\0")

#: ``(kvcm method) -> result``: ``get_storage_specs`` of the calling instance or ``list_storage``,
#: forwarded with the call's own credentials.
Fetch = Callable[[str], Decoded]


class Roots:
    """The directories of ``file`` and ``shm`` storages by name, shared by one caller's calls
    (:class:`CallerRoots`)."""

    def __init__(self, ttl_s: float = ROOTS_TTL_S, clock: Callable[[], float] = time.monotonic,
                 memo_max: int = MEMO_MAX) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._memo_max = memo_max
        # name -> (storage type, directory without a trailing "/", expiry); replaced whole, never
        # mutated, so concurrent calls read it without a lock
        self._dirs: dict[str, tuple[str, str, float]] = {}
        # kvcm URI -> Tair URI, valid until the earliest expiry of the directories it used
        self._memo: dict[str, str] = {}
        self._memo_until = 0.0

    def clear(self) -> None:
        """Forget every directory (a storage was added, updated or removed here)."""
        self._dirs = {}
        self._memo = {}

    def learn(self, storages: Iterable[Decoded]) -> None:
        expires = self._clock() + self._ttl
        dirs = dict(self._dirs)
        for storage in storages:
            if not isinstance(storage, dict):
                continue
            kind = storage.get("storage_type")
            field = DIR_FIELD.get(kind) if isinstance(kind, str) else None
            directory = as_map(storage.get("storage_spec") or {}).get(field) if field else None
            name = storage.get("global_unique_name")
            if isinstance(directory, str) and directory.startswith("/") and isinstance(name, str) \
                    and _UNSAFE.isdisjoint(directory):
                dirs[name] = (str(kind), directory.rstrip("/"), expires)
        self._dirs = dirs
        self._memo = {}

    def cached(self, name: str, kind: str) -> tuple[str, float] | None:
        """(directory, expiry) of a storage of that type, while fresh."""
        entry = self._dirs.get(name)
        if entry is None or entry[0] != kind or entry[2] < self._clock():
            return None
        return entry[1], entry[2]

    def memo(self) -> dict[str, str]:
        """The remembered translations, emptied once a directory they used has expired."""
        if self._memo and self._memo_until < self._clock():
            self._memo = {}
        return self._memo

    def remember(self, uri: str, tair: str, expires: float) -> None:
        memo = self._memo
        if len(memo) >= self._memo_max:
            memo = self._memo = {}
        self._memo_until = expires if not memo else min(self._memo_until, expires)
        memo[uri] = tair

    def translator(self, fetch: Fetch) -> Translator:
        return Translator(self, fetch)


class CallerRoots:
    """A :class:`Roots` per caller: per set of credentials (``auth``, the remote address a relay
    adds aside), so a directory learned with one tenant's credentials is never used, nor shown,
    for another's call. Without credentials (auth off: no tenants) every call shares one."""

    def __init__(self, ttl_s: float = ROOTS_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._by_caller: dict[bytes, Roots] = {}
        self._lock = threading.Lock()
        # Credentials are keyed by a hash under a per-process key, never kept as they are.
        self._key = secrets.token_bytes(32)

    def of(self, auth: Decoded) -> Roots:
        caller = self._caller(auth)
        with self._lock:
            roots = self._by_caller.get(caller)
            if roots is None:
                if len(self._by_caller) >= MAX_CALLERS:
                    self._by_caller = {}
                memo = MEMO_MAX if not caller else MEMO_MAX // 4
                roots = self._by_caller[caller] = Roots(self._ttl, self._clock, memo)
        return roots

    def clear(self) -> None:
        """Forget every caller's directories (a storage was added, updated or removed here)."""
        with self._lock:
            self._by_caller = {}

    def _caller(self, auth: Decoded) -> bytes:
        if auth is None:
            return b""
        if isinstance(auth, dict):
            auth = {k: v for k, v in auth.items() if k != "client"}
        text = json.dumps(auth, sort_keys=True, default=repr)
        return hmac.new(self._key, text.encode(), hashlib.sha256).digest()


class Translator:
    """One call's URI translation; asks for the storages at most once per call."""

    def __init__(self, roots: Roots, fetch: Fetch) -> None:
        self._roots = roots
        self._fetch = fetch
        self._asked = False
        self._why = ""  # why list_storage could not be read (a non-admin caller with auth on)
        self._memo = roots.memo()

    def directory(self, name: str, kind: str) -> tuple[str, float] | None:
        """(directory, expiry) of a storage, asking kvcm once per call if it is not cached."""
        found = self._roots.cached(name, kind)
        if found is None and not self._asked:
            self._asked = True
            self._roots.learn(as_list(as_map(self._fetch("get_storage_specs")).get("storages") or []))
            found = self._roots.cached(name, kind)
            if found is None:  # a storage the group no longer lists still holds blocks
                try:
                    self._roots.learn(as_list(as_map(self._fetch("list_storage")).get("storage") or []))
                except KvcmError as exc:  # list_storage is admin-only when auth is on
                    self._why = f" (its group does not list it, and list_storage: {exc.code.name})"
                found = self._roots.cached(name, kind)
        return found

    def out(self, uri: str) -> str:
        """kvcm's URI -> Tair's: the storage's directory joined in front of the path."""
        tair = self._memo.get(uri)
        if tair is None:
            kind, start, slash = _parts(uri)
            if not kind or slash < 0:
                return uri  # 3FS, Mooncake, MemPool: already Tair's
            name = uri[start:slash]
            found = self.directory(name, kind)
            if found is None:
                # Never kvcm's relative path: a Tair reader would open it from "/".
                raise ServerError(f"storage {name!r}: its {DIR_FIELD[kind]} is unknown{self._why} or cannot be "
                                  "written in a URI, so this location has no Tair form")
            tair = uri[:slash] + found[0] + uri[slash:]
            self._roots.remember(uri, tair, found[1])
        return tair

    def locations_out(self, locations: list[DecodedMap]) -> list[DecodedMap]:
        """Every spec URI of kvcm's ``locations`` in Tair's form, in place (a forwarded reply is
        the call's own): the hot path of a lookup, a dictionary look-up per remembered URI."""
        memo, out = self._memo, self.out
        for loc in locations:
            for spec in as_maps(loc["location_specs"]):
                uri = spec["uri"]
                if type(uri) is not str:
                    raise TypeError(f"a location spec's uri is a string, not {type(uri).__name__}")
                spec["uri"] = memo.get(uri) or out(uri)
        return locations

    def into(self, uri: Decoded, where: str) -> str:
        """Tair's URI -> kvcm's; InvalidArgument unless it names a block path kvcm generates under
        the storage's directory."""
        if not isinstance(uri, str):
            raise InvalidArgument(f"{where}: expected a string, got {type(uri).__name__}")
        kind, start, slash = _parts(uri)
        if not kind:  # 3FS, Mooncake, MemPool: the same form on both sides, if it is kvcm's
            try:
                parse_block_uri(uri)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where}: {_cut(uri)} is not a block kvcm created ({exc.message})") from None
            return uri
        name = uri[start:slash] if slash > start else ""
        found = self.directory(name, kind) if name else None
        if found is None:
            raise InvalidArgument(f"{where}: {_cut(uri)} names no {kind} storage kvcm knows")
        directory = found[0]
        path, mark, query = uri[slash:].partition("?")
        if not path.startswith(directory + "/"):
            raise InvalidArgument(f"{where}: {_cut(uri)} is outside storage {name!r}'s {DIR_FIELD[kind]} "
                                  f"{directory or '/'}")
        kvcm = uri[:slash] + path[len(directory):] + mark + query
        try:
            parse_block_uri(kvcm)  # kvcm's exact form: no "..", no other file
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {_cut(uri)} is not a block kvcm created ({exc.message})") from None
        return kvcm


def _parts(uri: str) -> tuple[str, int, int]:
    """(kvcm storage type, where the host starts, where the path starts or -1) of a file or shm
    URI; ("", 0, -1) for another scheme."""
    if uri.startswith("file://"):
        return "file", 7, uri.find("/", 7)
    if uri.startswith("shm://"):
        return "shm", 6, uri.find("/", 6)
    return "", 0, -1


def _cut(uri: str) -> str:
    return repr(uri if len(uri) <= 200 else uri[:200] + "...")
