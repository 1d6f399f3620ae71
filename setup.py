"""Builds kvpress_cpp._C, the shared object that registers the kvcomp operator library.

CPU kernels are always built. CUDA kernels are built whenever the installed torch is a CUDA build and nvcc is found
(no GPU needed), following torchao's gating on torch.version.cuda. KVCOMP_FORCE_CPU=1 forces a CPU-only build.
TORCH_CUDA_ARCH_LIST picks the GPU architectures as usual (the test command builds sm_90 only). The CPU kernels are
vectorised for the CPU that builds them (KVCOMP_CPU_ARCH, default "native"; set e.g. x86-64-v3 for a portable wheel).
Build with `pip install --no-build-isolation .` so the extension compiles against the torch you run.
"""

import ast
import os
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"

# What `pip install --no-build-isolation .` pulls in: ranges, not pins (requirements.txt pins what the tests ran,
# and tests/test_packaging.py checks those pins fall inside these ranges). torch is whichever build the user has
# (the extension compiles against it); kvpress bounds transformers (0.5.5: < 5.3).
INSTALL_REQUIRES = [
    "torch>=2.11",
    "transformers>=4.56",
    "huggingface-hub>=0.34",  # its repo-id rule tells a mistyped local --model folder from a hub name
    "kvpress>=0.5.5",
    "gguf>=0.17",  # the embedded SmolLM2 is a GGUF file
    "safetensors>=0.4",
    "tokenizers>=0.22",  # the default model's tokenizer, rebuilt where transformers' GGUF loader adds tokens to it
    "tqdm>=4.66",
    "matplotlib>=3.8",  # the plots of train_kvzap and the benchmarks
    "packaging>=23",
]
EXTRAS_REQUIRE = {
    # kvpress_cpp.evaluation: kvpress's evaluation script's own imports, and our report's.
    "evaluation": ["pandas>=2", "pyyaml>=6", "rouge-score>=0.1.2", "datasets>=2.19",
                   "fire>=0.6", "rouge>=1.0", "nltk>=3.8", "jieba>=0.42", "fuzzywuzzy>=0.18", "bert-score>=0.3.13"],
    "test": ["pytest>=8", "pytest-xdist>=3.5"],
}


def package_version() -> str:
    """kvpress_cpp.__version__, read from its source."""
    for node in ast.parse((ROOT / "kvpress_cpp" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise SystemExit("setup.py: kvpress_cpp/__init__.py assigns no __version__")


def build_cuda() -> bool:
    if os.environ.get("KVCOMP_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def pip_cuda_include_dirs() -> list[str]:
    """Headers of the CUDA libraries torch's own headers include (cusparse.h, cublas_v2.h, ...). With torch from
    PyPI they ship in the nvidia-* wheels, not necessarily in the toolkit beside nvcc."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(str(p) for root in nvidia.__path__ for p in Path(root).glob("cu*/include"))


def pip_cuda_include_flags() -> list[str]:
    """pip_cuda_include_dirs as -isystem flags, searched after every -I, so after the toolkit's own include folder
    (CUDA_HOME/include, which torch adds with -I): a header the toolkit has comes from the toolkit, and the wheels fill
    in only what it lacks. As -I they came first, and their cuda_runtime_api.h too: torch 2.15's wheels bring CUDA
    13.2's, and CCCL under nvcc 13.0 then stops with "CUDA compiler and CUDA toolkit headers are incompatible"."""
    return [flag for d in pip_cuda_include_dirs() for flag in ("-isystem", d)]


def openmp_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags where torch's ATen parallel backend is OpenMP, as in its Linux wheels: there
    at::parallel_for is a `#pragma omp parallel` inlined from ATen's headers, which a build without -fopenmp ignores,
    so every CPU kernel ran on one thread whatever torch.set_num_threads said. The extension links the libgomp torch
    ships (torch/lib; any name it has), which torch has loaded already: one OpenMP runtime, sized by
    torch.set_num_threads. A torch without its own copy uses the compiler's (-fopenmp)."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return [], []
    bundled = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return ["-fopenmp"], [str(bundled[0])] if bundled else ["-fopenmp"]


def sources(pattern_dirs):
    return sorted(str(p.relative_to(ROOT)) for d, pattern in pattern_dirs for p in (CSRC / d).glob(pattern))


class BuildExtensionNamingArchitectures(BuildExtension):
    """torch reads the GPU architectures to compile for from TORCH_CUDA_ARCH_LIST, else from the GPUs it sees; with
    neither it stopped on a bare IndexError."""

    def build_extensions(self):
        if build_cuda() and not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
            raise SystemExit("kvpress_cpp: building the CUDA kernels (a CUDA torch and nvcc are here) with no GPU to "
                             "read the architecture from: set TORCH_CUDA_ARCH_LIST (e.g. 9.0 for H100/H200, 8.0 for "
                             "A100), or KVCOMP_FORCE_CPU=1 for a CPU-only build")
        super().build_extensions()


def extension():
    cpp_sources = sources([(".", "*.cpp"), ("cpu", "*.cpp")])
    include_dirs = [str(CSRC), str(CSRC / "include")]
    openmp_compile, openmp_link = openmp_flags()
    # -g0 overrides the -g of Python's CFLAGS, which setuptools puts first: debug info for ATen's templates doubled
    # each C++ file's compile (keepkv.cpp: 32 s against 16 s) and made 24 of the extension's 44 MB.
    cxx_flags = ["-O3", "-g0", f"-march={os.environ.get('KVCOMP_CPU_ARCH', 'native')}", "-DPy_LIMITED_API=0x030A0000",
                 *openmp_compile]
    if build_cuda():
        return CUDAExtension(
            "kvpress_cpp._C",
            cpp_sources + sources([("cuda", "*.cu")]),
            include_dirs=include_dirs,
            # No --use_fast_math: the tests compare CUDA's keepkv_match and gvote_union_mask with float64 references
            # exactly (away from near-ties, csrc/kernels/keepkv.h), and the decode path is memory-bound, so
            # approximate exp / log / division would buy nothing.
            extra_compile_args={"cxx": cxx_flags + pip_cuda_include_flags(),
                                "nvcc": ["-O3", "-lineinfo"] + pip_cuda_include_flags()},
            extra_link_args=openmp_link,
            py_limited_api=True,
        )
    return CppExtension(
        "kvpress_cpp._C", cpp_sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags},
        extra_link_args=openmp_link, py_limited_api=True,
    )


setup(
    name="kvpress_cpp",
    version=package_version(),
    description="KV-cache compression methods (ZSMerge, KeepKV, WeightedKV, KVzap, GVote) as PyTorch C++/CUDA ops",
    packages=find_packages(include=["kvpress_cpp", "kvpress_cpp.*"]),
    package_data={"kvpress_cpp": ["surrogates/**/*", "evaluation/*.yaml"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtensionNamingArchitectures},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    python_requires=">=3.10",
)
