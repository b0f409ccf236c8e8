"""The ``kvcm`` command line: thin wrappers over the app, the client and the optimizer."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from kvcm.config import Config, ConfigError, ServerConfig, load, overrides_from_pairs, to_toml
from kvcm.errors import KvcmError, StartRefused

DEFAULT_ENDPOINT = ServerConfig.endpoint

log = logging.getLogger("kvcm.cli")

#: What ``add_subparsers`` returns: each subcommand (and each plugin's) adds its parser to it.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable)")


def _serve_parser(sub: Subcommands) -> None:
    p = sub.add_parser("serve", help="run the kvcm server (embedded default: ./kvcm-data)")
    _add_config_args(p)
    p.add_argument("--endpoint", help="RPC endpoint, e.g. tcp://127.0.0.1:6381 or ipc:///tmp/kvcm.sock")
    p.add_argument("--data-dir", help="data directory (LMDB metadata, file storage)")
    p.add_argument("--http-port", type=int, help="side HTTP port for /metrics, /livez, /readyz (0 = any)")
    p.add_argument("--memory", action="store_true", help="keep metadata in memory only (nothing persisted)")
    p.add_argument("--standby", action="store_true", default=None,
                   help="one of several nodes sharing this host's data dir: the first leads, the others follow "
                        "(answering reads) and take over when it stops or dies (server.standby: ha.enabled with "
                        "ha.coordination = file://DATA_DIR)")
    orphans = p.add_mutually_exclusive_group()
    orphans.add_argument("--adopt-orphans", dest="orphans", action="store_const", const="adopt", default="refuse",
                         help="storages hold blocks of lost metadata: keep the files (unindexed) and start")
    orphans.add_argument("--discard-orphans", dest="orphans", action="store_const", const="discard",
                         help="storages hold blocks of lost metadata: delete the blocks kvcm named, then start")


def _call_parser(sub: Subcommands) -> None:
    p = sub.add_parser("call", help="call one RPC method and print its JSON result", add_help=False,
                       description="Call one RPC method and print its JSON result.")
    p.add_argument("-h", "--help", action=_CallHelp, nargs=0, help="show this help (with the endpoint a call "
                   "would use now and the method names) and exit")
    p.add_argument("method", help="the RPC method (see the list below)")
    p.add_argument("params", nargs="?", default="{}", help="JSON object of parameters")
    _add_config_args(p)
    p.add_argument("--endpoint", help="the server's RPC endpoint; else $KVCM_SERVER_ENDPOINT, else server.endpoint "
                                      f"of --config FILE, else {DEFAULT_ENDPOINT}")
    p.add_argument("--timeout", type=_positive_seconds, default=10.0, help="seconds to wait for the reply")
    p.add_argument("--user", help="account name (when auth is on); its password comes from KVCM_PASSWORD, "
                                  "--password-file, or a prompt on a terminal")
    p.add_argument("--password", help="account password: visible in the process list, prefer KVCM_PASSWORD "
                                      "or --password-file")
    p.add_argument("--password-file", metavar="FILE", help="read the account password from FILE (its first line)")
    p.add_argument("--token", help="API token (add_token): visible in the process list, prefer KVCM_TOKEN")
    p.add_argument("--curve-server-key", metavar="FILE_OR_Z85",
                   help="CURVE: the server's public key (its .key file, or z85 text)")
    p.add_argument("--curve-client-key", metavar="SECRET_CERT_FILE",
                   help="CURVE: this client's secret certificate (default: an ephemeral key pair)")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def call_endpoint(args: argparse.Namespace) -> tuple[str, str]:
    """The endpoint ``kvcm call`` uses and where it came from: ``--endpoint`` > ``--set
    server.endpoint=...`` > ``KVCM_SERVER_ENDPOINT`` > ``server.endpoint`` of ``--config`` > the
    default (the precedence of :func:`kvcm.config.load`, the one ``kvcm serve`` follows)."""
    if getattr(args, "endpoint", None):
        return args.endpoint, "--endpoint"
    endpoint = effective_config(args).server.endpoint
    if any(pair.partition("=")[0].strip() == "server.endpoint" for pair in getattr(args, "sets", None) or []):
        return endpoint, "--set server.endpoint"
    if "KVCM_SERVER_ENDPOINT" in os.environ:
        return endpoint, "KVCM_SERVER_ENDPOINT"
    if getattr(args, "config", None) and endpoint != DEFAULT_ENDPOINT:
        return endpoint, f"server.endpoint in {args.config}"
    return endpoint, "default"


class _CallHelp(argparse.Action):
    """``kvcm call --help``: argparse's help plus the endpoint a call would use now (with the
    flags given before ``--help``, the environment and the config file) and the method names."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str | Sequence[object] | None,
                 option_string: str | None = None) -> None:
        from kvcm.client import METHODS

        try:
            endpoint, source = call_endpoint(namespace)
            now = f"{endpoint} (from {source}; default {DEFAULT_ENDPOINT})"
        except ConfigError as exc:
            now = f"unknown: config error: {exc} (default {DEFAULT_ENDPOINT})"
        print(parser.format_help(), end="")
        print(f"\nendpoint now: {now}\n\nmethods:")
        for name in METHODS:
            print(f"  {name}")
        parser.exit()


def _config_parser(sub: Subcommands) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    show = csub.add_parser("show", help="print the effective config as TOML")
    _add_config_args(show)


def _storage_parser(sub: Subcommands) -> None:
    p = sub.add_parser("storage", help="storage root tools")
    ssub = p.add_subparsers(dest="storage_cmd", required=True)
    release = ssub.add_parser("release", help="remove the ownership marker of a root whose data dir is gone "
                              "(its block files are not touched)")
    release.add_argument("root", help="a file storage's root_path, or a shm storage's shm_dir/prefix")
    release.add_argument("--force", action="store_true",
                         help="also a marker nothing proves (an earlier kvcm's), if the data dir it names does not "
                              "exist on this host")
    release.set_defaults(run=cmd_storage_release)


def cmd_storage_release(args: argparse.Namespace) -> int:
    from kvcm.backends.storage.release import release
    from kvcm.errors import KvcmError

    try:
        print(release(args.root, force=args.force))
    except (KvcmError, OSError) as exc:
        print(f"kvcm storage release: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcm", description="KV-cache metadata manager for LLM inference")
    parser.add_argument("--version", action="version", version=f"kvcm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _call_parser(sub)
    _config_parser(sub)
    _storage_parser(sub)
    _shards_parser(sub)
    _plugin_parsers(sub)
    return parser


def _shards_parser(sub: Subcommands) -> None:
    p = sub.add_parser("shards", help="list the shards of a sharded deployment: leaders, nodes, groups (any node "
                                      "of any shard answers)")
    _add_config_args(p)
    p.add_argument("--endpoint", help="a node's RPC endpoint; else as `kvcm call` finds one")
    p.add_argument("--timeout", type=_positive_seconds, default=5.0, help="seconds to wait for the reply")
    p.add_argument("--json", action="store_true", help="print the shard map as JSON")
    p.set_defaults(run=cmd_shards)


def cmd_shards(args: argparse.Namespace) -> int:
    """``kvcm shards``: ``get_shard_map`` of one node, as a table (or JSON)."""
    from kvcm.client import Client

    endpoint, _ = call_endpoint(args)
    auth = _call_auth(argparse.Namespace(token=None, user=None, password=None, password_file=None), os.environ)
    with Client(endpoint, timeout=args.timeout, retries=0, auth=auth) as client:
        reply = client.call("get_shard_map")
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    shards = reply.get("shards") or []
    if not shards:
        print(f"{endpoint}: not sharded (no shard.directory)")
        return 0
    print(f"directory {reply.get('directory')} (asked {endpoint}, shard {reply.get('shard')})")
    print(f"{'shard':<16} {'groups':>7}  {'leader':<40} nodes")
    for shard in shards:
        followers = [e for e in shard.get("endpoints", []) if e != shard.get("leader_endpoint")]
        print(f"{shard.get('name', ''):<16} {shard.get('groups', 0):>7}  {shard.get('leader_endpoint') or '(none)':<40} "
              f"{len(shard.get('endpoints', []))} ({', '.join(followers) or 'no followers'})")
    return 0


def _plugin_parsers(sub: Subcommands) -> None:
    """Subcommands owned by other packages (optimizer, engine events, CURVE keys)."""
    for module_name, adder in (("kvcm.optimizer.cli", "add_optimize_parser"), ("kvcm.engines.cli", "add_events_parser"),
                               ("kvcm.rpc.keygen", "add_keys_parser")):
        try:
            module = __import__(module_name, fromlist=[adder])
        except ImportError:
            continue
        getattr(module, adder)(sub)


def _version() -> str:
    from kvcm.version import __version__

    return __version__


def effective_config(args: argparse.Namespace) -> Config:
    layer = overrides_from_pairs(getattr(args, "sets", []) or [])
    flags = {
        ("server", "endpoint"): getattr(args, "endpoint", None),
        ("store", "data_dir"): getattr(args, "data_dir", None),
        ("http", "port"): getattr(args, "http_port", None),
        ("store", "backend"): "memory" if getattr(args, "memory", False) else None,
        ("server", "standby"): getattr(args, "standby", None),
    }
    for (section, key), value in flags.items():
        if value is not None:
            layer.setdefault(section, {})[key] = value
    return load(getattr(args, "config", None), overrides=layer)


#: ``kvcm serve``'s GIL switch interval (see cmd_serve); measured by ``scripts/bench_hostile``.
GIL_SWITCH_S = 0.0005


def cmd_serve(args: argparse.Namespace) -> int:
    from kvcm.node.app import App
    from kvcm.node.ha import HaNode, with_standby

    config = effective_config(args)
    logging.basicConfig(level=config.log.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The RPC loop shares the GIL with the side port's threads, the subscriber and the deleter:
    # a busy one holds it up to the switch interval (5 ms by default) before the loop gets it,
    # which is what one client's load (an HTTP flood, a replay) would add to everyone's latency.
    sys.setswitchinterval(GIL_SWITCH_S)
    stop = threading.Event()  # a stop asked for before the app exists (while it is being built)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    config = with_standby(config)
    app = (HaNode if config.ha.enabled else App)(config, orphans=args.orphans)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: app.request_stop())
    if stop.is_set():  # asked while the app was being built: it stops before serving
        app.request_stop()
    app.run(started=lambda: print("\n".join(app.startup_block(args.config)), flush=True))
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from kvcm.client import Client, Endpoints

    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as exc:
        print(f"kvcm call: params are not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(params, dict):
        print("kvcm call: params must be a JSON object", file=sys.stderr)
        return 2
    try:
        auth = _call_auth(args, os.environ)
    except _CredentialsError as exc:
        print(f"kvcm call: {exc}", file=sys.stderr)
        return 2
    endpoint, source = call_endpoint(args)
    if not any(_accepts_connections(e, min(CONNECT_PROBE_S, args.timeout)) for e in Endpoints(endpoint).all):
        print(f"kvcm call: no server answered at {endpoint} (from {source}) within "
              f"{min(CONNECT_PROBE_S, args.timeout):g} s: start one with `kvcm serve`, or point --endpoint "
              "or KVCM_SERVER_ENDPOINT at a running one", file=sys.stderr)
        return 1
    curve = bool(args.curve_server_key or args.curve_client_key)  # a client key alone is refused by Client
    with Client(endpoint, timeout=args.timeout, auth=auth, curve_server_key=args.curve_server_key if curve else None,
                curve_client_keys=args.curve_client_key if curve else None) as client:
        result = client.call(args.method, params)
    print(json.dumps(result, indent=2, sort_keys=True, default=_jsonable))
    return 0


#: How long ``kvcm call`` waits for a connection before saying no server is there: well under
#: the call's own timeout, which (with retries) is meant for a server that is slow, not absent.
CONNECT_PROBE_S = 2.0


def _accepts_connections(endpoint: str, timeout: float) -> bool:
    """Something accepts connections at ``endpoint`` (seen by the socket monitor, no message
    sent): a refused TCP port or a missing ipc socket never gets a connection, and zmq alone
    would retry silently until the call times out."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if monitor.poll(int(left * 1000) + 1) and recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED:
                return True
        return False
    except zmq.ZMQError:
        return False  # a malformed endpoint: the call itself reports it
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


class _CredentialsError(Exception):
    """The credentials ``kvcm call`` was given cannot be used (the message says why)."""


_VISIBLE = " is visible to other users in the process list; use {instead} instead"


def _call_auth(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The request's ``auth`` map: ``--token``, else ``--user`` with a password (``--password``,
    ``--password-file``, ``KVCM_PASSWORD``, a prompt), else ``KVCM_TOKEN``, else none."""
    if args.token is not None:
        if args.password is not None or args.password_file is not None:
            raise _CredentialsError("give --token or a password, not both")
        _warn("--token" + _VISIBLE.format(instead="KVCM_TOKEN"))
        return {"token": args.token}
    if args.user:
        return {"user": args.user, "password": _password(args, environ)}
    if args.password is not None or args.password_file is not None:
        raise _CredentialsError("a password needs --user")
    token = environ.get("KVCM_TOKEN")
    return {"token": token} if token else None


def _password(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if args.password is not None:
        _warn("--password" + _VISIBLE.format(instead="KVCM_PASSWORD or --password-file"))
        return str(args.password)
    if args.password_file is not None:
        try:
            with open(args.password_file, encoding="utf-8") as fh:
                first = fh.readline()
        except (OSError, UnicodeDecodeError) as exc:
            raise _CredentialsError(f"cannot read --password-file {args.password_file}: {exc}") from None
        return first.removesuffix("\n").removesuffix("\r")
    password = environ.get("KVCM_PASSWORD")
    if password:
        return password
    if sys.stdin.isatty():
        return getpass.getpass(f"password for {args.user}: ")
    raise _CredentialsError("--user needs a password: set KVCM_PASSWORD, give --password-file, or run on a terminal")


def _warn(message: str) -> None:
    print(f"kvcm call: warning: {message}", file=sys.stderr)


def _jsonable(value: object) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")


def cmd_config(args: argparse.Namespace) -> int:
    print(to_toml(effective_config(args)), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"serve": cmd_serve, "call": cmd_call, "config": cmd_config}
    handler = handlers.get(args.command) or getattr(args, "run", None)
    if handler is None:
        parser.error(f"unknown command {args.command}")
    try:
        return int(handler(args))
    except ConfigError as exc:
        print(f"kvcm: config error: {exc}", file=sys.stderr)
        return 2
    except StartRefused as exc:
        print(f"kvcm: {exc.message}", file=sys.stderr)
        return 2
    except KvcmError as exc:
        print(f"kvcm: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `kvcm call ... | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
