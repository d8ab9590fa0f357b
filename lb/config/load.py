"""Configuration: command-line flags over an optional TOML file, validated into one frozen Config.

The settings themselves -- names, flags, TOML keys, kinds, defaults, help -- are one table,
lb/config/schema.py; this module reads the two sources with it (read_file, build_argparser) and
lb/config/validate.py checks what spans several keys. Every bad value raises ConfigError with one line
naming the key and the value; edge.py prints it and exits 2. The flag names and the file's keys are a
contract (README "Configuration").
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import replace
from typing import Any

from lb import __version__
from lb.config.docs import help_text

# The names the rest of the code imports from lb.config.load, its one door: the value kinds and specs
# (kinds.py), the checks (validate.py).
from lb.config.kinds import parse_backend_url, parse_hostport  # noqa: F401
from lb.config.schema import SETTINGS, Config, file_keys
from lb.config.validate import admin_token, check_rate, check_upgrades, redis_files, tls_listener, validate  # noqa: F401
from lb.errors import ConfigError

_FILE = file_keys()  # {"": the top-level keys, "health": [health]'s, ...}
_BY_NAME = {s.name: s for s in SETTINGS}


def read_file(path: str, problems: list[str]) -> dict:
    """The TOML file as Config field values (not yet cross-validated); problems collects every bad key."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        problems.append(f"--config {path}: {e.strerror}")
        return {}
    except tomllib.TOMLDecodeError as e:
        problems.append(f"--config {path}: not valid TOML: {e}")
        return {}
    except UnicodeDecodeError as e:  # tomllib decodes the whole file first: a binary or Latin-1 file
        problems.append(f"--config {path}: not valid TOML: not UTF-8 (byte {e.start})")
        return {}
    except RecursionError:  # tomllib parses nested arrays/tables recursively
        problems.append(f"--config {path}: not valid TOML: nested too deeply")
        return {}
    out: dict = {}
    for key, value in doc.items():
        try:
            if key in _FILE and key and isinstance(value, dict):
                out.update(_read_table(key, value, problems))
            elif key in _FILE[""]:
                s = _FILE[""][key]
                out[s.name] = s.kind.file(value, key)
            elif key in _FILE and key:
                raise ConfigError(f"{key}: expected a [{key}] table")
            else:
                known = ", ".join(dict.fromkeys(p.split(".")[0] for s in SETTINGS for p in s.toml))
                raise ConfigError(f"{key}: unknown key (known at the top level: {known})")
        except ConfigError as e:
            problems.extend(e.problems)
    return out


def _read_table(section: str, table: dict, problems: list[str]) -> dict:
    out: dict = {}
    for sub, v in table.items():
        try:
            if sub not in _FILE[section]:
                raise ConfigError(f"{section}.{sub}: unknown key (known in [{section}]: {', '.join(_FILE[section])})")
            s = _FILE[section][sub]
            out[s.name] = s.kind.file(v, f"{section}.{sub}")
        except ConfigError as e:
            problems.extend(e.problems)
    return out


def build_argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edge.py", description="An L7 load balancer and rate limiter.", argument_default=argparse.SUPPRESS
    )
    p.add_argument("--version", action="version", version=f"edge {__version__}")
    for s in SETTINGS:
        if s.flag:
            how: dict[str, Any] = {"dest": s.name, "help": _escaped(help_text(s))}
            if s.kind.action:
                how["action"] = s.kind.action
            if s.value_name:
                how["metavar"] = s.value_name
            p.add_argument(s.flag, **how)
    return p


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %-style (%(default)s)


def _from_flags(ns: argparse.Namespace, problems: list[str]) -> dict:
    out: dict = {}
    for name, value in vars(ns).items():
        s = _BY_NAME[name]
        try:
            out[name] = s.kind.flag(value, s.flag or name)
        except ConfigError as e:
            problems.extend(e.problems)
    return out


def _values_may_start_with_dash(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--limit -5/s` -> `--limit=-5/s`: argparse would take -5/s for an option and say "expected one
    argument"; as a value it gets the clear range error from the table instead."""
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs is None for o in a.option_strings}
    known = {o for a in parser._actions for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if (
            tok in takes_value
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1].split("=", 1)[0] not in known
        ):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def load(argv: list[str] | None = None) -> Config:
    """Flags over file over defaults, then the checks that span several keys. Raises ConfigError with
    every problem found (one line each), not only the first."""
    parser = build_argparser()
    ns = parser.parse_args(_values_may_start_with_dash(list(sys.argv[1:] if argv is None else argv), parser))
    problems: list[str] = []
    values: dict = {}
    path = getattr(ns, "config_path", None)
    if path:
        values.update(read_file(path, problems))
    values.update(_from_flags(ns, problems))
    if values.get("pools"):  # a pool's own [health]/[upstream] keys, read with this table's kinds
        from lb.config.routes import typed_overrides

        values["pools"] = typed_overrides(values["pools"], _FILE, problems)
    try:
        values["keys"] = _known_keys(values)
    except ConfigError as e:
        problems.extend(e.problems)
        values.pop("keys", None)
    cfg = replace(Config(), **values)
    later = validate(cfg)
    # not "none configured" as well when the backends (or the whole file) could not be read
    if any(p.startswith(("--backends", "backends", "--config")) for p in problems):
        later = [p for p in later if not p.startswith("backends: none configured")]
    problems += later
    if problems:
        raise ConfigError(*problems)
    return replace(cfg, upgrades=check_upgrades(cfg.upgrades))  # normalised (lower case, a set)


def _known_keys(values: dict) -> tuple:
    """[[keys]] tables, then the api_keys_file's (read now: a reload re-reads it)."""
    from lb.limiting.keys import check_unique, parse_keys, parse_tiers, read_keys_file

    try:
        tiers = parse_tiers(dict(values.get("tiers", ())), "limits.tiers")
        keys = parse_keys(values.get("keys", []), tiers, "keys")
        if values.get("api_keys_file"):
            keys += read_keys_file(values["api_keys_file"], tiers)
        check_unique(keys)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return keys
