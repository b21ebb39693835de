"""Where one profiled kernel's warps wait, from an ncu report exported as CSV (ncu --page raw/source --csv).

  ncu -i rep.ncu-rep --page raw --csv > raw.csv
  ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
  python3 tools/stall_summary.py raw.csv sass.csv

Prints the busiest pipes and memory units (percent of their sustained peak), the warp-stall
reasons (cycles a warp waits per issued instruction, largest first) and the SASS instructions
with the most stall samples, each with its leading reasons.
"""

from __future__ import annotations

import csv
import re

STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
# A pipe's or a memory unit's load: what caps a kernel that more warps do not speed up.
# With ncu's `breakdown:` metrics the L2's and L1's sub-units are there too (tags, sectors,
# crossbar ports, banks): which of them is the throughput's max.
BUSY = re.compile(r"^(sm__\w*pipe_\w+|dram__\w*throughput|lts__\w+|l1tex__\w+)\.\w+\.pct_of_peak_\w+$")


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return [row for row in csv.reader(f) if row]


def metrics(rows: list[list[str]], pattern: re.Pattern) -> list[tuple[str, float]]:
    """(name, value) of the raw page's metrics matching pattern, largest first: a header row of
    metric names, a units row, then one row per kernel (the first is reported)."""
    header = next((r for r in rows if any(pattern.match(c) for c in r)), None)
    if header is None:
        return []
    values = rows[rows.index(header) + 2]
    found = [(n, number(v)) for n, v in zip(header, values, strict=False) if pattern.match(n)]
    return sorted(((n, v) for n, v in found if v is not None), key=lambda item: -item[1])


def stall_reasons(rows: list[list[str]]) -> list[tuple[str, float]]:
    """(reason, warp cycles per issued instruction), largest first."""
    return [(STALL.match(name).group(1), v) for name, v in metrics(rows, STALL)]


def hot_instructions(rows: list[list[str]], n: int) -> tuple[list[str], list[list[str]]]:
    """The header and the n SASS rows with the most warp-stall samples (all samples)."""
    header = next((r for r in rows if any("Warp Stall Sampling (All" in c for c in r)), None)
    if header is None:
        return [], []
    samples = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    body = [
        r for r in rows[rows.index(header) + 1 :] if len(r) == len(header) and number(r[samples]) is not None
    ]
    return header, sorted(body, key=lambda r: -(number(r[samples]) or 0.0))[:n]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0], epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("raw", help="ncu --page raw --csv export")
    parser.add_argument("sass", help="ncu --page source --csv --print-source sass export")
    args = parser.parse_args()
    raw, sass = args.raw, args.sass
    raw_rows = read_csv(raw)
    print("busiest pipes and memory units (% of peak; each unit's largest rollup):")
    seen = set()
    for name, v in metrics(raw_rows, BUSY):
        if name.split(".")[0] not in seen and ".min." not in name and len(seen) < 25:
            seen.add(name.split(".")[0])
            print(f"  {name:78s} {v:6.1f}")
    reasons = stall_reasons(raw_rows)
    total = sum(v for _, v in reasons) or 1.0
    print("warp stall reasons (warp cycles per issued instruction):")
    for name, v in reasons[:12]:
        print(f"  {name:28s} {v:7.2f}  {v / total:5.1%}")
    sass_rows = read_csv(sass)
    header, hot = hot_instructions(sass_rows, 30)
    if not header:
        print("no SASS source page (columns: Warp Stall Sampling) in", sass)
        return
    samples = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    source = next((i for i, c in enumerate(header) if c.strip() == "Source"), 1)
    address = next((i for i, c in enumerate(header) if c.strip() == "Address"), 0)
    reason_cols = [i for i, c in enumerate(header) if c.startswith("stall_") and "(" not in c]  # all samples
    all_samples = sum(number(r[samples]) or 0.0 for r in sass_rows if len(r) == len(header))
    print(f"hottest SASS instructions ({all_samples:.0f} stall samples in all):")
    for r in hot:
        top = sorted(
            ((header[i], number(r[i]) or 0.0) for i in reason_cols if (number(r[i]) or 0.0) > 0),
            key=lambda item: -item[1],
        )[:3]
        why = ", ".join(f"{k} {v:.0f}" for k, v in top)
        print(f"  {r[address]:>6s} {number(r[samples]) or 0:7.0f}  {r[source][:60]:60s} {why}")


if __name__ == "__main__":
    main()
