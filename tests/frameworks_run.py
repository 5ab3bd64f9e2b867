"""Distributed runs for tests/test_torch_frameworks.py, started there in their own processes.

``python tests/frameworks_run.py lightning_ddp OUT`` trains with Lightning, ``strategy="ddp_spawn"`` on 2 CPU
ranks (gloo), from torch's and bridgeflow's loader side by side (a dict of loaders: Lightning injects a
DistributedSampler into each); every rank writes the sample ids each loader gave it, and what Lightning
trained from, to ``OUT/lightning-<rank>.json``.

``python -m torch.distributed.run --nproc_per_node 2 tests/frameworks_run.py accelerate OUT`` does the same
with Accelerate: each loader is prepared and read for two epochs, accumulating gradients over 3 steps; every
rank writes its sample ids and the ``sync_gradients`` flag of each step to ``OUT/accelerate-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader

N, BATCH, SEED = 22, 3, 31


class Ids(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


class Recorder(pl.LightningModule):
    """Records the sample ids each named loader gives this rank, epoch by epoch."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[str, list] = {"torch": [], "bridgeflow": []}

    def on_train_epoch_start(self) -> None:
        for ids in self.seen.values():
            ids.append([])

    def training_step(self, batch, batch_idx):
        for name, (_, ids) in batch.items():
            self.seen[name][-1].extend(int(i) for i in ids)
        return sum(self.layer(x).sum() for x, _ in batch.values())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        loaders = self.trainer.train_dataloader
        record = {
            "rank": self.global_rank, "ids": self.seen,
            "classes": {k: f"{type(v).__module__}.{type(v).__qualname__}" for k, v in loaders.items()},
            "samplers": {k: type(v.sampler).__name__ for k, v in loaders.items()},
        }
        with open(os.path.join(self.out, f"lightning-{self.global_rank}.json"), "w") as f:
            json.dump(record, f)


def lightning_ddp(out: str) -> None:
    pl.seed_everything(SEED, workers=True)
    loaders = {"torch": tud.DataLoader(Ids(), batch_size=BATCH, shuffle=True),
               "bridgeflow": DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2)}
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Recorder(out), train_dataloaders=loaders)


def accelerate(out: str) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    record: dict = {"rank": acc.process_index}
    for name, cls, kwargs in (("torch", tud.DataLoader, {}), ("bridgeflow", DataLoader, {"num_workers": 2})):
        loader = cls(Ids(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED), **kwargs)
        prepared = acc.prepare(loader)
        epochs = []
        for _ in range(2):
            steps = []
            for x, ids in prepared:
                with acc.accumulate(model):
                    loss = model(x).sum()
                    acc.backward(loss)
                    opt.step()
                    opt.zero_grad()
                steps.append([[int(i) for i in ids], bool(acc.sync_gradients)])
            epochs.append(steps)
        record[name] = {"epochs": epochs, "prepared": type(prepared).__qualname__}
    with open(os.path.join(out, f"accelerate-{acc.process_index}.json"), "w") as f:
        json.dump(record, f)
    acc.wait_for_everyone()
    # Collecting the DDP-wrapped model at interpreter exit can deadlock in torch's gloo process group
    # (its destructor joins a thread that waits for the GIL): leave without tearing it down.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    {"lightning_ddp": lightning_ddp, "accelerate": accelerate}[sys.argv[1]](sys.argv[2])
