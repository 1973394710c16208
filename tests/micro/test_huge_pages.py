"""``micro.model.zeros_on_huge_pages``, the KV cache's allocation: zeros like
``torch.zeros``, and on Linux with transparent huge pages available, advised onto them."""

import re
from pathlib import Path

import pytest
import torch

from nodraft.micro.model import KVCache, MicroConfig, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised(t: torch.Tensor) -> list[bool]:
    """For each mapping that overlaps ``t``'s 2 MiB-aligned part (/proc/self/smaps):
    whether it carries the huge-page advice (``hg`` in its VmFlags). Whether the kernel
    then finds free huge pages is the system's affair (a fragmented memory gives fewer);
    the advice is what the allocation controls."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // (2 << 20)) * (2 << 20), end // (2 << 20) * (2 << 20)
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and lo < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            flags.append("hg" in line.split()[1:])
    return flags


@pytest.mark.parametrize("shape, dtype", [((4, 32, 4, 512, 40), torch.float32),
                                          ((3, 5), torch.float32), ((2, 1000, 700), torch.bfloat16)])
def test_it_is_zeros_of_the_shape_and_type_asked(shape, dtype):
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text()
                    or not Path("/proc/self/smaps").exists(),
                    reason="no transparent huge pages on this system")
def test_the_engines_cache_is_advised_onto_huge_pages():
    cache = KVCache(MicroConfig(), 32)  # the server's default: 84 MB each for k and v
    for t in (cache.k, cache.v):
        flags = advised(t)
        assert flags and all(flags)
    assert not any(advised(torch.zeros(cache.k.shape)))  # a plain tensor is not advised
