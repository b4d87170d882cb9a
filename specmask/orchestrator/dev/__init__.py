"""Developer tooling, apart from the serving code and out of the orchestrator image.

``local_stack`` (the whole stack on one machine), ``up`` and ``demo`` (their subcommands).
"""
