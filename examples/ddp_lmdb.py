"""Two-rank DistributedDataParallel training on CPU (gloo), both ranks reading one LMDB file.

Each rank opens the same file with ``shard="auto"``: rank and world size come from
``torch.distributed``, and the rank reads only its contiguous part of every epoch's shuffled order
(the same order on both ranks: same seed, and ``set_epoch`` before each epoch). Every rank gets the
same number of batches, so DDP's collective calls never wait for a rank that ran out. The script checks
that the ranks' samples are disjoint and together the whole dataset, epoch after epoch.

Run: python examples/ddp_lmdb.py [--world 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bridgeflow as bf

log = logging.getLogger("ddp_lmdb")

SAMPLES, BATCH, EPOCHS = 1000, 25, 3


def write_dataset(path: str) -> None:
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(SAMPLES, 16)).astype(np.float32)
    ys = (xs[:, :4].sum(1) > 0).astype(np.int64)
    bf.LMDBSerializer.save(bf.DataFromList([[i, xs[i], ys[i]] for i in range(SAMPLES)], shuffle=False), path,
                           progress=False)


def rank_main(rank: int, world: int, path: str, init_file: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flow = bf.BatchData(bf.LMDBSerializer.load(path, shuffle=True, seed=0, shard="auto"), BATCH)
    try:
        for epoch in range(EPOCHS):
            flow.set_epoch(epoch)  # every rank: the same new order, this rank's part of it
            seen, loss = [], torch.tensor(0.0)
            for ids, x, y in flow:
                loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
                optimizer.zero_grad()
                loss.backward()  # gradients are averaged across the ranks here
                optimizer.step()
                seen.extend(ids.tolist())
            everyone: list = [None] * world
            dist.all_gather_object(everyone, seen)
            counts = [len(s) for s in everyone]
            union = set().union(*map(set, everyone))
            assert len(set(counts)) == 1, f"ranks read different numbers of samples: {counts}"
            assert len(union) == sum(counts) == SAMPLES, "the ranks' parts overlap or miss samples"
            if rank == 0:
                log.info("epoch %d: %d ranks x %d batches, disjoint parts covering all %d samples, loss %.3f",
                         epoch, world, counts[0] // BATCH, SAMPLES, loss.item())
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        flow.close()
        del model, optimizer  # DDP holds the process group: let go of it before the group is destroyed
        dist.destroy_process_group()
    # torch 2.13's gloo backend sometimes aborts the process while the interpreter shuts down after a clean
    # destroy_process_group() ("terminate called without an active exception", SIGABRT: about 1 run in 10
    # on a busy 2-core machine, with or without bridgeflow in the script). Everything is closed and written
    # by now, so the rank ends here instead of running the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train.lmdb")
        write_dataset(path)
        mp.spawn(rank_main, args=(args.world, path, os.path.join(d, "init")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
