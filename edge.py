#!/usr/bin/env python3
"""The edge: an L7 load balancer and rate limiter in one process.

    python edge.py --demo                                  three built-in backends on free ports
    python edge.py --backends http://127.0.0.1:9001=3,http://127.0.0.1:9002 --limit 100/s
    python edge.py --config conf/edge.toml                 flags override the file

See README.md for every flag and the TOML keys.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from lb.app import App
from lb.config import ConfigError, load


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s edge: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
    log = logging.getLogger("edge")
    try:
        cfg = load(argv)
        app = App(cfg)
    except ConfigError as e:
        print(f"edge: configuration error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the listen or admin address could not be bound
        print(f"edge: cannot start: {e.strerror or e}", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        log.info("received %s: shutting down", signal.Signals(signum).name)
        threading.Thread(target=app.shutdown, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    app.serve_forever()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
