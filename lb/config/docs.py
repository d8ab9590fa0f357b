"""The settings table (lb/config/schema.py) written out for people: --help's lines and the configuration reference's table.

    python3 -m lb.config.docs --markdown          print the README's configuration table
    python3 -m lb.config.docs --write docs/reference/configuration.md   rewrite it between its markers

tests/test_settings_table.py fails when docs/reference/configuration.md's table and the schema disagree.
"""

from __future__ import annotations

import json
import re
import sys

from lb.config.kinds import Bool, HostPort
from lb.config.schema import SETTINGS, Setting
from lb.netaddr import hostport


def default_text(s: Setting) -> str:
    """The default as the README writes it (markdown): `value`, off, none, or the setting's own words."""
    if s.shown is not None:
        return s.shown
    v = s.default
    if v is None or v is False:
        return "off"
    if v is True:
        return "`on`"
    if isinstance(s.kind, HostPort):
        return f"`{hostport(*v)}`"
    if isinstance(v, (tuple, frozenset)):
        if not v:
            return "none"
        items = sorted(v) if isinstance(v, frozenset) else list(v)
        return f"`{','.join(items)}`" if s.flag else f"`{json.dumps(items)}`"
    return f"`{v:g}`" if isinstance(v, float) else f"`{v}`"


def help_text(s: Setting) -> str:
    """--help's line: the help, then the default (a switch is off unless given: no default shown)."""
    shown = default_text(s).replace("`", "")
    if not shown or isinstance(s.kind, Bool):
        return s.help
    return f"{s.help} (default {shown})"


# -------------------------------------------------------------------------- the configuration reference's table


def _marked(help: str) -> str:
    """--help's plain text as the README writes it: flags in backticks, arrows."""
    return re.sub(r"(?<![`\w-])(--[a-z][a-z0-9-]*)", r"`\1`", help).replace(" -> ", " → ")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The README's configuration table, one row per setting, in the table's order."""
    rows = ["| flag | TOML | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        if s.flag:
            flag = f"`{s.flag} {s.value_name}`" if s.value_name else f"`{s.flag}`"
        else:
            flag = f"env `{s.env}`" if s.env else "—"
        if s.flag and s.env:
            flag += f", env `{s.env}`"
        toml = " or ".join(s.kind.toml_shown(p) for p in s.toml) or "—"
        rows.append(
            f"| {_cell(flag)} | {_cell(toml)} | {_cell(default_text(s) or '—')} | {_cell(s.doc or _marked(s.help))} |"
        )
    return "\n".join(rows) + "\n"


BEGIN = "<!-- the settings table: generated from lb/config/schema.py by `python3 -m lb.config.docs --write docs/reference/configuration.md` -->"
END = "<!-- end of the settings table -->"


def readme_table(text: str) -> str | None:
    """The table between its markers (None: no markers)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(BEGIN) : end].strip("\n") + "\n"


def write_readme(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no {BEGIN!r} ... {END!r} markers")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: start + len(BEGIN)] + "\n" + markdown() + text[end:])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv[:1] == ["--write"] and len(argv) == 2:
        write_readme(argv[1])
        return 0
    print("usage: python3 -m lb.config.docs --markdown | --write docs/reference/configuration.md", file=sys.stderr)
    return 2


if __name__ == "__main__":  # python3 -m lb.config.docs --markdown | --write docs/reference/configuration.md
    sys.exit(main(sys.argv[1:]))
