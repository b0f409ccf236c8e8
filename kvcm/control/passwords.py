"""Account passwords: what a password may be, and its salted scrypt hash (the only form stored).

A password is checked when it is set and before every login (:func:`password_problem`); a stored
hash is parsed with bounded cost parameters, so a planted one (say, in a loaded snapshot) cannot
make a login expensive.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

from kvcm.errors import InvalidArgument

_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1
_MAX_PASSWORD = 1024
# C0 and C1 control characters, NUL included: nobody types them, and a trailing NUL is
# invisible to the original hash format (see _scrypt_key).
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# The format hash_password writes; "scrypt" (the first format) is still verified.
_HASH_V2, _HASH_V1 = "scrypt2", "scrypt"


def password_problem(password: str) -> str | None:
    """Why ``password`` cannot be a password, or None: it must be 1..1024 bytes of UTF-8
    without control characters. Checked when a password is set and before every login."""
    try:
        size = len(password.encode())
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a JSON "\ud800" escape
        return "must be valid Unicode text"
    if not 0 < size <= _MAX_PASSWORD:
        return f"must be 1..{_MAX_PASSWORD} bytes"
    if CONTROL_CHARS.search(password):
        return "must not contain control characters (NUL, tab, newline, ...)"
    return None


def check_password(password: str) -> None:
    problem = password_problem(password)
    if problem is not None:
        raise InvalidArgument(f"password: {problem}")


def hash_password(password: str) -> str:
    """``scrypt2$N$r$p$salt$hash`` (base64) with a fresh random salt."""
    check_password(password)
    salt = secrets.token_bytes(16)
    digest = _scrypt(_scrypt_key(password, _HASH_V2), salt, _SCRYPT_N, _SCRYPT_R, _SCRYPT_P)
    return "$".join([_HASH_V2, str(_SCRYPT_N), str(_SCRYPT_R), str(_SCRYPT_P), _b64(salt), _b64(digest)])


def verify_password(password: str, encoded: str) -> bool:
    """Constant-time check of ``password`` against a :func:`hash_password` string. A string that
    cannot be a password (:func:`password_problem`) never matches, whatever the hash."""
    try:
        version, n, r, p, salt, digest = _parse_hash(encoded)
    except ValueError:
        return False
    if password_problem(password) is not None:
        return False
    return hmac.compare_digest(_scrypt(_scrypt_key(password, version), salt, n, r, p), digest)


def check_password_hash(encoded: str) -> None:
    """Refuse a malformed or abusive (huge cost) hash, e.g. in a loaded snapshot."""
    try:
        _parse_hash(encoded)
    except ValueError as exc:
        raise InvalidArgument(f"password_hash: {exc}") from None


def _parse_hash(encoded: str) -> tuple[str, int, int, int, bytes, bytes]:
    parts = encoded.split("$")
    if len(parts) != 6 or parts[0] not in (_HASH_V2, _HASH_V1):
        raise ValueError("not an scrypt2$N$r$p$salt$hash string")
    if not all(x.isdigit() and len(x) <= 6 for x in parts[1:4]):
        raise ValueError("scrypt parameters must be small decimal numbers")
    n, r, p = (int(x) for x in parts[1:4])
    # Bounded so that a planted hash (e.g. in a loaded snapshot) cannot make a check take >128 MiB.
    if not (2 <= n <= 1 << 16 and n & (n - 1) == 0 and 1 <= r <= 16 and 1 <= p <= 4):
        raise ValueError("scrypt parameters out of range")
    return parts[0], n, r, p, base64.b64decode(parts[4], validate=True), base64.b64decode(parts[5], validate=True)


def _scrypt_key(password: str, version: str) -> bytes:
    """What scrypt is fed. scrypt uses the password as an HMAC-SHA256 key, and HMAC pads a key
    shorter than 64 bytes with zero bytes (and replaces a longer one by its SHA-256): fed raw,
    ``pw`` and ``pw\\0`` are the same key. The v2 format feeds SHA-256(password), always 32
    bytes, so two passwords share a key only if they share a SHA-256."""
    raw = password.encode()
    return hashlib.sha256(raw).digest() if version == _HASH_V2 else raw


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _scrypt(key: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(key, salt=salt, n=n, r=r, p=p, maxmem=256 * n * r + (1 << 20), dklen=32)
