"""Block keys from a request's ``token_ids``: the prepare hook of the methods that take a prompt.

Hashing a long prompt is the one piece of a request's work that happens before it is costed and
run, and it may take longer than everyone else's requests of a turn together. So it is done a
slice at a time (:data:`HASH_SLICE` tokens): the dispatcher gives the hook what is left of the
turn's preparation allowance, and a prompt that is not finished is carried to the next turn,
the requests arriving meanwhile being answered between its slices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvcm.cache.keys import ChainHasher
from kvcm.errors import Code, error
from kvcm.proto.extra_keys import BlockExtras, check_request, request_extras
from kvcm.proto.requests.prompt import PromptRequest
from kvcm.rpc.dispatch import Admission, Preparation, Prepare

#: Tokens hashed per slice before the clock is looked at again (about 0.3 ms).
HASH_SLICE = 1024

R = TypeVar("R")


@dataclass(frozen=True)
class TokenWork:
    """Keys to derive before the handler runs: ``done(keys)`` stores them on the request.
    ``extras``: the prompt's extra keys (:func:`kvcm.proto.extra_keys.request_extras`), mixed in."""

    tokens: Sequence[int]
    block_size: int
    done: Callable[[list[int]], None]
    extras: BlockExtras | None = None


class _Hashing:
    """One prompt being hashed over as many turns as it takes (:class:`Preparation`)."""

    __slots__ = ("_hasher", "_work")
    reason = "hashing"

    def __init__(self, work: TokenWork) -> None:
        self._work = work
        self._hasher = ChainHasher(work.block_size, extras=work.extras)

    def advance(self, deadline: float) -> bool:
        """Hash slices until the prompt is done (True) or ``deadline`` (``time.perf_counter``)
        has passed (False). A prompt not started yet always gets its first slice, so every
        request makes progress."""
        work, hasher = self._work, self._hasher
        step = max(1, HASH_SLICE // work.block_size) * work.block_size  # whole blocks per slice
        fed = len(hasher.keys) * work.block_size
        while fed < len(work.tokens):
            if fed and time.perf_counter() > deadline:
                return False
            hasher.feed(work.tokens[fed:fed + step])
            fed += step
        work.done(hasher.keys)
        return True


def hash_tokens(tokens_of: Callable[[R], TokenWork | None]) -> Prepare[R]:
    """The prepare hook of a method whose requests may give ``token_ids`` instead of keys:
    ``tokens_of`` says what to hash (None: the request gave keys, nothing to do). It is asked
    of every request of the method, so it also refuses extra keys sent without ``token_ids``."""

    def prepare(request: R, admission: Admission) -> Preparation | None:
        work = tokens_of(request)
        if work is None:
            return None
        keys = len(work.tokens) // work.block_size
        if keys > admission.max_keys:
            raise error(Code.TOO_MANY_KEYS, f"{admission.method}: token_ids make {keys} blocks of {work.block_size}; "
                                            f"the limit is {admission.max_keys} (server.max_keys)")
        # refused before any hashing when the keys it would make are refused once made
        admission.refuse_if_too_large(keys, per_key=(work.block_size, "token_ids"))
        return _Hashing(work)

    return prepare


def prompt_work(request: PromptRequest, given: bool, block_size: Callable[[], int]) -> TokenWork | None:
    """What to hash for a request naming its blocks by a prompt (None: it gave keys, ``given``, or
    no tokens); the keys go to its ``block_keys``. Extra keys sent without ``token_ids`` are
    refused here (they would be left out silently). ``block_size()``: the instance's, looked up
    only when there is something to hash."""
    r = request
    check_request(bool(r.token_ids) and not given, r.extra_keys, r.mm_features, r.cache_salt)
    if given or not r.token_ids:
        return None
    size = block_size()

    def done(keys: list[int]) -> None:
        r.block_keys = keys

    extras = request_extras(tokens=len(r.token_ids), block_size=size, extra_keys=r.extra_keys,
                            mm_features=r.mm_features, lora_name=r.lora_name, cache_salt=r.cache_salt)
    return TokenWork(r.token_ids, size, done, extras)
