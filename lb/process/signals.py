"""The signals the edge handles, taken by one thread of their own and by no thread that reads.

A read waits in the kernel (SO_RCVTIMEO, lb/http/framing.py). A signal delivered to the reading thread
interrupts it (EINTR), and Python restarts the call (PEP 475) with the socket's whole timeout again:
a signal every second, to a thread reading with a 2 s bound, and the read never ends -- a deadline
stretched without limit. So the serving process blocks these signals before it starts any thread
(every thread inherits the block: nothing to do per connection) and one thread takes them with
sigwait(). The Python handlers stay installed as the disposition; they are never delivered.
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def route(handler) -> None:
    """From the main thread, before it starts any other: block HANDLED here (so in every thread
    started from now on) and call handler(signum) on the "signals" thread for each one that arrives."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)

    def take() -> None:
        while True:
            handler(signal.sigwait(HANDLED))

    threading.Thread(target=take, name="signals", daemon=True).start()
