"""Test work at a given number of torch's intra-op threads (the CPU kernels' at::parallel_for), the count restored
afterwards."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def at_one_and_two_threads(work):
    """work() on one thread, then on two: what an op whose result does not depend on the thread count must repeat."""
    with intra_op_threads(1):
        one = work()
    with intra_op_threads(2):
        two = work()
    return one, two
