"""Every family gpu_worker.architecture describes runs the static forward exactly as
transformers' own eager forward runs the model.

Tiny random models of each family are built from transformers' own config classes, with
every bias and norm weight randomised (transformers initialises biases to zero and norms
to one, under which a forward that skipped them would still pass). The worker's runner
then drives sequences through prefill, decode and multi-token verify forwards with draft
rollbacks, on the static path (exact and bucketed layouts) and on the eager packed path,
and every logits row is compared with the model's plain ``forward`` over the sequence's
tokens so far, without any cache, under transformers' "eager" attention.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specmask.gpu_worker.architecture import (
    ARCHITECTURES,
    UnsupportedModel,
    check,
    sliding_window,
    static_architecture,
    unsupported,
)
from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner

VOCAB = 101
ATOL = 2e-5
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_COMMON, attention_bias=True))


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    # Mistral v0.3 / Nemo: no window; head_dim wider than hidden / heads, as in Nemo.
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None, head_dim=12))


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3-0.6B's shape in small: head_dim (16) is not hidden / heads (8); tied embeddings.
    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True))


BUILDERS: dict[str, Callable[[], Any]] = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}


def _build(family: str) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BUILDERS[family]().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
                elif "norm" in name:
                    param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def models(family: str) -> tuple[Any, Any]:
    """(the model the runners use, an identical copy under transformers' eager attention)."""
    model = _build(family)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return model, reference


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _drive(runner: ModelRunner) -> list[tuple[list[int], torch.Tensor]]:
    """Prefill 4 sequences (widths within and past the static width buckets), then decode and
    verify steps of mixed widths over all or some of them, rolling back rejected drafts and
    freeing one sequence midway. Returns per logits block the tokens its sequence held after
    the forward and the [num_logits, V] logits."""
    kvs = [SequenceKV() for _ in range(4)]
    tokens: list[list[int]] = [[] for _ in kvs]
    out: list[tuple[list[int], torch.Tensor]] = []

    def forward(live: list[int], widths: list[int], logits: list[int], seed: int) -> None:
        items = []
        for j, (i, w) in enumerate(zip(live, widths, strict=True)):
            new = _ids(w, seed + j)
            tokens[i] += new
            items.append(ForwardItem(kvs[i], new, logits[j]))
        for i, got in zip(live, runner.forward(items), strict=True):
            out.append((list(tokens[i]), got))

    forward([0, 1, 2, 3], [5, 12, 20, 3], [1, 3, 1, 2], seed=1)  # prefill, verify-like tails
    for step in range(6):
        if step == 3:  # a finished sequence: its slot is refilled by the last one
            kvs[1].free()
            live_ids = [0, 2, 3]
        live = [i for i in (live_ids if step >= 3 else [0, 1, 2, 3]) if step % 2 == 0 or i != 2]
        widths = [1 + (i + step) % 5 for i in live]  # 1 = decode, 2..5 = verify k + 1
        forward(live, widths, widths, seed=100 * (step + 1))
        for i in live:
            reject = (i + step) % 3
            kvs[i].crop(kvs[i].length - reject)
            del tokens[i][len(tokens[i]) - reject :]
    return out


@torch.inference_mode()
def _reference(model: Any, seq: list[int], rows: int) -> torch.Tensor:
    """The last ``rows`` positions' logits of ``model``'s own forward over ``seq``: [rows, V]."""
    ids = torch.tensor([seq], device=next(model.parameters()).device)
    return model(input_ids=ids).logits[0, len(seq) - rows :].float()


@pytest.mark.parametrize("path", ["static-exact", "static-bucketed", "eager-packed"])
def test_forward_matches_transformers_eager(models: tuple[Any, Any], path: str) -> None:
    model, reference = models
    runner = ModelRunner(model, static="off" if path == "eager-packed" else "on")
    if path != "eager-packed":
        assert runner.static is not None
        runner.static.pad_to_buckets = path == "static-bucketed"
    blocks = _drive(runner)
    if runner.static is not None:
        assert runner.static.forwards >= 6  # prefill of short prompts, decode, verify: static
    for seq, got in blocks:
        want = _reference(reference, seq, got.shape[0])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_match_transformers_eager(family: str) -> None:
    """On CUDA the static path captures and replays graphs at bucketed shapes (float32, so the
    comparison is tight; the bf16 path is bench.gpu's)."""
    model = _build(family).to("cuda")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    runner = ModelRunner(model, static="on")
    assert runner.static is not None and runner.static.use_graphs and runner.static.pad_to_buckets
    blocks = _drive(runner)
    assert runner.static.captures > 0 and runner.static.replays > 0
    for seq, got in blocks:
        want = _reference(reference, seq, got.shape[0])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_static_path_is_taken_and_logged(
    family: str, models: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = models
    arch, why = static_architecture(model)
    assert arch is ARCHITECTURES[family] and why == ""
    assert arch.qk_norm == (family == "qwen3")
    with caplog.at_level("INFO", logger="specmask.gpu_worker.model_runner"):
        runner = ModelRunner(model, static="auto", name="draft")
    assert runner.static is not None
    line = f"draft: {type(model).__name__} ({family}): static forward (eager, no graphs off CUDA)"
    assert line in caplog.messages
    assert runner.describe_path() == line.removeprefix("draft: ")


def test_unsupported_family_logs_the_eager_path_and_why(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64)).eval()
    with caplog.at_level("INFO", logger="specmask.gpu_worker.model_runner"):
        runner = ModelRunner(gpt2, static="auto", name="target")
    assert runner.static is None
    assert any(
        m.startswith("target: GPT2LMHeadModel (gpt2): eager packed forward (model_type 'gpt2' is not one of")
        for m in caplog.messages
    )


# -- configurations the worker refuses -----------------------------------------------------------


def _config(family: str, **fields: Any) -> Any:
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }[family]
    return cls(**fields)


def test_mistral_v01_window_is_refused_unless_max_model_len_fits_it() -> None:
    config = _config("mistral", sliding_window=4096, max_position_embeddings=32768)
    assert sliding_window(config) == 4096
    with pytest.raises(UnsupportedModel, match=r"^target \(mistral\) is not supported: sliding_window=4096 is below"):
        check(config, name="target")
    with pytest.raises(UnsupportedModel, match="max_model_len=4097"):
        check(config, 4097)
    check(config, 4096)  # the window never takes effect: exact
    assert unsupported(_config("mistral", sliding_window=None)) is None


def test_qwen_windows_follow_layer_types() -> None:
    # Qwen2.5's configs carry a window that use_sliding_window leaves off.
    assert unsupported(_config("qwen2", sliding_window=131072, use_sliding_window=False)) is None
    windowed = _config("qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=1024, max_window_layers=2)
    assert sliding_window(windowed) == 1024
    assert "sliding_window=1024" in (unsupported(windowed, 8192) or "")


def test_gemma2_is_refused_by_window_then_softcap() -> None:
    gemma = _config("gemma2", max_position_embeddings=8192)
    assert "sliding_window=4096" in (unsupported(gemma) or "")
    # Within the window the soft-capping is still refused, by name.
    assert "attn_logit_softcapping=50.0" in (unsupported(gemma, 4096) or "")


@pytest.mark.parametrize(
    ("rope", "ok"),
    [
        ({"rope_type": "default", "rope_theta": 1e6}, True),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, True),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}, True),
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, False),
    ],
)
def test_rope_types(rope: dict[str, Any], ok: bool) -> None:
    reason = unsupported(_config("qwen3", rope_parameters=rope))
    assert (reason is None) == ok
    if not ok:
        assert reason is not None and "rope type 'dynamic' (rope_parameters)" in reason


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_is_refused(family: str) -> None:
    reason = unsupported(_config(family)) or ""
    assert "experts=" in reason and "mixture-of-experts" in reason


def test_runner_refuses_at_construction() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=64)).eval()
    with pytest.raises(UnsupportedModel, match="sliding_window=64"):
        ModelRunner(model, name="target")
    # Capped at the window, it is served, and on the static path (the window never bites).
    runner = ModelRunner(model, static="auto", max_model_len=64)
    assert runner.static is not None and runner.max_model_len == 64


def test_loading_refuses_before_reading_weights(tmp_path: Any) -> None:
    from transformers import MistralConfig

    from specmask.gpu_worker.loading import load_causal_lm

    MistralConfig(**_COMMON, sliding_window=64).save_pretrained(tmp_path)  # a config, no weights at all
    with pytest.raises(UnsupportedModel, match=r"^draft \(mistral\) is not supported: sliding_window=64"):
        load_causal_lm(str(tmp_path), torch.float32, torch.device("cpu"), name="draft")
