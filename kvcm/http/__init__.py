r"""The side HTTP port: ``/metrics`` (Prometheus), ``/livez``, ``/readyz`` and ``POST /api/<method>``.

``POST /api/<lowerCamelName>`` is Tair KVCM's RPC of that name, in Tair's JSON (:mod:`kvcm.tair`;
kvcm's own names are snake_case, so the two never clash). With ``http.admin_port`` a second
listener serves Tair's AdminService RPCs and nothing else, and the side port Tair's MetaService.

``/api`` calls are forwarded to the RPC front door through pooled :class:`~kvcm.client.Client`\ s,
so every method still runs on the RPC thread, with the same validation, auth and group commit.
Replies are JSON: ``{"result": {...}}`` with status 200, or ``{"error": {"code", "name",
"message"}}`` with the status below.

The port is for programs (Prometheus, probes, scripts), never for browsers. Any web page a user
visits can make the browser send requests to a loopback port, so the port refuses what only a
browser would send: a foreign ``Origin`` or ``Sec-Fetch-Site``, a ``Host`` that is not this
server's own address (DNS rebinding), and ``/api`` bodies that are not ``application/json`` (a
page can post ``text/plain`` without a CORS preflight). No CORS header is ever sent.

Each connection has one thread, at most ``http.max_connections`` of them, and at most
``http.max_connections_per_peer`` from one remote address; a connection past either gets a canned
503 and is closed on the accept thread. Past the cap, a few more slots (one per address) each
serve a single ``/livez`` or ``/readyz``, so probes are answered while the cap is full. A request
(line, headers and body) must arrive within ``http.read_timeout_s`` of its first byte (of the
connection, for the first request), however slowly it trickles in; a kept-alive connection idle
for ``http.idle_timeout_s`` is closed.

With auth on, a request's credentials are checked before its body is read: a bearer token with
RPC ``whoami`` (remembered briefly), and without one the body, which must then carry them, may be
``http.max_unauthenticated_body_bytes`` at most. Refused, the body is never read or parsed, only
drained briefly before the connection closes.

======  ============================================================================================
Status  When
======  ============================================================================================
200     the call succeeded (``/livez``, ``/readyz``: the probe passed)
204     ``OPTIONS`` of a known path (an ``Allow`` header, no CORS headers)
400     bad request line or headers, two ``Content-Length``, ``Content-Length`` with
        ``Transfer-Encoding``, a body that is not a JSON object, or has a key twice in an object, a
        non-finite number, an integer past 64 bits or nesting past 32 levels (named by its path);
        INVALID_ARGUMENT from the call
401     auth on and no or bad credentials, or no bearer token for a body over
        ``http.max_unauthenticated_body_bytes`` (``WWW-Authenticate: Bearer``; Tair's routes answer
        200 in Tair's reply, docs/tair.md); UNAUTHENTICATED
403     a foreign ``Origin`` or a cross-site ``Sec-Fetch-Site``; PERMISSION_DENIED
404     unknown path; METHOD_NOT_FOUND, NOT_FOUND, INSTANCE_NOT_EXIST, WRITE_SESSION_*
405     a method other than GET (probes, metrics), POST (``/api``) or OPTIONS
409     DUPLICATE_ENTITY, VERSION_CONFLICT, STILL_REFERENCED
411     ``/api`` POST without ``Content-Length``, or with ``Transfer-Encoding`` (chunked)
413     body larger than ``server.max_message_bytes``; MESSAGE_TOO_LARGE, TOO_MANY_KEYS, TOO_LARGE
415     ``/api`` body not sent as ``Content-Type: application/json``
421     ``Host`` is not an address of this server nor in ``http.allowed_hosts``
429     RATE_LIMITED
500     INTERNAL_ERROR, IO_ERROR, UNSUPPORTED, or a failure of the HTTP side itself
503     probe failed; connection cap (or the address's share of it) reached; SERVICE_NOT_READY,
        SHUTTING_DOWN, SERVER_NOT_LEADER
504     TIMEOUT: the RPC loop did not answer in time
507     QUOTA_EXCEEDED, NO_STORAGE_AVAILABLE, CAPACITY_EXHAUSTED, REACH_MAX_ENTITY_CAPACITY
======  ============================================================================================

The HTTP parser itself may also answer 414 (request line over 64 KiB) or 431 (too many or too long
headers). A refusal by the port itself (any status above that it decides before or instead of a
call) closes the connection and echoes nothing of the request; a call's own answer keeps it open.
``docs/http.md`` has the same table and the reasons behind each check. Modules: :mod:`.guards`,
:mod:`.server`, :mod:`.handler`, :mod:`.forwarding`, :mod:`.json_body`, :mod:`.side`.
"""

from __future__ import annotations

from kvcm.http.server import SidePort
from kvcm.http.side import SideHttp, refuse_unguarded

__all__ = ["SideHttp", "SidePort", "refuse_unguarded"]
