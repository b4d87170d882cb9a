"""Micro-benchmark of the KV path: batched forwards over long cached pasts.

    python -m bench.kv                        # B=32, L=1000, a small Llama on CPU
    python -m bench.kv --device cuda --shape llama-3.2-1b
    python -m bench.kv --model smollm2-135m-instruct --batch 9 --length 500 \\
        --widths 1,2,3,4,5 --layouts packed,padded --threads 2   # packed vs padded A/B

B sequences are prefilled to L tokens each (lengths staggered by a few tokens,
as in a real batch), then each timed round is one verify-style forward of new
tokens per sequence followed by a rollback of all but one of them (rejected
drafts), so lengths stay near L. Row r verifies ``widths[r % len(widths)]``
tokens (default: k + 1 for every row). With several ``--layouts`` the rounds
interleave the layouts (ModelRunner ``packed`` on/off over the same model and
pasts), so a noisy box affects both alike. Uses only the public
``ModelRunner`` / ``SequenceKV`` API. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SMALL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip
# ModelRunner keyword arguments of each layout.
LAYOUTS: dict[str, dict[str, bool]] = {
    "packed": dict(batched=True, packed=True),
    "padded": dict(batched=True, packed=False),
}


def _model(args: argparse.Namespace, device: torch.device, dtype_name: str):
    from specmask.gpu_worker.loading import checkpoint_dtype, load_causal_lm, resolve_dtype

    if args.model:
        from specmask.gpu_worker.models.registry import resolve_model

        path = resolve_model(args.model, progress=False)
        assert path is not None  # None only for no model
        return load_causal_lm(path, resolve_dtype(dtype_name, device, checkpoint_dtype(path)), device)
    dtype = resolve_dtype(dtype_name, device, "bfloat16")  # the shapes are of bfloat16 checkpoints
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu import SHAPES

    torch.manual_seed(0)
    kwargs = SMALL if args.shape == "small" else SHAPES[args.shape]
    config = LlamaConfig(**{**kwargs, "max_position_embeddings": max(4096, args.length + 64)})
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()  # type: ignore[arg-type]  # transformers types .to() through a decorator that hides self


def main(argv: list[str] | None = None) -> int:
    from specmask.gpu_worker.kv_cache import SequenceKV
    from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--widths", default=None, help="per-row verify widths, cycled (e.g. 1,2,3,4,5); default k+1")
    parser.add_argument("--layouts", default="packed", help=f"comma list of {list(LAYOUTS)}, interleaved per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shape", default="small", help="small or a bench.gpu shape (ignored with --model)")
    parser.add_argument("--model", default=None, help="a model dir or registered name instead of a random --shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default="auto", help="auto = the checkpoint's (bfloat16 for --shape) on CUDA, float32 on a CPU"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layouts = args.layouts.split(",")
    if unknown := [name for name in layouts if name not in LAYOUTS]:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    widths = [int(w) for w in args.widths.split(",")] if args.widths else [args.k + 1]
    if min(widths) < 1:
        parser.error("widths must be >= 1")

    device = torch.device(args.device)
    model = _model(args, device, args.dtype)
    runners = {
        name: ModelRunner(model, batched=LAYOUTS[name]["batched"], packed=LAYOUTS[name]["packed"]) for name in layouts
    }
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    kvs = {name: [SequenceKV() for _ in range(args.batch)] for name in layouts}
    prompts = [torch.randint(0, vocab, (args.length - (j % 7),), generator=gen).tolist() for j in range(args.batch)]
    for name, runner in runners.items():
        for start in range(0, args.batch, 8):  # prefill 8 sequences at a time (bounded memory)
            runner.forward([ForwardItem(kv, p, 0) for kv, p in zip(kvs[name][start : start + 8], prompts[start:])])
    row_widths = [widths[r % len(widths)] for r in range(args.batch)]

    def one_round(name: str) -> tuple[float, float]:
        items = [
            ForwardItem(kv, torch.randint(0, vocab, (w,), generator=gen).tolist(), w)
            for kv, w in zip(kvs[name], row_widths)
        ]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        runners[name].forward(items)[-1].sum().item()  # waits for the device
        elapsed, cpu = 1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0)
        for kv, w in zip(kvs[name], row_widths):
            kv.crop(kv.length - (w - 1))
        return elapsed, cpu

    for name in layouts:
        one_round(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in layouts}
    # CPU time of the process: on a shared box it moves less than wall time (with
    # OMP_WAIT_POLICY=passive, so idle OpenMP threads do not spin).
    cpu: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name in layouts:
            wall_ms, cpu_ms = one_round(name)
            times[name].append(wall_ms)
            cpu[name].append(cpu_ms)
    result = {
        "batch": args.batch,
        "length": args.length,
        "widths": row_widths,
        "real_positions": sum(row_widths),
        "padded_positions": args.batch * max(row_widths),
        "model": args.model or args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        # The first layout's figures at the top level, as before --layouts existed.
        "forward_ms_median": statistics.median(times[layouts[0]]),
        "forward_ms_min": min(times[layouts[0]]),
        "layouts": {
            name: {
                "forward_ms_median": statistics.median(t),
                "forward_ms_min": min(t),
                "cpu_ms_median": statistics.median(cpu[name]),
                "forward_ms": t,
            }
            for name, t in times.items()
        },
    }
    for name, t in times.items():
        print(
            f"{name}: B={args.batch} L={args.length} widths={widths} {result['model']} {device}: "
            f"{statistics.median(t):.1f} ms median, {min(t):.1f} min, {statistics.median(cpu[name]):.1f} ms CPU"
        )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
