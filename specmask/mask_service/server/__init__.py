"""The mask-service process: gRPC servicer, sessions, compile pool, the mask hot path."""
