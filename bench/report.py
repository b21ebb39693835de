"""Turning measurements into result rows, the printed table, the JSON, the plot and the crossover."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from cases import OP_VARIANTS, traffic

COLUMNS = (
    "op",
    "T",
    "D",
    "tp",
    "graph",
    "time_us",
    "baseline",
    "baseline_us",
    "speedup",
    "floor_us",
    "hbm_GBps",
    "frac_of_floor",
    "wrong",
)


def floor_us(op: str, T: int, D: int, tp: int, floors: dict) -> float | None:
    link_bytes, hbm_bytes = traffic(op, T, D, tp)
    link_bw = floors.get("link_GBps", {}).get(str(tp))
    copy_bw = floors.get("copy_GBps")
    parts = [hbm_bytes / copy_bw / 1e3 if copy_bw else None]
    if link_bytes:
        parts.append(link_bytes / link_bw / 1e3 if link_bw else None)
    return None if None in parts else max(parts)


def make_rows(records: list[dict], floors: dict) -> list[dict]:
    """One row per op variant x shape x mode x baseline (docs/performance.md), plus ``wrong`` and
    ``error``."""
    by_shape = defaultdict(list)
    for r in records:
        by_shape[(r["op"], r["T"], r["D"], r["tp"], r["graph"])].append(r)
    rows = []
    for (op, T, D, tp, graph), recs in by_shape.items():
        fl = floor_us(op, T, D, tp, floors)
        hbm_bytes = traffic(op, T, D, tp)[1]
        baselines = [r for r in recs if r["variant"] not in OP_VARIANTS] or [None]
        for r in (r for r in recs if r["variant"] in OP_VARIANTS):
            name = op + (":plain" if r["variant"] == "fused:plain" else "")
            t = r["time_us"]
            for b in baselines:
                bt = b["time_us"] if b else None
                row = {
                    "op": name,
                    "T": T,
                    "D": D,
                    "tp": tp,
                    "graph": graph,
                    "time_us": t,
                    "baseline": b["variant"] if b else None,
                    "baseline_us": bt,
                    "speedup": bt / t if t and bt else None,
                    "floor_us": fl,
                    "hbm_GBps": hbm_bytes / t / 1e3 if t else None,
                    "frac_of_floor": fl / t if t and fl else None,
                    "wrong": r["wrong"],
                }
                errors = "; ".join(e for e in (r.get("error"), b.get("error") if b else None) if e)
                if errors:
                    row["error"] = errors
                rows.append(row)
    rows.sort(key=lambda r: (r["op"], r["tp"], r["D"], r["T"], r["graph"], r["baseline"] or ""))
    return rows


def crossover(rows: list[dict]) -> dict:
    """{tp: {D: smallest T from which the SP boundary beats the TP boundary at every larger T}}
    (graph mode, or eager where nothing ran in graphs; zero-copy partial; None where SP never wins)."""
    mode = any(r["graph"] for r in rows)
    times = defaultdict(dict)
    for r in rows:
        if r["graph"] == mode and r["op"] in ("mhc_post_pre_rs_ag", "mhc_post_pre_ar") and r["time_us"]:
            times[(r["tp"], r["D"], r["T"])][r["op"]] = r["time_us"]
    out: dict = defaultdict(dict)
    for tp, D in sorted({(tp, D) for tp, D, _ in times}):
        pts = sorted((T, t) for (a, b, T), t in times.items() if (a, b) == (tp, D) and len(t) == 2)
        best = None
        for T, t in reversed(pts):
            if t["mhc_post_pre_rs_ag"] >= t["mhc_post_pre_ar"]:
                break
            best = T
        if pts:
            out[str(tp)][str(D)] = best
    return dict(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "graph" if v else "eager"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    cells = [[_fmt(r[c]) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def key_rows(rows: list[dict]) -> list[dict]:
    """The graph-mode rows against the strongest (fastest) baseline of each op and shape."""
    best = {}
    has_graph = any(r["graph"] for r in rows)
    for r in rows:
        if has_graph and not r["graph"]:
            continue
        k = (r["op"], r["T"], r["D"], r["tp"], r["graph"])
        if k not in best or (r["baseline_us"] or float("inf")) < (best[k]["baseline_us"] or float("inf")):
            best[k] = r
    return list(best.values())


def targets(rows: list[dict]) -> list[dict]:
    """The project's targets (docs/performance.md, "Open targets"), each with the worst measured value
    over the shapes it covers."""

    graph = any(r["graph"] for r in rows)

    def pick(op, baseline, cond):  # baseline None: any (the op's own time and floor do not depend on it)
        return [r for r in rows if r["op"] == op and baseline in (None, r["baseline"]) and r["graph"] == graph
                and cond(r)]  # fmt: skip

    def worst(rs, key, lo=True):
        vals = [r[key] for r in rs if r[key] is not None]
        return (min(vals) if lo else max(vals)) if vals else None

    sp = lambda r: r["T"] >= 4096 and r["tp"] == 2  # noqa: E731
    tp = lambda r: r["T"] <= 64 and r["D"] == 4096 and r["tp"] == 2  # noqa: E731
    local = lambda r: r["T"] >= 4096  # noqa: E731
    spec = [
        (
            "SP boundary T>=4096 speedup vs nccl+spkernels",
            worst(pick("mhc_post_pre_rs_ag", "nccl+spkernels", sp), "speedup"),
            ">=",
            2.5,
        ),
        (
            "SP boundary T>=4096 speedup vs nccl+compile_ref",
            worst(pick("mhc_post_pre_rs_ag", "nccl+compile_ref", sp), "speedup"),
            ">=",
            8.0,
        ),
        (
            "SP boundary T>=4096 frac_of_floor",
            worst(pick("mhc_post_pre_rs_ag", "nccl+spkernels", sp), "frac_of_floor"),
            ">=",
            0.85,
        ),
        (
            "TP boundary T<=64 D=4096 graph time_us",
            worst(pick("mhc_post_pre_ar", "nccl+spkernels", tp), "time_us", lo=False),
            "<=",
            8.0,
        ),
        (
            "TP boundary T<=64 D=4096 speedup vs nccl+spkernels",
            worst(pick("mhc_post_pre_ar", "nccl+spkernels", tp), "speedup"),
            ">=",
            2.0,
        ),
    ] + [
        (
            f"{op} T>=4096 frac_of_floor (HBM roofline)",
            worst(pick(op, None, local), "frac_of_floor"),
            ">=",
            0.8,
        )
        for op in ("mhc_pre", "mhc_post", "mhc_post_pre", "mhc_head")
    ]
    out = []
    for name, value, cmp, goal in spec:
        ok = None if value is None else (value >= goal if cmp == ">=" else value <= goal)
        out.append(
            {
                "target": name,
                "worst": value,
                "goal": f"{cmp} {goal}",
                "status": "n/a" if ok is None else ("met" if ok else "MISSED"),
            }
        )
    return out


def format_targets(ts: list[dict]) -> str:
    w = max(len(t["target"]) for t in ts)
    return "\n".join(
        f"{t['target'].ljust(w)}  {_fmt(t['worst']):>8}  {t['goal']:>8}  {t['status']}" for t in ts
    )


def write_json(path: Path, machine: dict, floors: dict, config: dict, rows: list[dict], cross: dict) -> None:
    doc = {"machine": machine, "floors": floors, "config": config, "crossover": cross, "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def plot(path: Path, rows: list[dict]) -> bool:
    """Latency and speedup (vs the strongest baseline) against T, one row of panels per op, graph
    mode (eager where no graph rows exist). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = key_rows(rows)
    ops = sorted({r["op"] for r in rows})
    if not ops:
        return False
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 2.8 * len(ops)), squeeze=False)
    for ax_row, op in zip(axes, ops, strict=True):
        lat, spd = ax_row
        series = sorted({(r["tp"], r["D"]) for r in rows if r["op"] == op})
        for k, (tp, D) in enumerate(series):
            rs = sorted(
                (r for r in rows if r["op"] == op and r["tp"] == tp and r["D"] == D), key=lambda r: r["T"]
            )
            color = f"C{k}"
            label = f"tp={tp} D={D}"
            pts = [(r["T"], r["time_us"]) for r in rs if r["time_us"]]
            if pts:
                lat.plot(*zip(*pts, strict=True), "o-", color=color, label=label)
            base = [(r["T"], r["baseline_us"]) for r in rs if r["baseline_us"]]
            if base:
                lat.plot(*zip(*base, strict=True), "x--", color=color, alpha=0.6)
            sp = [(r["T"], r["speedup"]) for r in rs if r["speedup"]]
            if sp:
                spd.plot(*zip(*sp, strict=True), "o-", color=color, label=label)
        lat.set(
            xscale="log",
            yscale="log",
            xlabel="T",
            ylabel="µs",
            title=f"{op} (solid) vs best baseline (dashed)",
        )
        spd.set(xscale="log", xlabel="T", ylabel="speedup", title=f"{op} speedup vs best baseline")
        spd.axhline(1.0, color="gray", lw=0.8)
        for ax in ax_row:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


# The README's benchmark table: (label, op, T, D, baseline variant, baseline in words, target). Each
# row comes from the first results file given that measured it: the one-GPU local-op grid (its
# torch.compile baselines primed) for the local ops, the two-GPU default sweep for the collectives.
README_ROWS = (
    ("`mhc_post_pre_rs_ag` (SP boundary)", "mhc_post_pre_rs_ag", 8192, 4096, "nccl+spkernels",
     "NCCL RS + local post_pre + NCCL AG", "≥ 2.5×, ≥ 0.85"),
    ("same, D = 7168", "mhc_post_pre_rs_ag", 8192, 7168, "nccl+spkernels", "same", "≥ 2.5×, ≥ 0.85"),
    ("same", "mhc_post_pre_rs_ag", 4096, 4096, "nccl+spkernels", "same", "≥ 2.5×, ≥ 0.85"),
    ("`mhc_post_pre_ar` (TP boundary)", "mhc_post_pre_ar", 8, 4096, "nccl+spkernels",
     "NCCL AR + local post_pre", "≤ 8 µs, ≥ 2×"),
    ("`mhc_post_pre_ar`", "mhc_post_pre_ar", 64, 4096, "nccl+spkernels", "same", "≤ 8 µs, ≥ 2×"),
    ("`mhc_post_ar`", "mhc_post_ar", 8, 4096, "nccl+spkernels", "NCCL AR + local post", ""),
    ("`mhc_post_rs`", "mhc_post_rs", 8192, 4096, "nccl+spkernels", "NCCL RS + local post", ""),
    ("`sp_all_gather`", "sp_all_gather", 8192, 4096, "nccl", "NCCL all-gather", ""),
    ("`mhc_post`", "mhc_post", 4096, 4096, "compile_ref", "`torch.compile` reference", "≥ 0.98"),
    ("`mhc_post`", "mhc_post", 1, 4096, "compile_ref", "`torch.compile` reference", "a few µs"),
    ("`mhc_post_pre`", "mhc_post_pre", 4096, 4096, "compile_ref", "`torch.compile` reference", ""),
    ("`mhc_pre`", "mhc_pre", 512, 4096, "compile_ref", "`torch.compile` reference", "≤ 12 µs on an H200"),
    ("`mhc_pre`", "mhc_pre", 8, 4096, "compile_ref", "`torch.compile` reference", "a few µs"),
    ("`mhc_head`", "mhc_head", 4096, 4096, "compile_ref", "`torch.compile` reference", ""),
)  # fmt: skip


def _us(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def machine_line(m: dict) -> str:
    gpu = m["gpu"].removeprefix("NVIDIA ")
    return (f"{m['date'][:10]}, {m['gpus']}× {gpu}, driver {m['driver']}, torch {m['torch']}, "
            f"NCCL {m['nccl']}, commit {m['commit'][:7]}")  # fmt: skip


def readme_table(docs: list[dict]) -> str:
    """The README's benchmark table (graph replays) from results JSONs, each row from the first one
    that measured it, with a run letter naming its file's machine line; a row that no run measured
    says so instead of a number. Fractions of the floor only at T >= 4096, where they mean something."""
    lookup = [{(r["op"], r["T"], r["D"], r["baseline"]): r for r in d["rows"] if r["graph"]} for d in docs]
    used: dict[int, str] = {}
    lines = [
        "| op | T | tp | µs | best unfused baseline | µs | speedup | fraction of floor | target | run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, op, T, D, baseline, words, target in README_ROWS:
        key = (op, T, D, baseline)
        found = [(i, rows[key]) for i, rows in enumerate(lookup) if key in rows]
        found = [(i, r) for i, r in found if r["time_us"] and r["baseline_us"]]
        if not found:
            lines.append(f"| {label} | {T} | | not measured | {words} | | | | {target} | |")
            continue
        i, r = found[0]
        run = used.setdefault(i, "abcdefgh"[len(used)])
        frac = f"{r['frac_of_floor']:.2f}" if T >= 4096 and r["frac_of_floor"] else ""
        lines.append(
            f"| {label} | {T} | {r['tp']} | {_us(r['time_us'])} | {words} | {_us(r['baseline_us'])} | "
            f"{r['speedup']:.2f}× | {frac} | {target} | {run} |"
        )
    runs = [f"({letter}) {machine_line(docs[i]['machine'])}" for i, letter in used.items()]
    return "\n".join(lines) + "\n\nRuns: " + "; ".join(runs) + "."


README_BEGIN = "<!-- table: python bench/report.py --readme -->"
README_END = "<!-- end of table -->"
DEFAULT_RESULTS = ("local_grid.json", "collectives_full.json")


def update_readme(readme: str, table: str) -> str:
    """The README with the text between its table markers replaced by ``table``."""
    head, sep, rest = readme.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise ValueError(f"the README has no {README_BEGIN} ... {README_END} markers")
    return f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Print the README's benchmark table from results JSONs.")
    parser.add_argument(
        "json", type=Path, nargs="*", help="results files, first match wins",
        default=[Path(__file__).parent / "results" / f for f in DEFAULT_RESULTS],
    )  # fmt: skip
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    args = parser.parse_args()
    docs = []
    for path in args.json:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            parser.error(f"{path}: {e}")
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or "machine" not in doc:
            parser.error(f"{path}: not a results file of bench/collectives.py (no machine and rows)")
        docs.append(doc)
    table = readme_table(docs)
    if args.readme:
        path = Path(__file__).resolve().parent.parent / "README.md"
        path.write_text(update_readme(path.read_text(), table))
    else:
        print(table)
