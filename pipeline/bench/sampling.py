"""The sampling cost of a step without drafts: vLLM's plain sampler against its rejection sampler.

Once a speculator is configured, vLLM's model runner hands every step to `RejectionSampler`,
drafts or none. The ServiceProposer sends a step without drafts to the plain `Sampler` instead
(`pipeline/engine/proposer.py` `plain_sampling_without_drafts`). Both arms run here in one
process, on the same random logits:

- `plain`: `Sampler`;
- `rejection_no_drafts`: `RejectionSampler` with zero drafts per request.

Each arm runs at each batch size, greedy (temperature 0) and random (temperature 0.8). The output
is the median time per call, and whether the two arms sampled the same tokens (greedy only: random
draws differ by construction). The vocabulary defaults to the embedded model's (SmolLM2, 49,152).

    moonserve bench sampling [--vocab 49152] [--batch-sizes 1 8 16 64] [--calls 300]
                             [--out bench-sampling.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

EMBEDDED_VOCAB = 49152  # SmolLM2-135M's vocab_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=EMBEDDED_VOCAB,
                        help=f"logits per row (default {EMBEDDED_VOCAB}, the embedded model's)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per arm and case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="bench-sampling.json", help="JSON results file")


def sampling_metadata(batch_size: int, greedy: bool):
    """vLLM's SamplingMetadata for a batch of plain requests (no penalties, no logprobs)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None if greedy else torch.full((batch_size,), 0.8), all_greedy=greedy,
        all_random=not greedy, top_p=None, top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(batch_size),
        presence_penalties=torch.zeros(batch_size), repetition_penalties=torch.ones(batch_size),
        output_token_ids=[[] for _ in range(batch_size)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(batch_size)])


def no_drafts(batch_size: int):
    """The SpecDecodeMetadata vLLM's model runner builds for a step in which no request has a
    draft (`_calc_spec_decode_metadata`): one sampled token per request, each request's logits
    row its bonus row (`make_dummy`'s indices are all 0, for shape warm-ups only)."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    rows = torch.arange(batch_size, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.empty(0, dtype=torch.int32), num_draft_tokens=[0] * batch_size,
        cu_num_draft_tokens=torch.zeros(batch_size, dtype=torch.int32),
        cu_num_sampled_tokens=rows + 1, target_logits_indices=torch.empty(0, dtype=torch.int32),
        bonus_logits_indices=rows, logits_indices=rows)


def arms(batch_size: int, greedy: bool, logits) -> dict:
    """name -> a call sampling `logits` [batch, vocab] as that arm does; each returns the sampled
    token ids [batch, 1]."""
    import torch
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    rejection = RejectionSampler(sampler, None, torch.device("cpu"))
    metadata, spec = sampling_metadata(batch_size, greedy), no_drafts(batch_size)
    return {"plain": lambda: sampler(logits.clone(), metadata).sampled_token_ids,
            "rejection_no_drafts": lambda: rejection(spec, None, logits.clone(),
                                                     metadata).sampled_token_ids}


def median_ms(call, calls: int) -> float:
    for _ in range(min(20, calls)):  # warm-up
        call()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def run(vocab: int, batch_sizes: list[int], calls: int) -> list[dict]:
    import torch

    rows = []
    for batch_size in batch_sizes:
        for greedy in (True, False):
            logits = torch.randn(batch_size, vocab, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float32).to(torch.bfloat16)
            calls_by_arm = arms(batch_size, greedy, logits)
            tokens = {name: call() for name, call in calls_by_arm.items()}
            row = {"batch_size": batch_size, "sampling": "greedy" if greedy else "random",
                   **{f"{name}_ms": round(median_ms(call, calls), 3)
                      for name, call in calls_by_arm.items()}}
            row["rejection_over_plain"] = round(row["rejection_no_drafts_ms"] / row["plain_ms"], 2)
            if greedy:
                row["same_tokens"] = bool(torch.equal(tokens["plain"].reshape(-1),
                                                      tokens["rejection_no_drafts"].reshape(-1)))
            rows.append(row)
    return rows


def main(args: argparse.Namespace) -> int:
    import torch
    from vllm.platforms import current_platform

    torch.set_num_threads(args.threads)
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()  # the CPU build's sampler kernels
    rows = run(args.vocab, args.batch_sizes, args.calls)
    result = {"vocab": args.vocab, "threads": args.threads, "calls": args.calls, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'batch':>5} {'sampling':<8} {'plain ms':>9} {'rejection ms':>13} {'x':>6}  same")
    for row in rows:
        print(f"{row['batch_size']:>5} {row['sampling']:<8} {row['plain_ms']:>9.3f} "
              f"{row['rejection_no_drafts_ms']:>13.3f} {row['rejection_over_plain']:>6.2f}  "
              f"{row.get('same_tokens', '-')}")
    print(f"results written to {args.out}")
    return 0
