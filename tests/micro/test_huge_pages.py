"""``micro.model.zeros_on_huge_pages``, the KV cache's allocation: zeros like
``torch.zeros``, and on Linux with transparent huge pages available, backed by them."""

import re
from pathlib import Path

import pytest
import torch

from nodraft.micro.model import KVCache, MicroConfig, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap ``t``'s bytes (/proc/self/smaps; the
    advice splits the allocation's mapping at the aligned part's edges)."""
    start = t.data_ptr()
    end, total, inside = start + t.numel() * t.element_size(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < end and start < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("shape, dtype", [((4, 32, 4, 512, 40), torch.float32),
                                          ((3, 5), torch.float32), ((2, 1000, 700), torch.bfloat16)])
def test_it_is_zeros_of_the_shape_and_type_asked(shape, dtype):
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this system")
def test_the_engines_cache_is_on_huge_pages():
    cache = KVCache(MicroConfig(), 32)  # the server's default: 84 MB each for k and v
    assert huge_kib(cache.k) >= 40 * 1024 and huge_kib(cache.v) >= 40 * 1024
    if "[madvise]" in THP.read_text():  # only what asks gets them: a plain tensor does not
        assert huge_kib(torch.zeros(cache.k.shape)) < huge_kib(cache.k)
