"""The Lua scripts the Redis stores run, kept as files in lua/ (package data), as the `limits` library
keeps its own: read as Lua (an editor highlights and checks them; a diff is a diff of Lua), and each
module's Python says only how a script is assembled and called. Read once, at import."""

from __future__ import annotations

from importlib.resources import files


def lua(name: str) -> str:
    """The text of lua/NAME, exactly as the file holds it."""
    return files(__package__).joinpath("lua", name).read_text(encoding="utf-8")
