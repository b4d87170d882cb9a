"""The static-shape forward against the eager packed forward, same model, same process.

    python -m bench.static_forward                 # SmolLM2-135M-Instruct if cached, else the toy target
    python -m bench.static_forward --compile       # also the static decoder under torch.compile

Two runners over the same weights, each with its own slot pool holding the same
B sequences (prompts of ``--prompt-len`` random tokens). Per round and width T
(1: a draft position; k + 1: a verify forward) each runner runs one forward of T
tokens on every sequence, then crops it back, so every timed forward sees the
same lengths. Rounds alternate which runner goes first, so a slow spell of the
shared host hits both; the headline is the median per-round ratio static / eager
(goal <= 1.0 on a CPU; on a GPU the static runner replays CUDA graphs). With
``--compile`` a third runner runs the static decoder through ``torch.compile``
(CPU inductor), reported the same way. Prints a table and ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REAL_MODEL = "smollm2-135m-instruct"


def _model_dir(arg: str | None) -> str:
    from specmask.gpu_worker.models.resolve import resolve_pair

    if arg is None and (Path(".specmask/models") / REAL_MODEL).is_dir():
        arg = REAL_MODEL
    if arg is None:
        from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR, build_toy_models

        return str(build_toy_models(DEFAULT_OUT_DIR, progress=False).target_dir)
    return resolve_pair(arg, None, progress=False)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help=f"model dir or registered name (default {REAL_MODEL})")
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--widths", default="1,5", help="tokens per row of the timed forwards")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto = the checkpoint's on CUDA, float32 on a CPU")
    parser.add_argument("--compile", action="store_true", help="also time the static decoder under torch.compile")
    args = parser.parse_args(argv)

    from specmask.gpu_worker.kv_cache import SequenceKV
    from specmask.gpu_worker.loading import checkpoint_dtype, load_causal_lm, resolve_dtype
    from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner

    torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)
    path = _model_dir(args.target)
    model = load_causal_lm(path, resolve_dtype(args.dtype, device, checkpoint_dtype(path)), device)
    vocab = int(model.config.vocab_size)
    runners = {"eager": ModelRunner(model, name="eager"), "static": ModelRunner(model, name="static", static="on")}
    if args.compile:
        compiled = ModelRunner(model, name="compiled", static="on")
        assert compiled.static is not None
        # Swapping the bound method for its compiled form is the point of this runner.
        compiled.static.decode = torch.compile(compiled.static.decode, dynamic=True)  # type: ignore[method-assign]  # see above
        runners["static+compile"] = compiled
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len + i,), generator=gen).tolist() for i in range(args.batch)]
    caches: dict[str, list[SequenceKV]] = {}
    for name, runner in runners.items():
        caches[name] = [SequenceKV() for _ in prompts]
        runner.forward([ForwardItem(kv, p, 0) for kv, p in zip(caches[name], prompts, strict=True)])
    widths = [int(w) for w in args.widths.split(",")]
    times: dict[str, dict[int, list[float]]] = {n: {w: [] for w in widths} for n in runners}
    agree = True

    def once(name: str, width: int, seed: int) -> torch.Tensor:
        feed = torch.randint(0, vocab, (args.batch, width), generator=torch.Generator().manual_seed(seed)).tolist()
        items = [ForwardItem(kv, f, width) for kv, f in zip(caches[name], feed, strict=True)]
        t0 = time.perf_counter()
        out = runners[name].forward(items)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[name][width].append(time.perf_counter() - t0)
        for kv in caches[name]:
            kv.crop(kv.length - width)
        return torch.cat(out).argmax(-1)

    for w in widths:  # warm-up (and compilation) outside the timed rounds
        for name in runners:
            once(name, w, 0)
        for t in times.values():
            t[w].clear()
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for w in widths:
            tokens = {name: once(name, w, 1000 * r + w) for name in order}
            agree &= all(torch.equal(tokens["eager"], t) for t in tokens.values())

    ratio_vs_eager: dict[str, dict[int, float]] = {}
    result: dict[str, object] = {
        "model": path,
        "device": str(device),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "torch_threads": args.torch_threads,
        "rounds": args.rounds,
        "greedy_tokens_equal": agree,
        "ms": {n: {w: statistics.median(t[w]) * 1e3 for w in widths} for n, t in times.items()},
        "ratio_vs_eager": ratio_vs_eager,
    }
    print(f"model {path}, B={args.batch}, prompts ~{args.prompt_len} tokens, {args.torch_threads} torch threads")
    print("| runner | " + " | ".join(f"T={w}: ms | x eager (median of rounds)" for w in widths) + " |")
    print("|---|" + "---:|---:|" * len(widths))
    for name in runners:
        cells = []
        ratios: dict[int, float] = {}
        for w in widths:
            per_round = [a / b for a, b in zip(times[name][w], times["eager"][w], strict=True)]
            ratios[w] = statistics.median(per_round)
            cells.append(f"{statistics.median(times[name][w]) * 1e3:.1f} | {ratios[w]:.3f}")
        ratio_vs_eager[name] = ratios
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"greedy tokens equal across runners: {agree}")
    print("RESULT " + json.dumps(result, separators=(",", ":")))
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
