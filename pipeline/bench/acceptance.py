"""Offline acceptance of a drafter against known target continuations, and the measurements
behind the embedded DSpark drafter's choices (docs/speculative.md has the tables).

`offline_acceptance(drafter, sequences, k, start)` walks each target-greedy sequence, proposes k
drafts from every prefix past `start` and counts the leading drafts equal to the target's tokens:
the greedy acceptance length, without an engine. Works with any `Drafter`.

    python -m moonserve.pipeline.bench.acceptance [--reference]   # layer choices of the embedded drafter
    python -m moonserve.pipeline.bench.acceptance --mxfp4         # float vs MXFP4 weights

Example:
    >>> from moonserve.pipeline.speculative.ngram import NgramDrafter
    >>> offline_acceptance(NgramDrafter(1, 2), [[1, 2, 3, 1, 2, 3, 1]], k=2, start=4).mean_accepted_length
    2.0
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moonserve.pipeline.speculative.drafter import Drafter
from moonserve.pipeline.models.dspark import target_shared_tensors
from moonserve.pipeline.prepare.drafter import (
    build_embedded_dspark,
    derive_markov_head,
    dspark_from_llama,
    quantize_drafter_checkpoint,
)
from moonserve.pipeline.speculative.dspark import DSparkDrafter


@dataclass(frozen=True)
class OfflineAcceptance:
    """Greedy acceptance of a drafter against known target continuations."""

    mean_accepted_length: float  # leading drafts equal to the target's tokens, 0..k
    per_position: tuple[float, ...]  # [k]: fraction of proposals whose drafts 0..i all matched
    num_proposals: int


@dataclass(frozen=True)
class Proposal:
    """One offline proposal: the drafts after a prefix and the k target tokens that follow it."""

    drafts: tuple[int, ...]
    target: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return num_leading_equal(self.drafts, self.target)


def offline_acceptance(
    drafter: Drafter, sequences: Sequence[Sequence[int]], k: int, start: int | Sequence[int]
) -> OfflineAcceptance:
    """Propose k drafts after every prefix `seq[:p]`, `start <= p <= len(seq) - k`, and count the
    leading drafts equal to `seq[p:p + k]` (what a greedy target would accept).

    `start`: one position for all sequences, or one per sequence (e.g. each prompt's length).

    >>> from moonserve.pipeline.speculative.ngram import NgramDrafter
    >>> offline_acceptance(NgramDrafter(1, 2), [[1, 2, 3, 1, 2, 3, 1]], k=2, start=4)
    OfflineAcceptance(mean_accepted_length=2.0, per_position=(1.0, 1.0), num_proposals=2)
    """
    return summarize_acceptance(offline_proposals(drafter, sequences, k, start), k)


def offline_proposals(
    drafter: Drafter, sequences: Sequence[Sequence[int]], k: int, start: int | Sequence[int]
) -> list[Proposal]:
    """The proposals `offline_acceptance` scores, in order (to compare two drafters' drafts)."""
    starts = [start] * len(sequences) if isinstance(start, int) else list(start)
    proposals = []
    for seq, first in zip(sequences, starts, strict=True):
        state = drafter.new_state("offline-acceptance")
        state.append(seq[:first])
        for p in range(first, len(seq) - k + 1):
            proposals.append(Proposal(tuple(state.propose(k)), tuple(seq[p : p + k])))
            state.append(seq[p : p + 1])
    if not proposals:
        raise ValueError(f"no position with {k} target tokens after it past start={start}")
    return proposals


def summarize_acceptance(proposals: Sequence[Proposal], k: int) -> OfflineAcceptance:
    accepted = [p.num_accepted for p in proposals]
    per_position = tuple(sum(n > i for n in accepted) / len(accepted) for i in range(k))
    return OfflineAcceptance(sum(accepted) / len(accepted), per_position, len(accepted))


@dataclass(frozen=True)
class DraftAgreement:
    """How often two drafters propose the same drafts at the same offline proposals."""

    identical: float  # fraction of proposals whose k drafts are all equal
    first_draft: float  # fraction whose first drafts are equal
    num_proposals: int


def draft_agreement(a: Sequence[Proposal], b: Sequence[Proposal]) -> DraftAgreement:
    """`a` and `b`: `offline_proposals` of two drafters on the same sequences and starts."""
    pairs = list(zip(a, b, strict=True))
    if any(x.target != y.target for x, y in pairs):
        raise ValueError("draft_agreement needs proposals made on the same sequences and starts")
    identical = sum(x.drafts == y.drafts for x, y in pairs) / len(pairs)
    first = sum(x.drafts[:1] == y.drafts[:1] for x, y in pairs) / len(pairs)
    return DraftAgreement(identical, first, len(pairs))


def num_leading_equal(drafts: Sequence[int], target: Sequence[int]) -> int:
    n = 0
    while n < min(len(drafts), len(target)) and drafts[n] == target[n]:
        n += 1
    return n


MEASURE_PROMPTS = (
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Give me three tips for staying focused while studying."),
    ("chat", "Explain what a hash table is to a beginner."),
    ("chat", "Write a short, friendly email inviting my team to lunch on Friday."),
    ("copy", ("Repeat the following sentence exactly: The quick brown fox jumps over the lazy "
              "dog, and then the dog chases the fox around the old red barn.")),
    ("copy", ("Fix the typos and return the corrected text: Teh meeting is schedulled for "
              "tomorow at noon in the main conferense room.")),
    ("copy", ("Rename the variable x to count in this code and return the whole code:\n"
              "def f(items):\n    x = 0\n    for item in items:\n        x += 1\n    return x")),
    ("copy", "Convert to a bulleted list: apples, bananas, cherries, dates, elderberries, figs."),
)


def greedy_continuations(
    lm_dir: Path, prompts: Sequence[str], max_new_tokens: int = 48
) -> tuple[list[list[int]], list[int]]:
    """Chat-templated prompts and the target's greedy continuation (transformers, float32):
    (prompt + continuation ids per prompt, prompt lengths)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(lm_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(lm_dir), dtype=torch.float32,
                                                 local_files_only=True).eval()
    return chat_greedy_continuations(model, tokenizer, prompts, max_new_tokens)


def chat_greedy_continuations(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """`greedy_continuations` with a loaded transformers model and tokenizer."""
    sequences, starts = [], []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        sequences.append(greedy_extend(model, ids[0].tolist(), max_new_tokens))
        starts.append(ids.shape[1])
    return sequences, starts


@torch.inference_mode()
def greedy_extend(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """`token_ids` plus the model's argmax tokens, past EOS too (`generate`'s `min_new_tokens`
    would instead forbid EOS and so pick a token the target would not)."""
    out = model(torch.tensor([token_ids]), use_cache=True)
    sequence = list(token_ids)
    for _ in range(max_new_tokens):
        sequence.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([sequence[-1:]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return sequence


def measure_layer_choices(
    lm_dir: Path,
    choices: Mapping[str, tuple[int, ...]],
    k: int = 4,
    max_new_tokens: int = 48,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Offline acceptance on `MEASURE_PROMPTS` per layer choice, with the derived Markov head and
    with it zero, plus vLLM-style n-gram prompt lookup on the same sequences; logs a table."""
    from moonserve.pipeline.speculative.ngram import NgramDrafter

    sequences, starts = greedy_continuations(lm_dir, [p for _, p in MEASURE_PROMPTS],
                                             max_new_tokens)
    log(f"{'layers':18s} {'mean':>6s} {'d1':>6s} {'d2':>6s} {'d3':>6s} {'d4':>6s} "
        f"{'no-Markov mean':>15s} {'Markov derive s':>16s}")
    results = {}
    for label, layer_ids in choices.items():
        model = dspark_from_llama(lm_dir, layer_ids)
        zero = offline_acceptance(DSparkDrafter(model), sequences, k, starts)
        begin = time.perf_counter()
        derive_markov_head(model)
        derive_s = time.perf_counter() - begin
        derived = offline_acceptance(DSparkDrafter(model), sequences, k, starts)
        results[label] = {"layers": list(layer_ids), **asdict(derived), "derive_s": derive_s,
                          "no_markov": asdict(zero)}
        log(f"{label:18s} {format_acceptance(derived)} {zero.mean_accepted_length:15.3f} "
            f"{derive_s:16.1f}")
    results["ngram"] = asdict(offline_acceptance(NgramDrafter(2, 5), sequences, k, starts))
    log(f"{'ngram (2..5)':18s} {format_acceptance(OfflineAcceptance(**results['ngram']))}")
    return results


def measure_mxfp4(
    lm_dir: Path,
    work_dir: Path,
    k: int = 4,
    max_new_tokens: int = 48,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Build the embedded drafter and its MXFP4 copy in `work_dir`, then offline acceptance of
    both on `MEASURE_PROMPTS` and how often their drafts agree; logs a table."""
    begin = time.perf_counter()
    float_dir = build_embedded_dspark(lm_dir, work_dir / "float")
    build_s = time.perf_counter() - begin
    paths = {"float": float_dir, "mxfp4": quantize_drafter_checkpoint(float_dir, work_dir / "mxfp4")}
    shared = target_shared_tensors(lm_dir)
    sequences, starts = greedy_continuations(lm_dir, [p for _, p in MEASURE_PROMPTS],
                                             max_new_tokens)
    log(f"build {build_s:.1f} s; {'drafter':8s} {'MB':>6s} {'mean':>6s} {'d1':>6s} {'d2':>6s} "
        f"{'d3':>6s} {'d4':>6s} {'ms/proposal':>12s}")
    proposals, results = {}, {}
    for label, path in paths.items():
        drafter = DSparkDrafter.from_pretrained(path, shared=shared)
        begin = time.perf_counter()
        proposals[label] = offline_proposals(drafter, sequences, k, starts)
        ms = 1e3 * (time.perf_counter() - begin) / len(proposals[label])
        size_mb = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        acceptance = summarize_acceptance(proposals[label], k)
        results[label] = {**asdict(acceptance), "megabytes": size_mb, "ms_per_proposal": ms}
        log(f"{'':14s}{label:8s} {size_mb:6.1f} {format_acceptance(acceptance)} {ms:12.1f}")
    agreement = draft_agreement(proposals["float"], proposals["mxfp4"])
    log(f"mxfp4 vs float: identical drafts {agreement.identical:.3f}, first draft "
        f"{agreement.first_draft:.3f} ({agreement.num_proposals} proposals)")
    return {**results, "agreement": asdict(agreement), "build_s": build_s}


def format_acceptance(result: OfflineAcceptance) -> str:
    return " ".join(f"{x:6.3f}" for x in (result.mean_accepted_length, *result.per_position))


def default_layer_choices(num_layers: int = 30) -> dict[str, tuple[int, ...]]:
    last = num_layers - 1
    return {
        "first 4": (0, 1, 2, 3),
        "first 8": tuple(range(8)),
        "first 3 + last 3": (0, 1, 2, last - 2, last - 1, last),
        "first 4 + last 4": (0, 1, 2, 3, last - 3, last - 2, last - 1, last),
        "every 4th + last": (*range(0, last - 4, 4), last),
    }


# Past the 8-layer budget, to show how far untrained layer subsets are from the target.
REFERENCE_LAYER_CHOICES = {"first 16": tuple(range(16)), "first 24": tuple(range(24)),
                           "all 30": tuple(range(30))}


if __name__ == "__main__":
    import sys

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    lm_dir = prepare_language_model(progress=False)
    if "--mxfp4" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as work_dir:
            measure_mxfp4(lm_dir, Path(work_dir))
        sys.exit()
    choices = default_layer_choices()
    if "--reference" in sys.argv[1:]:
        choices.update(REFERENCE_LAYER_CHOICES)
    measure_layer_choices(lm_dir, choices)
