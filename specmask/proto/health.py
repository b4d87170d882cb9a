"""gRPC health service names every SpecMask server answers (grpc.health.v1), and what each means.

Two questions, two names, so a probe never restarts a process for a fault elsewhere:

* ``READINESS`` ("", the whole server): can this replica do useful work now? It
  goes NOT_SERVING when a dependency is gone (the orchestrator with no healthy
  GPU worker) and on graceful shutdown. Kubernetes readiness probes ask it: the
  pod leaves its Service's endpoints, and comes back when the dependency does.
* ``LIVENESS``: is the process itself alive (its event loop or thread pool
  answers)? SERVING from start-up to shutdown, whatever its dependencies do.
  Liveness and startup probes ask it: a GPU worker restart or a mask-tier
  outage must not get the orchestrator killed and restarted (which would only
  add a Ray reconnect and model-load wait to the outage).

The Helm chart's probes name these strings (deploy/helm, tests/deploy check it).
"""

READINESS = ""
LIVENESS = "specmask.liveness"
