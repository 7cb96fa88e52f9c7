"""chatserve.core — pure-Python bookkeeping: requests, block pool, KV cache manager, scheduler.

Never imports torch (tests/core/test_no_torch.py enforces it), so everything here is testable in
milliseconds with scripted runner outputs.
"""
