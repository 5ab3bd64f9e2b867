"""``bridgeflow serve``: push a flow to a remote consumer over ZeroMQ; ``bridgeflow keys``: make the keys.

``SOURCE`` is ``module:function`` (or ``file.py:function``) returning a DataFlow, or a dataset file
written by bridgeflow (LMDB, HDF5, npz; recognised by content). The flow is served on ``--addr``
(loopback by default) for ``--epochs`` passes, with a progress line on stderr; a
:class:`~bridgeflow.remote.RemoteDataZMQ` on the trainer connects to that address. ``--keys FOLDER``
encrypts and authenticates the stream (CurveZMQ): only a consumer given the same folder can read it. Make
the folder once with ``bridgeflow keys FOLDER`` and copy it to every machine (see
:mod:`bridgeflow.remote._keys`).

Example:
    $ bridgeflow keys ~/.bridgeflow/job-keys
    $ bridgeflow serve mypkg.data:train_flow --addr tcp://0.0.0.0:8877 --keys ~/.bridgeflow/job-keys --epochs 0
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._base import DataFlow
from ._commands import load_object

__all__ = ["DEFAULT_ADDR", "load_source", "register"]

DEFAULT_ADDR = "tcp://127.0.0.1:8877"


def _load_file(path: str, shuffle: bool, allow_pickle: bool = False) -> DataFlow:
    from .serialize import load  # recognises LMDB, HDF5 and npz files by their content

    return load(path, shuffle=shuffle, allow_pickle=allow_pickle)


def load_source(source: str, shuffle: bool = False, allow_pickle: bool = False) -> Any:
    """The flow named by ``source``: an existing dataset file, or ``module:function``."""
    if os.path.exists(source):
        return _load_file(source, shuffle, allow_pickle)
    if ":" not in source:
        raise FileNotFoundError(f"bridgeflow serve: no such file: {source} (and it is not module:function)")
    df = load_object(source)
    if not hasattr(df, "__iter__"):
        raise ValueError(f"bridgeflow serve: {source} gave a {type(df).__name__}, not a DataFlow or iterable")
    return df


def _cmd_serve(args: argparse.Namespace) -> int:
    from .remote import send_dataflow_zmq

    df = load_source(args.source, shuffle=args.shuffle, allow_pickle=args.allow_pickle)
    epochs = None if args.epochs == 0 else args.epochs
    try:
        n = send_dataflow_zmq(df, args.addr, hwm=args.hwm, codec=args.codec, epochs=epochs,
                              heartbeat_s=args.heartbeat, send_timeout=args.send_timeout,
                              progress=not args.quiet, keys=args.keys, allow_insecure=args.allow_insecure)
    finally:
        if hasattr(df, "close"):
            df.close()
    print(f"served {n} datapoints on {args.addr}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from .remote import generate_keys

    try:
        keys = generate_keys(args.folder, overwrite=args.overwrite)
    except FileExistsError as exc:  # the function's argument is overwrite=True; the command's, --overwrite
        raise FileExistsError(str(exc).replace("overwrite=True", "--overwrite")) from None
    print(f"wrote CurveZMQ keys to {keys.source} (server {keys.server_public.decode()}, client "
          f"{keys.client_public.decode()}); copy the folder to every machine of the job (its *.key_secret files "
          "are secrets) and pass it as --keys / keys=")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``serve`` and ``keys`` sub-commands to the ``bridgeflow`` command line."""
    p = subparsers.add_parser("serve", help="serve a flow or dataset file to RemoteDataZMQ consumers over ZeroMQ")
    p.add_argument("source", help="module:function returning a DataFlow, or a dataset file (LMDB, HDF5, npz)")
    p.add_argument("--addr", default=DEFAULT_ADDR,
                   help=f"address to bind (default {DEFAULT_ADDR}, loopback only); one other machines can reach "
                        "needs --keys, or --allow-insecure")
    p.add_argument("--keys", metavar="FOLDER", default=None,
                   help="encrypt and authenticate the stream with the CurveZMQ keys of FOLDER (made by "
                        "bridgeflow keys, copied to every machine): only consumers holding them can read it")
    p.add_argument("--allow-insecure", action="store_true",
                   help="serve an address other machines can reach without --keys: anyone who can connect can "
                        "then read the stream (only on a network you trust)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the flow; 0 serves forever (default 1)")
    p.add_argument("--hwm", type=int, default=50, help="messages queued before sending blocks (default 50)")
    p.add_argument("--codec", default="bridgeflow", choices=("bridgeflow", "pickle"),
                   help="datapoint codec (default bridgeflow; pickle needs allow_pickle=True to read)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats when idle")
    p.add_argument("--send-timeout", type=float, default=None,
                   help="give up when no consumer takes data for this many seconds (default: wait)")
    p.add_argument("--shuffle", action="store_true", help="shuffle a dataset file's order each pass")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a dataset file written with codec=pickle (only files you trust)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_serve)

    k = subparsers.add_parser("keys", help="make a folder of CurveZMQ keys for serve --keys / keys=")
    k.add_argument("folder", help="the folder to write (created; secrets readable by you only)")
    k.add_argument("--overwrite", action="store_true", help="replace the keys already in FOLDER")
    k.set_defaults(func=_cmd_keys)
