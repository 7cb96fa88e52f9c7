"""Pydantic v2 models of every request and response body the HTTP API speaks; /openapi.json is built from them.

openai.py: the OpenAI-compatible routes and the operational ones; sessions.py: /v1/sessions.
Not the handlers and not the cross-field rules that need the model (protocol.py).
"""
