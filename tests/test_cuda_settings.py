"""The cuda backend's kernel settings are checked by name before any kernel runs (no GPU needed)."""

from __future__ import annotations

import pytest

from kernelstudy.core import cuda_backend


def test_defaults_are_valid_settings():
    assert cuda_backend.CAUSAL_KERNEL in cuda_backend.CAUSAL_KERNELS
    assert cuda_backend._walk_blocks() == (
        cuda_backend.WALK_BLOCKS if cuda_backend.CAUSAL_KERNEL == "walk" else 0
    )


def test_walk_passes_its_block_target(monkeypatch):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 96)
    assert cuda_backend._walk_blocks() == 96
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "chunks")
    assert cuda_backend._walk_blocks() == 0


def test_fused_backward_passes_the_kernel_choice(monkeypatch):
    """The fused backward is the selected kernel's: the walk's block target reaches it."""
    calls = []

    class Ext:
        def causal_backward(self, *tensors, out_fp32, walk_blocks):
            calls.append((len(tensors), out_fp32, walk_blocks))
            return []

    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 64)
    for kernel, blocks in (("walk", 64), ("chunks", 0)):
        monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", kernel)
        cuda_backend._fused_backward(Ext(), 1, 2, 3, 4, out_fp32=True)
        assert calls[-1] == (4, True, blocks)


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
