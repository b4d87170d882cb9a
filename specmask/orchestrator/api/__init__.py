"""The orchestrator's front doors, beside the engine.

``grpc_server`` and ``grpc_servicer`` (the gRPC API), ``http`` (the OpenAI-compatible HTTP API),
``error_table`` (how each kind of error looks on both).
"""
