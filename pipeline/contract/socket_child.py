"""The entry of a child process that talks to its parent over one inherited socket (msgpack frames): the
engine process (``stages.engine_process``) and the grammar sandbox (``frontend.grammar_worker``)."""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection
from typing import Callable, NoReturn


def child_main(serve: Callable[[Connection], int], label: str) -> NoReturn:
    """Run ``serve`` on the socket whose descriptor is ``argv[1]``, then leave with its code. ``os._exit``,
    not ``sys.exit``: no lingering non-daemon thread may keep the child alive after its parent is gone."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {label} %(name)s: %(message)s")
    conn = Connection(int(sys.argv[1]))
    try:
        code = serve(conn)
    finally:
        conn.close()
    os._exit(code)
