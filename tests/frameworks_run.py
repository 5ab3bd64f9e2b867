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
import signal
import sys

import lightning.pytorch as pl
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader

N, BATCH, SEED = 22, 3, 31


class Ids(tud.Dataset):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

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


def lightning_resume(out: str, kind: str, workers: str, phase: str) -> None:
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


def accelerate_resume(out: str, phase: str) -> None:
    """Accelerate keeping bridgeflow's workers: the loader is not prepared; a DistributedSampler shards it
    and AllRanksState checkpoints every rank's position. ``full``: 2 epochs uninterrupted; ``killed``: the
    same, ``save_state()`` after step 4, every rank SIGKILLed at step 6; ``resume``: ``load_state()`` in new
    processes and the rest. Each rank appends its steps to ``OUT/<phase>-<rank>.jsonl``."""
    from accelerate import Accelerator

    from bridgeflow.adapters.torch import AllRanksState

    acc = Accelerator(cpu=True)
    torch.manual_seed(SEED + acc.process_index)  # each rank's global RNG its own: the workers' seeds differ
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    dataset = Ids(40)
    sampler = tud.DistributedSampler(dataset, num_replicas=acc.num_processes, rank=acc.process_index,
                                     shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    progress = {"epoch": 0}

    class Progress:
        def state_dict(self):
            return dict(progress)

        def load_state_dict(self, state):
            progress.update(state)

    acc.register_for_checkpointing(AllRanksState(loader), Progress())
    folder = os.path.join(out, "ckpt")
    if phase == "resume":
        acc.load_state(folder)
    path = os.path.join(out, f"{phase}-{acc.process_index}.jsonl")
    step = 0
    while progress["epoch"] < 2:
        sampler.set_epoch(progress["epoch"])
        for x, ids in loader:
            with open(path, "a") as f:
                f.write(json.dumps([progress["epoch"], [int(i) for i in ids], torch.rand(()).item()]) + "\n")
            loss = model(x).sum()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            if phase == "killed" and step == 4:
                acc.save_state(folder)
            if phase == "killed" and step == 6:
                os.kill(os.getpid(), signal.SIGKILL)
        progress["epoch"] += 1
    acc.wait_for_everyone()
    loader.close()
    sys.stdout.flush()
    os._exit(0)  # see accelerate()


if __name__ == "__main__":
    {"lightning_ddp": lightning_ddp, "accelerate": accelerate,
     "lightning_resume": lightning_resume, "accelerate_resume": accelerate_resume}[sys.argv[1]](*sys.argv[2:])
