"""A causal language model trained with the Hugging Face Trainer, benchmarked by gpuscout through the drop-in
callback: the one line that connects it is marked ``# gpuscout`` (plus the import).

The model is a small Llama-architecture decoder initialised at random, and the data are SYNTHETIC token sequences
drawn with a fixed seed (no download: it runs offline and in network-isolated jobs). gpuscout compares throughput
(samples/s, tokens/s, $ per 1M samples), not model quality. Under torchrun (one process per GPU, what the cloud
launcher starts on a multi-GPU instance) the Trainer trains data-parallel by itself; the callback counts the samples of
all ranks and stops every rank at the same step.
"""

from __future__ import annotations

import argparse
import os

import gpuscout_report as gs  # gpuscout
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class SyntheticTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``count`` sequences of ``length`` token ids (fixed seed); labels = inputs (the model shifts them)."""

    def __init__(self, *, count: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=8, help="per device")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--sequence_length", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=4096)
    parser.add_argument("--bf16", type=str, default="auto", help="true | false | auto (if the GPU supports it)")
    parser.add_argument("--output_dir", default=os.environ.get("SM_MODEL_DIR", "trainer-output"))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported() if args.bf16 == "auto" else args.bf16 == "true"
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=1,
        max_position_embeddings=args.sequence_length,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    global_batch = args.batch_size * args.gradient_accumulation_steps * world
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=100_000,  # gpuscout's stop rule ends training (the callback sets should_training_stop)
        learning_rate=3e-4,
        bf16=bf16,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    data = SyntheticTokens(count=args.sequences, length=args.sequence_length, vocab=args.vocab, seed=0)
    callback = gs.hf_trainer_callback(  # gpuscout
        samples_per_step=global_batch, tokens_per_step=global_batch * args.sequence_length
    )
    Trainer(model=model, args=training_args, train_dataset=data, callbacks=[callback]).train()


if __name__ == "__main__":
    main()
