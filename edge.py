#!/usr/bin/env python3
"""The edge: an L7 load balancer and rate limiter in one process (or N, with --workers).

    python3 edge.py --demo                                  three built-in backends on free ports
    python3 edge.py --backends http://127.0.0.1:9001=3,http://127.0.0.1:9002 --limit 100/s
    python3 edge.py --config conf/edge.toml                 flags override the file
    python3 edge.py --check --config conf/edge.toml         validate, print each problem, exit 0 or 2

Signals: SIGHUP reloads the configuration (and reopens the logs); SIGUSR1 reopens the logs;
SIGTERM/SIGINT stop accepting, let in-flight requests finish (up to --drain-timeout) and exit 0.
See README.md for every flag and the TOML keys.

This file only parses, configures and calls down: lb/process/serve.py serves, lb/process/supervisor.py runs workers.
"""

from __future__ import annotations

import sys

from lb import logs
from lb.config.load import load
from lb.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    logs.remember_stderr()
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load(argv)
    except ConfigError as e:
        for p in e.problems:
            logs.say(f"configuration error: {p}")
        return 2
    if cfg.check:
        from lb.config.check import problems
        from lb.netaddr import hostport
        found = problems(cfg)
        for p in found:
            logs.say(f"configuration error: {p}")
        if not found:
            print(f"edge: configuration OK ({cfg.config_path or 'flags only'}: {len(cfg.backends)} backends, "
                  f"listen {hostport(*cfg.listen)}{', tls' if cfg.tls_cert else ''}"
                  f"{', limit ' + cfg.limit if cfg.limit else ''})")
        return 2 if found else 0
    from lb.errors import StartError
    try:
        if cfg.workers > 1:
            from lb.process import supervisor
            return supervisor.run(cfg, argv)
        from lb.process.serve import serve
        return serve(cfg, argv)
    except StartError as e:
        logs.say(f"cannot start: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
