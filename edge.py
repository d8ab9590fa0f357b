#!/usr/bin/env python3
"""The edge: an L7 load balancer and rate limiter in one process (or N, with --workers).

    python edge.py --demo                                  three built-in backends on free ports
    python edge.py --backends http://127.0.0.1:9001=3,http://127.0.0.1:9002 --limit 100/s
    python edge.py --config conf/edge.toml                 flags override the file

Signals: SIGHUP reloads the configuration; SIGTERM/SIGINT stop accepting, let in-flight requests
finish (up to --drain-timeout) and exit 0. See README.md for every flag and the TOML keys.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from lb.config import ConfigError, load


def serve(cfg, argv, reuse_port: bool = False, worker: int | None = None) -> int:
    """One serving process: build the app, handle signals, serve until told to stop, drain."""
    from lb.app import App
    log = logging.getLogger("edge")
    app = App(cfg, argv, reuse_port=reuse_port, worker=worker)

    def on_term(signum, frame):
        log.info("received %s: draining (up to %gs)", signal.Signals(signum).name, app.cfg.drain_timeout)
        threading.Thread(target=app.stop_accepting, name="stop", daemon=True).start()

    def on_hup(signum, frame):
        threading.Thread(target=app.reload, name="reload", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    app.serve_forever()
    app.drain()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s edge: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load(argv)
        if cfg.workers > 1:
            from lb import supervisor
            return supervisor.run(cfg, argv)
        return serve(cfg, argv)
    except ConfigError as e:
        print(f"edge: configuration error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the listen or admin address could not be bound
        print(f"edge: cannot start: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
