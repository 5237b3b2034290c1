"""A two-tower retrieval model (user tower, item tower, in-batch negatives) in plain PyTorch, benchmarked by gpuscout.

The data is SYNTHETIC: interactions drawn with a fixed seed from hidden user and item factors, so the model has a
signal to learn. gpuscout compares throughput (samples/s and $ per 1M samples), not model quality.

The three lines that connect it to gpuscout are marked ``# gpuscout``. Under torchrun (one process per GPU, what the
cloud launcher starts on a multi-GPU instance) it trains data-parallel and reports the samples of all ranks.
"""

from __future__ import annotations

import argparse
import os

import gpuscout_report as gs  # gpuscout
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def synthetic_interactions(
    *, users: int, items: int, count: int, seed: int, candidates: int = 64, chunk: int = 262_144
) -> tuple[torch.Tensor, torch.Tensor]:
    """(user id, item id) pairs: each interaction's user picks, of ``candidates`` random items, the one whose hidden
    factors match its own best (plus noise). Memory is ``chunk x candidates`` at a time, whatever ``count`` is."""
    g = torch.Generator().manual_seed(seed)
    user_f = torch.randn(users, 8, generator=g)
    item_f = torch.randn(items, 8, generator=g)
    u = torch.randint(0, users, (count,), generator=g)
    picked = torch.empty(count, dtype=torch.long)
    for start in range(0, count, chunk):
        rows = u[start : start + chunk]
        cands = torch.randint(0, items, (len(rows), candidates), generator=g)
        scores = (user_f[rows].unsqueeze(1) * item_f[cands]).sum(-1) + 0.5 * torch.randn(cands.shape, generator=g)
        picked[start : start + chunk] = cands.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)
    return u, picked


class Tower(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.mlp(self.embed(ids)), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--embedding_dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--interactions", type=int, default=20000)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # One process per GPU under torchrun (the cloud launcher's default on a multi-GPU instance): data parallel,
    # each rank trains on its own batches; batch_size is per process.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)  # same initial weights on every rank
    users, items = synthetic_interactions(users=args.users, items=args.items, count=args.interactions, seed=args.seed)
    user_tower: nn.Module = Tower(args.users, args.embedding_dim, args.hidden).to(device)
    item_tower: nn.Module = Tower(args.items, args.embedding_dim, args.hidden).to(device)
    if world > 1:
        user_tower, item_tower = DistributedDataParallel(user_tower), DistributedDataParallel(item_tower)
    optimizer = torch.optim.Adam([*user_tower.parameters(), *item_tower.parameters()], lr=args.learning_rate)
    if device.type == "cuda":
        gs.configure(sync=torch.cuda.synchronize)

    order_generator = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches
    stop = False
    while not stop:
        order = torch.randperm(len(users), generator=order_generator)
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            index = order[start : start + args.batch_size]
            u, i = users[index].to(device), items[index].to(device)
            logits = user_tower(u) @ item_tower(i).T / args.temperature  # in-batch negatives
            loss = nn.functional.cross_entropy(logits, torch.arange(len(index), device=device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # gpuscout: samples of all ranks; True when enough is measured (rank 0 decides for every rank)
            if gs.step(samples=len(index) * world, loss=loss.item()):
                stop = True
                break
    gs.done()  # gpuscout (rank 0 writes benchmark.json)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
