#!/usr/bin/env python3
"""Print the soft-RoCE lane's perf comparison side by side (fabriq perf vs perftest), and with
`1` as the second argument also write it into docs/BENCHMARKS.md (section replaced in place).
A sanity comparison on an emulated CPU, never a timing assertion."""
import json, re, sys, datetime, pathlib

stage = pathlib.Path(sys.argv[1])
record = len(sys.argv) > 2 and sys.argv[2] == "1"

def fabriq(name, key):
    try:
        doc = json.loads((stage / f"perf-fabriq-{name}.json").read_text())
        return float(doc["results"][0][key])
    except Exception:
        return None

def perftest(name, col):
    # perftest prints a header line then one numeric row; take column `col` of the last row.
    try:
        rows = [l.split() for l in (stage / f"perf-ib_{name}.txt").read_text().splitlines()
                if re.match(r"^\s*\d", l)]
        return float(rows[-1][col])
    except Exception:
        return None

def connect(mode):
    # connect_spin_ab prints "rxe0 <mode> spin ... both p10 A p50 B p90 C | client ...".
    try:
        for l in (stage / "perf-connect.txt").read_text().splitlines():
            f = l.split()
            if len(f) > 9 and f[1] == mode and f[6] == "p10" and f[8] == "p50":
                return float(f[9])
    except Exception:
        pass
    return None

def fmt(v, unit):
    return "not measured" if v is None else f"{v:.2f} {unit}"

rows = [
    ("send_lat 8 B, one-way p50", fmt(fabriq("send_lat", "p50_us"), "µs"),
     fmt(perftest("send_lat", 4), "µs"), "ib_send_lat t_typical"),
    ("write_bw 64 KiB", fmt(fabriq("write_bw", "gbit_s"), "Gb/s"),
     fmt(perftest("write_bw", 3), "Gb/s"), "ib_write_bw BW average"),
]
cold, cached = connect("cold"), connect("cached")
ratio = f" (cached {cold / cached:.1f} × faster)" if cold and cached else ""
rows.append(("connect through Endpoint, p50 of both ends (connect_spin_ab)",
             f"cold {fmt(cold, 'µs')}, cached {fmt(cached, 'µs')}{ratio}", "—",
             "no counterpart"))
table = ["| test | fabriq perf (rdma-core on rxe0) | perftest | perftest column |",
         "|---|---|---|---|"]
table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
print("\n".join(table))
if record:
    doc = pathlib.Path("docs/BENCHMARKS.md")
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start, end = "<!-- rxe-lane:start -->", "<!-- rxe-lane:end -->"
    section = "\n".join([
        start,
        "## Soft-RoCE (rxe) lane: fabriq perf beside perftest",
        "",
        f"`tests/rxe/lane.sh --record`, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC. Both run",
        "in the same QEMU guest on an emulated CPU (TCG) with rxe on the guest's loopback: a",
        "sanity comparison of the two verbs clients on one device, not a speed of either. A cold",
        "connect creates both QPs in the kernel's rxe and opens a TCP control stream; a cached one",
        "reuses the QPs (reset) and the stream of the previous, closed connection (100 connects",
        "of each, taking turns in blocks of 10).",
        "",
        *table,
        end,
    ])
    if start in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)
