"""A request's state in the dispatcher across the steps and turns it goes through."""

from __future__ import annotations

import time
from typing import Any

from kvcm.rpc.methods import Method, Preparation


class Outcome:
    """One request on its way through the dispatcher, from its bytes to its reply."""


    __slots__ = ("authorized", "carried", "error", "method", "msgid", "params", "peer", "prepared", "preparing",
                 "result", "since", "size", "tag", "told_until", "waiting")

    def __init__(self, msgid: int | None, method: Method | None, tag: object = None, peer: bytes = b"") -> None:
        self.msgid = msgid
        self.method = method
        self.tag = tag
        self.peer = peer
        self.error: dict[str, Any] | None = None  # the wire error, once it failed
        self.result: object = None  # the raw params map until the handler replaces it
        self.params: object = None  # the validated request
        self.since = time.monotonic()
        self.authorized = False
        self.carried = False  # kept over from an earlier turn at least once
        self.preparing: Preparation | None = None  # preparation in progress
        self.prepared = False  # prepared (or nothing to prepare): a carried request is not asked again
        self.waiting = False  # carried for a verdict of another thread (not runnable yet)
        self.size = 0  # the request's bytes (a big refusal may be held: kvcm.rpc.tarpit)
        self.told_until: float | None = None  # refused unread: its sender was told to wait until then
