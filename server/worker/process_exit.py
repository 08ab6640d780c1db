"""Ending a pdserve process (a worker, ``pdserve launch``) without the interpreter's teardown.

Once a process's ``main`` has returned, it has closed what other processes can see (control
sockets, the HTTP listener, the discovery lease; a launcher has stopped its workers). What remains
is its own memory, which the kernel frees at once when the process ends. The interpreter's own
teardown instead runs a final garbage collection over every object still alive (a worker's model
and KV pool, a router's tokenizer and app): 3 to 15 s each on a busy 2-core host. That is longer
than the launcher's stop grace (10 s), so a worker that had drained cleanly was SIGKILLed with a
warning, and every stop of a launch took that long again in the launcher itself. No module of
this repository registers ``atexit`` hooks or finalizers that skipping the teardown would lose.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the log handlers, stdout and stderr, then end the process with status ``code``
    (``os._exit``: no interpreter teardown, no atexit hooks). Call it only once ``main`` has
    returned; an exception out of ``main`` still ends the process the ordinary way."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)
