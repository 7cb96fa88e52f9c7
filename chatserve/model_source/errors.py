"""The two ways finding or checking a model fails; each message is one line meant for the operator."""
from __future__ import annotations


class ModelSourceError(ValueError):
    """A model name that names nothing local and cannot be fetched (not in the cache, offline, not on
    the Hub, no file for the quant tag asked for)."""


class ModelCheckError(ValueError):
    """Model files that cannot be served as they are: a truncated, corrupt or non-GGUF file, a tensor type
    no reader knows, a missing or unreadable safetensors shard, or more memory than the machine has."""
