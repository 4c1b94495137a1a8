"""The generic in-place strategy: copy a chunk of experts aside, gather it back into place.

Any gather executor runs a permutation in place this way: for each chunk of
``scratch_experts`` experts, ``scratch = x[chunk]`` then ``x[chunk] = gather(scratch)``.
Every byte moves twice (so at most half the copy bandwidth); the scratch is the chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from fimoe_lab.kernels.compiled import ExecMap

__all__ = ["copy_then_gather"]


def copy_then_gather(
    gather: Callable[[ExecMap, torch.Tensor, torch.Tensor], None], em: ExecMap, flat: torch.Tensor, scratch_experts: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Permute every expert of ``flat`` ``(E, bytes)`` in place, ``scratch_experts`` at a time.

    Yields the number of leading experts done after each chunk. If ``gather`` raises,
    the chunk in flight is copied back from the scratch first: ``flat`` then holds the
    output layout before the last yielded count and its input after it.
    """
    experts = flat.shape[0]
    scratch = torch.empty((scratch_experts, flat.shape[1]), dtype=torch.uint8, device=flat.device)
    for start in range(0, experts, scratch_experts):
        stop = min(start + scratch_experts, experts)
        part, s = flat[start:stop], scratch[: stop - start]
        s.copy_(part)
        try:
            gather(em, s, part)
        except BaseException:
            part.copy_(s)
            raise
        yield stop, scratch
