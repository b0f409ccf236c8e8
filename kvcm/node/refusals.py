"""Start-up refusals that name what is in the way: a port another process holds, a metadata
store that cannot be read. Each is a :class:`~kvcm.errors.StartRefused` whose message says which
setting or flag changes it, so ``kvcm serve`` exits with one readable line."""

from __future__ import annotations

import errno
import os

from kvcm.config import Config, HttpConfig
from kvcm.errors import StartRefused
from kvcm.http import SidePort
from kvcm.rpc.server import endpoint_in_use


def refuse_taken_ports(config: Config, side_port: SidePort | None) -> None:
    """A taken port refuses the start before the data dir is even opened; the binds still
    report a port taken in between (and clean up what was built). ``side_port``: the side HTTP
    port an HA node holds already (nothing to check)."""
    if endpoint_in_use(config.server.endpoint):
        raise rpc_in_use(config.server.endpoint)
    if config.http.enabled and side_port is None and http_port_in_use(config.http):
        raise http_in_use(config.http)
    if config.publisher.enabled:
        for key, endpoint in (("endpoint", config.publisher.endpoint),
                              ("replay_endpoint", config.publisher.replay_endpoint)):
            if endpoint and endpoint_in_use(endpoint):
                raise publisher_in_use(key, endpoint)


def rpc_in_use(endpoint: str) -> StartRefused:
    return StartRefused(f"the RPC endpoint {endpoint} is already in use by another process; "
                        "choose another with --endpoint or server.endpoint")


def http_port_in_use(cfg: HttpConfig) -> bool:
    if cfg.port == 0:
        return False
    return endpoint_in_use(f"tcp://{'[' + cfg.host + ']' if ':' in cfg.host else cfg.host}:{cfg.port}")


def http_in_use(cfg: HttpConfig) -> StartRefused:
    default = (" (the default http.port: every kvcm binds it unless told otherwise, so a second server "
               "needs its own)") if cfg.port == HttpConfig.port else ""
    return StartRefused(f"the HTTP port {cfg.host}:{cfg.port} is already in use by another process{default}; "
                        "choose another with --http-port or http.port (0 picks a free port)")


def http_bind_failed(cfg: HttpConfig, exc: OSError) -> StartRefused:
    """Why the side HTTP port could not be bound: taken, or not bindable at all."""
    if exc.errno == errno.EADDRINUSE:
        return http_in_use(cfg)
    return StartRefused(f"cannot bind the HTTP port {cfg.host}:{cfg.port} "
                        f"({exc.strerror or exc}); change --http-port or http.host / http.port")


def publisher_in_use(key: str, endpoint: str) -> StartRefused:
    return StartRefused(f"the publisher's {endpoint} is already in use by another process; "
                        f"choose another with --set publisher.{key}=...")


def store_error(config: Config, exc: Exception) -> StartRefused:
    """The metadata store is there but cannot be read (corrupt, or of another format)."""
    meta = os.path.join(os.path.abspath(config.store.data_dir), "meta", "data.mdb")
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StartRefused(
        f"the metadata {meta} cannot be read ({type(exc).__name__}: {reason}); nothing was changed or deleted. "
        "Restore it from a backup (or move it away to start empty)"
    )


__all__ = ["http_bind_failed", "http_in_use", "http_port_in_use", "publisher_in_use", "refuse_taken_ports",
           "rpc_in_use", "store_error"]
