"""Distributed runs for tests/test_torch_frameworks.py, started there in their own processes.

``python tests/frameworks_run.py lightning_ddp OUT`` trains with Lightning, ``strategy="ddp_spawn"`` on 2 CPU
ranks (gloo), from torch's and bridgeflow's loader side by side (a dict of loaders: Lightning injects a
DistributedSampler into each); every rank writes the sample ids each loader gave it, and what Lightning
trained from, to ``OUT/lightning-<rank>.json``.

``python -m torch.distributed.run --nproc_per_node 2 tests/frameworks_run.py accelerate OUT`` does the same
with Accelerate: each loader is prepared and read for two epochs, accumulating gradients over 3 steps; every
rank writes its sample ids and the ``sync_gradients`` flag of each step to ``OUT/accelerate-<rank>.json``.

The Lightning runs live in tests/frameworks_lightning.py, imported only for them: Accelerate's ranks (and
a spawned worker's re-run of this file) do not import Lightning, seconds of CPU each.
"""

from __future__ import annotations

import json
import os
import signal
import sys

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


def accelerate_resume(out: str, phase: str) -> None:
    """Accelerate keeping bridgeflow's workers: the loader is not prepared; a DistributedSampler shards it
    and AllRanksState checkpoints every rank's position. ``full``: 2 epochs uninterrupted; ``killed``: the
    same, ``save_state()`` after step 4, every rank SIGKILLed at step 6; ``resume``: ``load_state()`` in new
    processes and the rest. Each rank appends its steps to ``OUT/<phase>-<rank>.jsonl``. ``full+killed`` runs
    the first two one after the other in the same processes (one launch less: seconds of imports), each from
    the same seeds and with objects of its own."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    for one in phase.split("+"):
        accelerate_resume_run(acc, out, one)
        acc.free_memory()  # the next run prepares and saves only its own model and optimizer
    acc.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)  # see accelerate()


def accelerate_resume_run(acc, out: str, phase: str) -> None:
    from bridgeflow.adapters.torch import AllRanksState

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

    if phase != "full":  # the uninterrupted run saves nothing
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
    loader.close()


def lightning_ddp(out: str) -> None:
    from frameworks_lightning import lightning_ddp as run

    run(out)


def lightning_ddp_resume(out: str, strategy: str, phase: str) -> None:
    from frameworks_lightning import lightning_ddp_resume as run

    run(out, strategy, phase)


def lightning_resume(*cases: str) -> None:
    from frameworks_lightning import lightning_resume as run

    run(*cases)


if __name__ == "__main__":
    {"lightning_ddp": lightning_ddp, "accelerate": accelerate, "lightning_ddp_resume": lightning_ddp_resume,
     "lightning_resume": lightning_resume, "accelerate_resume": accelerate_resume}[sys.argv[1]](*sys.argv[2:])
