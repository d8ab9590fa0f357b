"""What the limit stage shows operators, read from it and spending nothing: the [[rules]] in force (/status),
the key table's fill, and one client's state under each limit (the admin API's GET /limits/KEY).

Off the request path: lb/limiting/stage.py decides, this module only describes.
"""

from __future__ import annotations

from lb import netaddr
from lb.limiting.identity import ip_key
from lb.limiting.rules import BUILTIN
from limiter import MemoryStore


def rules_status(stage) -> list[dict]:
    """The [[rules]] in force, for /status: what each says and how many keys it holds in memory."""
    out = []
    for r in stage.rules:
        s = r.spec
        match = {
            k: v
            for k, v in (
                ("path_prefix", s.path_prefix),
                ("methods", list(s.methods)),
                ("host", s.host),
                ("client_cert_subject", list(s.client_cert_subjects)),
            )
            if v
        }
        row = {
            "name": r.name,
            "key": s.key,
            "limit": s.limit,
            "algorithm": r.algorithm,
            "match": match,
            "dry_run": s.dry_run,
        }
        if s.cost != 1:
            row["cost"] = s.cost
        if s.max_in_flight:
            row["max_in_flight"] = s.max_in_flight
        if isinstance(r.limiter, MemoryStore):
            row["keys"] = len(r.limiter)
        elif hasattr(r.limiter, "held"):  # --workers: the shared table, the same in every worker
            row["keys"] = r.limiter.held()
        out.append(row)
    return out


def key_table(stage) -> dict:
    """The key table's fill: keys holding state now and the cap (memory: summed over this process's
    limiters; shm: the one table every worker shares, counted at most once a second -- a scan)."""
    lims = list(stage.limiters.values())
    if not lims or not hasattr(lims[0], "__len__") or not hasattr(lims[0], "max_keys"):
        return {"keys": None, "max_keys": None, "shared": False}  # Redis: the server holds them
    if isinstance(lims[0], MemoryStore):
        return {"keys": sum(len(x) for x in lims), "max_keys": lims[0].max_keys * len(lims), "shared": False}
    if hasattr(lims[0], "held"):
        lims[0].held()  # takes (or reuses) the table's census
        return {"keys": sum(lims[0].arena.census[1].values()), "max_keys": lims[0].max_keys, "shared": True}
    return {"keys": len(lims[0]), "max_keys": lims[0].max_keys, "shared": True}


def peek(stage, who: str = "", api_key: bytes | None = None, now: float | None = None) -> tuple[int, dict]:
    """(HTTP status, body): each limit's answer for a client now, spending nothing (the stores' peek:
    the algorithm's step on the stored state, not stored). who: "ip:ADDR" or "key:NAME" of a known key;
    api_key: a raw X-Api-Key, taken from a header of the admin request so that it is in no URL (admin
    access logs, shell history). A raw key is never accepted in `who`."""
    known = None
    if api_key is not None:
        try:
            ident, label, known = stage.identify(api_key, "")
        except ValueError as e:
            return 400, {"error": str(e)}
        if ident is None or ident == "ip:":
            return 404, {"error": "unknown API key: its client is limited by IP address; ask for ip:ADDR"}
    elif who.startswith("ip:"):
        try:
            ident = label = ip_key(str(netaddr.ip(who[3:])), stage.ipv6_prefix)
        except ValueError:
            return 400, {"error": f"{who[:64]!r}: not an IP address (ip:1.2.3.4, ip:2001:db8::1)"}
    elif who.startswith("key:"):
        known = stage.registry.names.get(who[4:]) if stage.registry is not None else None
        if known is None:
            # not echoed: it may be a raw key someone put in the URL
            return 404, {
                "error": "key:NAME names a known key (api_keys_file) and there is none of that name; "
                "for any other key send it in the X-Api-Key header of GET /limits/key, "
                "never in the URL"
            }
        ident = label = who
    else:
        return 400, {
            "error": "ask for /limits/ip:ADDR, /limits/key:NAME (a known key) or /limits/key with "
            "the key in an X-Api-Key header"
        }
    out = {
        "key": label,
        "exempt": ident in stage.exempt_names or (ident.startswith("ip:") and stage.ip_exempt(ident[3:].split("/")[0])),
        "rules": [],
    }
    lim = stage.overrides.get(ident)
    source = "override"
    if lim is None:
        lim, source = (stage.tiers.get(known.name), "tier") if known is not None else (None, "")
        if lim is None:
            lim, source = stage.default, "default"
    if lim is not None:
        out["rules"].append(_peek_one(BUILTIN, lim, ident, now, source=source))
    for r in stage.rules:
        if r.kind == "ip":
            key = ident if ident.startswith("ip:") else None
        else:
            key = {"api-key": ident, "global": "*"}.get(r.kind)
        if key is None:
            out["rules"].append(
                {"rule": r.name, "applies": False, "why": f"keyed by {r.spec.key}, not by this kind of client"}
            )
        else:
            out["rules"].append(_peek_one(r.name, r.limiter, key, now, dry_run=not r.enforce, algorithm=r.algorithm))
    return 200, out


def _peek_one(name, lim, key, now, **extra) -> dict:
    row = {"rule": name, "applies": True, "limit": lim.limit, "window": lim.algorithm.window, **extra}
    try:
        held, d = lim.peek(key, now)
    except Exception as e:  # a store that does not answer: say so, for this rule only
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    # remaining: requests admitted now before a rejection (the Decision's counts after one more)
    row.update(
        tracked=held,
        would_admit=d.allowed,
        remaining=d.remaining + 1 if d.allowed else 0,
        reset=round(d.reset, 3),
        retry_after=round(d.retry_after, 3),
    )
    return row
