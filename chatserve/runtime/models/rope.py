"""Rotary position tables for every RoPE scaling a supported checkpoint can carry: default, linear,
dynamic NTK, YaRN (with its attention factor), llama3, LongRoPE, and GGUF's stored frequency factors.

One table row per position (cos and sign-folded sin), so a per-position frequency (dynamic NTK) costs
nothing at run time. Not the rotation itself (layers.Rotary) and not config parsing (arch_config.py).
"""
from __future__ import annotations

from typing import Any

import math

import torch

from chatserve.runtime.arch_config import ArchConfig, UnsupportedModelError


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    # [dim/2] (or [L, dim/2] for a per-position theta [L, 1])
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta ** exps)


def _yarn(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between; the
    attention factor (0.1·ln(factor) + 1 unless given) scales cos and sin."""
    orig = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = s.get("attention_factor")
    if att is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:      # the dimension that turns `rotations` times over orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv = _base_inv_freq(theta, dim)
    keep = 1 - ramp                                                   # 1: extrapolate (high frequency)
    return inv / factor * (1 - keep) + inv * keep, float(att)


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """llama3: wavelengths longer than orig/low_freq_factor are divided by factor, shorter than
    orig/high_freq_factor kept, and a smooth blend between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    orig = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(medium, blended, scaled)


def angles(theta: float, dim: int, scaling: dict[str, Any] | None, max_len: int, max_position_embeddings: int,
           freq_factors: tuple[float, ...] | None = None, start: int = 0, count: int | None = None
           ) -> tuple[torch.Tensor, float]:
    """(angle per position and frequency [count, dim/2] float32 for positions [start, start + count) of a
    max_len table (all of it by default), cos/sin scale)."""
    count = max_len - start if count is None else count
    pos = torch.arange(start, start + count, dtype=torch.int64).to(torch.float32)    # [L]
    s: dict[str, Any] = scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    att: float = 1.0
    if kind == "dynamic":
        # dynamic NTK (as transformers decodes): position p is rotated with the base stretched for a
        # context of p + 1 tokens once that passes max_position_embeddings
        factor = float(s["factor"])
        ctx = torch.clamp(pos.double() + 1, min=float(max_position_embeddings))[:, None]   # [L, 1]
        base = theta * ((factor * ctx / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return pos[:, None] * _base_inv_freq(base.float(), dim), att
    inv = _base_inv_freq(theta, dim)
    if freq_factors is not None:
        inv = inv / torch.tensor(freq_factors, dtype=torch.float32)
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, s)
    elif kind == "yarn":
        inv, att = _yarn(theta, dim, s, max_position_embeddings)
    elif kind == "longrope":
        # the long factors when the served context passes the original one, for every position
        # (llama.cpp's choice: a sequence's rotation never depends on its batch or its length so far)
        orig = int(s["original_max_position_embeddings"])
        factors = s["long_factor"] if max_len > orig else s["short_factor"]
        if len(factors) != dim // 2:
            raise UnsupportedModelError(f"LongRoPE factors have {len(factors)} entries, not {dim // 2}")
        inv = inv / torch.tensor(factors, dtype=torch.float32)
        factor = s.get("factor") or max_position_embeddings / orig
        given = s.get("attention_factor")
        if given is not None:
            att = float(given)
        else:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    elif kind != "default":
        raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported")
    return torch.outer(pos, inv), float(att)


# positions per chunk of rope_tables: its float32 temporaries stay a few MiB, so a 131,072-position table is one
# pass of writes into its final dtype instead of ~10 full-size float32 intermediates (0.2-0.9 s of first-touch
# page faults and copies at a load, docs/benchmarks.md)
_CHUNK = 4096


def rope_tables(config: ArchConfig, max_len: int, local: bool = False, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary_dim] in dtype, rotate-half layout with the sign folded into sin:
        rope(x) = x·cos + roll(x, rotary_dim/2)·sin,   sin = [-s, s]
    each element computed in float32 and rounded once to dtype. local: Gemma 3's sliding layers (their own
    base, no scaling)."""
    dim = int(config.head_dim * config.partial_rotary_factor)
    if local and config.local_rope_theta is not None:
        theta, scaling, factors = config.local_rope_theta, None, None
    else:
        theta, scaling, factors = config.rope_theta, config.rope_scaling, config.rope_freq_factors
    cos = torch.empty(max_len, dim, dtype=dtype)
    sin = torch.empty(max_len, dim, dtype=dtype)
    half = dim // 2
    for at in range(0, max_len, _CHUNK):
        # angles of positions [at, at + n) (each position's row is independent of the table's length, except
        # LongRoPE's choice of factors, which sees max_len)
        ang, att = angles(theta, dim, scaling, max_len, config.max_position_embeddings, factors, start=at,
                          count=min(_CHUNK, max_len - at))
        c, s = ang.cos(), ang.sin()                                                     # [n, dim/2]
        if att != 1.0:
            c, s = c * att, s * att
        rows = slice(at, at + ang.shape[0])
        cos[rows, :half], cos[rows, half:] = c, c
        sin[rows, :half], sin[rows, half:] = -s, s
    return cos, sin
