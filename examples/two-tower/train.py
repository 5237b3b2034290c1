"""A two-tower retrieval model (user tower, item tower, in-batch negatives) in plain PyTorch, benchmarked by gpuscout.

The data is SYNTHETIC: interactions drawn with a fixed seed from hidden user and item factors, so the model has a
signal to learn. gpuscout compares throughput (samples/s and $ per 1M samples), not model quality.

The three lines that connect it to gpuscout are marked ``# gpuscout``.
"""

from __future__ import annotations

import argparse

import gpuscout_report as gs  # gpuscout
import torch
from torch import nn


def synthetic_interactions(*, users: int, items: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(user id, item id) pairs: each user picks items whose hidden factors match its own."""
    g = torch.Generator().manual_seed(seed)
    user_f = torch.randn(users, 8, generator=g)
    item_f = torch.randn(items, 8, generator=g)
    u = torch.randint(0, users, (count,), generator=g)
    scores = user_f[u] @ item_f.T + 0.5 * torch.randn(count, items, generator=g)
    return u, scores.argmax(dim=1)


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

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    users, items = synthetic_interactions(users=args.users, items=args.items, count=args.interactions, seed=args.seed)
    user_tower = Tower(args.users, args.embedding_dim, args.hidden).to(device)
    item_tower = Tower(args.items, args.embedding_dim, args.hidden).to(device)
    optimizer = torch.optim.Adam([*user_tower.parameters(), *item_tower.parameters()], lr=args.learning_rate)
    if device == "cuda":
        gs.configure(sync=torch.cuda.synchronize)

    stop = False
    while not stop:
        order = torch.randperm(len(users))
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            index = order[start : start + args.batch_size]
            u, i = users[index].to(device), items[index].to(device)
            logits = user_tower(u) @ item_tower(i).T / args.temperature  # in-batch negatives
            loss = nn.functional.cross_entropy(logits, torch.arange(len(index), device=device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if gs.step(samples=len(index), loss=loss.item()):  # gpuscout: True when enough is measured
                stop = True
                break
    gs.done()  # gpuscout


if __name__ == "__main__":
    main()
