"""The OpenAI-compatible HTTP front door of the orchestrator (beside the gRPC one, same engine).

Modules: ``app`` (the aiohttp application and its lifecycle), ``routes`` (the
handlers), ``protocol`` (request bodies), ``translate`` (OpenAI request ->
``GenerationRequest``), ``tool_grammar`` (tool calls as a grammar, parsed back), ``tool_formats`` (each
model family's call format), ``prompting``
(chat messages -> prompt text), ``responses`` (response and chunk bodies),
``sse`` (Server-Sent Events), ``errors`` (OpenAI error objects and HTTP codes).
"""
