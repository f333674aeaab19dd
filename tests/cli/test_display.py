"""What ``kvstore`` prints: sizes, ages, tables and every command's rendering; nothing a
terminal would take as a command."""

from __future__ import annotations

import pytest

from kvstore.cli import display


@pytest.mark.parametrize(
    "n, text",
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (100 * 2**20, "100 MiB"),
        (int(1.5 * 2**30), "1.5 GiB"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert display.format_bytes(n) == text


@pytest.mark.parametrize(
    "s, text",
    [
        (0, "0s"),
        (42.9, "42s"),
        (60, "1m"),
        (61, "1m 1s"),
        (3600, "1h"),
        (3725, "1h 2m"),
        (90061, "1d 1h"),
        (7 * 86400, "7d"),
        (None, "-"),
    ],
)
def test_format_duration(s: float | None, text: str) -> None:
    assert display.format_duration(s) == text


def test_format_age_and_ratio() -> None:
    assert display.format_age(1000.0, now=1300.0) == "5m ago"
    assert display.format_age(0, now=1300.0) == "-"
    assert display.format_age(2000.0, now=1300.0) == "just now"
    assert display.format_ratio(1, 3) == "33.3%" and display.format_ratio(1, 0) == "-"
    assert display.format_count(1234567) == "1,234,567"


def test_table_aligns_columns() -> None:
    out = display.table(["name", "n"], [["a", 1], ["long-name", 1000]])
    assert out.splitlines() == ["name          n", "a             1", "long-name  1000"]


def test_table_aligns_wide_and_combining_characters_by_the_columns_they_take() -> None:
    # session names are any text: a CJK name takes two columns a character, an accent none
    out = display.table(["session", "blocks"], [["会話", 3], ["cafe\u0301", 12], ["abc", 100]])
    assert out.splitlines() == [
        "session  blocks",
        "会話          3",
        "cafe\u0301         12",
        "abc         100",
    ]
    assert [display.columns(line) for line in out.splitlines()] == [15, 15, 15, 15]


STATS = {
    "server": {"endpoint": "ipc:///x.sock", "pid": 42, "uptime": 3725.0, "requests": 1200, "errors": 1},
    "store": {
        "tiers": {
            "hbm": {
                "blocks": 3,
                "used": 3 * 2**20,
                "capacity": 2**30,
                "hits": 9,
                "misses": 1,
                "evictions": 0,
                "demotions": 2,
                "promotions": 0,
                "corrupt": 0,
            },
            "nvme": {
                "blocks": 5,
                "used": 2**20,
                "capacity": 2**36,
                "hits": 0,
                "misses": 0,
                "evictions": 4,
                "demotions": 0,
                "promotions": 1,
                "corrupt": 2,
            },
        },
        "blocks": 5,
        "sessions": 2,
        "namespaces": 1,
        "pinned": 0,
        "write_queue": 0,
        "write_deferred": 0,
        "written": 5,
        "expired": 0,
        "write_failures": 3,
        "unencodable": 1,
        "lookups": 4,
        "tokens_asked": 200,  # a lookup and a get of 100 tokens each
        "tokens_matched": 64,
        "tokens_served": 64,
    },
}


def test_render_stats() -> None:
    out = display.render_stats(STATS).splitlines()
    assert out[0] == "kvstore daemon at ipc:///x.sock  pid 42  up 1h 2m  requests 1,200  errors 1"
    hbm = next(line for line in out if line.startswith("hbm")).split()
    assert hbm[:4] == ["hbm", "3", "3.0", "MiB"] and "90.0%" in hbm
    assert any(line.startswith("nvme") and line.endswith("2") for line in out)  # corrupt column
    assert not any(line.startswith("ram") for line in out)  # a tier the daemon did not report
    assert "matched 64, served 64 (hit rate 64.0%)" in out[-1]  # what the metrics export
    assert any(line.endswith("failed 3") for line in out)  # write-through attempts that failed
    assert "unencodable (inf or NaN, dropped) 1" in out
    # a daemon that sends fewer counters still renders
    assert "blocks -" in display.render_stats({"store": {}, "server": {}})
    # same-host clients' shared memory: on, or off
    shm = {
        "directory": "/dev/shm/kvstore-0",
        "segments": ["a", "b", "c"],
        "staging_bytes": 2**30,
        "staging_used": 3 * 2**20,
        "staging_clients": 2,
        "leases": 1,
        "lapsed": 4,
    }
    on = display.render_stats({**STATS, "server": {**STATS["server"], "shm": shm}}).splitlines()[-1]
    assert on == (
        "shared memory: /dev/shm/kvstore-0, 3 segments; staging 3.0 MiB in use of 1.0 GiB (2 clients); "
        "leases 1, lapsed 4"
    )
    off = display.render_stats({**STATS, "server": {**STATS["server"], "shm": None}}).splitlines()[-1]
    assert off == "shared memory: off (clients use the socket)"


def test_render_stats_of_the_cluster_tier() -> None:
    cluster = {"state": "up", "nodes": "3 seeds", "written": 9, "queue": 0, "write_dropped": 1}
    store = {**STATS["store"], "cluster": cluster}
    line = next(
        ln for ln in display.render_stats({**STATS, "store": store}).splitlines() if ln.startswith("cluster")
    )
    assert line.startswith("cluster: up (3 seeds); written 9  queued 0  dropped 1") and "kept" not in line
    store["cluster"] = {**cluster, "kept_evicted": 4}  # copies held here that an evict took from the cluster
    line = next(
        ln for ln in display.render_stats({**STATS, "store": store}).splitlines() if ln.startswith("cluster")
    )
    assert line.endswith("kept (evicted there) 4")


def test_render_sessions_most_recent_first() -> None:
    sessions = [
        {
            "name": "old",
            "model": "m",
            "tenant": "t",
            "tokens": 128,
            "blocks": 2,
            "tiers": {"nvme": 2},
            "created": 100.0,
            "last_access": 100.0,
        },
        {
            "name": "new",
            "model": "m",
            "tenant": "t",
            "tokens": 64,
            "blocks": 1,
            "tiers": {"hbm": 1, "nvme": 1},
            "created": 100.0,
            "last_access": 990.0,
        },
    ]
    out = display.render_sessions(sessions, now=1000.0).splitlines()
    assert out[0].split() == [
        "session",
        "model",
        "tenant",
        "tokens",
        "blocks",
        "hbm",
        "ram",
        "nvme",
        "last",
        "used",
        "created",
    ]
    assert out[1].split()[:8] == ["new", "m", "t", "64", "1", "1", "0", "1"] and "10s ago" in out[1]
    assert out[2].startswith("old") and "15m ago" in out[2]
    assert "no sessions" in display.render_sessions([], now=0.0)


def test_render_session_prefix_evict_prefetch() -> None:
    detail = {
        "info": {
            "name": "s",
            "model": "m",
            "tenant": "t",
            "namespace": "ab",
            "tokens": 8,
            "blocks": 2,
            "tiers": {"hbm": 2},
            "created": 1.0,
            "last_access": 2.0,
        },
        "blocks": [
            {"position": 0, "key": "00" * 32, "tiers": ["hbm", "nvme"], "last_access": 2.0},
            {"position": 1, "key": "11" * 32, "tiers": [], "last_access": 0},
        ],
    }
    out = display.render_session(detail, now=62.0).splitlines()
    assert out[0] == "session s: model m, tenant t, namespace ab"
    assert "2 blocks cached (hbm 2, ram 0, nvme 0)" in out[1]
    assert out[-2].split() == ["0", "0" * 16, "hbm,nvme", "1m", "ago"]
    assert out[-1].split() == ["1", "1" * 16, "-", "-"]
    prefix = display.render_prefix(
        {
            "namespace": "ab",
            "tokens": 10,
            "matched_tokens": 8,
            "blocks": [{"position": 0, "key": "aa" * 32, "tier": "ram"}],
        }
    )
    assert prefix.splitlines()[0] == "namespace ab: 8 of 10 tokens stored in 1 blocks"
    # none stored: most often a model name (or tenant, revision, layout) other than the engine's
    none = display.render_prefix({"namespace": "ab", "tokens": 10, "matched_tokens": 0, "blocks": []})
    assert none.splitlines()[0] == "namespace ab: 0 of 10 tokens stored in 0 blocks"
    assert "model, revision, tenant and layout together" in none and "kvstore inspect" in none
    assert display.render_evict({"blocks": 0, "dry_run": True}) == "no blocks matched (dry run)"
    assert (
        display.render_evict({"blocks": 3, "moved": 1, "bytes_freed": {"ram": 2048}, "dry_run": False})
        == "evicted 3 blocks (1 of them moved down a tier); freed ram 2.0 KiB"
    )
    assert (
        display.render_evict(
            {"blocks": 3, "moved": 0, "bytes_freed": {"hbm": 1024, "nvme": 10}, "dry_run": True}
        )
        == "would evict 3 blocks; would free hbm 1.0 KiB, nvme 10 B"
    )
    assert display.render_evict(
        {"blocks": 2, "bytes_freed": {"hbm": 1024}, "not_done": "the cluster is down"}
    ).splitlines() == ["evicted 2 blocks; freed hbm 1.0 KiB", "not done: the cluster is down"]
    assert (
        display.render_evict({"blocks": 1, "moved": 1, "bytes_freed": {"hbm": 1024}, "displaced": 3})
        == "evicted 1 block (1 of them moved down a tier); freed hbm 1.0 KiB; 3 other blocks dropped "
        "to make room below"
    )
    assert (
        display.render_prefetch({"session": "s", "to": "hbm", "moved": 2, "present": 1, "failed": 0})
        == "session s: 2 blocks brought up to hbm, 1 already there, 0 failed"
    )


def test_render_prefetch_timing_and_progress() -> None:
    # the CLI's summary adds bytes, wall time and rate
    done = {
        "session": "s",
        "to": "ram",
        "moved": 40,
        "present": 0,
        "failed": 0,
        "bytes_moved": 3 * 2**20,
        "seconds": 0.5,
        "blocks": 40,
        "requests": 3,
    }
    assert (
        display.render_prefetch(done)
        == "session s: 40 blocks brought up to ram, 0 already there, 0 failed; 3.0 MiB moved in 0.50s (6.0 MiB/s)"
    )
    assert display.render_prefetch({**done, "moved": 0, "bytes_moved": 0, "seconds": 0.0}).endswith(
        "; 0 B moved in 0.00s (-)"
    )
    assert [display.format_seconds(x) for x in (0.0421, 12.34, 75, None)] == ["0.04s", "12.3s", "1m 15s", "-"]
    assert display.format_rate(2048, 2.0) == "1.0 KiB/s" and display.format_rate(10, 0) == "-"
    assert display.render_progress(12, 40, 2048, width=10) == "[###.......] 12/40 blocks  2.0 KiB"
    assert display.render_progress(0, 0, 0, width=4) == "[####] 0/0 blocks  0 B"  # an empty session is done


def test_names_with_control_characters_print_escaped() -> None:
    # a row written by an earlier build may hold any character; what reaches the terminal must not
    # be a command to it
    evil = {
        "name": "conv\x1b]0;pwned\x07",
        "model": "m\x1b[2J",
        "tenant": "t\u202eevil",
        "namespace": "ns\r",
        "tokens": 64,
        "blocks": 1,
        "tiers": {"hbm": 1},
        "last_access": 10.0,
        "created": 5.0,
    }
    outputs = [
        display.render_sessions([evil], now=20.0),
        display.render_session({"info": evil, "blocks": []}, now=20.0),
        display.render_prefix({"namespace": evil["namespace"], "tokens": 4, "matched_tokens": 0}),
        display.render_prefetch({"session": evil["name"], "to": "ram", "moved": 0}),
    ]
    for out in outputs:
        assert not any(c in out for c in "\x1b\x07\r\u202e"), out
    assert "conv\\x1b]0;pwned\\x07" in outputs[0] and "t\\u202eevil" in outputs[0]
    assert "m\\x1b[2J" in outputs[1] and "ns\\r" in outputs[1]
    assert display.printable("plain — été") == "plain — été"
