"""The engine layer: AsyncEngine (async_engine.py) and the offline LLM driver (llm.py) over the parts
builder.py makes; deltas.py and request_streams.py carry a request's output. Not HTTP (server/), not the
model (runtime/), not the bookkeeping (core/)."""
from chatserve.engine.async_engine import (MAX_BUFFERED_DELTAS, AdmissionError, AsyncEngine, Delta, DeltaChannel,
                                           Detokenizer, EngineStats, RequestStream)

__all__ = ["AsyncEngine", "AdmissionError", "Delta", "DeltaChannel", "Detokenizer", "EngineStats", "RequestStream",
           "MAX_BUFFERED_DELTAS"]
