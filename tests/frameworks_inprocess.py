"""Lightning run inside the test process, for tests/test_torch_frameworks.py's in-process tests: a module of
its own so that only the test process that runs them imports Lightning (see IN_PROCESS there)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["ModelCheckpoint", "Recorder", "pl", "trainer"]


class Recorder(pl.LightningModule):
    """Records the sample ids of every training batch, epoch by epoch, and the loader it trained from."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.epochs: list[list[list[int]]] = []
        self.loader_class: type | None = None

    def on_train_epoch_start(self) -> None:
        self.epochs.append([])
        self.loader_class = type(self.trainer.train_dataloader)

    def training_step(self, batch, batch_idx):
        x, ids = batch
        if not self.epochs:  # resumed mid-epoch: Lightning does not start that epoch again
            self.epochs.append([])
        self.epochs[-1].append([int(i) for i in ids])
        return self.layer(x.float().reshape(-1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(**kwargs) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)
