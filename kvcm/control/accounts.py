"""Accounts and API tokens in the registry: add, update, delete (an admin always remains), tokens by digest."""

from __future__ import annotations

import msgspec

from kvcm.backends.metastore.base import ReadTxn
from kvcm.control.passwords import hash_password
from kvcm.control.records import (
    ALL_GROUPS,
    Account,
    Token,
    check_account,
    check_token_label,
    new_token,
    now_ms,
)
from kvcm.control.registry_core import RegistryCore
from kvcm.errors import Code, Conflict, InvalidArgument

#: Longest token lifetime ``add_token`` accepts (ten years); 0 means no expiry.
_MAX_TOKEN_TTL_S = 10 * 365 * 86400


class AccountRegistry(RegistryCore):
    """Accounts and API tokens in the registry: add, update, delete (an admin always remains), tokens by digest."""

    def add_account(
        self, user_name: str, password: str, role: str = "user", groups: list[str] | None = None
    ) -> Account:
        """``groups``: the instance groups the account may use; none by default (``["*"]`` = all)."""
        normalized = check_account(user_name, role, [] if groups is None else groups)
        password_hash = hash_password(password)  # slow: outside the write transaction
        with self._store.write() as txn:
            if self._accounts.read(txn, user_name) is not None:
                raise Conflict(f"account {user_name!r} already exists", Code.DUPLICATE_ENTITY)
            now = now_ms()
            account = Account(
                user_name=user_name,
                role=role,
                password_hash=password_hash,
                groups=normalized or [],
                create_time=now,
                update_time=now,
            )
            self._accounts.put(txn, account, self._changed)
            return account

    def update_account(
        self,
        user_name: str,
        password: str | None = None,
        role: str | None = None,
        groups: list[str] | None = None,
        caller: str | None = None,
    ) -> Account:
        """Change a password, role and/or groups. The last admin cannot be demoted, nor can
        ``caller`` (the admin making the call) demote itself."""
        normalized = check_account(user_name, role or "user", groups)
        password_hash = None if password is None else hash_password(password)
        with self._store.write() as txn:
            old = self._must(txn, self._accounts, user_name)
            if role == "user" and old.role == "admin":
                self._not_the_caller(user_name, caller, "demote")
                self._keep_an_admin(txn, user_name)
            new = msgspec.structs.replace(
                old,
                role=role or old.role,
                password_hash=password_hash or old.password_hash,
                groups=old.groups if normalized is None else normalized,
                update_time=now_ms(),
            )
            self._accounts.put(txn, new, self._changed)
            return new

    def delete_account(self, user_name: str, caller: str | None = None) -> None:
        """The last admin cannot be deleted (it would lock everyone out when auth is on), nor can
        ``caller`` delete itself. The account's API tokens go with it, in the same commit."""
        self._not_the_caller(user_name, caller, "delete")
        with self._store.write() as txn:
            old = self._must(txn, self._accounts, user_name)
            if old.role == "admin":
                self._keep_an_admin(txn, user_name)
            for token in self._tokens.all(txn):
                if token.user_name == user_name:
                    self._tokens.delete(txn, token.token_id, self._changed)
            self._accounts.delete(txn, user_name, self._changed)

    def _keep_an_admin(self, txn: ReadTxn, leaving: str) -> None:
        if not any(a.role == "admin" and a.user_name != leaving for a in self._accounts.all(txn)):
            raise Conflict(f"account {leaving!r} is the last admin; add another admin first", Code.STILL_REFERENCED)

    @staticmethod
    def _not_the_caller(user_name: str, caller: str | None, what: str) -> None:
        if caller is not None and caller == user_name:
            raise Conflict(
                f"you cannot {what} the account you are calling as ({user_name!r}); another admin can",
                Code.STILL_REFERENCED,
            )

    def ensure_admin(self, user_name: str, password: str) -> bool:
        """Create ``user_name`` as admin unless some admin exists. Returns True if created."""
        if any(a.role == "admin" for a in self._accounts.cache.values()):
            return False
        if self._accounts.cache.get(user_name) is not None:
            self.update_account(user_name, password, "admin", [ALL_GROUPS])
        else:
            self.add_account(user_name, password, "admin", [ALL_GROUPS])
        return True

    def add_token(self, user_name: str, name: str = "", ttl_seconds: float = 0.0) -> tuple[str, Token]:
        """A new token for ``user_name``: returns the token (its only appearance) and the stored
        record (its digest). ``ttl_seconds`` 0 = it never expires."""
        check_token_label(name)
        if not 0 <= ttl_seconds <= _MAX_TOKEN_TTL_S:
            raise InvalidArgument(f"ttl_seconds: must be in 0..{_MAX_TOKEN_TTL_S} (0 = no expiry)")
        token_id, token, digest = new_token()
        with self._store.write() as txn:
            self._must(txn, self._accounts, user_name)
            now = now_ms()
            expire = now + max(1, int(ttl_seconds * 1000)) if ttl_seconds else 0
            record = Token(
                token_id=token_id, user_name=user_name, digest=digest, name=name, create_time=now, expire_time=expire
            )
            self._tokens.put(txn, record, self._changed)
        return token, record

    def revoke_token(self, token_id: str) -> Token:
        """Delete a token; it stops working with the next request."""
        with self._store.write() as txn:
            old = self._must(txn, self._tokens, token_id)
            self._tokens.delete(txn, token_id, self._changed)
            return old
