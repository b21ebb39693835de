"""Build spkernels: setuptools drives CMake (as vLLM does); CMake finds torch and, for CUDA
builds, the NCCL of the nvidia-nccl-cu{12,13} wheel that matches torch.version.cuda."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def nccl_root() -> str:
    """The folder of the NCCL wheel that torch itself loads; never a system copy."""
    import torch

    major = torch.version.cuda.split(".")[0]
    try:
        import nvidia.nccl as nccl_pkg
    except ImportError as e:
        raise RuntimeError(
            f"torch {torch.__version__} is a CUDA {torch.version.cuda} build: install "
            f"nvidia-nccl-cu{major} (the NCCL that torch loads) before building spkernels"
        ) from e
    root = Path(list(nccl_pkg.__path__)[0])
    if not (root / "include" / "nccl.h").exists() or not (root / "lib" / "libnccl.so.2").exists():
        raise RuntimeError(f"{root} lacks include/nccl.h or lib/libnccl.so.2")
    return str(root)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import torch

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp).resolve()
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("SPK_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DSPK_OUTPUT_DIR={out.parent}",
            f"-DSPK_OUTPUT_NAME={out.name}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-GNinja",
        ]
        if torch.version.cuda is not None and os.environ.get("SPK_CPU_ONLY", "0") != "1":
            args += ["-DSPK_WITH_CUDA=ON", f"-DSPK_NCCL_ROOT={nccl_root()}"]
            arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0a")
            args.append("-DSPK_CUDA_ARCHS=" + ";".join(a.replace(".", "") for a in arch.replace(",", " ").split()))
        else:
            args.append("-DSPK_WITH_CUDA=OFF")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


setup(
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"spkernels": ["*.json"]},
    ext_modules=[CMakeExtension("spkernels._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
