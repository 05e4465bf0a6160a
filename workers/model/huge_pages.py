"""CPU memory for the weights a decode step streams whole, on the OS's transparent huge pages where it grants them.

A lone stream's step reads every weight once: on 4 KB pages a model's ~100-300 MB span tens of thousands of pages,
on 2 MB pages a few hundred. Linux backs memory with huge pages unasked only in the `always` mode of
/sys/kernel/mm/transparent_hugepage/enabled; in the common `madvise` mode, only memory advised `MADV_HUGEPAGE` (which
torch's allocator advises only under THP_MEM_ALLOC_ENABLE=1, for every allocation of 2 MB or more). Measured with the
int8 weights, one buffer (`int8_linear.quantize_linears`), on an AMD EPYC Zen 4 at one thread: a lone SmolLM2 step
in a process of one engine 6.8-8.5 ms on 4 KB pages, 6.5-6.8 on huge pages (an engine built later in a process was
as fast on 4 KB pages; why the first is not was not found).
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` for the caller to fill, in an anonymous mapping advised `MADV_HUGEPAGE` (the
    tensor keeps the mapping alive); where the OS or Python has no such advice, plain torch memory."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError as error:  # transparent huge pages compiled out of the kernel
        log.debug("no huge pages for the weights: %s", error)
    return torch.frombuffer(mapping, dtype=torch.uint8)
