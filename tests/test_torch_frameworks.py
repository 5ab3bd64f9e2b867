"""bridgeflow's DataLoader under the training frameworks most torch users train with, for real.

Lightning on one CPU device (in this process): the same batches as torch's loader under seed_everything, a
DataFlow-backed loader over several epochs, and an exact mid-epoch resume from a Lightning checkpoint.
Lightning DDP (``ddp_spawn``, 2 CPU ranks, gloo) and Accelerate (``torch.distributed.run``, 2 processes) run
tests/frameworks_run.py in processes of their own: each rank reads its own shard, the one torch's loader
gives it, and Accelerate's gradient-accumulation steps end with the epochs as they do with torch's loader.
Lightning ``ddp`` and ``ddp_spawn`` jobs SIGKILLed mid-epoch resume every rank from rank 0's checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest

import bridgeflow
from conftest import need

need("torch")
need("lightning", import_it=False)  # imported by the tests that run it here, in one test process (below)

import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Ids(tud.Dataset):
    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i


# Lightning is imported by the three tests below, not at collection: the import costs each pytest-xdist
# process ~6 s, so they share one process (xdist_group, with the README's --dist loadgroup) and the other
# processes never pay it. The module they import holds the LightningModule.
IN_PROCESS = pytest.mark.xdist_group("lightning")


@IN_PROCESS
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_trains_on_torchs_batches(num_workers, leak_check):
    """Under seed_everything, shuffled from torch's global RNG: the same order as torch's loader, so
    Lightning neither draws an extra seed nor starts an extra worker pool for bridgeflow's loader."""
    from frameworks_inprocess import Recorder, pl, trainer

    runs = []
    for cls in (tud.DataLoader, DataLoader):
        pl.seed_everything(0)
        model = Recorder()
        trainer(max_epochs=2).fit(model, cls(Ids(), batch_size=3, shuffle=True, num_workers=num_workers))
        runs.append(model)
    assert runs[1].loader_class is DataLoader
    assert runs[0].epochs == runs[1].epochs
    assert runs[1].epochs[0] != runs[1].epochs[1]


@IN_PROCESS
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_trains_from_a_dataflow_for_several_epochs(num_workers, tmp_path, leak_check):
    """A sized flow: Lightning ends each epoch after len() batches, without StopIteration, and starts the
    next with a new iter() while the old iterator is still held; with checkpointing on, the loader's
    state is taken at each epoch's end."""
    from frameworks_inprocess import Recorder, trainer

    flow = bridgeflow.DataFromList([[np.float32(i), np.int64(i)] for i in range(8)], shuffle=True, seed=3)
    model = Recorder()
    loader = DataLoader(flow, batch_size=3, num_workers=num_workers)
    trainer(max_epochs=3, enable_checkpointing=True, default_root_dir=str(tmp_path)).fit(model, loader)
    assert len(model.epochs) == 3 and model.loader_class is DataLoader
    for epoch in model.epochs:
        assert sorted(i for batch in epoch for i in batch) == list(range(8))
    assert model.epochs[0] != model.epochs[1]  # the flow reshuffles each epoch
    assert list(tmp_path.rglob("*.ckpt"))
    loader.close()
    flow.close()


@IN_PROCESS
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resumes_mid_epoch_from_a_checkpoint(num_workers, tmp_path, leak_check):
    from frameworks_inprocess import ModelCheckpoint, Recorder, trainer

    def loader():
        return DataLoader(Ids(), batch_size=3, shuffle=True, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(1))

    full = Recorder()
    every_2 = ModelCheckpoint(str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    trainer(max_epochs=2, callbacks=[every_2], enable_checkpointing=True).fit(full, loader())
    mid_epoch = next(p for p in tmp_path.glob("*.ckpt") if "step=2" in p.name)
    resumed = Recorder()
    trainer(max_epochs=2).fit(resumed, loader(), ckpt_path=str(mid_epoch))
    flat = lambda epochs: [b for e in epochs for b in e]
    assert flat(resumed.epochs) == flat(full.epochs)[2:]  # the rest of epoch 1, then epoch 2


# --- distributed ------------------------------------------------------------------------------------------

# A launch of two ranks, each importing torch and Lightning or Accelerate, then training: beside .ci/stress's
# four test processes and a spinning core one passed 240 s with both ranks still running (not stuck). Its bound,
# and the tests' time limits above it, leave room for that.
LAUNCH_S = 420
LAUNCH_LIMIT = pytest.mark.timeout(LAUNCH_S + 60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], out, timeout: float = LAUNCH_S) -> list[dict]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(records) == 2, proc.stderr[-3000:]
    return records


@pytest.mark.slow
@LAUNCH_LIMIT
def test_lightning_ddp_spawn_gives_each_rank_torchs_shard(tmp_path):
    from frameworks_run import N

    ranks = run([sys.executable, "frameworks_run.py", "lightning_ddp", str(tmp_path)], tmp_path)
    for rec in ranks:
        assert rec["classes"]["bridgeflow"] == "bridgeflow.adapters.torch._loader.DataLoader"
        assert rec["samplers"]["bridgeflow"] == "DistributedSampler"  # injected into bridgeflow's class
        assert rec["ids"]["bridgeflow"] == rec["ids"]["torch"]  # per epoch, in order
    for epoch in range(2):
        shards = [set(rec["ids"]["bridgeflow"][epoch]) for rec in ranks]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(N))
    assert ranks[0]["ids"]["bridgeflow"][0] != ranks[0]["ids"]["bridgeflow"][1]  # set_epoch reshuffles


@pytest.mark.slow
@LAUNCH_LIMIT
def test_accelerate_two_processes_shard_and_accumulate_like_torch(tmp_path):
    need("accelerate")  # tests/frameworks_run.py runs it
    from frameworks_run import N

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "frameworks_run.py", "accelerate", str(tmp_path)]
    ranks = run(args, tmp_path)
    for rec in ranks:
        ours, torchs = rec["bridgeflow"], rec["torch"]
        assert ours["prepared"] == "DataLoaderShard"  # Accelerate replaced it, as it replaces torch's
        assert ours["epochs"] == torchs["epochs"]  # sample ids and sync_gradients, step by step
        for steps in ours["epochs"]:  # every 3rd step syncs, and the epoch's last, which ends a short group
            assert [s[1] for s in steps] == [i % 3 == 2 or i == len(steps) - 1 for i in range(len(steps))]
    for epoch in range(2):
        seen = [set(i for ids, _ in rec["bridgeflow"]["epochs"][epoch] for i in ids) for rec in ranks]
        assert seen[0] | seen[1] == set(range(N))


RESUME_CASES = [(kind, workers) for workers in (0, 2) for kind in ("map", "dataflow")]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Every case of the test below in one process that imports Lightning once (each case's phases are
    processes forked from it): the folder of each case, and the exit codes of its phases."""
    root = tmp_path_factory.mktemp("killed")
    folders = {case: root / f"{case[0]}-{case[1]}" for case in RESUME_CASES}
    for folder in folders.values():
        folder.mkdir()
    args = [sys.executable, "frameworks_run.py", "lightning_resume",
            *(f"{folders[case]}:{case[0]}:{case[1]}" for case in RESUME_CASES)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=480, cwd=HERE)
    codes = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            codes[rec.pop("case")] = rec
    return {case: (folder, codes.get(f"{folder}:{case[0]}:{case[1]}"), proc) for case, folder in folders.items()}


@pytest.mark.slow
@pytest.mark.timeout(540)  # the first case waits for killed_runs, bounded by 480 s
@pytest.mark.xdist_group("lightning_resume")  # the cases share one launch (killed_runs)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "dataflow"])
def test_lightning_resumes_a_killed_run_exactly(kind, num_workers, killed_runs):
    """Issue 21's case: shuffled without a generator, a checkpoint every 6 steps, the process SIGKILLed at
    step 8, a new process resumes from step 6 (Lightning restores no RNG): every remaining step of every
    epoch is the uninterrupted run's, the epochs after the resumed one included."""
    folder, codes, proc = killed_runs[(kind, num_workers)]
    # each phase a process of its own (forked from one that has only imported Lightning); full: then the
    # run killed at step 8
    assert codes == {"full": -signal.SIGKILL, "resume": 0}, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    steps = {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
             for name in ("full", "killed", "resumed")}
    assert len(steps["full"]) == 30 and steps["killed"] == steps["full"][:8]  # killed at step 8
    assert [s[1] for s in steps["resumed"]] == list(range(6, 30))
    assert steps["resumed"] == steps["full"][6:]
    assert steps["full"][:10] != steps["full"][10:20]  # each epoch reshuffles


@pytest.fixture(scope="module")
def ddp_killed_runs(tmp_path_factory):
    """Both strategies' runs for the test below: per strategy, three launches (uninterrupted; checkpointing and
    SIGKILLed; resumed), each in a session of its own (the kill takes its process group). The folder, and each
    launch's exit code and output's tail."""
    out = tmp_path_factory.mktemp("ddp")
    codes = {}
    for strategy in ("ddp", "ddp_spawn"):
        for phase in ("full", "killed", "resume"):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
            proc = subprocess.Popen([sys.executable, "frameworks_run.py", "lightning_ddp_resume", str(out), strategy,
                                     phase], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=HERE, start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                text, _ = proc.communicate()
            codes[strategy, phase] = (proc.returncode, text[-3000:])
    return out, codes


@pytest.mark.slow
@pytest.mark.timeout(6 * 300 + 60)  # the first case waits for ddp_killed_runs: six launches of at most 300 s
@pytest.mark.xdist_group("lightning_ddp_resume")  # the strategies share one fixture
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_ddp_resumes_every_rank_from_rank_zeros_checkpoint(strategy, ddp_killed_runs):
    """Issue 39: 2 CPU ranks (gloo), 2 workers each, a DistributedSampler injected by Lightning; a checkpoint every
    6 steps, the whole job SIGKILLed at step 8, a new job resumes from step 6 (mid-epoch). Lightning saves rank 0's
    loader state and loads it on every rank: each rank goes on with its own remaining steps of every epoch, the
    uninterrupted run's, down to the random draws in ``__getitem__`` (``seed_per_sample=True``)."""
    out, codes = ddp_killed_runs
    for phase, want in (("full", 0), ("killed", -signal.SIGKILL), ("resume", 0)):
        code, text = codes[strategy, phase]
        assert code == want, f"{phase}: exit {code}: {text}"
    steps = {(phase, rank): [json.loads(line) for line in (out / f"{strategy}-{phase}-{rank}.jsonl").read_text()
                             .splitlines()] for phase in ("full", "killed", "resume") for rank in (0, 1)}
    for rank in (0, 1):
        full = steps["full", rank]
        assert len(full) == 15 and steps["killed", rank][:8] == full[:8]
        assert [s[1] for s in steps["resume", rank]] == list(range(6, 15))
        assert steps["resume", rank] == full[6:], rank
    for epoch in range(3):  # each rank its own half of every epoch
        shards = [{i for s in steps["full", rank] if s[0] == epoch for i in s[2]} for rank in (0, 1)]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(40))


@pytest.mark.slow
@LAUNCH_LIMIT
def test_lightning_ddp_spawn_with_the_import_inside_the_hook(tmp_path):
    """bridgeflow first imported inside train_dataloader(): Lightning re-creates the loader with its
    DistributedSampler (torch's __init__ is called by keyword, so the recorded call takes sampler=)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "frameworks_late_import.py", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=LAUNCH_S, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("late-*.json"))]
    assert len(ranks) == 2
    for rec in ranks:
        assert rec["class"] == "bridgeflow.adapters.torch._loader.DataLoader"
        assert rec["sampler"] == "DistributedSampler"
        assert rec["start_method"] == "spawn"  # its worker started as the rank was, importing Lightning again
    for epoch in range(2):
        shards = [set(rec["ids"][epoch]) for rec in ranks]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(22))


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_S + 60)  # two launches, one after the other
def test_accelerate_resumes_every_rank_with_bridgeflows_workers(tmp_path):
    need("accelerate")  # tests/frameworks_run.py runs it
    """The documented route (loader not prepared, a DistributedSampler, AllRanksState registered for
    checkpointing): save_state() after step 4, every rank SIGKILLed at step 6, load_state() in new
    processes; each rank's remaining steps over 2 epochs (sample ids and a draw from its global RNG, which
    Accelerate restores) equal the uninterrupted run's."""
    for phase, ok in (("full+killed", False), ("resume", True)):  # full, then killed, in the same processes
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "frameworks_run.py",
                               "accelerate_resume", str(tmp_path), phase],
                              env=env, capture_output=True, text=True, timeout=LAUNCH_S, cwd=HERE)
        assert (proc.returncode == 0) == ok, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = {(phase, rank): [json.loads(line) for line in (tmp_path / f"{phase}-{rank}.jsonl").read_text().splitlines()]
             for phase in ("full", "killed", "resume") for rank in (0, 1)}
    for rank in (0, 1):
        full = steps["full", rank]
        assert len(full) == 14 and steps["killed", rank] == full[:6]
        assert steps["resume", rank] == full[4:]
    assert steps["full", 0][0][1] != steps["full", 1][0][1]  # each rank its own shard


def test_all_ranks_state_refuses_another_world_size(leak_check):
    from bridgeflow.adapters.torch import AllRanksState, ResumeStateError

    loader = DataLoader(Ids(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    it = iter(loader)
    next(it)
    state = AllRanksState(loader).state_dict()
    assert state["world_size"] == 1 and state["ranks"][0]["yielded"] == 1
    again = DataLoader(Ids(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
    AllRanksState(again).load_state_dict(state)
    assert [b[1].tolist() for b in again] == [b[1].tolist() for b in it]
    with pytest.raises(ResumeStateError, match="saved with world size 2, this job has world size 1"):
        AllRanksState(again).load_state_dict({**state, "world_size": 2, "ranks": state["ranks"] * 2})
    loader.close()
