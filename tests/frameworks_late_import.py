"""Lightning ``ddp_spawn`` (2 CPU ranks) with bridgeflow imported inside ``train_dataloader()``, for
tests/test_torch_frameworks.py: nothing here imports bridgeflow at the top, so its DataLoader class is first
defined while Lightning records the arguments of DataLoaders built in its hook (issue 21: the recorded
positional call and the injected ``sampler=`` collided). Each rank writes its sample ids and the class and
sampler it trained from to ``OUT/late-<rank>.json``.

``python tests/frameworks_late_import.py OUT``
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud

N, BATCH = 22, 3


class Ids(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


class Model(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def train_dataloader(self):
        from bridgeflow.adapters.torch import DataLoader  # first imported here, inside Lightning's hook

        return DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2)

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
                  "sampler": type(loader.sampler).__name__}
        with open(os.path.join(self.out, f"late-{self.global_rank}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    pl.seed_everything(7)
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(sys.argv[1]))
