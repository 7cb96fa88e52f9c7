"""Kernel tests: Triton runs in its CPU interpreter unless CUDA is present.

TRITON_INTERPRET must be set before triton is first imported; chatserve_kernels.dispatch also sets it
on CUDA-less machines, so test order does not matter. `force_triton` makes the public functions pick
the Triton path on CPU tensors for one test.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setenv("CHATSERVE_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
