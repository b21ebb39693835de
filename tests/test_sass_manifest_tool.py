"""tools/sass_manifest.py's parsing on fixed text, without nvcc: cuobjdump's SASS split per function
and normalised (no addresses, no file paths), ptxas -v's registers and spills, and the comparison
that the manifest test reports."""

from __future__ import annotations

from repo_scripts import import_script

(sass_manifest,) = import_script("tools", "sass_manifest")

SASS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]
host = linux
compile_size = 64bit
identifier = /some/checkout/csrc/kernels/mhc_kernels.cu

\tcode for sm_90a
\t.target\tsm_90a

\t\tFunction : _ZN3spk4kernENS_8TileArgsE
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
                                                                               /* 0x000fe20000000800 */
        /*0010*/                   EXIT ;                                      /* 0x000000000000794d */
                                                                               /* 0x000fea0003800000 */
        .........................

\t\tFunction : _ZN3spk39_GLOBAL__N__b2dc649d_7_comm_cu_44c7861110fill_wordsEPjmj
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   EXIT ;                                      /* 0x000000000000794d */
                                                                               /* 0x000fea0003800000 */
        .........................
"""

PTXAS = """ptxas info    : Compiling entry function '_ZN3spk4kernENS_8TileArgsE' for 'sm_90a'
ptxas info    : Function properties for _ZN3spk4kernENS_8TileArgsE
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 14592 bytes smem
"""


def test_split_and_normalise():
    sass = sass_manifest.split_sass(SASS)
    assert list(sass) == [
        "_ZN3spk4kernENS_8TileArgsE",
        "_ZN3spk39_GLOBAL__N__b2dc649d_7_comm_cu_44c7861110fill_wordsEPjmj",
    ]
    # Text and both encoding words per instruction; no address, no path, no header.
    assert sass["_ZN3spk4kernENS_8TileArgsE"] == [
        "LDC R1, c[0x0][0x28] ; 0x00000a00ff017b82 0x000fe20000000800",
        "EXIT ; 0x000000000000794d 0x000fea0003800000",
    ]
    moved = SASS.replace("/some/checkout", "/elsewhere").replace("/*0010*/", "/*0020*/")
    assert sass_manifest.split_sass(moved) == sass


def test_demangle_drops_the_file_hash():
    names = sass_manifest.demangle(["_ZN3spk39_GLOBAL__N__b2dc649d_7_comm_cu_44c7861110fill_wordsEPjmj"])
    assert "b2dc649d" not in next(iter(names.values()))


def test_ptxas_usage():
    usage = sass_manifest.ptxas_usage(PTXAS)["_ZN3spk4kernENS_8TileArgsE"]
    assert usage == {"stack": 8, "spill_stores": 8, "spill_loads": 4, "registers": 128}


def test_compare():
    entry = {"sha256": "a", "registers": 100, "spill_bytes": 0, "units": ["x.cu"]}
    recorded = {"k1": entry, "k2": entry}
    assert sass_manifest.compare(recorded, dict(recorded)) == ([], [])
    fails, _ = sass_manifest.compare(recorded, {"k1": {**entry, "sha256": "b"}, "k3": entry})
    assert fails == ["changed: k1: SASS", "removed: k2", "added:   k3"]
    fails, notes = sass_manifest.compare(recorded, {"k1": {**entry, "units": ["y.cu"]}, "k2": entry})
    assert fails == [] and notes == ["units:   k1: ['x.cu'] -> ['y.cu']"]
