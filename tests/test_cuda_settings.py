"""The cuda backend's kernel settings are checked by name before any kernel runs (no GPU needed)."""

from __future__ import annotations

import pytest

from kernelstudy.core import cuda_backend


def test_defaults_select_the_chunk_kernels():
    assert cuda_backend.CAUSAL_KERNEL in cuda_backend.CAUSAL_KERNELS
    assert cuda_backend._walk_blocks() == (
        cuda_backend.WALK_BLOCKS if cuda_backend.CAUSAL_KERNEL == "walk" else 0
    )


def test_walk_passes_its_block_target(monkeypatch):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 96)
    assert cuda_backend._walk_blocks() == 96
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    assert not cuda_backend._fused_backward()  # the fused backward is the chunk kernels'
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "chunks")
    assert cuda_backend._walk_blocks() == 0 and cuda_backend._fused_backward()


def test_unknown_kernel_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"CAUSAL_KERNEL must be one of .*'fast'"):
        cuda_backend._walk_blocks()


@pytest.mark.parametrize("blocks", [0, -3, True, 2.0, "256"])
def test_walk_blocks_must_be_a_positive_int(monkeypatch, blocks):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", blocks)
    with pytest.raises(ValueError, match="WALK_BLOCKS must be an int >= 1"):
        cuda_backend._walk_blocks()
