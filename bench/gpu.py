"""Measure the GPU path: bitmask kernels, worker step time, mask wait, tokens per second.

    python -m bench.gpu                 # on a CUDA host: real shapes (Llama 3 8B+1B, Qwen3 8B+0.6B, SmolLM2-135M)
    python -m bench.gpu --dry-run       # tiny shapes on CPU: checks the harness end to end (CI)
    make bench-gpu

Runs on a bare GPU host with no network, no Ray and no weights:

* **Models** are random-initialised from configs at real shapes, directly on the
  device: a Llama-3.1-8B-shaped target with a Llama-3.2-1B-shaped draft in bf16
  and the real Llama-3 tokenizer (copied into ``bench/.tokenizers/llama3``, which
  git ignores; ``make bench-gpu`` copies it from ``../shared/data``), a Qwen3-8B
  target with a Qwen3-0.6B draft (the Qwen3 architecture: q/k norm, head_dim 128
  on the 0.6B's 1,024-wide hidden state) with the real Qwen3 tokenizer
  (``bench/.tokenizers/qwen3``, or ``../shared/data``; 151,669 tokens, the models'
  vocabulary padded to 151,936 as the published checkpoints are), and a
  SmolLM2-135M-shaped target with an 8-layer early-exit-shaped draft. SmolLM2's
  tokenizer is not available offline: that pair uses a byte-level stand-in (257
  tokens, logits padded to SmolLM2's 49,152), so its masks are cheaper than the
  real tokenizer's would be.
* **The worker** is the in-process ``GpuWorker`` (the same class Ray runs as an
  actor) talking gRPC to a real mask service started as a local subprocess on the
  host's CPUs.
* **Acceptance is fixed, not measured.** Random weights accept nothing useful, so
  both models' real logits get a scripted bias (+1e4) on the next token of a fixed
  valid JSON document per sequence (compact separators, canonical tokenisation);
  decoding is greedy. The target therefore emits that document, the draft agrees
  with it on a fixed fraction of positions (``--agreement``, default 1.0: every
  draft accepted, k + 1 tokens per spec step), and constrained and unconstrained
  runs emit identical tokens. Every forward, mask, kernel and rejection-sampling
  call is the real one; the bias is one indexed add per forward.

Measured:
(a) bitmask apply at B=64, k=4, V=128,256 — our Triton kernel (direct and the
    indirect-table one the verifier uses) against xgrammar's
    ``apply_token_bitmask_inplace`` and the memory-bandwidth floor (bytes that
    must move: the mask words read + -inf written to each disallowed logit, over
    a measured device-to-device copy rate);
(b) worker step time (median over timed steps, after warm-up) for no-spec / spec
    x unconstrained / constrained x draft masks on/off, at B in {1, 8, 32, 64}, k=4;
(c) the mask wait left on the critical path (``StepOutput.mask_time_s``);
(d) tokens per second (emitted tokens / timed wall time).
Each batch size gets one untimed pass, then ``--rounds`` passes over the modes
(alternating, so a slow spell of the host hits every mode); the constrained /
unconstrained ratios are also reported per round (paired). ``--profile-batch B``
adds torch.profiler op tables. Prints markdown tables; the last line is
``RESULT {json}``. Missing wheels are listed by name at start (``REQUIRED_WHEELS``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BENCH_DIR = Path(__file__).resolve().parent
# git-ignored; `make bench-gpu` fills llama3/ from ../shared/data, and prepare_tokenizer copies
# what it finds there into it (a device host without ../shared/data gets this folder carried).
TOKENIZER_CACHE = BENCH_DIR / ".tokenizers"
# Real tokenizers a pair may use (folders of TOKENIZER_CACHE and of the shared data's tokenizers/).
REAL_TOKENIZERS = ("llama3", "qwen3")

# Modules beyond torch/triton/transformers that this path imports, with the wheel that provides each.
REQUIRED_WHEELS: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers==5.23.0",
    "tokenizers": "tokenizers>=0.21",
    "xgrammar": "xgrammar==0.2.8 (needs apache-tvm-ffi, pydantic)",
    "pydantic": "pydantic",
    "tvm_ffi": "apache-tvm-ffi",
    "grpc": "grpcio==1.85.1",
    "grpc_health": "grpcio-health-checking==1.85.1",
    "grpc_reflection": "grpcio-reflection==1.85.1",
    "google.protobuf": "protobuf==7.36.2",
    "xxhash": "xxhash>=3.4",
    "prometheus_client": "prometheus-client>=0.20",
    "numpy": "numpy>=1.26",
    "jsonschema": "jsonschema>=4.20 (needs jsonschema-specifications, referencing, rpds-py, attrs)",
    "google.rpc": "googleapis-common-protos",
    "grpc_status": "grpcio-status==1.85.1",
}
CUDA_WHEELS = {"triton": "triton"}

# Model shapes (config keyword arguments of SHAPE_TYPES' model type, llama unless named there),
# as published in each model's config.json.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    # SmolLM2-135M's first 8 layers + its norm and head: the early-exit draft's shape.
    "smollm2-135m-exit8": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # The Qwen3 pair's architecture and real tokenizer (padded vocabulary) at CPU sizes.
    "tiny-qwen3": dict(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny-qwen3-draft": dict(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
    "tiny-draft": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
}  # fmt: skip
# transformers model_type of each shape not Llama's.
SHAPE_TYPES: dict[str, str] = {
    "qwen3-8b": "qwen3",
    "qwen3-0.6b": "qwen3",
    "tiny-qwen3": "qwen3",
    "tiny-qwen3-draft": "qwen3",
}


@dataclass(frozen=True)
class Pair:
    target: str  # key of SHAPES
    draft: str
    tokenizer: str  # one of REAL_TOKENIZERS (from TOKENIZER_CACHE) or "bytes" (byte-level stand-in)


PAIRS: dict[str, Pair] = {
    "llama3-8b-1b": Pair("llama-3.1-8b", "llama-3.2-1b", "llama3"),
    "qwen3-8b-0.6b": Pair("qwen3-8b", "qwen3-0.6b", "qwen3"),
    "smollm2-135m": Pair("smollm2-135m", "smollm2-135m-exit8", "bytes"),
    "tiny": Pair("tiny", "tiny-draft", "bytes"),
    "tiny-qwen3": Pair("tiny-qwen3", "tiny-qwen3-draft", "qwen3"),
}


@dataclass(frozen=True)
class Mode:
    speculate: bool
    grammar: bool
    draft_masks: bool


MODES: dict[str, Mode] = {
    "nospec/unconstrained": Mode(False, False, False),
    "nospec/constrained": Mode(False, True, False),
    "spec/unconstrained": Mode(True, False, False),
    "spec/constrained/draft-masks-off": Mode(True, True, False),
    "spec/constrained/draft-masks-on": Mode(True, True, True),
}

# Logit bias that makes the scripted token the argmax whatever the random weights say.
SCRIPT_BIAS = 1e4

# Schemas whose documents can be made arbitrarily long (arrays without maxItems), so no
# sequence completes its grammar inside the timed window.
SCHEMAS: dict[str, dict[str, Any]] = {
    "orders": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name", "email"],
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                    "required": ["sku", "qty", "price"],
                },
            },
        },
        "required": ["customer", "items"],
    },
    "events": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "kind": {"enum": ["click", "view", "purchase"]},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["id", "kind", "ok", "tags"],
        },
    },
    "people": {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "first": {"type": "string"},
                        "last": {"type": "string"},
                        "age": {"type": "integer", "minimum": 0},
                        "city": {"type": "string"},
                    },
                    "required": ["first", "last", "age", "city"],
                },
            }
        },
        "required": ["people"],
    },
}
_WORDS = (
    "alpha",
    "bravo",
    "delta",
    "echo",
    "lima",
    "oscar",
    "romeo",
    "tango",
    "victor",
    "zulu",
    "north",
    "south",
    "river",
    "stone",
    "maple",
    "cedar",
)


def missing_wheels(cuda: bool) -> list[str]:
    """Requirements whose module cannot be imported here (nothing is imported)."""
    needed = {**REQUIRED_WHEELS, **(CUDA_WHEELS if cuda else {})}
    missing = []
    for module, requirement in needed.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package (google.protobuf without google)
            found = False
        if not found:
            missing.append(requirement)
    return missing


# -- documents and scripts ---------------------------------------------------------------
def _document(schema_name: str, rng: Any, min_chars: int) -> str:
    """A valid compact JSON document of ``schema_name`` with at least ``min_chars`` characters."""

    def word() -> str:
        return rng.choice(_WORDS) + str(rng.randrange(100))

    def grow(make: Callable[[], Any], wrap: Callable[[list[Any]], Any]) -> str:
        items: list[Any] = []
        while True:
            items.append(make())
            text = json.dumps(wrap(items), separators=(",", ":"))
            if len(text) >= min_chars:
                return text

    if schema_name == "orders":
        customer = {"name": word(), "email": f"{word()}@{word()}.com"}
        item = lambda: {"sku": word(), "qty": rng.randrange(1, 50), "price": rng.randrange(100, 99999) / 100}  # noqa: E731
        return grow(item, lambda items: {"customer": customer, "items": items})
    if schema_name == "events":
        event = lambda: {  # noqa: E731
            "id": rng.randrange(10**6),
            "kind": rng.choice(["click", "view", "purchase"]),
            "ok": rng.random() < 0.5,
            "tags": [word() for _ in range(rng.randrange(0, 3))],
        }
        return grow(event, lambda items: items)
    person = lambda: {"first": word(), "last": word(), "age": rng.randrange(90), "city": word()}  # noqa: E731
    return grow(person, lambda items: {"people": items})


@dataclass(frozen=True)
class ScriptedSequence:
    seq_id: str
    schema: str
    prompt: tuple[int, ...]
    script: tuple[int, ...]  # prompt + the document's tokens: token p is what position p must hold


def make_sequences(
    tokenizer: Any, batch: int, *, prompt_len: int, doc_tokens: int, seed: int
) -> list[ScriptedSequence]:
    """``batch`` sequences over the schemas in turn, each with a unique prompt of ``prompt_len``
    tokens and a document of at least ``doc_tokens`` tokens."""
    import random

    rng = random.Random(seed)
    names = list(SCHEMAS)
    out = []
    for i in range(batch):
        name = names[i % len(names)]
        text = f"Request {i}. Produce JSON for the schema {json.dumps(SCHEMAS[name])}. Answer with JSON only. "
        prompt = tokenizer.encode(text, add_special_tokens=False)
        filler = tokenizer.encode(
            " Keep the values short and use the exact property order given.", add_special_tokens=False
        )
        while len(prompt) < prompt_len:
            prompt = prompt + filler
        prompt = prompt[:prompt_len]
        min_chars = doc_tokens * 2
        while True:
            doc = tokenizer.encode(_document(name, rng, min_chars), add_special_tokens=False)
            if len(doc) >= doc_tokens:
                break
            min_chars *= 2
        out.append(ScriptedSequence(f"s{i}-{name}", name, tuple(prompt), tuple(prompt) + tuple(doc)))
    return out


class ScriptedLogits:
    """Adds ``SCRIPT_BIAS`` to one token per logits row of a ``ModelRunner``'s real forward:
    the token the sequence's script holds at the position that row predicts. A runner
    installed with ``agreement < 1`` (the draft) is scripted off by one token at a fixed,
    pseudo-random ``1 - agreement`` fraction of positions, so its drafts there are rejected.

    A cache is matched to its script at its first forward, by the prompt that forward starts
    (all of it and the first drafts when the first step feeds the prompt, its head when a long
    prompt is prefilled first: WorkerConfig.step_prefill_tokens), so prompts must be unique."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # runner name -> agreement x 1000 (set_agreement changes it between cells)
        self.thresholds: dict[str, int] = {}
        # runner name -> host seconds spent inside its forward calls (launch time: no sync is added)
        self.host_s: dict[str, float] = {}
        self._by_prompt: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._by_kv: dict[int, tuple[int, ...]] = {}

    def register(self, seqs: Sequence[ScriptedSequence]) -> None:
        for s in seqs:
            self._by_prompt[s.prompt] = s.script

    def _script_starting(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The script of the one registered prompt that ``token_ids`` (a cache's first forward) starts."""
        fed = tuple(token_ids)
        found = [s for p, s in self._by_prompt.items() if fed[: len(p)] == p[: len(fed)]]
        if len(found) != 1:
            raise KeyError(f"{len(found)} registered prompts start a first forward of {len(fed)} tokens")
        return found[0]

    def install(self, runner: Any, *, agreement: float = 1.0) -> None:
        import torch

        inner = runner.forward
        self.set_agreement(runner, agreement)
        name = runner.name

        def scripted_token(script: tuple[int, ...], position: int) -> int:
            tok = script[position] if position < len(script) else script[-1]
            threshold = self.thresholds[name]
            if threshold < 1000 and (position * 2654435761) % 1000 >= threshold:
                tok = (tok + 1) % self.vocab_size
            return tok

        def forward(items: Sequence[Any]) -> list[Any]:
            rows: list[int] = []
            toks: list[int] = []
            row = 0
            for it in items:
                start, num_new = it.kv.length, it.length
                if start == 0:
                    self._by_kv[id(it.kv)] = self._script_starting(it.token_ids)
                script = self._by_kv[id(it.kv)]
                first = start + num_new - it.num_logits  # position of the first row's input token
                for j in range(it.num_logits):
                    rows.append(row + j)
                    toks.append(scripted_token(script, first + j + 1))
                row += it.num_logits
            t0 = time.perf_counter()
            out = inner(items)
            self.host_s[runner.name] = self.host_s.get(runner.name, 0.0) + time.perf_counter() - t0
            if rows:
                with torch.inference_mode():
                    whole = _as_one(out, row)
                    dev = whole.device
                    index = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
                    whole.index_put_(index, torch.tensor(SCRIPT_BIAS, device=dev), accumulate=True)
            return out

        runner.forward = forward

    def set_agreement(self, runner: Any, agreement: float) -> None:
        """The fraction of positions ``runner`` (installed) is scripted to get right from now on."""
        self.thresholds[runner.name] = round(agreement * 1000)


def _as_one(parts: Sequence[Any], total_rows: int) -> Any:
    """The ``[total_rows, V]`` tensor that ``parts`` (consecutive row splits of one contiguous
    tensor, as ``ModelRunner._project`` returns) are views of, so one indexed add reaches them all."""
    nonempty = [p for p in parts if p.shape[0]]
    first = nonempty[0]
    width = first.shape[1]
    step = width * first.element_size()
    for a, b in itertools.pairwise(nonempty):
        if not (a.is_contiguous() and b.data_ptr() == a.data_ptr() + a.shape[0] * step):
            raise RuntimeError("logits rows are not consecutive views of one tensor")
    return first.as_strided((total_rows, width), (width, 1))


# The phases of StepRunner.run timed on the host, in step order: proposing drafts (draft
# forwards, draft sampling, draft-side mask waits), the target forward, rejection sampling
# with the token checks, committing, and sending the next step's first masks. The wait for
# the verify-path masks (the mask wait column) falls in "rest". Phase -> its clock in
# ScriptedLogits.host_s: the target forward is timed by ScriptedLogits itself.
PHASES: dict[str, str] = {
    "propose": "propose",
    "target forward": "target",
    "verify": "verify",
    "commit": "commit",
    "prefetch": "prefetch",
}


def install_phase_clocks(worker: Any, host_s: dict[str, float]) -> None:
    """Accumulate the host seconds of the ``PHASES`` that ScriptedLogits does not time into
    ``host_s``, under their clock names."""
    import specmask.gpu_worker.step as step_module

    def clocked(fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                host_s[phase] = host_s.get(phase, 0.0) + time.perf_counter() - t0

        return run

    stepper = worker.stepper
    stepper.drafter.propose = clocked(stepper.drafter.propose, "propose")
    step_module.verify = clocked(step_module.verify, "verify")  # bench-only patch of the module's global
    stepper._commit = clocked(stepper._commit, "commit")
    stepper.drafter.prefetch_first = clocked(stepper.drafter.prefetch_first, "prefetch")


# -- set-up -----------------------------------------------------------------------------
def prepare_tokenizer(kind: str, out_dir: Path) -> None:
    """Write tokenizer files into ``out_dir``: a real one (``REAL_TOKENIZERS``, from
    TOKENIZER_CACHE or the shared data, which then fills the cache), or the byte-level stand-in."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind in REAL_TOKENIZERS:
        cache = TOKENIZER_CACHE / kind
        src = cache
        if not (src / "tokenizer.json").is_file():
            shared = Path(os.environ.get("SPECMASK_SHARED_DATA", BENCH_DIR.parent.parent / "shared" / "data"))
            src = shared / "tokenizers" / kind
            if (src / "tokenizer.json").is_file():
                # A device host has no ../shared/data: it gets the git-ignored cache carried.
                cache.mkdir(parents=True, exist_ok=True)
                for f in src.glob("tokenizer*.json"):
                    shutil.copy2(f, cache / f.name)
        if not (src / "tokenizer.json").is_file():
            raise SystemExit(
                f"the {kind} tokenizer is not in {cache}: copy tokenizer.json and tokenizer_config.json "
                f"there (from ../shared/data/tokenizers/{kind})"
            )
        for f in src.glob("tokenizer*.json"):
            shutil.copy2(f, out_dir / f.name)
        return
    from specmask.gpu_worker.toy.tokenizer import save_tokenizer, train_bpe

    # No training text: the vocabulary is the EOS special plus the 256 byte tokens.
    save_tokenizer(train_bpe([], vocab_size=257), out_dir, model_max_length=1 << 20)


def build_model(shape: str, dtype: Any, device: Any, seed: int) -> Any:
    """A random-initialised causal LM of ``shape`` (its SHAPE_TYPES model type, Llama by
    default), built directly on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(SHAPE_TYPES.get(shape, "llama"), **SHAPES[shape])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.eval()
    return model


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device: Any, reps: int) -> float:
    """Median milliseconds per call: CUDA events via triton's do_bench on a GPU, host clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(reps, 50), return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# -- (a) kernels ------------------------------------------------------------------------
def copy_bandwidth_gbps(device: Any, nbytes: int, reps: int) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / ms / 1e6


@dataclass(frozen=True)
class ModelBytes:
    """What one forward of a model must read from device memory, besides activations."""

    weights: int  # every parameter once (tied embeddings counted once)
    kv_per_token: int  # keys + values of one cached position, all layers


def model_bytes(model: Any) -> ModelBytes:
    config = model.config
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    param = next(model.parameters())
    return ModelBytes(
        weights=sum(p.numel() * p.element_size() for p in model.parameters()),
        kv_per_token=2 * layers * kv_heads * head_dim * param.element_size(),
    )


def step_floor_bytes(
    target: ModelBytes, draft: ModelBytes | None, *, batch: int, context: float, draft_forwards: int
) -> float:
    """Bytes a step must read at least: the target's weights and its KV cache once (the verify
    forward), the draft's weights and KV cache once per draft forward."""
    total = target.weights + batch * context * target.kv_per_token
    if draft is not None and draft_forwards:
        total += draft_forwards * (draft.weights + batch * context * draft.kv_per_token)
    return total


# Allowed fraction of the bitmask bench's rows.
KERNEL_DENSITIES = (0.5, 0.001)


def bench_kernels(device: Any, *, batch: int, k: int, vocab: int, reps: int, density: float) -> dict[str, Any]:
    import torch
    import xgrammar

    from specmask.kernels.backend import Backend
    from specmask.kernels.bitmask import apply_token_bitmask_indirect_inplace, apply_token_bitmask_inplace

    backend = Backend.TRITON if device.type == "cuda" else Backend.REFERENCE
    gen = torch.Generator().manual_seed(0)
    rows = batch * (k + 1)
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=gen).to(device)  # [rows, V] float32
    allowed = torch.rand(rows, vocab, generator=gen) < density
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(device)  # [rows, W]
    row_ids = torch.arange(rows, dtype=torch.int32, device=device)  # [rows]: every row its own table row
    # Bytes under the store-only scheme our kernel uses: the mask words read once, -inf stored at
    # each disallowed logit, allowed logits neither read nor written. That is also the floor
    # (no scheme can move less). A read-modify-write kernel (load every logit, store it back
    # masked) moves mask + 2 x logits whatever the density, for comparison.
    must_bytes = bitmask.numel() * 4 + int((~allowed).sum()) * logits.element_size()
    rmw_bytes = bitmask.numel() * 4 + 2 * logits.numel() * logits.element_size()
    bandwidth = copy_bandwidth_gbps(device, 1 << 30 if device.type == "cuda" else 1 << 26, reps)
    floor_ms = must_bytes / bandwidth / 1e6

    # Correctness first: every implementation gives the reference's result on these inputs.
    expected = logits.clone().masked_fill_(~allowed.to(device), float("-inf"))
    impls: dict[str, Callable[[Any], object]] = {
        "specmask direct": lambda x: apply_token_bitmask_inplace(x, bitmask, backend=backend),
        "specmask indirect (verifier)": lambda x: apply_token_bitmask_indirect_inplace(
            x, bitmask, row_ids, backend=backend
        ),
        "xgrammar": lambda x: xgrammar.apply_token_bitmask_inplace(x, bitmask),
    }
    results: dict[str, Any] = {}
    for name, fn in impls.items():
        try:
            check = logits.clone()
            fn(check)
            if not torch.equal(check, expected):
                raise AssertionError("result differs from the reference masking")
            work = logits.clone()
            ms = _median_ms(lambda: fn(work), device, reps)
            results[name] = {"ms": ms, "vs_floor": ms / floor_ms, "gbps_must": must_bytes / ms / 1e6}
        except Exception as exc:  # report, keep measuring the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {
        "batch": batch,
        "k": k,
        "vocab": vocab,
        "density": density,
        "backend": backend.value if hasattr(backend, "value") else str(backend),
        "must_bytes": must_bytes,
        "read_modify_write_bytes": rmw_bytes,
        "copy_gbps": bandwidth,
        "floor_ms": floor_ms,
        "impls": results,
    }


# -- (b)-(d) worker steps -----------------------------------------------------------------
@dataclass
class StepStats:
    batch: int
    step_ms: float  # median
    step_ms_p90: float
    mask_wait_ms: float  # median per step
    tokens_per_s: float
    tokens_per_step: float
    acceptance: float | None  # accepted / proposed drafts (fixed by the script)
    steps: int
    # Tokens per second with every step timed at the median of the steps like it (drafting or
    # plain: the speculation gate mixes both in a speculative cell): the odd step a shared host
    # stretches does not swing it, the mix of steps and what each kind costs still count.
    tokens_per_s_steady: float
    drafting_steps: float  # the fraction of steps that proposed drafts
    unmasked_steps: float  # the fraction of steps that drafted without draft-side masks
    # Median host ms per step inside each model's forward calls (no sync added: the time the
    # host spends launching them, plus any sync the forward itself does).
    target_forward_host_ms: float
    draft_forward_host_ms: float
    # Median host ms per step in each phase of StepRunner.run (PHASES; "rest" is the step's
    # time outside all of them). A phase that waits on the device (a .tolist() of its
    # results) counts that wait too, so the GPU's time lands in the first phase that syncs.
    phase_host_ms: dict[str, float] = field(default_factory=dict)
    # Memory-bandwidth floor of the step (step_floor_bytes over the copy rate measured in the
    # same run) and the step's multiple of it; filled in by run_pair.
    floor_ms: float | None = None
    vs_floor: float | None = None


@dataclass
class Samples:
    """Raw per-step measurements of one cell, over one or more rounds."""

    batch: int
    times: list[float]  # step wall seconds
    waits: list[float]  # seconds the step waited on the mask service
    target_host: list[float]  # host seconds inside the target's forward calls
    draft_host: list[float]
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase -> host seconds per step
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    counts: list[Any] = field(default_factory=list)  # host_counter.StepCount per counted step
    drafted: list[bool] = field(default_factory=list)  # per step: whether it proposed drafts
    # per step: whether the speculation gate had it draft without draft-side masks
    unmasked: list[bool] = field(default_factory=list)

    def extend(self, other: Samples) -> None:
        self.times += other.times
        self.waits += other.waits
        self.target_host += other.target_host
        self.draft_host += other.draft_host
        for phase, values in other.phases.items():
            self.phases.setdefault(phase, []).extend(values)
        self.tokens += other.tokens
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.drafted += other.drafted
        self.unmasked += other.unmasked

    def steady_seconds(self) -> float:
        """The cell's time with each step timed at the median of the steps of its kind (plain,
        drafting with draft-side masks, drafting without)."""
        of = list(zip(self.drafted, self.unmasked, strict=True))
        kinds = {
            kind: statistics.median(t for t, k in zip(self.times, of, strict=True) if k == kind) for kind in set(of)
        }
        return sum(kinds[kind] for kind in of)

    def stats(self) -> StepStats:
        ordered = sorted(self.times)
        return StepStats(
            batch=self.batch,
            step_ms=1e3 * statistics.median(self.times),
            step_ms_p90=1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            mask_wait_ms=1e3 * statistics.median(self.waits),
            tokens_per_s=self.tokens / sum(self.times),
            tokens_per_step=self.tokens / len(self.times),
            tokens_per_s_steady=self.tokens / self.steady_seconds(),
            drafting_steps=sum(self.drafted) / len(self.drafted),
            unmasked_steps=sum(self.unmasked) / len(self.unmasked),
            acceptance=self.accepted / self.proposed if self.proposed else None,
            steps=len(self.times),
            target_forward_host_ms=1e3 * statistics.median(self.target_host),
            draft_forward_host_ms=1e3 * statistics.median(self.draft_host),
            phase_host_ms={phase: 1e3 * statistics.median(values) for phase, values in self.phases.items()},
        )


def time_mode(
    worker: Any,
    scripts: ScriptedLogits,
    mode: Mode,
    batch: int,
    args: argparse.Namespace,
    *,
    k: int,
    on_step: Callable[[], None] | None = None,
    counter: Any = None,
) -> Samples:
    """Add ``batch`` scripted sequences in ``mode``, time ``args.steps`` steps after
    ``args.warmup`` untimed ones, remove them. ``on_step`` runs after every timed step."""
    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.common.proposer_kind import ProposerKind
    from specmask.gpu_worker.speculation_gate import Arm
    from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

    steps = args.warmup + args.steps
    seqs = make_sequences(
        worker.tokenizer, batch, prompt_len=args.prompt_len, doc_tokens=steps * (k + 1) + 8, seed=batch
    )
    scripts.register(seqs)
    spec = SpeculationParams(
        enabled=mode.speculate,
        k=k if mode.speculate else 0,
        proposers=(ProposerKind.DRAFT_MODEL,),
        draft_masking=mode.draft_masks,
    )
    new = [
        NewSequence(
            seq_id=s.seq_id,
            prompt_token_ids=s.prompt,
            grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS[s.schema])) if mode.grammar else None,
            sampling=SamplingParams(temperature=0.0, max_tokens=steps * (k + 1) + 4),
            speculation=spec,
        )
        for s in seqs
    ]
    _add_all(worker, new)
    emitted: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    out_samples = Samples(batch, [], [], [], [])
    try:
        for i in range(steps):
            before = dict(scripts.host_s)
            t0 = time.perf_counter()
            if counter is not None and i >= args.warmup:
                # gpu_worker.host_counter.StepCounter: the counting hooks slow the step (its
                # time is not what this cell reports), never change it.
                outs, count = counter.step()
                out_samples.counts.append(count)
            else:
                outs = worker.step()
            dt = time.perf_counter() - t0
            for out in outs:
                if out.error or out.finish_reason is not None:
                    raise RuntimeError(f"{out.seq_id}: finished early ({out.finish_reason}, {out.error})")
                emitted[out.seq_id].extend(out.new_token_ids)
            if i >= args.warmup:
                out_samples.times.append(dt)
                out_samples.waits.append(outs[0].mask_time_s)
                out_samples.target_host.append(scripts.host_s.get("target", 0.0) - before.get("target", 0.0))
                out_samples.draft_host.append(scripts.host_s.get("draft", 0.0) - before.get("draft", 0.0))
                inside = 0.0
                for phase, clock in PHASES.items():
                    spent = scripts.host_s.get(clock, 0.0) - before.get(clock, 0.0)
                    inside += spent
                    out_samples.phases.setdefault(phase, []).append(spent)
                out_samples.phases.setdefault("rest", []).append(dt - inside)
                out_samples.tokens += sum(len(o.new_token_ids) for o in outs)
                out_samples.proposed += sum(o.drafts_proposed for o in outs)
                out_samples.drafted.append(any(o.drafts_proposed for o in outs))
                out_samples.unmasked.append(worker.stepper.last_arm is Arm.SPECULATE_UNMASKED)
                out_samples.accepted += sum(o.drafts_accepted for o in outs)
                if on_step is not None:
                    on_step()
    finally:
        worker.remove(worker.active_ids())
    for s in seqs:  # the script held: the target emitted exactly the document
        got = emitted[s.seq_id]
        want = list(s.script[len(s.prompt) : len(s.prompt) + len(got)])
        if got != want:
            raise AssertionError(f"{s.seq_id}: emitted tokens left the script")
    return out_samples


def profile_modes(worker: Any, scripts: ScriptedLogits, batch: int, args: argparse.Namespace, out_dir: Path) -> None:
    """torch.profiler over a few steps of each profiled mode: host-side op table to ``out_dir``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for mode_name in args.profile_modes:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            time_mode(worker, scripts, MODES[mode_name], batch, args, k=args.k)
        averages = prof.key_averages()
        tables = {"self CPU": averages.table(sort_by="self_cpu_time_total", row_limit=30)}
        if torch.cuda.is_available():
            tables["self device"] = averages.table(sort_by="self_device_time_total", row_limit=30)
        name = f"profile-B{batch}-{mode_name.replace('/', '_')}.txt"
        (out_dir / name).write_text("\n\n".join(tables.values()))
        for order, table in tables.items():
            print(f"\nprofile {mode_name} B={batch} ({order}, top 16):\n" + "\n".join(table.splitlines()[:20]))


def _add_all(worker: Any, new: Sequence[Any], attempts: int = 30) -> None:
    """``worker.add`` that retries sequences refused only because their grammar is still
    compiling (the service answers RESOURCE_EXHAUSTED rather than block past its budget)."""
    pending = list(new)
    for _ in range(attempts):
        errors = worker.add(pending, wait_for_sessions=True)
        failed = [(seq, err) for seq, err in zip(pending, errors) if err]
        if not failed:
            return
        if any("still compiling" not in err for _, err in failed):
            raise RuntimeError(f"add failed: {[err for _, err in failed][:3]}")
        pending = [seq for seq, _ in failed]
        time.sleep(1.0)
    raise RuntimeError(f"add failed: grammars still compiling after {attempts} attempts")


def run_pair(name: str, pair: Pair, device: Any, dtype: Any, args: argparse.Namespace, log_dir: Path) -> dict:
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from specmask.orchestrator.dev.local_stack import MaskServiceProcess

    vocab = SHAPES[pair.target]["vocab_size"]
    with tempfile.TemporaryDirectory(prefix=f"specmask-bench-gpu-{name}-") as tmp:
        model_dir = Path(tmp) / "model"
        prepare_tokenizer(pair.tokenizer, model_dir)
        t0 = time.perf_counter()
        target = build_model(pair.target, dtype, device, seed=1)
        draft = build_model(pair.draft, dtype, device, seed=2)
        _sync(device)
        build_s = time.perf_counter() - t0
        service = MaskServiceProcess(
            [f"{model_dir}:{vocab}"],
            log_path=log_dir / f"mask-service-{name}.log",
            extra_args=["--mask-threads", str(args.mask_threads)],
        ).start()
        worker = None
        try:
            worker = GpuWorker(
                WorkerConfig(
                    target_dir=str(model_dir),
                    draft_dir=str(model_dir),
                    dtype=str(dtype).removeprefix("torch."),
                    device=str(device),
                    mask_service_addresses=(service.address,),
                    max_batch=max((*args.batches, *(HOST_COUNT_BATCHES if args.host_counts else ()))),
                    max_k=args.k,
                    max_model_len=args.prompt_len + (args.warmup + args.steps + 2) * (args.k + 1) + 64,
                    torch_threads=args.torch_threads,
                    # Prompts prefilled in add(), untimed: the timed steps are decode steps.
                    step_prefill_tokens=1,
                    # No iteration budget trims drafts: every cell (the host counts' B = 64 on a
                    # CPU too) verifies the k it asked for.
                    max_iteration_tokens=1 << 20,
                    static_forward=args.static_forward,
                ),
                target_model=target,
                draft_model=draft,
            )
            # The floor's denominator, measured in this run: a large device-to-device copy.
            copy_gbps = copy_bandwidth_gbps(device, 1 << 30 if device.type == "cuda" else 1 << 26, 20)
            target_bytes, draft_bytes = model_bytes(target), model_bytes(draft)
            scripts = ScriptedLogits(vocab)
            scripts.install(worker.target)
            assert worker.draft is not None
            scripts.install(worker.draft, agreement=args.agreements[0])
            install_phase_clocks(worker, scripts.host_s)
            rows: dict[str, dict[str, Any]] = {}
            per_round: dict[str, dict[str, list[float]]] = {}  # ratio -> batch -> one value per round
            for batch in args.batches:
                # Untimed pass first: the first run at a new batch size grows the CUDA caching
                # allocator's pool (cudaMalloc per new buffer size), which would be charged to
                # whichever mode happened to run first.
                for mode_name in dict.fromkeys((args.modes[0], args.modes[-1])) if args.prime else ():
                    time_mode(worker, scripts, MODES[mode_name], batch, args, k=args.k)
                # Rounds alternate the modes, so a slow spell of the host hits them all alike.
                cells: dict[str, Samples] = {}
                for _ in range(args.rounds):
                    this_round: dict[str, Samples] = {}
                    for mode_name in args.modes:
                        got = time_mode(worker, scripts, MODES[mode_name], batch, args, k=args.k)
                        this_round[mode_name] = got
                        if mode_name in cells:
                            cells[mode_name].extend(got)
                        else:
                            cells[mode_name] = Samples(batch, [], [], [], [])
                            cells[mode_name].extend(got)
                    # Paired within the round: both modes ran minutes apart at most.
                    for key, (num, den) in ROUND_RATIOS.items():
                        if num in this_round and den in this_round:
                            value = statistics.median(this_round[num].times) / statistics.median(this_round[den].times)
                            per_round.setdefault(key, {}).setdefault(str(batch), []).append(value)
                for mode_name, samples in cells.items():
                    stats = samples.stats()
                    mode = MODES[mode_name]
                    per_seq = stats.tokens_per_step / batch  # tokens one sequence gains per step
                    # Mean cached positions over the timed steps (prompt, warm-up, then half the timed ones).
                    context = args.prompt_len + per_seq * (args.warmup + (args.steps + 1) / 2)
                    floor_bytes = step_floor_bytes(
                        target_bytes,
                        draft_bytes,
                        batch=batch,
                        context=context,
                        draft_forwards=args.k if mode.speculate else 0,
                    )
                    stats.floor_ms = floor_bytes / copy_gbps / 1e6
                    stats.vs_floor = stats.step_ms / stats.floor_ms
                    rows.setdefault(mode_name, {})[str(batch)] = asdict(stats)
                    print(
                        f"  {name} B={batch:<3} {mode_name:<34} step {stats.step_ms:8.2f} ms  "
                        f"mask wait {stats.mask_wait_ms:7.2f} ms  {stats.tokens_per_s:9.1f} tok/s  "
                        f"host in target fwd {stats.target_forward_host_ms:7.2f} ms, "
                        f"draft fwd {stats.draft_forward_host_ms:7.2f} ms  floor {stats.floor_ms:7.2f} ms "
                        f"({stats.vs_floor:.2f}x)  {per_seq:.2f} tok/row",
                        flush=True,
                    )
                    if mode.speculate and args.agreement == 1.0 and per_seq < args.k + 1 - 1e-9:
                        # Every draft is accepted by construction: fewer than k + 1 tokens per row
                        # means drafts were trimmed before verification, and the cell measures a
                        # smaller k than asked for.
                        print(
                            f"  WARNING: {mode_name} at B={batch} gained {per_seq:.2f} tokens per row per step, "
                            f"not k + 1 = {args.k + 1}: drafts were trimmed (verify width or iteration budget)",
                            flush=True,
                        )
            swept, swept_steady = agreement_sweep(worker, scripts, args)
            by_agreement = {str(args.agreements[0]): _spec_vs_nospec(rows, args.batches), **swept}
            by_agreement_steady = {
                str(args.agreements[0]): _spec_vs_nospec(rows, args.batches, "tokens_per_s_steady"),
                **swept_steady,
            }
            counts = host_counts(worker, scripts, args) if args.host_counts else None
            if args.profile_batch:
                profile_modes(worker, scripts, args.profile_batch, args, log_dir)
            static = {}
            for role, runner in (("target", worker.target), ("draft", worker.draft)):
                st = getattr(runner, "static", None)
                static[role] = (
                    None
                    if st is None
                    else {"graphs": st.use_graphs, "forwards": st.forwards, "captures": st.captures,
                          "replays": st.replays, "capture_failures": st.capture_failures}
                )  # fmt: skip
        finally:
            if worker is not None:
                worker.shutdown()
            service.stop()
    ratios: dict[str, Any] = _ratios(rows, args.batches)  # plus the per-round lists below
    for key, by_batch in per_round.items():
        ratios[f"{key}_rounds"] = by_batch
        ratios[f"{key}_round_median"] = {b: statistics.median(v) for b, v in by_batch.items()}
    return {
        "target": pair.target,
        "draft": pair.draft,
        "tokenizer": pair.tokenizer,
        "vocab": vocab,
        "build_s": build_s,
        "copy_gbps": copy_gbps,
        "weights_bytes": {"target": target_bytes.weights, "draft": draft_bytes.weights},
        "kv_bytes_per_token": {"target": target_bytes.kv_per_token, "draft": draft_bytes.kv_per_token},
        "static_forward": static,
        "modes": rows,
        "spec_vs_nospec_tokens_per_s_by_agreement": by_agreement,
        "spec_vs_nospec_steady_by_agreement": by_agreement_steady,
        "host_counts": counts,
        **ratios,
    }


# Speculative mode -> the mode with speculation off that it is compared with.
SPEC_BASELINE = {
    "spec/unconstrained": "nospec/unconstrained",
    "spec/constrained/draft-masks-off": "nospec/constrained",
    "spec/constrained/draft-masks-on": "nospec/constrained",
}


def _spec_vs_nospec(
    rows: dict[str, dict[str, Any]], batches: Sequence[int], figure: str = "tokens_per_s"
) -> dict[str, dict[str, float]]:
    """Per speculative mode and batch size: its tokens/s (``figure``) over the same batch's with
    speculation off."""
    return {
        mode: {str(b): rows[mode][str(b)][figure] / rows[base][str(b)][figure] for b in batches}
        for mode, base in SPEC_BASELINE.items()
        if mode in rows and base in rows
    }


def agreement_sweep(
    worker: Any, scripts: ScriptedLogits, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any]]:
    """spec/no-spec tokens/s at each agreement after the first (one round per cell): agreement ->
    mode -> batch -> ratio, as measured and steady (``StepStats.tokens_per_s_steady``), and the
    fraction of the speculative cells' steps that drafted. Speculation must never cost: every
    ratio should be at least 0.95 (the speculation gate decodes plainly where drafts do not pay;
    the cells' warm-up steps are where it learns that)."""
    out: dict[str, Any] = {}
    steady: dict[str, Any] = {}
    modes = [m for m in args.modes if m in SPEC_BASELINE or m in SPEC_BASELINE.values()]
    for agreement in args.agreements[1:]:
        scripts.set_agreement(worker.draft, agreement)
        rows: dict[str, dict[str, Any]] = {}
        for batch in args.batches:
            for mode_name in modes:
                stats = time_mode(worker, scripts, MODES[mode_name], batch, args, k=args.k).stats()
                rows.setdefault(mode_name, {})[str(batch)] = asdict(stats)
        out[str(agreement)] = _spec_vs_nospec(rows, args.batches)
        steady[str(agreement)] = _spec_vs_nospec(rows, args.batches, "tokens_per_s_steady")
        for mode, by_batch in out[str(agreement)].items():
            cells = ", ".join(
                f"B={b}: {v:.2f} (steady {steady[str(agreement)][mode][b]:.2f}, "
                f"{rows[mode][b]['drafting_steps']:.0%} of steps drafting, "
                f"{rows[mode][b]['unmasked_steps']:.0%} without draft-side masks)"
                for b, v in by_batch.items()
            )
            print(f"  agreement {agreement}: {mode} spec/no-spec tokens/s {cells}", flush=True)
    scripts.set_agreement(worker.draft, args.agreements[0])
    return out, steady


# Batch sizes the host-path counts compare (ops at the larger over ops at the smaller).
HOST_COUNT_BATCHES = (8, 64)


def host_counts(worker: Any, scripts: ScriptedLogits, args: argparse.Namespace) -> dict[str, Any]:
    """Reads of tensor values and torch ops per step (gpu_worker.host_counter), model forwards
    excluded, for every speculative mode at ``HOST_COUNT_BATCHES``: the host path's own cost,
    the same on a CPU as on a GPU. RESULT keys: ``host_reads_per_step`` (the largest over the
    cells) with the ``mask_round_trips_per_step`` of that cell, ``host_ops_ratio_b64_b8`` (the
    largest over the modes), and the per-cell counts."""
    from specmask.gpu_worker.host_counter import StepCounter

    small, large = HOST_COUNT_BATCHES
    cells: dict[str, dict[str, Any]] = {}
    with StepCounter(worker, worker.target.device) as counter:
        for mode_name in [m for m in args.modes if MODES[m].speculate]:
            for batch in HOST_COUNT_BATCHES:
                got = time_mode(worker, scripts, MODES[mode_name], batch, args, k=args.k, counter=counter)
                worst = max(got.counts, key=lambda c: (c.reads - c.round_trips, c.ops))
                cells.setdefault(mode_name, {})[str(batch)] = {
                    "reads": worst.reads,
                    "round_trips": worst.round_trips,
                    "ops": max(c.ops for c in got.counts),
                    "read_sites": worst.read_sites,
                }
    if not cells:
        return {}
    worst_mode, worst_batch = max(
        ((m, b) for m, by in cells.items() for b in by),
        key=lambda mb: cells[mb[0]][mb[1]]["reads"] - cells[mb[0]][mb[1]]["round_trips"],
    )
    ratio = max(by[str(large)]["ops"] / by[str(small)]["ops"] for by in cells.values())
    for m, by in cells.items():
        print(
            f"  host path {m}: "
            + ", ".join(
                f"B={b}: {c['reads']} reads ({c['round_trips']} mask trips), {c['ops']} ops" for b, c in by.items()
            ),
            flush=True,
        )
    return {
        "host_reads_per_step": cells[worst_mode][worst_batch]["reads"],
        "mask_round_trips_per_step": cells[worst_mode][worst_batch]["round_trips"],
        "host_reads_cell": f"{worst_mode} B={worst_batch}",
        f"host_ops_ratio_b{large}_b{small}": ratio,
        "cells": cells,
    }


# Step-time ratios also computed per round (paired): name -> (numerator mode, denominator mode).
ROUND_RATIOS: dict[str, tuple[str, str]] = {
    "constrained_vs_unconstrained_step_time": ("spec/constrained/draft-masks-on", "spec/unconstrained"),
    "constrained_vs_unconstrained_step_time_draft_masks_off": (
        "spec/constrained/draft-masks-off",
        "spec/unconstrained",
    ),
}


def _ratios(rows: dict[str, dict[str, Any]], batches: Sequence[int]) -> dict[str, dict[str, float]]:
    def ratio(num: str, den: str, field: str = "step_ms") -> dict[str, float]:
        if num not in rows or den not in rows:
            return {}
        return {str(b): rows[num][str(b)][field] / rows[den][str(b)][field] for b in batches}

    speedup = {}
    if "spec/constrained/draft-masks-on" in rows and "nospec/constrained" in rows:
        speedup = {
            str(b): rows["spec/constrained/draft-masks-on"][str(b)]["tokens_per_s"]
            / rows["nospec/constrained"][str(b)]["tokens_per_s"]
            for b in batches
        }
    return {
        "constrained_vs_unconstrained_step_time": ratio("spec/constrained/draft-masks-on", "spec/unconstrained"),
        "constrained_vs_unconstrained_step_time_draft_masks_off": ratio(
            "spec/constrained/draft-masks-off", "spec/unconstrained"
        ),
        "constrained_vs_unconstrained_step_time_nospec": ratio("nospec/constrained", "nospec/unconstrained"),
        "spec_vs_nospec_tokens_per_s_constrained": speedup,
    }


# -- report -------------------------------------------------------------------------------
def print_tables(result: dict[str, Any]) -> None:
    for kern in result.get("kernels_by_density") or ([result["kernels"]] if result.get("kernels") else []):
        print(
            f"\n### Bitmask apply: B={kern['batch']}, k={kern['k']}, V={kern['vocab']}, "
            f"{kern['density']:.1%} allowed; floor {kern['floor_ms'] * 1e3:.1f} us "
            f"({kern['must_bytes'] / 1e6:.2f} MB moved by the store-only kernel, against "
            f"{kern['read_modify_write_bytes'] / 1e6:.2f} MB read-modify-write; "
            f"{kern['copy_gbps']:.0f} GB/s copy rate)\n"
        )
        print("| implementation | us | x floor |\n|---|---:|---:|")
        for name, r in kern["impls"].items():
            if "error" in r:
                print(f"| {name} | error: {r['error']} | |")
            else:
                print(f"| {name} | {r['ms'] * 1e3:.1f} | {r['vs_floor']:.2f} |")
    for name, pair in result["pairs"].items():
        print(
            f"\n### Worker step, {name} ({pair['target']} + {pair['draft']} draft, tokenizer {pair['tokenizer']}), "
            f"k={result['k']}, prompt {result['prompt_len']} tokens, draft agreement {result['agreement']}\n"
        )
        batches = sorted({int(b) for m in pair["modes"].values() for b in m})
        head = " | ".join(f"B={b}: ms / wait / tok/s" for b in batches)
        print(f"| mode | {head} |\n|---|" + "---:|" * len(batches))
        for mode, by_batch in pair["modes"].items():
            cells = []
            for b in batches:
                s = by_batch[str(b)]
                cells.append(f"{s['step_ms']:.1f} / {s['mask_wait_ms']:.2f} / {s['tokens_per_s']:.0f}")
            print(f"| {mode} | " + " | ".join(cells) + " |")
        print(
            f"\nStep time against its memory-bandwidth floor (target weights + k x draft weights + KV "
            f"bytes over the {pair['copy_gbps']:.0f} GB/s device copy rate measured in this run): "
            "ms / floor ms / x floor\n"
        )
        print("| mode | " + " | ".join(f"B={b}" for b in batches) + " |\n|---|" + "---:|" * len(batches))
        for mode, by_batch in pair["modes"].items():
            cells = [
                f"{by_batch[str(b)]['step_ms']:.1f} / {by_batch[str(b)]['floor_ms']:.2f} / "
                f"{by_batch[str(b)]['vs_floor']:.2f}"
                for b in batches
            ]
            print(f"| {mode} | " + " | ".join(cells) + " |")
        print(f"\nstatic forward (CUDA graphs on a GPU): {json.dumps(pair['static_forward'])}")
        print("\nHost ms per step inside the forward calls (target / draft), no sync added:\n")
        print("| mode | " + " | ".join(f"B={b}" for b in batches) + " |\n|---|" + "---:|" * len(batches))
        for mode, by_batch in pair["modes"].items():
            cells = [
                f"{by_batch[str(b)]['target_forward_host_ms']:.1f} / {by_batch[str(b)]['draft_forward_host_ms']:.1f}"
                for b in batches
            ]
            print(f"| {mode} | " + " | ".join(cells) + " |")
        phases = [*PHASES, "rest"]
        print(f"\nHost ms per step by phase ({' / '.join(phases)}; a phase that syncs waits for the device):\n")
        print("| mode | " + " | ".join(f"B={b}" for b in batches) + " |\n|---|" + "---:|" * len(batches))
        for mode, by_batch in pair["modes"].items():
            cells = [
                " / ".join(f"{by_batch[str(b)]['phase_host_ms'].get(ph, 0.0):.1f}" for ph in phases) for b in batches
            ]
            print(f"| {mode} | " + " | ".join(cells) + " |")
        steady = pair.get("spec_vs_nospec_steady_by_agreement", {})
        for agreement, by_mode in pair.get("spec_vs_nospec_tokens_per_s_by_agreement", {}).items():
            for mode, by_batch in by_mode.items():
                values = ", ".join(
                    f"B={b}: {v:.2f} (steady {steady[agreement][mode][b]:.2f})" for b, v in by_batch.items()
                )
                print(f"\nspec/no-spec tokens/s at agreement {agreement}, {mode}: {values}")
        for key in (
            "constrained_vs_unconstrained_step_time",
            "constrained_vs_unconstrained_step_time_draft_masks_off",
            "spec_vs_nospec_tokens_per_s_constrained",
        ):
            values = ", ".join(f"B={b}: {v:.3f}" for b, v in pair[key].items())
            print(f"\n{key}: {values}")
            if f"{key}_rounds" in pair:
                rounds = "; ".join(
                    f"B={b}: " + " ".join(f"{v:.3f}" for v in vs) for b, vs in pair[f"{key}_rounds"].items()
                )
                print(f"  per round (paired): {rounds}")


def apply_defaults(args: argparse.Namespace) -> None:
    """Fill what the flags left unset: full-size defaults, or tiny ones for ``--dry-run``.
    A value given on the command line is kept as given (``--dry-run --k 4`` runs k = 4)."""
    dry = args.dry_run
    args.pairs = (args.pairs or ("tiny" if dry else "llama3-8b-1b,qwen3-8b-0.6b,smollm2-135m")).split(",")
    args.batches = [int(b) for b in (args.batches or ("1,2" if dry else "1,8,32,64")).split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.k_defaulted = args.k is None
    if args.k is None:
        args.k = 2 if dry else 4  # tiny shapes: k = 2 keeps the CPU run short
    args.prompt_len = args.prompt_len or (24 if dry else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    args.steps = args.steps or (2 if dry else 8)
    args.rounds = args.rounds or (1 if dry else 2)
    args.profile_modes = [m for m in args.profile_modes.split(",") if m]
    args.agreements = [float(a) for a in str(args.agreement).split(",") if a]
    if not args.agreements or any(not 0.0 <= a <= 1.0 for a in args.agreements):
        raise SystemExit(f"--agreement: fractions in [0, 1], got {args.agreement!r}")
    args.agreement = args.agreements[0]  # the main tables' agreement
    if args.host_counts is None:
        args.host_counts = dry
    if dry:
        args.torch_threads = args.torch_threads or 1
        args.mask_threads = min(args.mask_threads, 2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (float32): checks the harness")
    parser.add_argument("--pairs", default=None, help=f"comma list of {list(PAIRS)} (default: the real ones)")
    parser.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,8,32,64)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    parser.add_argument("--k", type=int, default=None, help="max drafts per step (default 4; 2 with --dry-run)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence (default 256)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per measurement (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement and round (default 8)")
    parser.add_argument(
        "--agreement",
        default="1.0",
        help="fraction of positions the draft gets right; a comma list (1.0,0.7,0.3,0.0) also measures "
        "spec/no-spec tokens/s at each later value (one round per cell)",
    )
    parser.add_argument(
        "--host-counts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count host reads and torch ops per step at B=8 and 64 (default: on with --dry-run)",
    )
    parser.add_argument("--mask-threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="passes over the modes per batch (default 2)")
    parser.add_argument("--profile-batch", type=int, default=0, help="also profile steps at this batch size")
    parser.add_argument(
        "--profile-modes", default="spec/unconstrained,spec/constrained/draft-masks-on", help="modes to profile"
    )
    parser.add_argument(
        "--static-forward",
        default="auto",
        choices=("auto", "on", "off"),
        help="WorkerConfig.static_forward: auto = CUDA graphs on a GPU (off: the eager packed path, for comparison)",
    )
    parser.add_argument("--no-prime", dest="prime", action="store_false", help="skip the untimed pass per batch")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel measurement")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; cpu for --dry-run)")
    parser.add_argument(
        "--dtype", default="auto", help="auto = bfloat16 (the checkpoints') on CUDA, float32 on a CPU; or a name"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="where mask-service logs go (default: a temp dir)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the RESULT json here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch

    device = torch.device(args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    missing = missing_wheels(cuda=device.type == "cuda")
    if missing:
        print(
            "bench.gpu needs these packages, not importable here: "
            + ", ".join(missing)
            + "\n(on a host without network: `pip download --no-deps` the wheels elsewhere and install them "
            "with `pip install --no-index --no-deps --target DIR *.whl`, then PYTHONPATH=DIR)"
        )
        return 2
    if not args.dry_run and device.type != "cuda":
        print("bench.gpu: no CUDA device here; use --dry-run to check the harness on CPU (no GPU figures)")
        return 2
    dry = args.dry_run
    apply_defaults(args)
    print(f"bench.gpu: k={args.k}" + (" (the --dry-run default; --k sets it)" if dry and args.k_defaulted else ""))
    modes_named = args.modes + args.profile_modes
    for bad in [p for p in args.pairs if p not in PAIRS] + [m for m in modes_named if m not in MODES]:
        parser.error(f"unknown pair or mode {bad!r}; pairs {list(PAIRS)}, modes {list(MODES)}")
    from specmask.gpu_worker.loading import resolve_dtype

    # The shapes are of bfloat16 checkpoints: auto = bfloat16 on CUDA, float32 for --dry-run's CPU.
    dtype = resolve_dtype(args.dtype, device, "bfloat16")

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry,
        "torch": torch.__version__,
        "k": args.k,
        "prompt_len": args.prompt_len,
        "rounds": args.rounds,
        "timed_steps_per_cell": args.rounds * args.steps,
        "agreement": args.agreement,
        "agreements": args.agreements,
        "acceptance": "fixed by scripted logits (greedy; the draft matches the script at a fixed "
        f"fraction {args.agreement} of positions), not measured",
        "pairs": {},
    }
    if not args.no_kernels:
        kb, kk, kv = (2, 2, 320) if dry else (64, 4, 128256)
        # 50% allowed (the half-written case), and a grammar-like row density: most real rows
        # allow a handful of tokens, so nearly every logit is stored as -inf.
        result["kernels_by_density"] = [
            bench_kernels(device, batch=kb, k=kk, vocab=kv, reps=5 if dry else 100, density=density)
            for density in KERNEL_DENSITIES
        ]
        result["kernels"] = result["kernels_by_density"][0]
        for kern in result["kernels_by_density"]:
            print(f"kernels ({kern['density']:.1%} allowed): {json.dumps(kern['impls'])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="specmask-bench-gpu-logs-") as tmp_logs:
        log_dir = args.log_dir or Path(tmp_logs)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name in args.pairs:
            result["pairs"][name] = run_pair(name, PAIRS[name], device, dtype, args, log_dir)
    # The host-path checks (gpu_worker.host_counter) at the top level, from the first pair counted.
    counted = [p["host_counts"] for p in result["pairs"].values() if p.get("host_counts")]
    if counted:
        for key in ("host_reads_per_step", "mask_round_trips_per_step", "host_reads_cell", "host_ops_ratio_b64_b8"):
            result[key] = counted[0].get(key)
    print_tables(result)
    line = json.dumps(result, separators=(",", ":"))
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print("RESULT " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
