"""A training loop over augmented images, for tests/test_torch_sample_seeds.py: killed and resumed.

``python tests/torch_augment_loop.py OUT PHASE WORKERS``: ``full`` trains 3 epochs uninterrupted; ``killed``
trains the same, saving model, optimizer and loader every 5 steps to ``OUT/ckpt.pt`` (written to a temporary
file, then renamed), and SIGKILLs itself at step 12; ``resume`` loads the checkpoint in a new process (other
global generators: nothing else is restored) and trains to the end. Each step appends to ``OUT/<PHASE>.jsonl``
the step, a digest of the batch's bytes and the weights after the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.utils.data as tud

from bridgeflow import imgaug
from bridgeflow.adapters.torch import DataLoader


class Images(tud.Dataset):
    """30 images of 12x12x3, cropped, flipped, brightened and noised at random."""

    augs = imgaug.AugmentorList([imgaug.RandomCrop(8), imgaug.Flip(horiz=True), imgaug.Brightness(40)])

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        img = (np.arange(12 * 12 * 3).reshape(12, 12, 3) * (i + 1) % 251).astype(np.uint8)
        out = torch.from_numpy(self.augs.augment(img).astype(np.float32) / 255).permute(2, 0, 1)
        noise = torch.randn(out.shape) * 0.1 + float(np.random.uniform(-0.1, 0.1)) + random.uniform(-0.1, 0.1)
        return out + noise, i % 3


def main(out: str, phase: str, workers: str) -> None:
    torch.manual_seed(0 if phase != "resume" else 99)  # the resumed process starts from other generators
    np.random.seed(0 if phase != "resume" else 99)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 3))
    if phase == "resume":
        torch.manual_seed(0)  # the same initial weights (overwritten by the checkpoint anyway)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Images(), batch_size=4, shuffle=True, num_workers=int(workers), seed_per_sample=True)
    ckpt = os.path.join(out, "ckpt.pt")
    step, epoch = 0, 0
    if phase == "resume":
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        loader.load_state_dict(saved["loader"])
        step, epoch = saved["step"], saved["epoch"]
    with open(os.path.join(out, f"{phase}.jsonl"), "a") as log:
        while epoch < 3:
            for x, y in loader:
                if phase == "killed" and step == 12:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
                weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
                log.write(json.dumps({"step": step, "batch": digest, "weights": weights.hexdigest()[:16]}) + "\n")
                log.flush()
                step += 1
                if phase == "killed" and step % 5 == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict(),
                                "step": step, "epoch": epoch}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
            epoch += 1
    loader.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
