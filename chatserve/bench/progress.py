"""The progress bar the long benchmarks show on stderr (tqdm), or None when switched off."""
from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int | None, enabled: bool, *, desc: str | None = None, unit: str = "req") -> Any:
    """A tqdm bar on stderr (total None: a counter with a rate); None when not enabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, unit=unit, dynamic_ncols=True, leave=False)
