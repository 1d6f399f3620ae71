"""kvpress_cpp: KV-cache compression methods as PyTorch C++/CUDA operators, wrapped as kvpress presses.

Importing this package loads the compiled extension, which registers ``torch.ops.kvcomp.*`` (CPU always, CUDA when
built with it). ``kvpress_cpp.ops`` holds typed wrappers with the shapes of every op.
"""

import importlib.util

import torch

try:
    from kvpress_cpp import _C  # noqa: F401  (registers torch.ops.kvcomp)
except ImportError as error:
    # Python's own words for a missing extension are "cannot import name '_C' from partially initialized module
    # (most likely due to a circular import)".
    found = importlib.util.find_spec("kvpress_cpp._C") is not None
    raise ImportError(
        f"kvpress_cpp: its compiled extension (kvpress_cpp._C) "
        f"{f'did not load: {error}' if found else f'is not built in {__path__[0]}'}. Build it against the torch you "
        f"run: `make build` in the repository, or `pip install --no-build-isolation -e .` (README, Building by hand)"
    ) from error
from kvpress_cpp import _fake  # noqa: F401  (shape functions for torch.compile / meta tensors)
from kvpress_cpp import ops

# The one place the version is written: setup.py reads it from here (importing the package there would need the
# extension it is about to build).
__version__ = "0.1.0"

__all__ = ["ops", "cuda_kernels_built"]


def cuda_kernels_built() -> bool:
    """Whether this build registered CUDA kernels (asked of the dispatcher, not guessed from the machine)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("kvcomp::update_scores", "CUDA")
