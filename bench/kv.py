"""Micro-benchmark of the KV path: batched forwards over long cached pasts.

    python -m bench.kv                        # B=32, L=1000, a small Llama on CPU
    python -m bench.kv --device cuda --shape llama-3.2-1b --dtype bfloat16

B sequences are prefilled to L tokens each (lengths staggered by a few tokens,
as in a real batch), then each timed round is one verify-style forward of k+1
new tokens per sequence followed by a rollback of k of them (rejected drafts),
so lengths stay near L. Uses only the public ``ModelRunner`` / ``SequenceKV``
API, so the same script times any version of the KV code (an A/B runs it
against two trees). Last line: ``RESULT {json}``.
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


def main(argv: list[str] | None = None) -> int:
    from bench.gpu import SHAPES
    from gpu_worker.kv_cache import SequenceKV
    from gpu_worker.model_runner import ForwardItem, ModelRunner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shape", default="small", help=f"small or one of {list(SHAPES)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    kwargs = SMALL if args.shape == "small" else SHAPES[args.shape]
    config = LlamaConfig(**{**kwargs, "max_position_embeddings": max(4096, args.length + 64)})
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    runner = ModelRunner(model, batched=True)
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    kvs = [SequenceKV() for _ in range(args.batch)]
    for start in range(0, args.batch, 8):  # prefill 8 sequences at a time (bounded memory)
        chunk = kvs[start : start + 8]
        runner.forward(
            [
                ForwardItem(kv, torch.randint(0, vocab, (args.length - (j % 7),), generator=gen).tolist(), 0)
                for j, kv in enumerate(chunk, start)
            ]
        )

    def one_round() -> None:
        items = [ForwardItem(kv, torch.randint(0, vocab, (args.k + 1,), generator=gen).tolist(), 1) for kv in kvs]
        runner.forward(items)[-1].sum().item()  # waits for the device
        for kv in kvs:
            kv.crop(kv.length - args.k)

    one_round()
    times = []
    for _ in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        one_round()
        times.append(1e3 * (time.perf_counter() - t0))
    result = {
        "batch": args.batch,
        "length": args.length,
        "k": args.k,
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "forward_ms_median": statistics.median(times),
        "forward_ms_min": min(times),
        "forward_ms": times,
    }
    median, fastest = result["forward_ms_median"], result["forward_ms_min"]
    print(f"B={args.batch} L={args.length} k={args.k} {args.shape} {device}: {median:.1f} ms median, {fastest:.1f} min")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
