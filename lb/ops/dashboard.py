"""The admin listener's page (GET /): one self-contained HTML file -- its CSS and script inline, no
external asset, no build step, so it works offline and behind any firewall -- that polls /status and
/metrics of the same admin port and draws the backends, the traffic, the limits and the most limited
clients (HAProxy's stats page, for this edge). Read once at import: the admin handler only sends bytes.
"""

from __future__ import annotations

from pathlib import Path

CONTENT_TYPE = "text/html; charset=utf-8"
_PAGE = (Path(__file__).with_name("dashboard.html")).read_bytes()


def page() -> bytes:
    return _PAGE
