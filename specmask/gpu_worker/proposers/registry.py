"""Name -> proposer class. A plug-in point, not an if-chain."""

from __future__ import annotations

from collections.abc import Iterable

from specmask.gpu_worker.proposers.base import Proposer, ProposerResources

_REGISTRY: dict[str, type[Proposer]] = {}


def register(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator: make ``cls`` selectable by ``cls.name`` in SpeculationParams.proposers."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"proposer name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(cls: type[Proposer]) -> None:
    """Undo ``register(cls)`` (for tools that add a proposer for one run, e.g. bench.step_cost's replay)."""
    if _REGISTRY.get(cls.name) is cls:
        del _REGISTRY[cls.name]


def _load_builtins() -> None:
    # Importing registers them; done on first use rather than at package import.
    from specmask.gpu_worker.proposers import draft_model, grammar_forced, ngram  # noqa: F401


def registered_names() -> list[str]:
    """All proposer names (plain strings: they go into messages), in priority order."""
    _load_builtins()
    return [str(n) for n in sorted(_REGISTRY, key=lambda n: (_REGISTRY[n].priority, n))]


def order_names(names: Iterable[str]) -> tuple[str, ...]:
    """Validate ``names`` and return them in priority order, as plain strings (raises ValueError on
    unknown names)."""
    _load_builtins()
    names = tuple(dict.fromkeys(str(n) for n in names))
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown proposer(s) {unknown}; known: {registered_names()}")
    return tuple(sorted(names, key=lambda n: (_REGISTRY[n].priority, n)))


def build_proposers(resources: ProposerResources) -> dict[str, Proposer]:
    """Instantiate every registered proposer the worker can run (name -> instance)."""
    _load_builtins()
    built: dict[str, Proposer] = {}
    for name in registered_names():
        instance = _REGISTRY[name].create(resources)
        if instance is not None:
            built[name] = instance
    return built
