"""bench/collectives.py on the CPU: the gloo smoke sweep end to end, and the report's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_scripts import import_script

REPO = Path(__file__).resolve().parent.parent


cases, report, compare = import_script("bench", "cases", "report", "compare")
(profile_sp,) = import_script("tools", "profile_sp")

ROW_KEYS = {"op", "T", "D", "tp", "graph", "time_us", "baseline", "baseline_us", "speedup", "floor_us",
            "hbm_GBps", "frac_of_floor"}  # fmt: skip
MACHINE_KEYS = {"gpu", "gpus", "driver", "torch", "cuda", "nccl", "commit", "date"}


@pytest.mark.slow
def test_cpu_sweep_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "bench" / "collectives.py"),
        "--cpu",
        "--out",
        str(tmp_path),
        "--name",
        "smoke",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert MACHINE_KEYS <= set(doc["machine"])
    rows = doc["rows"]
    every_op = {*cases.LOCAL_OPS, *cases.SP_OPS, *cases.TP_OPS} | {f"{op}:plain" for op in cases.PARTIAL_OPS}
    assert {r["op"] for r in rows} == every_op
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["wrong"] == 0 and "error" not in r, r  # the CPU ops are the reference math
        assert r["graph"] is False and r["time_us"] > 0 and r["baseline_us"] > 0 and r["floor_us"] > 0, r
        assert r["speedup"] == pytest.approx(r["baseline_us"] / r["time_us"])
        assert r["frac_of_floor"] == pytest.approx(r["floor_us"] / r["time_us"])
        hbm_bytes = cases.traffic(r["op"], r["T"], r["D"], r["tp"])[1]
        assert r["hbm_GBps"] == pytest.approx(hbm_bytes / r["time_us"] / 1e3)
        if r["op"] in cases.LOCAL_OPS:  # the floor is the HBM bytes at the copy bandwidth
            assert r["frac_of_floor"] == pytest.approx(r["hbm_GBps"] / doc["floors"]["copy_GBps"])
    baselines = {r["baseline"] for r in rows}
    assert {"eager_ref", "nccl", "nccl+spkernels", "nccl+eager_ref"} <= baselines
    assert set(doc["crossover"]) == {"2"} and set(doc["crossover"]["2"]) == {"256"}
    assert doc["floors"]["copy_GBps"] > 0 and doc["floors"]["link_GBps"]["2"] > 0
    header, table = (tmp_path / "smoke.txt").read_text().split("\n", 1)
    assert header == "# " + report.machine_line(doc["machine"]) and table.startswith("op ")
    assert "Targets (worst value" in proc.stdout


@pytest.mark.slow
def test_profile_sp_smoke():
    """tools/profile_sp.py on gloo: every rank reports each op's calls (GPU runs split kernels)."""
    script = str(REPO / "tools" / "profile_sp.py")
    cmd = [sys.executable, script, "--cpu", "--T", "8", "--D", "64", "--calls", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    for rank in (0, 1):
        for op in ("mhc_post_pre_rs_ag", "mhc_post_pre_ar"):
            assert f"rank {rank}: {op} T=8 D=64 tp=2" in proc.stdout, proc.stdout
    assert proc.stdout.count("span of a call (1 kernels)") == 4, proc.stdout


def test_profile_sp_summary():

    spans = [("pass1", 0, 10), ("pass2", 12, 20), ("pass1", 30, 41), ("pass2", 44, 50)]
    lines = profile_sp.summarize(spans, calls=2)
    assert "pass1" in lines[0] and "10.5 us" in lines[0] and "(then 2.5 us gap)" in lines[0], lines
    assert "pass2" in lines[1] and "7.0 us" in lines[1] and "gap" not in lines[1], lines
    assert lines[2].strip() == "20.0 us  span of a call (2 kernels)", lines
    assert "cannot split" in profile_sp.summarize(spans[:3], calls=2)[0]


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_post_pre"])
def test_delayed_inputs_reach_every_variant(op):
    """--delayed: the op and its baselines all collapse with the inputs' pre_mix_in."""
    from spkernels import reference as ref

    T, D, dev = 6, 64, torch.device("cpu")
    params = cases.make_params(D, dev)
    x = cases.make_inputs("local", T, D, 1, 0, 1, params, dev, delayed=True)
    assert x.pre_mix_in.shape == (T, 4) and bool((x.pre_mix_in > 0).all())
    ctx = cases.Ctx("local", T, D, 1, x, params)
    outs = {name: fn(0) for name, fn in cases.variants(op, ctx).items()}
    if op == "mhc_pre":
        want = ref.mhc_pre(x.streams[0], *params.pre, x.pre_mix_in)
        v4 = ref.mhc_pre(x.streams[0], *params.pre)
    else:
        post = (x.partials[0], x.streams[0], x.post_mix, x.res_mix)
        want = ref.mhc_post_pre(*post, *params.pre, x.pre_mix_in)[1:]
        v4 = ref.mhc_post_pre(*post, *params.pre)[1:]
        outs = {name: out[1:] for name, out in outs.items()}
    assert not torch.equal(want[0], v4[0])  # the carried-in weights change layer_input
    for name, out in outs.items():
        for got, w in zip(out, want, strict=True):
            torch.testing.assert_close(got.float(), w.float(), atol=2e-2, rtol=2e-2, msg=f"{name}")


def test_compare_table(tmp_path):
    """bench/compare.py: one line per shape in every file, times and ratios to the first file."""

    def write(name, commit, rows):
        keys = ("op", "T", "D", "tp", "graph", "time_us")
        doc = {"machine": {"commit": commit}, "rows": [dict(zip(keys, r, strict=True)) for r in rows]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        return str(tmp_path / f"{name}.json")

    base = write("a", "c1", [("mhc_pre", 8, 64, 1, True, 10.0), ("mhc_pre", 8, 64, 1, True, 10.0),
                             ("mhc_post", 8, 64, 1, False, 4.0)])  # fmt: skip
    other = write("b", "c2", [("mhc_pre", 8, 64, 1, True, 5.0), ("mhc_head", 8, 64, 1, True, 1.0)])
    lines = compare.table([base, other])
    assert "a@c1" in lines[0] and "b@c2" in lines[0], lines[0]
    assert len(lines) == 2, lines  # only the shape present in both files
    assert lines[1].split()[:5] == ["mhc_pre", "8", "64", "1", "graph"], lines[1]
    assert "10.0 us" in lines[1] and "5.0 us ( 0.50x)" in lines[1], lines[1]
    # A case the bench refused to time (time_us null: wrong outputs) in either file.
    wrong = write("c", "c3", [("mhc_pre", 8, 64, 1, True, None), ("mhc_post", 8, 64, 1, False, 2.0)])
    lines = compare.table([base, wrong])
    assert len(lines) == 3 and "not timed" in lines[2] and "10.0 us" in lines[2], lines
    assert "2.0 us ( 0.50x)" in lines[1], lines
    lines = compare.table([wrong, base])
    assert "not timed" in lines[2] and "10.0 us" in lines[2] and "x)" not in lines[2], lines


def test_traffic_formulas():
    T, D = 4096, 4096
    R = D * 2
    link, hbm = cases.traffic("mhc_post_pre_rs_ag", T, D, 2)
    assert link == T * R  # RS + AG, each (n-1)/n * T*R per direction
    assert hbm == 2 * T * R + T // 2 * (8 * R + 176) + 24 * 4 * D * 4
    assert cases.traffic("mhc_post_pre_rs_ag:plain", T, D, 2) == (link, hbm)
    assert cases.traffic("mhc_post", T, D, 1) == (0.0, T * (9 * R + 80))
    link_ar, _ = cases.traffic("mhc_post_pre_ar", T, D, 4)
    assert link_ar == 2 * 3 / 4 * T * R
    floors = {"copy_GBps": 1000.0, "link_GBps": {"2": 100.0}}
    assert report.floor_us("mhc_post_pre_rs_ag", T, D, 2, floors) == pytest.approx(link / 100e3)
    assert report.floor_us("mhc_post", T, D, 1, floors) == pytest.approx(T * (9 * R + 80) / 1000e3)


def _row(op, T, t, graph=True):
    return {"op": op, "T": T, "D": 4096, "tp": 2, "graph": graph, "time_us": t}


def test_crossover_is_the_start_of_the_last_winning_run():
    times = {8: (10, 5), 64: (9, 10), 512: (20, 30), 4096: (100, 200)}  # T: (SP, TP)
    rows = [_row("mhc_post_pre_rs_ag", T, sp) for T, (sp, _) in times.items()]
    rows += [_row("mhc_post_pre_ar", T, tp) for T, (_, tp) in times.items()]
    rows += [_row("mhc_post_pre_rs_ag", 8, 1.0, graph=False)]  # eager rows are ignored when graphs ran
    assert report.crossover(rows) == {"2": {"4096": 64}}
    rows[3]["time_us"] = 1000  # SP loses at the largest T: it never wins for good
    assert report.crossover(rows) == {"2": {"4096": None}}


def test_count_wrong():
    x = torch.randn(16, 4, 32).to(torch.bfloat16)
    mix = torch.rand(16, 4)
    assert cases.count_wrong((x, mix), (x.clone(), mix + 1e-4)) == 0
    assert cases.count_wrong((x.transpose(1, 2).reshape(16, 4, 32), mix), (x, mix)) > 0
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    assert cases.count_wrong(bad, x) == 1
    assert cases.count_wrong(x[:8], x) == x.numel()


def test_profile_sp_timeline_is_in_time_order():
    """Kernels in launch order, not by name (by name, pass 2 of one call and pass 1 of the next
    would be paired into one call)."""
    from torch.autograd import DeviceType

    def kernel(name, start, end):
        return type(
            "E",
            (),
            dict(
                name=name, device_type=DeviceType.CUDA, time_range=type("R", (), dict(start=start, end=end))
            ),
        )

    events = [
        kernel("b_pass2", 12, 20),
        kernel("a_pass1", 30, 41),
        kernel("a_pass1", 0, 10),
        kernel("b_pass2", 44, 50),
    ]
    assert [s[0] for s in profile_sp.timeline(events, "cuda")] == ["a_pass1", "b_pass2", "a_pass1", "b_pass2"]


def test_stall_summary(tmp_path):
    """tools/stall_summary.py on ncu's CSV layouts: the raw page (names, units, one row per kernel)
    and the SASS source page (one row per instruction)."""
    raw = tmp_path / "raw.csv"
    raw.write_text(
        '"ID","Kernel Name","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
        '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","dram__bytes.sum",'
        '"lts__t_tag_requests.avg.pct_of_peak_sustained_elapsed","lts__t_tag_requests.max.pct_of_peak_sustained_elapsed",'
        '"lts__t_sectors.min.pct_of_peak_sustained_elapsed","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"\n'
        '"","","ratio","ratio","byte","%","%","%","%"\n'
        '"0","mhc_rows_kernel","1.50","4.25","1,024","80.5","88.0","99.0","35.9"\n'
    )
    sass = tmp_path / "sass.csv"
    sass.write_text(
        '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier"\n'
        '"0x10","LDG.E.128 R4, desc[UR4][R2.64]","120","110","0"\n'
        '"0x20","BAR.SYNC.DEFER_BLOCKING 0x0","300","0","290"\n'
        '"0x30","IMAD R1, R2, R3, R4","5","0","0"\n'
    )
    script = str(REPO / "tools" / "stall_summary.py")
    out = subprocess.run(
        [sys.executable, script, str(raw), str(sass)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    lines = out.splitlines()
    # each unit once, at its largest rollup; .min. rollups are not a unit's load
    assert [ln.split() for ln in lines[1:3]] == [
        ["lts__t_tag_requests.max.pct_of_peak_sustained_elapsed", "88.0"],
        ["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "35.9"],
    ], out
    assert lines[3].startswith("warp stall reasons"), out
    assert lines[4].split()[:2] == ["long_scoreboard", "4.25"] and lines[5].split()[:2] == [
        "barrier",
        "1.50",
    ], out
    assert "425 stall samples in all" in out, out
    hot = [ln for ln in lines if ln.startswith("    0x")]
    assert (
        hot[0].split()[:3] == ["0x20", "300", "BAR.SYNC.DEFER_BLOCKING"] and "stall_barrier 290" in hot[0]
    ), out
    assert hot[1].split()[:3] == ["0x10", "120", "LDG.E.128"] and "stall_long_sb 110" in hot[1], out


def test_compile_baselines_default():
    """The default sweep times every op beside its torch.compile'd reference; --quick only the
    boundaries and mhc_post_pre; an explicit list wins."""
    (collectives,) = import_script("bench", "collectives")
    assert collectives.parse_args([]).compile_ops == "all"
    assert set(collectives.parse_args(["--quick"]).compile_ops.split(",")) == set(
        collectives.QUICK_COMPILE_OPS
    )
    assert collectives.parse_args(["--compile-ops", "mhc_pre"]).compile_ops == "mhc_pre"


def results(*names: str) -> list[dict]:
    return [json.loads((REPO / "bench" / "results" / n).read_text()) for n in names]


def test_readme_table_from_results():
    """The README's table comes from the committed results, each row from the first file that has it;
    a shape no run measured is named."""
    docs = results(*report.DEFAULT_RESULTS)
    text = report.readme_table(docs)
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(report.README_ROWS)
    sp = next(r for r in docs[1]["rows"] if r["graph"] and (r["op"], r["T"], r["D"], r["baseline"]) ==
              ("mhc_post_pre_rs_ag", 8192, 4096, "nccl+spkernels"))  # fmt: skip
    assert f"| {sp['speedup']:.2f}× | {sp['frac_of_floor']:.2f} |" in table[2]
    assert report.machine_line(docs[1]["machine"]) in text  # the run a row comes from is named
    for doc in docs:
        doc["rows"] = [r for r in doc["rows"] if r["op"] != "mhc_head"]
    assert "| `mhc_head` | 4096 | | not measured |" in report.readme_table(docs)


def test_readme_shows_the_current_table():
    """README.md carries exactly the table that `python bench/report.py --readme` writes."""
    readme = (REPO / "README.md").read_text()
    table = report.readme_table(results(*report.DEFAULT_RESULTS))
    stale = "the README's table is stale: run python bench/report.py --readme"
    assert report.update_readme(readme, table) == readme, stale


def test_compiled_references_one_graph_per_D(monkeypatch):
    """The compiled baselines get a graph per D with D static and T symbolic, first called at a
    prefill size: one graph serving every D (automatic dynamic shapes made D symbolic at the second
    D) compiled mhc_post 4-5x slower on the GPU, and a first call at T = 2 autotuned it on noise."""
    graphs = []

    def backend(gm, example_inputs):  # records each graph's input shapes (symbolic); runs it uncompiled
        values = (n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder")
        graphs.append([tuple(v.shape) for v in values if isinstance(v, torch.Tensor)])
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend, **kw))
    monkeypatch.setattr(cases, "_compiled", {})
    monkeypatch.setattr(cases, "PRIME_TOKENS", 64)  # small on the CPU; the GPU sweep primes at 4096
    torch._dynamo.reset()
    try:
        # The process default (automatic dynamic shapes on) must not make D symbolic in the bench's graphs.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=True):
            cpu = torch.device("cpu")
            for D in (16, 24):
                params = cases.make_params(D, cpu)
                cases.prime_compiled("mhc_post", D, params, cpu)
                for T in (3, 40):  # no recompilation for another T
                    y = torch.randn(T, D).to(torch.bfloat16)
                    stream = torch.randn(T, cases.HC, D).to(torch.bfloat16)
                    post_mix, res_mix = cases.make_mixes(T, D, params, None, cpu)
                    cases.compiled(cases.ref_post)(y, stream, post_mix, res_mix)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2, graphs
    for D, shapes in zip((16, 24), graphs, strict=True):  # [T, ...] inputs: T symbolic, the rest static
        assert all(isinstance(s[0], torch.SymInt) for s in shapes), f"T not symbolic at D = {D}: {shapes}"
        assert not any(isinstance(n, torch.SymInt) for s in shapes for n in s[1:]), f"D not static: {shapes}"
        assert any(s[-1] == D for s in shapes), f"no [.., D] input at D = {D}: {shapes}"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--T", "garbage"], "--T"),
        (["--D", "0"], "--D"),
        (["--compile-T", "8,x"], "--compile-T"),
        (["--modes", "bogus"], "--modes"),
        (["--ops", "mhc_pre,nope"], "--ops"),
        (["--repeats", "0"], "--repeats"),
        (["--nprocs", "-1"], "--nprocs"),
    ],
)
def test_bench_rejects_bad_arguments_before_spawning(capsys, argv, named):
    (collectives,) = import_script("bench", "collectives")
    with pytest.raises(SystemExit):
        collectives.parse_args(argv)
    assert named in capsys.readouterr().err
    collectives.parse_args(["--T", "8,64", "--D", "4096", "--modes", "graph", "--compile-D", ""])  # fine


def test_runner_host_baseline_from_a_file(tmp_path):
    """--baseline REV=FILE (a checkout without git history): FILE's engine, recorded as REV."""
    (runner_host,) = import_script("bench", "runner_host")
    copy = tmp_path / "engine.py"
    copy.write_text((REPO / "python" / "spkernels" / "runner" / "engine.py").read_text())
    rev, module = runner_host.baseline_engine(f"54a3f7d={copy}")
    assert rev == "54a3f7d" and module.__file__ == str(copy) and hasattr(module, "Engine")


def test_runner_host_against_a_baseline(tmp_path):
    """bench/runner_host.py times every case's batch build for this tree and a baseline revision's
    engine.py (here HEAD's) and writes them with the machine facts."""
    cmd = [sys.executable, str(REPO / "bench" / "runner_host.py"), "--device", "cpu", "--quick"]
    cmd += ["--calls", "1", "--repeats", "1", "--baseline", "HEAD", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    doc = json.loads((tmp_path / "runner_host.json").read_text())
    assert MACHINE_KEYS <= set(doc["machine"]) and doc["config"]["baseline"] == "HEAD"
    assert [r["case"] for r in doc["rows"]][:3] == ["prefill 8192", "prefill 16 x 64", "decode 16 x 64"]
    cases = [r["case"] for r in doc["rows"]]
    assert len(cases) == 9 and "decode 16 x 64 in flight" in cases and "Engram prefill 16 x 64" in cases
    for r in doc["rows"]:
        assert r["current_us"] > 0 and r["baseline_us"] > 0, r
        assert r["speedup"] == pytest.approx(r["baseline_us"] / r["current_us"])
