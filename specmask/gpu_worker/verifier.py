"""Verification: grammar-mask the target rows, then rejection-sample (docs/design.md steps 3-4).

Layout follows kernels.rejection: request r owns k_r + 1 consecutive target
rows; drafts are flattened in request order with cumulative counts
``cu_num_draft_tokens``. Mask rows arrive as slots of the mask client's interned
table; ``DeviceMaskTable`` turns them into row ids into its device-resident
mirror (sequences without a grammar use the all-ones slot 0), and the indirect
kernel masks the logits with them: no per-step table is built. On the CPU
reference path the logits are masked from token ids cached per row instead
(``gpu_worker.row_index``: same result, without unpacking every row each step).

The same table and row ids go to the rejection sampler, which checks every
emitted token against its row (one bit read per token): a sequence
whose emitted token breaks its mask gets ``VerifyResult.violation`` (a message)
and no tokens, and the step finishes only that sequence with
``FinishReason.GRAMMAR_VIOLATION``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.proposers.base import DeviceDrafts
from specmask.gpu_worker.sampling_cache import SamplingCache
from specmask.gpu_worker.types import MIN_TOKENS_UNREACHABLE, ErrorKind, TokenLogprob
from specmask.kernels.backend import Backend, resolve_backend
from specmask.mask_service.client.row_table import MaskRow, MaskRows, as_blocks


@dataclass(frozen=True)
class VerifyInput:
    """One sequence's share of the verify step."""

    drafts: Sequence[int]  # [k_r] d_1..d_k
    q_rows: Sequence[torch.Tensor | None]  # [k_r] each [V] float32, or None = one-hot at the draft
    logits: torch.Tensor  # [k_r + 1, V] float32 target logits, not yet grammar-masked (not modified)
    # [k_r + 1] grammar rows M_0..M_k: slots of the client's table, as one block (MaskRows, the
    # step's form) or row by row; None = no grammar.
    mask: MaskRows | Sequence[MaskRow] | None
    temperature: float
    top_k: int
    top_p: float
    seed: int
    step: int
    logprobs: int | None = None  # None: none; N: each emitted token's logprob + the N most likely
    min_p: float = 0.0  # 0 = off (kernels.probs)
    # min_tokens: the first ``stop_suppressed`` of the k_r + 1 rows are output positions before
    # the minimum; ``stop_token_ids`` are removed from them (kernels.stop_suppression).
    stop_suppressed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # Drafts the device draft loop sampled (proposers.base.DeviceDrafts): the first ``num_device``
    # of row ``device_row`` are d_1..d_k, with their q rows; ``drafts`` is then empty or their
    # host copy, and ``q_rows`` empty.
    device: DeviceDrafts | None = None
    device_row: int = 0
    num_device: int = 0

    @property
    def k(self) -> int:
        """k_r: the drafts to verify."""
        return self.num_device if self.device is not None else len(self.drafts)


@dataclass(frozen=True)
class VerifyResult:
    emitted: list[int]  # accepted drafts + one recovered or bonus token; [] on a violation
    num_accepted: int
    violation: str | None = None  # set when an emitted token broke its mask row (nothing emitted)
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when the input asked
    # Set when the sequence cannot go on (nothing emitted): min_tokens met a row whose only
    # allowed tokens are stop tokens (kernels.stop_suppression).
    error: str | None = None
    error_kind: ErrorKind | None = None  # with error: MIN_TOKENS_UNREACHABLE, or INTERNAL


def verify(
    inputs: Sequence[VerifyInput],
    *,
    vocab_size: int,
    num_mask_words: int,
    kernel_backend: Backend | None = None,
    mask_table: DeviceMaskTable | None = None,
    sampling_cache: SamplingCache | None = None,
) -> list[VerifyResult]:
    """Mask and rejection-sample a batch; returns per sequence the emitted tokens.

    ``mask_table``: the worker's device mirror of the mask rows (None: a private one).
    ``sampling_cache``: the step runner's device sampling parameters per batch composition
    (None: built for this call)."""
    from specmask.kernels.bitmask import apply_token_bitmask_indirect_inplace
    from specmask.kernels.rejection import HostLayout, rejection_sample

    if not inputs:
        return []
    # The step's rows as blocks (a request's rows, or n all-ones rows): the work below is per
    # block, never per row (DeviceMaskTable.resolve_blocks).
    blocks: list[MaskRows | int] = []
    for inp in inputs:
        k = inp.k
        if inp.device is not None and (inp.q_rows or len(inp.drafts) not in (0, k)):
            raise ValueError(f"device drafts with {len(inp.drafts)} host drafts and {len(inp.q_rows)} q rows")
        if inp.logits.shape != (k + 1, vocab_size):
            raise ValueError(f"logits {tuple(inp.logits.shape)} != ({k + 1}, {vocab_size})")
        if inp.mask is None:
            blocks.append(k + 1)
            continue
        # A list (rows a step held across a table clear) splits into runs of one table epoch.
        parts = [inp.mask] if isinstance(inp.mask, MaskRows) else _grammar_blocks(inp.mask)
        widths = {b.view.num_mask_words for b in parts}
        num_rows = sum(len(b) for b in parts)
        if num_rows != k + 1 or widths - {num_mask_words}:
            raise ValueError(f"mask has {num_rows} rows of widths {sorted(widths)} != ({k + 1}, {num_mask_words})")
        blocks.extend(parts)
    logits = torch.cat([inp.logits for inp in inputs], dim=0)  # [num_tokens, V]
    device = logits.device

    table = row_ids = None  # [num_table_rows, W] int32, [num_tokens] int32
    if any(inp.mask is not None for inp in inputs):
        if mask_table is None:
            mask_table = DeviceMaskTable(device)
        table, row_ids = mask_table.resolve_blocks(blocks)
        if device.type == "cpu" and resolve_backend(kernel_backend, device) is Backend.REFERENCE:
            # Same result as the kernel below, from token ids cached per interned row
            # (gpu_worker.row_index): the reference kernel unpacks every row every step.
            mask_table.row_index.mask_blocks_(logits, blocks)
        else:
            apply_token_bitmask_indirect_inplace(logits, table, row_ids, backend=kernel_backend)

    # min_tokens: after the grammar mask (the sampler's and the logprobs' view of the rows).
    dead_rows = _suppress_stop_tokens(inputs, logits)

    num_drafts = [inp.k for inp in inputs]  # [B] k_r
    cu = torch.tensor(list(itertools.accumulate(num_drafts)), dtype=torch.int32, device=device)  # [B]
    draft_probs = None  # [num_draft_tokens, V] float32; None = one-hot everywhere
    on_device = {id(inp.device): inp.device for inp in inputs if inp.device is not None and inp.k}
    if on_device:
        draft_token_ids, draft_probs = _device_drafts(inputs, on_device, device)
    else:
        flat_drafts = [t for inp in inputs for t in inp.drafts]
        draft_token_ids = torch.tensor(flat_drafts, dtype=torch.int64, device=device)  # [num_draft_tokens]
    # q rows matter only for random requests whose proposer gave a distribution;
    # otherwise None (= one-hot everywhere) avoids a [num_draft_tokens, V] tensor.
    needs_q = any(inp.temperature > 0 and any(q is not None for q in inp.q_rows) for inp in inputs)
    if needs_q and not on_device:
        flat_q = [q for inp in inputs for q in inp.q_rows]
        given = [i for i, q in enumerate(flat_q) if q is not None]
        one_hot = torch.tensor([q is None for q in flat_q], dtype=torch.float32, device=device)  # [num_draft_tokens]
        # One-hot rows at their draft (q = 1 there), then the given rows copied in, in two ops.
        draft_probs = torch.zeros(len(flat_drafts), vocab_size, dtype=torch.float32, device=device).scatter_(
            1, draft_token_ids.unsqueeze(1), one_hot.unsqueeze(1)
        )  # [num_draft_tokens, V]
        draft_probs[torch.tensor(given, dtype=torch.int64, device=device)] = torch.stack(
            [flat_q[i] for i in given]  # type: ignore[misc]  # given: the rows whose q is not None
        )
    seeds = [inp.seed for inp in inputs]
    steps = [inp.step for inp in inputs]
    if sampling_cache is None:
        sampling_cache = SamplingCache(device)
    sampling = sampling_cache.tensors(
        [(inp.temperature, inp.top_k, inp.top_p, inp.min_p, inp.seed) for inp in inputs], steps
    )
    # What the sampler would otherwise read back from the device: the host holds it.
    host = HostLayout(num_drafts, [inp.temperature == 0.0 for inp in inputs], seeds, steps)
    out = rejection_sample(
        draft_token_ids,
        cu,
        draft_probs,
        logits,
        sampling,
        mask_table=table,
        mask_row_ids=row_ids,
        backend=kernel_backend,
        host=host,
    )
    scored = _score_logprobs(inputs, logits, out.output_token_ids)
    # The step's one read: tokens, counts and violation flags in one [B, K + 4] block.
    width = out.output_token_ids.shape[1]
    block = to_host(
        torch.cat(
            [
                out.output_token_ids,
                out.num_emitted.unsqueeze(1).to(torch.int64),
                out.num_accepted.unsqueeze(1).to(torch.int64),
                out.violation.unsqueeze(1).to(torch.int64),
            ],
            dim=1,
        )
    )
    tokens = [row[:width] for row in block]  # [B, K+1]
    emitted = [row[width] for row in block]  # [B]
    accepted = [row[width + 1] for row in block]  # [B]
    violation = [bool(row[width + 2]) for row in block]  # [B]
    results = [
        VerifyResult(tokens[r][: emitted[r]], accepted[r], logprobs=_emitted_logprobs(scored.get(r), emitted[r]))
        if not violation[r]
        else VerifyResult(
            [],
            0,
            violation=(
                f"the sampler produced a token outside the grammar mask ({out.backend.value} backend, "
                f"temperature={inputs[r].temperature}, top_k={inputs[r].top_k}, top_p={inputs[r].top_p}, "
                f"k={inputs[r].k}); it was not emitted"
            ),
        )
        for r in range(len(inputs))
    ]
    if dead_rows is not None:
        results = _check_min_tokens(inputs, results, tokens, emitted, dead_rows)
    return results


def _suppress_stop_tokens(inputs: Sequence[VerifyInput], logits: torch.Tensor) -> set[int] | None:
    """Remove each input's stop tokens from its rows before min_tokens (``logits``, [num_tokens, V],
    in place); returns the rows left with no token (None when no input suppresses anything)."""
    from specmask.kernels.stop_suppression import suppress_stop_tokens_

    rows: list[int] = []
    ids: list[tuple[int, ...]] = []
    start = 0
    for inp in inputs:
        if inp.stop_suppressed > 0 and inp.stop_token_ids:
            count = min(inp.stop_suppressed, inp.k + 1)
            rows.extend(range(start, start + count))
            ids.extend([inp.stop_token_ids] * count)
        start += inp.k + 1
    if not rows:
        return None
    dead = suppress_stop_tokens_(logits, rows, ids).tolist()  # [n]; read only for such batches
    return {row for row, empty in zip(rows, dead) if empty}


def _check_min_tokens(
    inputs: Sequence[VerifyInput],
    results: list[VerifyResult],
    tokens: list[list[int]],  # [B, K+1] emitted tokens, then placeholders
    emitted: list[int],  # [B]
    dead_rows: set[int],
) -> list[VerifyResult]:
    """A sequence that emitted from a row min_tokens left empty (the grammar allowed only stop
    tokens there), or that emitted a stop token before min_tokens, emits nothing and fails.

    A mask violation hides how far the sequence got (nothing is emitted): an empty row among its
    suppressed ones is then the cause (sampling an empty row is what leaves the mask), reported
    as such."""
    out = list(results)
    start = 0
    for r, inp in enumerate(inputs):
        width = inp.k + 1
        violated = results[r].violation is not None
        reach = min(width, inp.stop_suppressed if violated else min(emitted[r], inp.stop_suppressed))
        for j in range(reach):
            if start + j in dead_rows:
                out[r] = VerifyResult(
                    [],
                    0,
                    error=(
                        f"{MIN_TOKENS_UNREACHABLE}: the grammar allows only a stop token at output position "
                        f"{j + 1} of this step, before min_tokens; nothing was emitted"
                    ),
                    error_kind=ErrorKind.MIN_TOKENS_UNREACHABLE,
                )
                break
            if not violated and tokens[r][j] in inp.stop_token_ids:  # cannot happen after suppression
                out[r] = VerifyResult(
                    [],
                    0,
                    error=f"the sampler produced stop token {tokens[r][j]} before min_tokens; it was not emitted",
                    error_kind=ErrorKind.INTERNAL,
                )
                break
        start += width
    return out


def _score_logprobs(
    inputs: Sequence[VerifyInput],
    logits: torch.Tensor,  # [num_tokens, V] grammar-masked target rows
    output_token_ids: torch.Tensor,  # [B, K+1] int64, placeholders past each request's emitted tokens
) -> dict[int, list[TokenLogprob]]:
    """Per request that asked for logprobs: one entry per target row (k_r + 1), scored at the
    token the sampler put there (entries past the emitted tokens are dropped by the caller).

    Scores every row of such a request on the device, before its accept count is known on the
    host, so the step gains no extra round trip between host and device, only the small
    results' transfer; rows of requests that did not ask are never touched, and a batch where
    none asked pays nothing."""
    from specmask.kernels.logprobs import row_logprobs

    want = [r for r, inp in enumerate(inputs) if inp.logprobs is not None]
    if not want:
        return {}
    starts = [0]
    for inp in inputs:
        starts.append(starts[-1] + inp.k + 1)
    rows: list[int] = []
    requests: list[int] = []
    positions: list[int] = []
    temperature: list[float] = []
    for r in want:
        width = inputs[r].k + 1
        rows.extend(range(starts[r], starts[r] + width))
        requests.extend([r] * width)
        positions.extend(range(width))
        temperature.extend([inputs[r].temperature] * width)
    device = logits.device
    picked = output_token_ids[
        torch.tensor(requests, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
    ]  # [n]; placeholders (past the emitted tokens) clamped to a valid id, their entries unused
    picked = picked.clamp(0, logits.shape[1] - 1)
    num_top = max(inputs[r].logprobs or 0 for r in want)
    scored = row_logprobs(
        logits,
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(temperature, dtype=torch.float32, device=device),
        picked,
        num_top,
    )
    token_ids = picked.tolist()
    token_lp = scored.token_logprobs.tolist()
    top_lp = scored.top_logprobs.tolist()
    top_ids = scored.top_ids.tolist()
    out: dict[int, list[TokenLogprob]] = {}
    for i, r in enumerate(requests):
        n = inputs[r].logprobs or 0
        top = tuple((t, v) for t, v in zip(top_ids[i][:n], top_lp[i][:n]) if v != float("-inf"))
        out.setdefault(r, []).append(TokenLogprob(token_ids[i], token_lp[i], top))
    return out


def _device_drafts(
    inputs: Sequence[VerifyInput], on_device: dict[int, DeviceDrafts], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The flat draft tokens ([num_draft_tokens] int64) and q rows ([num_draft_tokens, V] float32,
    or None: one-hot) of a batch whose drafts the device draft loop sampled: one gather each, by
    indices the host knows (each input's row and k_r), nothing read back."""
    if len(on_device) > 1 or any(inp.device is None and inp.k for inp in inputs):
        raise ValueError("a verify batch takes its drafts from one device draft loop or from the host, not both")
    (drafts,) = on_device.values()
    rows = [inp.device_row for inp in inputs for _ in range(inp.k)]
    columns = [j for inp in inputs for j in range(inp.k)]
    index = torch.tensor([rows, columns], dtype=torch.int64).to(device, non_blocking=True)  # [2, num_draft_tokens]
    tokens = drafts.tokens[index[0], index[1]]
    sampled = drafts.probs is not None and any(inp.temperature > 0 and inp.k for inp in inputs)
    probs = drafts.probs[index[0], index[1]] if sampled and drafts.probs is not None else None
    return tokens, probs


def to_host(values: torch.Tensor) -> list[Any]:
    """``values.tolist()``, through a page-locked buffer and an event on a GPU: the copy is queued
    behind the work that produces ``values``, and the host waits for that event only, not for
    the whole device (work queued later, e.g. the next step's first draft forward, is not waited
    for)."""
    if values.device.type != "cuda":
        return values.tolist()
    staged = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    staged.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return staged.tolist()


def _emitted_logprobs(scored: list[TokenLogprob] | None, num_emitted: int) -> list[TokenLogprob] | None:
    return None if scored is None else scored[:num_emitted]


def _grammar_blocks(rows: Sequence[MaskRow]) -> list[MaskRows]:
    """``as_blocks`` of rows that all have a grammar (no all-ones runs among them)."""
    return [b for b in as_blocks(rows) if isinstance(b, MaskRows)]
