"""``kvcm keys generate DIR [--name NAME]``: a CURVE key pair for a kvcm server or client.

Writes ``DIR/NAME.key`` (the public certificate, to hand out) and ``DIR/NAME.key_secret`` (the
key pair, mode 0600, to keep), in the zmq.auth certificate format, and prints the public key
(z85) on stdout so a script can capture it.
"""

from __future__ import annotations

import argparse
import sys

from kvcm.rpc.curve import create_certificates


def add_keys_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``keys`` (with ``generate``) to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser("keys", help="CURVE key pairs for encrypted connections")
    sub = p.add_subparsers(dest="keys_cmd", required=True)
    gen = sub.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (secret, 0600) into DIR")
    gen.add_argument("dir", help="directory to write into (created 0700 if missing)")
    gen.add_argument("--name", default="kvcm", help="file name stem (default: kvcm)")
    p.set_defaults(run=run_keys)
    return p


def run_keys(args: argparse.Namespace) -> int:
    try:
        public_path, secret_path, keys = create_certificates(args.dir, args.name)
    except OSError as exc:
        print(f"kvcm keys: cannot write into {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(keys.public.decode())
    print(f"wrote {public_path} (public) and {secret_path} (secret, mode 0600)", file=sys.stderr)
    return 0
