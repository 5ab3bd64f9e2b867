"""Lightning ``ddp_spawn`` (2 CPU ranks) with bridgeflow imported inside ``train_dataloader()``, for
tests/test_torch_frameworks.py: nothing imports bridgeflow at the top, so its DataLoader class is first
defined while Lightning records the arguments of DataLoaders built in its hook (issue 21: the recorded
positional call and the injected ``sampler=`` collided). Each rank writes its sample ids and the class, sampler
and worker start method it trained from to ``OUT/late-<rank>.json``.

The model lives in tests/frameworks_late_model.py and Lightning is imported only when this runs as the script:
a spawned loader worker re-runs this file and unpickles ``Ids`` from it, and so does not import Lightning
(seconds of CPU each).

``python tests/frameworks_late_import.py OUT``
"""

from __future__ import annotations

import sys

import torch
import torch.utils.data as tud

N, BATCH = 22, 3


class Ids(tud.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


def main(out: str) -> None:
    import lightning.pytorch as pl
    from frameworks_late_model import Model

    pl.seed_everything(7)
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(out))


if __name__ == "__main__":
    main(sys.argv[1])
