"""Human-readable renderings for the CLI: sizes, ages, tables, and one view per operator command.

Pure functions of plain data (the dicts the daemon sends, or results passed
through ``dataclasses.asdict``): no I/O, no clock reads (``now`` is an
argument), so every rendering is testable as a string. Missing fields render
as ``-`` rather than failing, so a newer daemon with extra or fewer counters
still prints.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.units import format_bytes

TIERS = ("hbm", "ram", "nvme")


def format_duration(seconds: float | None) -> str:
    """``42 -> "42s"``, ``3725 -> "1h 2m"``, ``90061 -> "1d 1h"``: the two largest units."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    i = next(i for i, (_, size) in enumerate(units) if s >= size or size == 1)
    big, big_size = units[i]
    text = f"{s // big_size}{big}"
    if i + 1 < len(units):
        small, small_size = units[i + 1]
        rest = (s % big_size) // small_size
        if rest:
            text += f" {rest}{small}"
    return text


def format_age(timestamp: float | None, now: float) -> str:
    """How long before ``now`` a Unix time was: ``"5m ago"``; ``-`` for unset (0 or None)."""
    if not timestamp:
        return "-"
    if timestamp > now:
        return "just now"
    return f"{format_duration(now - timestamp)} ago"


def format_count(n: int | float | None) -> str:
    return "-" if n is None else f"{int(n):,}"


def format_ratio(part: float | None, whole: float | None) -> str:
    if part is None or not whole:
        return "-"
    return f"{100.0 * part / whole:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A plain-text table; ``align`` has one ``l``/``r`` per column (default: first left, rest right)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([columns(h)] + [columns(r[i]) for r in cells]) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(values: Sequence[str]) -> str:
        out = []
        for v, w, a in zip(values, widths, align, strict=True):
            pad = " " * (w - columns(v))
            out.append(v + pad if a == "l" else pad + v)
        return "  ".join(out).rstrip()

    return "\n".join([line(list(headers))] + [line(r) for r in cells])


def columns(text: str) -> int:
    """The terminal columns ``text`` takes: a wide character (CJK, most emoji) two, a combining mark
    or zero-width character none, every other one."""
    return sum(
        0
        if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me", "Cf")
        else 2
        if unicodedata.east_asian_width(c) in ("W", "F")
        else 1
        for c in text
    )


def printable(value: Any) -> str:
    """``value`` as text safe for a terminal: every character that is not printable (control
    characters such as ESC, format and separator characters) shown as a Python escape (``\\x1b``).
    Names come from clients, and rows an earlier build wrote may hold such characters."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _name(d: Mapping[str, Any], key: str, default: str = "-") -> str:
    """A name field of ``d`` (session, model, tenant, namespace), printable."""
    return printable(d.get(key, default))


def _g(d: Mapping[str, Any], key: str) -> Any:
    return d.get(key) if isinstance(d, Mapping) else None


def render_stats(data: Mapping[str, Any]) -> str:
    """``kvstore stats``: the daemon line, one row per tier, then store-wide counters."""
    store, server = data.get("store") or {}, data.get("server") or {}
    head = (
        f"kvstore daemon at {server.get('endpoint', '?')}  pid {server.get('pid', '?')}  "
        f"up {format_duration(server.get('uptime'))}  requests {format_count(server.get('requests'))}  "
        f"errors {format_count(server.get('errors'))}"
    )
    tiers = store.get("tiers") or {}
    rows = []
    for name in [*TIERS, *sorted(set(tiers) - set(TIERS))]:
        t = tiers.get(name)
        if t is None:
            continue
        lookups = (_g(t, "hits") or 0) + (_g(t, "misses") or 0)
        shared = name == "cluster"  # no count or capacity of this host's own
        rows.append(
            [
                name,
                "-" if shared else format_count(_g(t, "blocks")),
                "-" if shared else format_bytes(_g(t, "used")),
                "shared" if shared else format_bytes(_g(t, "capacity")),
                "-" if shared else format_ratio(_g(t, "used"), _g(t, "capacity")),
                format_count(_g(t, "hits")),
                format_count(_g(t, "misses")),
                format_ratio(_g(t, "hits"), lookups),
                format_count(_g(t, "evictions")),
                format_count(_g(t, "demotions")),
                format_count(_g(t, "promotions")),
                format_count(_g(t, "corrupt")),
            ]
        )
    tier_table = (
        table(
            [
                "tier",
                "blocks",
                "used",
                "capacity",
                "full",
                "hits",
                "misses",
                "hit rate",
                "evicted",
                "demoted",
                "promoted",
                "corrupt",
            ],
            rows,
        )
        if rows
        else "(no tiers reported)"
    )
    c = store.get
    lines = [
        head,
        "",
        tier_table,
        "",
        f"blocks {format_count(c('blocks'))}  sessions {format_count(c('sessions'))}  "
        f"namespaces {format_count(c('namespaces'))}  pinned {format_count(c('pinned'))}",
        f"write-through: queued {format_count(c('write_queue'))}  written {format_count(c('written'))}  "
        f"deferred {format_count(c('write_deferred'))}  expired {format_count(c('expired'))}  "
        f"failed {format_count(c('write_failures'))}",
        # blocks a tier's codec refused on their way down (K/V holding inf or NaN): gone, not stored
        f"unencodable (inf or NaN, dropped) {format_count(c('unencodable'))}",
        # a lookup adds to matched, a get to served, both to asked (the ratio the metrics export)
        f"lookups {format_count(c('lookups'))}: tokens asked {format_count(c('tokens_asked'))}, "
        f"matched {format_count(c('tokens_matched'))}, served {format_count(c('tokens_served'))} "
        f"(hit rate {format_ratio((c('tokens_matched') or 0) + (c('tokens_served') or 0), c('tokens_asked'))})",
    ]
    cluster = c("cluster")
    if isinstance(cluster, Mapping):
        lines.append(_cluster_line(cluster))
    if "shm" in server:
        lines.append(_shm_line(server["shm"]))
    return "\n".join(lines)


def _cluster_line(cl: Mapping[str, Any]) -> str:
    """The cluster tier: its state, what was written and dropped, the last error while it is down."""
    line = (
        f"cluster: {cl.get('state', '?')} ({cl.get('nodes', '?')}); written {format_count(cl.get('written'))}  "
        f"queued {format_count(cl.get('queue'))}  dropped {format_count(cl.get('write_dropped'))}"
        f" (sessions {format_count(cl.get('session_dropped'))})  "
        f"refused (full) {format_count(cl.get('write_refused'))}  errors {format_count(cl.get('errors'))}"
    )
    if cl.get("kept_evicted"):  # (a daemon of an earlier build reports none)
        line += f"  kept (evicted there) {format_count(cl['kept_evicted'])}"
    if cl.get("last_error"):
        line += f"\n  last error: {printable(cl['last_error'])}"
    return line


def _shm_line(shm: Any) -> str:
    """Same-host clients' shared memory (kvstore.shm): where, staging in use, leases."""
    if not isinstance(shm, Mapping):
        return "shared memory: off (clients use the socket)"
    return (
        f"shared memory: {shm.get('directory', '?')}, {format_count(len(shm.get('segments') or []))} segments; "
        f"staging {format_bytes(shm.get('staging_used'))} in use of {format_bytes(shm.get('staging_bytes'))} "
        f"({_plural(shm.get('staging_clients'), 'client')}); leases {format_count(shm.get('leases'))}, "
        f"lapsed {format_count(shm.get('lapsed'))}"
    )


def _tier_counts(tiers: Mapping[str, int] | None) -> list[str]:
    tiers = tiers or {}
    return [format_count(tiers.get(t, 0)) for t in TIERS]


def render_sessions(sessions: Sequence[Mapping[str, Any]], now: float) -> str:
    """``kvstore inspect``: one row per session, most recently used first."""
    if not sessions:
        return "no sessions (blocks put with session=... show up here)"
    ordered = sorted(sessions, key=lambda s: s.get("last_access") or 0, reverse=True)
    rows = [
        [
            _name(s, "name", "?"),
            _name(s, "model"),
            _name(s, "tenant"),
            format_count(s.get("tokens")),
            format_count(s.get("blocks")),
            *_tier_counts(s.get("tiers")),
            format_age(s.get("last_access"), now),
            format_age(s.get("created"), now),
        ]
        for s in ordered
    ]
    return table(
        ["session", "model", "tenant", "tokens", "blocks", *TIERS, "last used", "created"],
        rows,
        align="lll" + "r" * 5 + "ll",
    )


def render_session(detail: Mapping[str, Any], now: float) -> str:
    """``kvstore inspect --session S``: the session, then where each of its blocks lives."""
    info = detail.get("info") or {}
    tiers = info.get("tiers") or {}
    head = [
        f"session {_name(info, 'name', '?')}: model {_name(info, 'model')}, tenant {_name(info, 'tenant')}, "
        f"namespace {_name(info, 'namespace')}",
        f"{format_count(info.get('tokens'))} tokens, {format_count(info.get('blocks'))} blocks cached "
        f"({', '.join(f'{t} {tiers.get(t, 0)}' for t in [*TIERS, *sorted(set(tiers) - set(TIERS))])}); last used "
        f"{format_age(info.get('last_access'), now)}, created {format_age(info.get('created'), now)}",
    ]
    blocks = detail.get("blocks") or []
    if not blocks:
        return "\n".join([*head, "", "no blocks cached"])
    rows = [
        [
            format_count(b.get("position")),
            str(b.get("key", ""))[:16],
            ",".join(b.get("tiers") or []) or "-",
            format_age(b.get("last_access"), now),
        ]
        for b in blocks
    ]
    return "\n".join([*head, "", table(["block", "key", "tiers", "last used"], rows, align="rlll")])


def render_prefix(data: Mapping[str, Any]) -> str:
    """``kvstore inspect --tokens FILE``: how much of a token sequence is stored, and where."""
    blocks = data.get("blocks") or []
    head = (
        f"namespace {_name(data, 'namespace')}: {format_count(data.get('matched_tokens'))} of "
        f"{format_count(data.get('tokens'))} tokens stored in {len(blocks)} blocks"
    )
    if not blocks:  # a model, revision, tenant or layout other than the engine's names no block of it
        return (
            f"{head}\n(a namespace is model, revision, tenant and layout together: each must be the one "
            "the engine stored with; `kvstore inspect` lists the stored sessions with their models)"
        )
    rows = [[format_count(b.get("position")), str(b.get("key", ""))[:16], b.get("tier", "-")] for b in blocks]
    return "\n".join([head, "", table(["block", "key", "tier"], rows, align="rll")])


def render_evict(result: Mapping[str, Any]) -> str:
    """``kvstore evict``: what went (or, with --dry-run, would go), and the bytes freed per tier."""
    dry = bool(result.get("dry_run"))
    blocks, moved = int(result.get("blocks") or 0), int(result.get("moved") or 0)
    not_done = f"\nnot done: {printable(result['not_done'])}" if result.get("not_done") else ""
    if blocks == 0:
        return "no blocks matched" + (" (dry run)" if dry else "") + not_done
    freed = result.get("bytes_freed") or {}
    freed_text = (
        ", ".join(
            f"{t} {format_bytes(freed[t])}" for t in [*TIERS, *sorted(set(freed) - set(TIERS))] if t in freed
        )
        or "nothing"
    )
    moved_text = f" ({format_count(moved)} of them moved down a tier)" if moved else ""
    displaced = int(result.get("displaced") or 0)
    if displaced:  # the tier below was full, and nothing below it took its blocks: they went
        not_done = f"; {_plural(displaced, 'other block')} dropped to make room below{not_done}"
    if dry:
        return f"would evict {_plural(blocks, 'block')}{moved_text}; would free {freed_text}{not_done}"
    return f"evicted {_plural(blocks, 'block')}{moved_text}; freed {freed_text}{not_done}"


def format_seconds(seconds: float | None) -> str:
    """An elapsed time with sub-second detail: ``0.0421 -> "0.04s"``, ``12.34 -> "12.3s"``, ``75 -> "1m 15s"``."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{max(0.0, seconds):.2f}s"
    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)


def format_rate(nbytes: int | float | None, seconds: float | None) -> str:
    """Bytes per second: ``"7.1 MiB/s"``; ``-`` when either is unknown or no time passed."""
    if nbytes is None or not seconds or seconds <= 0:
        return "-"
    return f"{format_bytes(nbytes / seconds)}/s"


def render_progress(done: int, total: int, nbytes: int, width: int = 30) -> str:
    """One progress line (no newline): ``[######........]  12/40 blocks  3.0 MiB``; a bar of ``width``."""
    fill = width if total <= 0 else min(width, width * max(0, done) // total)
    return (
        f"[{'#' * fill}{'.' * (width - fill)}] {format_count(done)}/{format_count(total)} blocks  "
        f"{format_bytes(nbytes)}"
    )


def render_prefetch(result: Mapping[str, Any]) -> str:
    """``kvstore prefetch``: what moved; with ``seconds`` (the CLI's timing) also the bytes, time and rate."""
    text = (
        f"session {_name(result, 'session', '?')}: {format_count(result.get('moved'))} blocks brought up to "
        f"{result.get('to', '?')}, {format_count(result.get('present'))} already there, "
        f"{format_count(result.get('failed'))} failed"
    )
    if "seconds" in result:
        nbytes, seconds = result.get("bytes_moved"), result.get("seconds")
        text += (
            f"; {format_bytes(nbytes)} moved in {format_seconds(seconds)} ({format_rate(nbytes, seconds)})"
        )
    return text


def _plural(n: Any, noun: str) -> str:
    """``1 client``, ``3 clients``, ``- clients`` (unknown)."""
    return f"{format_count(n)} {noun}" + ("" if n == 1 else "s")
