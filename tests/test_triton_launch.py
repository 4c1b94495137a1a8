"""``kernels.triton_launch.first_launch``: how the first call of a launch key starts its kernel and
what later calls reuse, against every runner convention a Triton release may have.

Triton kernels do not run on this machine (the GPU tests run them on the H200: every launch of
``tests/test_kernels_gpu.py`` goes through ``launch``); here a stand-in with Triton's interface
(``warmup`` -> a compiled kernel whose ``[grid]`` is a runner; ``kernel[grid](...)``) records
which launches *started*, so each test can say how many times the kernel ran.
"""

from __future__ import annotations

import pytest

from fimoe_lab.kernels.triton_launch import OWN_PATH, Pointer, first_launch


def kernel_params(x_ptr, out_ptr, n, W, BM):  # the stand-in kernel's parameters: 3 runtime, 2 constexpr
    pass


class Compiled:
    def __init__(self, owner, takes):
        self.owner, self.takes = owner, takes

    def __getitem__(self, grid):
        def runner(*args):
            if self.takes == "driver refuses":
                raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
            if len(args) != {"all": 5, "runtime": 3}.get(self.takes, -1):
                raise TypeError(f"function takes {self.takes} arguments ({len(args)} given)")
            self.owner.started.append(("runner", grid, args))

        return runner


class StandIn:
    """A kernel as ``first_launch`` sees it; ``takes``: which arguments its runner accepts
    (``all``, ``runtime``, ``none``), ``no runner``: a compiled kernel without ``[grid]``."""

    fn = staticmethod(kernel_params)

    def __init__(self, takes):
        self.takes = takes
        self.started: list = []
        self.warmups = 0

    def warmup(self, *args, grid, **meta):
        self.warmups += 1
        return object() if self.takes == "no runner" else Compiled(self, self.takes)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.started.append(("own", grid, args, meta))


ARGS = (Pointer(4096, None), Pointer(8192, None), 7)
VALUES = [4096, 8192, 7]
META = {"W": 32, "BM": 16, "num_warps": 4}


@pytest.mark.parametrize("takes,tail", [("all", (32, 16)), ("runtime", ())])
def test_first_launch_starts_once_through_the_runner_convention_it_takes(takes, tail):
    k = StandIn(takes)
    run = first_launch(k, (5, 3), ARGS, META, VALUES)
    assert k.warmups == 1
    assert k.started == [("runner", (5, 3, 1), (4096, 8192, 7) + tail)]  # once, whichever convention
    runner, got_tail = run
    assert got_tail == tail
    runner(*VALUES, *got_tail)  # what launch() does for the next call of the key
    assert len(k.started) == 2


@pytest.mark.parametrize("takes", ["none", "no runner"])
def test_first_launch_falls_back_to_tritons_own_launch_once(takes):
    k = StandIn(takes)
    assert first_launch(k, (2,), ARGS, META, VALUES) is OWN_PATH
    assert k.started == [("own", (2,), ARGS, META)]


def test_first_launch_raises_a_driver_refusal_without_launching():
    """A refusal that is not about the arguments (the driver refusing a cooperative grid) is the
    caller's to handle (the in-place scale launch then runs the cycle plan): nothing started,
    and no second attempt through another path."""
    k = StandIn("driver refuses")
    with pytest.raises(RuntimeError, match="cooperative"):
        first_launch(k, (132,), ARGS, META, VALUES)
    assert k.started == []


def test_pointer_is_an_address_with_an_element_type():
    p = Pointer(1 << 40, "int32")
    assert p.data_ptr() == 1 << 40 and p.dtype == "int32"
