"""Train a tiny classifier with bridgeflow's drop-in torch DataLoader (runs in seconds on a CPU).

The only change from a plain torch script is the DataLoader import; CUDAPrefetcher moves batches to the
GPU on a side stream when there is one and passes them through otherwise.

Run: python examples/torch_train.py
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
from torch import nn

from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader

log = logging.getLogger("torch_train")


class Blobs(torch.utils.data.Dataset):
    """Two Gaussian blobs in 16 dimensions, with a little random jitter added per read (augmentation)."""

    def __init__(self, n: int = 2048) -> None:
        rng = np.random.default_rng(0)
        self.labels = rng.integers(0, 2, n)
        self.points = (rng.normal(size=(n, 16)) + self.labels[:, None] * 1.5).astype(np.float32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        jitter = np.random.normal(scale=0.05, size=16).astype(np.float32)  # seeded per worker, as torch does
        return self.points[i] + jitter, int(self.labels[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(Blobs(), batch_size=64, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        correct = total = 0
        for x, y in CUDAPrefetcher(loader, device=device):
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += int((logits.argmax(1) == y).sum())
            total += int(y.numel())
        log.info("epoch %d: loss %.3f, accuracy %.3f on %d samples (%s)", epoch, loss.item(), correct / total,
                 total, device)
    loader.close()


if __name__ == "__main__":
    main()
