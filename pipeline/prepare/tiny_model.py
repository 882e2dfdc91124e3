"""A tiny random-weight model with SmolLM2's tokenizer, for benchmarks of the serving path.

SmolLM2-135M on 2 CPU cores makes about a hundred tokens a second, so the engine hides what the
serving path costs. This model keeps SmolLM2's tokenizer, vocabulary and chat template (so every
request is tokenized, templated and detokenized as for the real one) but has 2 layers of hidden
size 64: the engine makes thousands of tokens a second, as on a GPU, and what a benchmark measures
is the path around it (`moonserve bench overhead --engine tiny`); the live tests that need no real
text run on it too (tests/serving.py). Its embedding (tied to its LM head) is drawn 2.5x wider than
transformers' init, so each greedy choice wins by a wide margin (at least a quarter of the top
logit on the corpus tests/unit/test_tiny_model.py checks; 0.0003 with transformers' own init,
0.19 with this draw at its 0.02): batch shapes, drafts and chunked prefill cannot tip a
near-tie. Greedy, it mostly repeats a token of its prompt; sampled, its tokens are random text.

Written under ``$MOONSERVE_HOME/models/tiny-smollm2/`` (a `store.Artifact`, seeded, float32) the
first time a benchmark asks for it.

Example:
    >>> path = prepare_tiny_model()                          # doctest: +SKIP
    >>> json.loads((path / "config.json").read_text())["num_hidden_layers"]   # doctest: +SKIP
    2
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moonserve.pipeline.prepare.language_model import prepare_language_model, untied_state_dict
from moonserve.pipeline.prepare.store import CONFIG_FILE, WEIGHTS_FILE, Artifact

TINY_LM = Artifact("tiny-smollm2", format_version=2)
SEED = 0
# SmolLM2-135M's architecture, narrowed; vocabulary, special tokens and rope as the real one.
SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
EMBEDDING_STD = 0.05  # transformers draws 0.02 (initializer_range)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def prepare_tiny_model(home: Path | None = None) -> Path:
    """Build (or verify and reuse) the tiny model's checkpoint; returns its directory."""
    source = prepare_language_model(home, progress=False)
    return TINY_LM.ensure(home, lambda staging: build(source, staging), seed=SEED, shape=SHAPE,
                          embedding_std=EMBEDDING_STD)


def build(source: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((source / CONFIG_FILE).read_text()) | SHAPE
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=EMBEDDING_STD)
    save_file(untied_state_dict(model), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out_dir / name)
