"""The LightningModule of tests/frameworks_late_import.py (see its doc), apart from the dataset so that a
loader worker, which unpickles only the dataset, does not import Lightning."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from frameworks_late_import import BATCH, Ids


class Model(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def train_dataloader(self):
        from bridgeflow.adapters.torch import DataLoader  # first imported here, inside Lightning's hook

        # one worker a rank, kept across the epochs: it starts as the rank did (spawned)
        return DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True)

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, batch_idx):
        x, ids = batch
        self.seen[-1].extend(int(i) for i in ids)
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        record = {"rank": self.global_rank, "ids": self.seen,
                  "class": f"{type(loader).__module__}.{type(loader).__qualname__}",
                  "sampler": type(loader.sampler).__name__, "start_method": loader.start_method}
        with open(os.path.join(self.out, f"late-{self.global_rank}.json"), "w") as f:
            json.dump(record, f)
