"""The Lightning runs of tests/frameworks_run.py (see its doc), apart so that the Accelerate runs there do
not import Lightning."""

from __future__ import annotations

import json
import os
import signal

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from frameworks_run import BATCH, SEED, Ids

from bridgeflow.adapters.torch import DataLoader


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
    # The workers are forked from their rank: a rank started by ddp_spawn spawns its children by default, and
    # each spawned worker imports Lightning again to unpickle its worker_init_fn (seconds of CPU, 8 workers a
    # run). What this run checks (the sampler injected into bridgeflow's class, each rank's shard, torch's
    # order) is decided in the rank; spawned workers under ddp_spawn are frameworks_late_import.py's.
    loaders = {"torch": tud.DataLoader(Ids(), batch_size=BATCH, shuffle=True),
               "bridgeflow": DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2,
                                        multiprocessing_context="fork")}
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Recorder(out), train_dataloaders=loaders)


class StepRecorder(pl.LightningModule):
    """Appends each training step's sample ids to ``path`` (flushed: the line survives a SIGKILL), and
    kills this process at step ``kill_at``."""

    def __init__(self, path: str, kill_at: int | None = None) -> None:
        super().__init__()
        self.path, self.kill_at = path, kill_at
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, ids = batch
        with open(self.path, "a") as f:
            f.write(json.dumps([self.current_epoch, self.global_step, [int(i) for i in ids]]) + "\n")
        return self.layer(x.float().reshape(-1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def resume_loader(kind: str, workers: int) -> DataLoader:
    """40 samples, batch 4, shuffled without a generator (issue 21's case)."""
    import numpy as np

    import bridgeflow as bf

    if kind == "map":
        return DataLoader(Ids(40), batch_size=4, shuffle=True, num_workers=workers)
    flow = bf.MapData(bf.DataFromList([[np.float32(i), np.int64(i)] for i in range(40)], shuffle=False),
                      lambda dp: dp)
    return DataLoader(flow, batch_size=4, shuffle=True, num_workers=workers)


def lightning_resume(*cases: str) -> None:
    """Each case ``OUT:KIND:WORKERS`` in turn, each phase in a new process forked from this one, which has
    imported Lightning and run nothing (as a fresh interpreter would be, without importing Lightning again):
    ``full``, then ``resume``. Prints the exit code of each phase of each case as JSON, a line a case."""
    import multiprocessing as mp

    for case in cases:
        out, kind, workers = case.rsplit(":", 2)
        codes = {}
        for phase in ("full", "resume"):
            proc = mp.get_context("fork").Process(target=lightning_resume_phase, args=(out, kind, workers, phase))
            proc.start()
            proc.join()
            codes[phase] = proc.exitcode
        print(json.dumps({"case": case, **codes}), flush=True)


def lightning_resume_phase(out: str, kind: str, workers: str, phase: str) -> None:
    """``full``: 3 epochs uninterrupted, then the same run checkpointing every 6 steps and SIGKILLed at
    step 8 (this process dies); ``resume``: a new process resumes from the step-6 checkpoint. Each writes
    its steps to ``OUT/<phase>.jsonl``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(path: str, kill_at: int | None = None, ckpt: str | None = None, every: int | None = None) -> None:
        pl.seed_everything(SEED)  # the same program each time; the resumed one's RNG is not restored
        model = StepRecorder(path, kill_at)
        callbacks = [ModelCheckpoint(os.path.join(out, "ckpt"), every_n_train_steps=every, save_top_k=-1)] \
            if every else []
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, callbacks=callbacks,
                             enable_checkpointing=bool(every), enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out)
        trainer.fit(model, resume_loader(kind, int(workers)), ckpt_path=ckpt)

    if phase == "full":
        fit(os.path.join(out, "full.jsonl"))
        fit(os.path.join(out, "killed.jsonl"), kill_at=8, every=6)
    else:
        ckpt = next(p for p in os.listdir(os.path.join(out, "ckpt")) if "step=6" in p)
        fit(os.path.join(out, "resumed.jsonl"), ckpt=os.path.join(out, "ckpt", ckpt))


class Drawn(tud.Dataset):
    """40 samples: the index and a draw from torch's generator (seeded per sample: seed_per_sample=True)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i, torch.rand(())


class RankSteps(pl.LightningModule):
    """Each rank appends its steps (epoch, step, sample ids, the samples' draws) to ``OUT/<phase>-<rank>.jsonl``
    (flushed: a line survives a SIGKILL); at step ``kill_at`` rank 0 SIGKILLs the whole job, every rank and
    worker (its process group: the test starts each launch in a session of its own)."""

    def __init__(self, out: str, phase: str, kill_at: int | None = None) -> None:
        super().__init__()
        self.out, self.phase, self.kill_at = out, phase, kill_at
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.kill_at and self.global_rank == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        x, ids, draws = batch
        with open(os.path.join(self.out, f"{self.phase}-{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([self.current_epoch, self.global_step, ids.tolist(), draws.tolist()]) + "\n")
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def lightning_ddp_resume(out: str, strategy: str, phase: str) -> None:
    """One phase of a 2-rank run (``strategy`` ``ddp`` or ``ddp_spawn``, CPU, gloo), 2 workers per rank, 3 epochs
    of 5 steps: ``full`` uninterrupted; ``killed`` checkpoints every 6 steps and is SIGKILLed at step 8;
    ``resume`` resumes from the step-6 checkpoint (mid-epoch) in new processes. Lightning writes rank 0's loader
    state and every rank loads it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(SEED)  # every rank alike, as a launched job seeds them; the resumed run's RNG not restored
    ckpts = os.path.join(out, f"ckpt-{strategy}")
    callbacks = [ModelCheckpoint(ckpts, every_n_train_steps=6, save_top_k=-1)] if phase == "killed" else []
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=3, logger=False,
                         callbacks=callbacks, enable_checkpointing=phase == "killed", enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    loader = DataLoader(Drawn(), batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork",
                        seed_per_sample=True)
    ckpt = None
    if phase == "resume":
        ckpt = os.path.join(ckpts, next(p for p in os.listdir(ckpts) if "step=6" in p))
    trainer.fit(RankSteps(out, f"{strategy}-{phase}", kill_at=8 if phase == "killed" else None), loader,
                ckpt_path=ckpt)
