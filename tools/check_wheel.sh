#!/usr/bin/env bash
# Build the spkernels wheel, install it into a fresh venv and smoke-test it from outside the source
# tree: import, a CPU op against the reference (and the CUDA op where there is a GPU), the wheel's
# version metadata, `python -m spkernels.env`.
# The venv uses --system-site-packages (or, where torch sits in the user site, that directory) so
# torch (and, on GPU servers, its NCCL wheel) comes from the environment the wheel was built in.
# Usage: bash tools/check_wheel.sh   (PYTHON=python3, DIST=dist: where the wheel is left)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
DIST="${DIST:-dist}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
version="$("$PYTHON" -c "exec(open('python/spkernels/version.py').read()); print(__version__)")"

echo "== wheel (spkernels $version)"
# build/lib.* and build/bdist.* are this build's staging (stale files there would land in the wheel);
# build/temp.* keeps the CMake cache for fast rebuilds.
rm -rf "$DIST"/spkernels-*.whl build/lib.* build/bdist.*
"$PYTHON" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w "$DIST" .
wheels=("$DIST"/spkernels-"$version"-*.whl)
[[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || { echo "expected one spkernels-$version wheel in $DIST"; exit 1; }
wheel="$(realpath "${wheels[0]}")"
echo "$wheel"
"$PYTHON" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["spkernels/__init__.py", "spkernels/_build_info.py", "spkernels/sp_crossover.json"]
missing = [n for n in need if n not in names]
libs = [n for n in names if n.startswith("spkernels/_C") and n.endswith(".so")]
assert not missing and len(libs) == 1, f"wheel lacks {missing} or has {len(libs)} libraries: {names}"
EOF

echo "== fresh venv"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VPY="$WORK/venv/bin/python"
# A venv sees the system site but never the user site (~/.local), where some GPU images keep torch
# (the device machine's does): then put torch's own site directory on the venv's path. A path in
# a .pth file does not run that directory's .pth files, so an editable spkernels there stays out.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  torch_site="$("$PYTHON" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")"
  echo "$torch_site" > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torch_site.pth"
  echo "torch from $torch_site"
fi
# --no-index: nothing is downloaded; the wheel's dependency (torch) must already be satisfied.
# --force-reinstall: a development (editable) install of the same version in the system site must
# not make pip skip the wheel.
"$VPY" -m pip install --disable-pip-version-check --no-index --force-reinstall --no-deps "$wheel"
# The wheel's own requirements must hold (other packages' complaints, such as torch about the venv's
# seeded setuptools, are not the wheel's business).
# (pip check's own exit status is not used: it fails for any package, and under pipefail it would
# also hide a match of grep.)
problems="$("$VPY" -m pip check 2>&1 || true)"
if grep -E "^spkernels " <<< "$problems"; then echo "spkernels' requirements are not met"; exit 1; fi

echo "== smoke test"
cd "$WORK"  # away from the source tree, so only the installed wheel can be imported
"$VPY" - "$WORK/venv" "$version" <<'EOF'
import importlib.metadata
import os
import sys

import torch

import spkernels
from spkernels import reference as ref

venv, version = sys.argv[1:]
assert spkernels.__file__.startswith(venv), f"imported {spkernels.__file__}, not the wheel in {venv}"
assert spkernels.__version__ == version == importlib.metadata.version("spkernels"), (
    spkernels.__version__, version, importlib.metadata.version("spkernels"))

gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
T, hc, D = 5, 4, 64
stream = torch.randn(T, hc, D, generator=gen).to(torch.bfloat16)
fn = torch.randn((2 + hc) * hc, hc * D, generator=gen) / (hc * D) ** 0.5
scale, base = 0.5 + 2 * torch.rand(3, generator=gen), 0.5 * torch.randn((2 + hc) * hc, generator=gen)
norm_weight = (1 + 0.2 * torch.randn(D, generator=gen)).to(torch.bfloat16)
out = torch.ops.spkernels.mhc_pre(stream, fn, scale, base, norm_weight, None)
want = ref.mhc_pre(stream, fn, scale, base, norm_weight)
# The CPU op is the fp32 reference itself: identical results, not merely close.
for name, o, w in zip(("layer_input", "post_mix", "res_mix", "pre_mix"), out, want):
    assert torch.equal(o, w), name
print(f"spkernels {spkernels.__version__} from {spkernels.__file__}: mhc_pre OK")
if torch.cuda.is_available():  # GPU servers: the wheel's CUDA kernel too (smoke-level tolerances)
    cuda = torch.ops.spkernels.mhc_pre(stream.cuda(), fn.cuda(), scale.cuda(), base.cuda(), norm_weight.cuda(), None)
    for name, o, w in zip(("layer_input", "post_mix", "res_mix", "pre_mix"), cuda, want):
        tol = 2**-6 if name == "layer_input" else 1e-4
        torch.testing.assert_close(o.cpu().float(), w.float(), rtol=tol, atol=tol, msg=name)
    print(f"mhc_pre on {torch.cuda.get_device_name()} OK")
EOF
"$VPY" -m spkernels.env
# The wheel refuses a torch of another minor release before loading its library.
"$VPY" - <<'EOF'
import torch

major, minor = (int(p) for p in str(torch.__version__).split(".")[:2])
torch.__version__ = f"{major}.{minor + 1}.0"
try:
    import spkernels  # noqa: F401
except ImportError as e:
    assert "built against torch" in str(e), e
    print("refuses torch", torch.__version__, "OK")
else:
    raise AssertionError(f"the wheel imported under torch {torch.__version__}")
EOF
echo "check_wheel: OK"
