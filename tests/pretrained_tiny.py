"""A small pretrained model made here, offline: the qwen2-tiny preset trained on one corpus (the Hebrew Bible) with
its own byte-level BPE tokenizer, saved as a transformers checkpoint with that tokenizer. Fine-tuning it on another
corpus is what an adapter run does with a hub model: it starts from weights that already know the language.

``pretrained_tiny(folder)`` writes it (a few seconds on 2 cores) and returns the folder; tests build it once per
session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from gpuscout_data.sources import BUNDLED_PACKAGES, _bundled_documents
from gpuscout_data.tokenizer import build_tokenizer

from gpuscout.domain.models import PRESETS

VOCAB = 1024
SEQUENCE = 128
STEPS = 300
BATCH = 8
DOCUMENTS = 400


def pretrained_tiny(folder: Path, *, steps: int = STEPS, seed: int = 0) -> Path:
    """Train the tiny preset for ``steps`` steps on the bundled Hebrew Bible and save model and tokenizer to
    ``folder`` (loadable by ``model.path`` and ``tokenizer: {kind: hf, path: ...}``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    assert "bundled:hebrew-bible" in BUNDLED_PACKAGES
    documents = [d for d in _bundled_documents("bundled:hebrew-bible") if len(d) >= 20][:DOCUMENTS]
    tokenizer, _ = build_tokenizer("bpe", vocab_size=VOCAB, path=None, train_documents=documents)
    ids = [
        i for doc in tokenizer(documents, add_special_tokens=False)["input_ids"] for i in [*doc, tokenizer.eos_token_id]
    ]
    blocks = torch.tensor(ids[: len(ids) // SEQUENCE * SEQUENCE]).view(-1, SEQUENCE)
    arch = dataclasses.replace(PRESETS["qwen2-tiny"], vocab_size=len(tokenizer))
    config = Qwen2Config(**arch.to_qwen2_config_kwargs(), use_cache=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (BATCH,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "pretraining.txt").write_text(
        f"qwen2-tiny, {steps} steps on bundled:hebrew-bible, final loss {loss:.3f}\n"
    )
    return folder
