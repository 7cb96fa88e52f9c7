"""cpu_qmatmul.quantize (plain torch, every CPU): the codes, scales and lows the packed weights hold. A GGUF
file's Q4_0 / Q4_1 / Q8_0 blocks come back bit for bit, and no group is rebuilt worse than min/max would."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chatserve_kernels import cpu_qmatmul as Q


@pytest.mark.parametrize("fmt,bits", [("Q4_0", 4), ("Q4_0", 8), ("Q4_1", 4), ("Q8_0", 8)])
def test_quantize_rebuilds_gguf_blocks_exactly(fmt, bits):
    """Weights dequantized by gguf-py from its own Q4_0 / Q4_1 / Q8_0 blocks come back bit for bit: the
    decode matmuls run the file's weights, not a second rounding of them (a Q4_0 block lacking q = 15 put
    min/max's grid off the file's, and a random Q4_0 model's decoded tokens drifted from transformers')."""
    gguf = pytest.importorskip("gguf")
    qt = gguf.GGMLQuantizationType[fmt]
    a = (np.random.default_rng(0).standard_normal((48, 256)) * 0.05).astype(np.float32)
    a[0, :32] = np.abs(a[0, :32])                 # a block whose extreme is positive (d < 0 in Q4_0)
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt).reshape(a.shape).copy())
    c, s, lo = Q.quantize(w, bits)
    assert torch.equal(Q.dequantize(c, s, lo), w)
    assert (s.half().float() == s).all() and (lo.half().float() == lo).all()       # as the kernel stores them


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_is_never_worse_than_min_max(bits):
    """Off any grid (plain random weights) each group's rebuild error stays within min/max's step / 2."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    c, s, lo = Q.quantize(w, bits)
    g = w.reshape(64, 16, 32)
    step = ((g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)).half().float()
    err = (Q.dequantize(c, s, lo) - w).reshape(64, 16, 32).abs().amax(-1)
    assert (err <= step * 0.5 + 1e-3 * step).all()
