"""The README's example runs as written (two CPU processes over gloo, under torchrun); the docs' links
lead to files of the repository and their runner commands are ones the runner accepts."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the README's Example section should hold one python block"
    return blocks[0]


# gloo's own teardown: a rank that has finished, printed and destroyed its process group can still
# abort in interpreter finalization (a gloo worker thread destroyed while joinable). Seen in about
# one run of fifty; it is retried once, and only when every rank printed its result first.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd.append(str(script))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    want = [f"rank {rank}: stream (128, 4, 1024), next input (256, 1024)" for rank in (0, 1)]
    for attempt in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        finished = all(line in proc.stdout for line in want)
        if proc.returncode == 0 or not (finished and GLOO_TEARDOWN_ABORT in proc.stderr) or attempt:
            break
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    assert finished, proc.stdout


DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_links_lead_to_repository_files(doc):
    """Every relative link of a doc names a file or folder of the repository (no web page is checked)."""
    for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_doc_python_blocks_parse():
    """Every python block of the README and docs/ is valid Python (the snippets rot otherwise)."""
    blocks = [
        (doc.name, block)
        for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    ]
    assert len(blocks) >= 4, blocks  # the README's example, integration.md's three
    for name, block in blocks:
        ast.parse(block, filename=name)


def test_runner_doc_commands_parse():
    """docs/runner.md's runner command lines (``$R`` standing for its R=...) parse as runner options."""
    from spkernels.runner.__main__ import parse_args

    text = (REPO / "docs" / "runner.md").read_text()
    lines = [
        ln.split("  #")[0]
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for ln in block.splitlines()
    ]
    r = next(shlex.split(ln.split("=", 1)[1])[0] for ln in lines if ln.startswith("R="))
    commands = [ln.replace("$R", r, 1) for ln in lines if ln.startswith(("$R", "python -m spkernels.runner"))]
    assert len(commands) >= 6, commands
    for command in commands:
        argv = shlex.split(command)[3:]  # after python -m spkernels.runner
        parse_args(argv)
