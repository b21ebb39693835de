"""Compare bench/collectives.py results of several builds (an A/B run: `tools/gpu_check.sh ab`).

    python bench/compare.py base.json other.json [...]

One line per (op, T, D, tp, mode) present in every file: each file's op time (µs) and its ratio
to the first file's (< 1: faster than the first). A case the bench refused to time (wrong outputs,
an error) reads "not timed".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median


def op_times(path: str) -> tuple[str, dict[tuple, float | None]]:
    """(label, {(op, T, D, tp, mode): µs, or None where it was not timed}) of one results file;
    an op timed against several baselines appears once per baseline with the same time: the median
    is kept."""
    data = json.loads(Path(path).read_text())
    times: dict[tuple, list[float]] = {}
    for r in data["rows"]:
        key = (r["op"], r["T"], r["D"], r["tp"], "graph" if r["graph"] else "eager")
        times.setdefault(key, [])
        if r["time_us"] is not None:
            times[key].append(r["time_us"])
    label = f"{Path(path).stem}@{data['machine'].get('commit', '?')}"
    return label, {k: median(v) if v else None for k, v in times.items()}


def cell(us: float | None, base: float | None) -> str:
    """One time and its ratio to base (none where base is None: the first file, or not timed)."""
    if us is None:
        return "not timed"
    return f"{us:10.1f} us ({us / base:5.2f}x)" if base is not None else f"{us:10.1f} us{'':>11}"


def table(paths: list[str]) -> list[str]:
    runs = [op_times(p) for p in paths]
    keys = sorted(set.intersection(*(set(t) for _, t in runs)))
    labels = " ".join(f"{label:>24}" for label, _ in runs)
    lines = [f"{'op':<22} {'T':>6} {'D':>5} {'tp':>2} {'mode':<5} {labels}"]
    for key in keys:
        base = runs[0][1][key]
        cells = [cell(base, None)] + [cell(t[key], base) for _, t in runs[1:]]
        op, T, D, tp, mode = key
        lines.append(f"{op:<22} {T:>6} {D:>5} {tp:>2} {mode:<5} " + " ".join(f"{c:>24}" for c in cells))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="bench JSON files; the first is the base")
    print("\n".join(table(p.parse_args().results)))


if __name__ == "__main__":
    main()
