"""How much HPACK dynamic table the edge's encoders keep, on both sides (clients, h2c:// backends).

The peer's SETTINGS_HEADER_TABLE_SIZE is the most an encoder may keep, not what it must (RFC 7541 4.2).
h2 takes the peer's value as it comes, so a peer that allows 2^32-1 made the edge keep every distinct
field it ever sent on that connection (each x-request-id, each date: ~76 bytes a message), for the
connection's life. Here it is capped at the table size HTTP/2 starts with, as nginx does.
"""

from __future__ import annotations

ENCODER_TABLE = 4096


def cap_encoder_table(h2conn) -> None:
    """(after the peer's SETTINGS, under the connection's lock) Our encoder's table back to ENCODER_TABLE."""
    enc = h2conn.encoder
    if enc.header_table_size > ENCODER_TABLE:
        enc.header_table_size = ENCODER_TABLE
        # The size updates the next header block signals: never the peer's bigger one (a decoder that has
        # not yet applied its own SETTINGS refuses it), a smaller one still (RFC 7541 4.2), ours last.
        enc.table_size_changes = [v for v in enc.table_size_changes if v < ENCODER_TABLE] + [ENCODER_TABLE]
