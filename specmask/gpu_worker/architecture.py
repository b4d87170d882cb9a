"""What the worker knows of a decoder architecture, in one place.

Two questions are answered here, from a model's configuration alone:

* **Which forward path a model takes.** The static forward (gpu_worker.static_forward)
  runs Llama's decoder layer through the model's own submodules: embeddings, RMSNorm,
  rotary, grouped-query attention, gated MLP. A family whose layer is that layer up to a
  few declared differences is described by an ``Architecture``; any other model runs the
  eager packed path (gpu_worker.model_runner), which calls transformers' module tree.
  q/k/v biases (Qwen2/2.5) need no declaration: they live in the projection modules the
  static forward calls. Qwen3 adds a per-head RMSNorm of q and k before rotary.
  Mistral's layer is Llama's; its sliding window is a configuration matter (below).
* **Which configurations nothing in the worker implements.** Both paths attend with an
  explicit mask over the whole context, never a window; neither caps attention logits;
  rotary frequencies are computed per forward, so a rope type whose frequencies depend on
  the forward's longest position would change a sequence's logits with the batch it
  shares. Such a model would run and answer wrongly, so it is refused at start-up
  (``check``), with the field that asks for it named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    """One decoder family the static forward runs: Llama's layer plus the flags below."""

    model_type: str  # transformers' config.model_type
    # Per-head RMSNorm of q and k after their projections, before rotary (Qwen3:
    # ``self_attn.q_norm`` / ``self_attn.k_norm`` over the head dimension).
    qk_norm: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture("llama"),
        Architecture("mistral"),  # Llama's layer; a window within max_model_len is refused (check)
        Architecture("qwen2"),  # q/k/v biases, carried by the projection modules
        Architecture("qwen3", qk_norm=True),
    )
}

# Rope types whose frequencies are fixed at load (transformers' rotary module then maps
# positions to cos/sin the same way in every forward). "dynamic" and "longrope" switch
# frequencies on the forward's longest position, so a row's logits would depend on its
# batch; a type not listed is one nobody has checked.
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

# Config fields that make a layer a mixture of experts (Qwen2/3-MoE, Mixtral, DeepSeek, ...).
# transformers' MoE blocks would run in the eager path, but no MoE model has been checked
# against either path, and the per-token cost model (gpu_worker.token_cost) counts every
# parameter as read by every token: refused rather than served unchecked.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# Scalings of the final logits that a model's own forward applies after its LM head and the
# runner's projection (model_runner._project: the head, then final_logit_softcapping) does not.
_LOGIT_SCALE_FIELDS = ("logits_scaling", "logit_scale")


class UnsupportedModel(ValueError):
    """A model whose configuration asks for something the worker does not implement."""


def text_config(config: Any) -> Any:
    """The decoder's configuration (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def rope_type(config: Any) -> str:
    """The rope type the config asks for ("default" when none)."""
    c = text_config(config)
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return "default"
    kind = rope.get("rope_type", rope.get("type", "default"))
    return str(kind)


def sliding_window(config: Any) -> int | None:
    """The attention window some layer uses, or None when every layer attends over the whole
    context. transformers' convention: a query at position q sees keys q - window + 1 .. q."""
    c = text_config(config)
    window = getattr(c, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(c, "use_sliding_window", True) is False:
        return None
    return int(window)


def max_len(config: Any, max_model_len: int | None) -> int:
    """Positions a sequence of this model may reach: the config's, capped by ``max_model_len``."""
    own = int(getattr(text_config(config), "max_position_embeddings", None) or 1 << 30)
    return own if max_model_len is None else min(own, max_model_len)


def unsupported(config: Any, max_model_len: int | None = None) -> str | None:
    """Why the worker cannot serve a model of ``config`` (naming the field), or None.

    ``max_model_len`` caps the positions a sequence reaches: a sliding window at least that
    wide never takes effect, so it is no reason to refuse."""
    c = text_config(config)
    limit = max_len(c, max_model_len)
    layer_types = getattr(c, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        return f"layer_types has {', '.join(other)} layers: only full attention is implemented"
    window = sliding_window(c)
    if window is not None and window < limit:
        return (
            f"sliding_window={window} is below max_model_len={limit}: the worker attends over the whole "
            f"context, never a window (serving with max_model_len <= {window} is exact)"
        )
    softcap = getattr(c, "attn_logit_softcapping", None)
    if softcap:
        return f"attn_logit_softcapping={softcap}: attention logit soft-capping is not implemented"
    kind = rope_type(c)
    if kind not in ROPE_TYPES:
        return f"rope type {kind!r} (rope_parameters): only {', '.join(sorted(ROPE_TYPES))} are implemented"
    for field in _MOE_FIELDS:
        experts = getattr(c, field, None)
        if isinstance(experts, int) and experts > 1:
            return f"{field}={experts}: mixture-of-experts layers are not supported"
    for field in _LOGIT_SCALE_FIELDS:
        scale = getattr(c, field, None)
        if isinstance(scale, int | float) and scale != 1:
            return f"{field}={scale}: the worker's vocabulary projection does not apply it"
    return None


def check(config: Any, max_model_len: int | None = None, *, name: str = "model") -> None:
    """Raise ``UnsupportedModel`` (one line, naming the field) when ``unsupported`` has a reason."""
    reason = unsupported(config, max_model_len)
    if reason is not None:
        model_type = getattr(text_config(config), "model_type", "?")
        raise UnsupportedModel(f"{name} ({model_type}) is not supported: {reason}")


def static_architecture(model: Any, max_model_len: int | None = None) -> tuple[Architecture | None, str]:
    """The ``Architecture`` the static forward runs ``model`` as, or None and why not (its
    sequences capped at ``max_model_len`` positions)."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        return None, f"model_type {model_type!r} is not one of {', '.join(sorted(ARCHITECTURES))}"
    base = getattr(model, "model", None)
    if base is None:
        return None, f"{type(model).__name__} has no decoder the static forward can call"
    # The static forward has no window either: one wider than every sequence the runner
    # admits (``max_model_len``) never takes effect.
    reason = unsupported(config, max_model_len)
    if reason is not None:
        return None, reason
    layers = getattr(base, "layers", None)
    if not layers or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        return None, f"{type(model).__name__}'s layers are not self_attn + mlp"
    if arch.qk_norm and not all(
        hasattr(layer.self_attn, "q_norm") and hasattr(layer.self_attn, "k_norm") for layer in layers
    ):
        return None, f"{type(model).__name__}'s attention has no q_norm/k_norm"
    return arch, ""
