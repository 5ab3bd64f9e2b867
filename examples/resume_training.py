"""Kill a training run, restart it from its checkpoint, and get the run that was never interrupted.

A torch training loop reads a bridgeflow pipeline (shuffled list -> map in 2 processes -> batches) and
saves ``{"model", "optimizer", "epoch", "data": flow.state_dict()}`` after every step. This script runs
the loop three times, each in a subprocess:

1. uninterrupted, for reference;
2. killed with SIGKILL (as a pre-empted job is) right after the checkpoint of step K;
3. restarted from that checkpoint.

It checks that runs 2 and 3 together trained on exactly the samples of run 1, in the same order, and
ended with bit-identical weights.

Run: python examples/resume_training.py [--kill-after 11]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

log = logging.getLogger("resume_training")

EPOCHS, BATCH, SAMPLES = 2, 32, 400


def augment(dp):
    """Runs in the workers: a deterministic function of the sample (what an exact resume needs)."""
    i, x, y = dp
    return [i, (x * (1 + (i % 3) * 0.1)).astype(np.float32), y]


def make_flow():
    import bridgeflow as bf

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(SAMPLES, 8)).astype(np.float32)
    ys = (xs.sum(1) > 0).astype(np.int64)
    samples = bf.DataFromList([[i, xs[i], ys[i]] for i in range(SAMPLES)], shuffle=True, seed=1)
    return bf.BatchData(bf.MultiProcessMapData(samples, 2, augment, buffer_size=64), BATCH)


def train(checkpoint: str, ids_out: str, pause_after: int) -> None:
    """The training job: resumes from ``checkpoint`` if there is one, saves it after every step (and, for
    this demonstration, waits to be killed after ``pause_after`` steps)."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    flow = make_flow()
    start_epoch = 0
    if os.path.exists(checkpoint):
        ckpt = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        flow.load_state_dict(ckpt["data"])  # the first iteration continues the saved epoch
        start_epoch = ckpt["epoch"]
    with flow, open(ids_out, "a") as out:
        for epoch in range(start_epoch, EPOCHS):
            for ids, x, y in flow:
                loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                out.write(json.dumps(ids.tolist()) + "\n")
                out.flush()
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                         "data": flow.state_dict()}
                torch.save(state, checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)  # never a half-written checkpoint
                print("saved", flush=True)
                pause_after -= 1
                if pause_after == 0:
                    time.sleep(600)  # the parent kills us now
    torch.save(model.state_dict(), ids_out + ".weights")
    print("done", flush=True)


def run(checkpoint: str, ids_out: str, kill_after: int | None = None) -> list:
    """Run the job in a subprocess; with ``kill_after``, SIGKILL it (and its workers) after that checkpoint."""
    proc = subprocess.Popen([sys.executable, __file__, "--train", checkpoint, ids_out, str(kill_after or -1)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    saved = 0
    try:
        for line in proc.stdout:
            saved += line.strip() == "saved"
            if kill_after is not None and saved == kill_after:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if kill_after is None and proc.returncode != 0:
        raise RuntimeError(f"the training job failed with exit code {proc.returncode}")
    with open(ids_out) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-after", type=int, default=11, help="checkpoints written before the kill")
    parser.add_argument("--train", nargs=3, metavar=("CHECKPOINT", "IDS", "PAUSE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args.train[0], args.train[1], int(args.train[2]))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    with tempfile.TemporaryDirectory() as d:
        whole = run(os.path.join(d, "ref.pt"), os.path.join(d, "ref.jsonl"))
        first = run(os.path.join(d, "job.pt"), os.path.join(d, "job.jsonl"), kill_after=args.kill_after)
        log.info("killed after %d steps (SIGKILL to the job and its workers)", len(first))
        both = run(os.path.join(d, "job.pt"), os.path.join(d, "job.jsonl"))
        assert len(first) == args.kill_after and both[:len(first)] == first
        assert both == whole, "the interrupted run did not see the same samples"
        ref, job = (torch.load(os.path.join(d, f"{n}.jsonl.weights")) for n in ("ref", "job"))
        assert all(torch.equal(ref[k], job[k]) for k in ref), "the weights differ"
        log.info("%d steps, %d samples: the killed-and-resumed run saw the same batches in the same order and "
                 "ended with the same weights as the uninterrupted one", len(whole), sum(map(len, whole)))


if __name__ == "__main__":
    main()
