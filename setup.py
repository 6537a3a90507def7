"""Build of kda_dsa_ops._C: the one place that lists sources and compiler flags.

CMakeLists.txt drives this file (it runs `setup.py build_ext --inplace`); nothing else
keeps a list of sources or flags.

Environment:
  KDA_DSA_OPS_CUDA=0        build the CPU kernels only (quick iterations); =1: the CUDA kernels or
                            an error (unset: the CUDA kernels where a toolkit is found, else the
                            CPU kernels, said before compiling)
  TORCH_CUDA_ARCH_LIST      CUDA targets, default "9.0a" (wgmma/TMA kernels need 9.0a)
  CUDA_HOME                 CUDA toolkit (bin/nvcc, include/, the runtime library); else CUDA_PATH,
                            /usr/local/cuda, then torch's guess, the first that holds a toolkit
  MAX_JOBS                  parallel compile jobs (ninja)

The CUDA build takes about 10 minutes on 2 cores, 2 on 16; ninja prints a line per file as it
starts it (pip shows them with -v).
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _is_toolkit(home: str) -> bool:
    """home holds nvcc, the runtime headers and the runtime library (a bare nvcc wrapper on PATH
    makes torch guess its folder, e.g. /usr/local, where linking then fails on -lcudart)."""
    libs = [os.path.join(home, d, "libcudart.so") for d in ("lib64", "lib", "targets/x86_64-linux/lib",
                                                            "targets/sbsa-linux/lib")]
    return (os.path.isfile(os.path.join(home, "bin", "nvcc")) and
            os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")) and any(map(os.path.isfile, libs)))


def _with_cuda() -> bool:
    """Whether to build the CUDA kernels; points torch's build at the toolkit found."""
    wanted = os.environ.get("KDA_DSA_OPS_CUDA")
    if wanted == "0":
        return False
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", cpp_extension.CUDA_HOME]
    home = next((c for c in candidates if c and _is_toolkit(c)), None)
    why = ("this torch has no CUDA" if torch.version.cuda is None else
           f"no CUDA toolkit (bin/nvcc, include/cuda_runtime.h, libcudart) in any of "
           f"{[c for c in candidates if c]}; set CUDA_HOME" if home is None else None)
    if why is not None:
        if wanted == "1":
            raise SystemExit(f"kda_dsa_ops: KDA_DSA_OPS_CUDA=1 but {why}")
        print(f"kda_dsa_ops: building the CPU kernels only: {why}", flush=True)
        return False
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = home
    print(f"kda_dsa_ops: building the CPU and CUDA kernels with the toolkit in {home} (about 10 minutes on 2 cores, "
          "2 on 16)", flush=True)
    return True


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True))


def _extension():
    with_cuda = _with_cuda()
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a") if with_cuda else ""
    defines = [  # py_limited_api=True below makes torch define Py_LIMITED_API
        ("KDA_DSA_OPS_VERSION", f'"{VERSION}"'),
        ("KDA_DSA_OPS_CUDA_ARCHS", f'"{arch_list}"'),
    ]
    # No -std flag: torch's BuildExtension picks the standard its headers were built with
    # (C++17 for torch 2.11, C++20 for 2.14); mixing standards across c10's inline code breaks.
    cxx_flags = ["-O3", "-fdiagnostics-color=always"]
    # Share torch's C++ runtime: a toolchain that links libstdc++ statically would give the
    # extension its own locale tables, and formatting a number in an error message then crashes.
    link_flags = ["-l:libstdc++.so.6"]
    sources = _sources("*.cpp")
    if not with_cuda:
        return cpp_extension.CppExtension(
            "kda_dsa_ops._C", sources, include_dirs=[os.path.join(ROOT, "csrc")], define_macros=defines,
            extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags, py_limited_api=True)
    nvcc_flags = [
        "-O3", "--expt-relaxed-constexpr",
        "-lineinfo", "-Xptxas=-warn-spills",
        # torch's defaults undefine the half operators; our kernels use cuda_bf16/cuda_fp16 directly.
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    ]
    if os.environ.get("KDA_DSA_OPS_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    return cpp_extension.CUDAExtension(
        "kda_dsa_ops._C", sources + _sources("*.cu"), include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=defines + [("KDA_DSA_OPS_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags,
        py_limited_api=True)


setup(
    name="kda_dsa_ops",
    version=VERSION,
    description="CUDA kernels for hybrid KDA / DSA sparse-attention MoE models: KDA, LI, SFA, SFAG, grouped expert GEMM",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest", "hypothesis", "numpy"], "bench": ["matplotlib"]},
)
