"""Fake kernels (shape functions) of every kvcomp op, for meta tensors and torch.compile.

Each one is generated from the op's declared contract (kvpress_cpp/_contract.py): it validates its arguments with the
C++ kernel's rules and words (devices all equal, dtypes, ranks, sizes, scalar ranges, in-place aliasing), so a traced,
meta or mixed-device call fails exactly where an eager one would, then returns empty outputs of the contract's shapes.
A meta tensor among CPU ones dispatches here, not to the CPU kernel: the device check is what turns that into an error.
"""

import torch

from kvpress_cpp._contract import CONTRACTS, Contract


def _register(contract: Contract) -> None:
    def fake(*args, **kwargs):
        return contract.output_tensors(args, kwargs)

    fake.__name__ = f"_{contract.op}_fake"
    torch.library.register_fake(contract.qualified)(fake)


for _contract in CONTRACTS.values():
    _register(_contract)
