"""Saving when the disk says no: a full disk (ENOSPC), the file-size limit (EFBIG, ``ulimit -f``) and a
read-only folder (EROFS), for every format, on real file systems (a small tmpfs, in a mount namespace of
its own, so nothing outside the test sees it).

Each save raises DatasetWriteError naming the target (not the hidden temporary file) and the real cause,
leaves nothing at the target's path (an existing dataset there is kept, whole) and never crashes the
process (libhdf5 crashed it on exit after a failed write). The checks run in a child process.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = r"""
import errno, json, os, resource, sys
import numpy as np
from bridgeflow.serialize import HDF5Serializer, LMDBSerializer, NumpySerializer, load_dataset
from bridgeflow.serialize import DatasetWriteError

folder, cause, existing = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if cause == "EROFS":
    os.system(f"mount -o remount,ro {folder}")  # after the existing datasets were written (see below)
if cause == "EFBIG":
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
big = [[np.full(100_000, i % 200, np.uint8), i] for i in range(60)]  # 6 MB: more than the disk or the limit
out = {}
for name, save in (("d.lmdb", LMDBSerializer.save), ("d.h5", HDF5Serializer.save), ("d.npz", NumpySerializer.save)):
    target = os.path.join(folder, name)
    try:
        save(big, target, progress=False, overwrite=existing)
        out[name] = {"error": None}
    except DatasetWriteError as exc:
        out[name] = {"error": type(exc).__name__, "errno": exc.errno, "message": str(exc), "filename": exc.filename}
    except BaseException as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc)}
    if existing:
        with load_dataset(target, shuffle=False) as ds:
            ds.reset_state()
            out[name]["kept"] = [int(dp[0]) for dp in ds]
out["left"] = sorted(os.listdir(folder))
print(json.dumps(out))
"""

OLD = r"""
import sys
from bridgeflow.serialize import HDF5Serializer, LMDBSerializer, NumpySerializer
for name, save in (("d.lmdb", LMDBSerializer.save), ("d.h5", HDF5Serializer.save), ("d.npz", NumpySerializer.save)):
    save([[i] for i in range(3)], sys.argv[1] + "/" + name, progress=False)
"""


def _run(tmp_path, cause: str, existing: bool) -> dict:
    folder = tmp_path / "disk"
    folder.mkdir()
    py = sys.executable
    setup = f"{py} -c {_quote(OLD)} {folder} && " if existing else ""
    check = f"{setup}{py} -c {_quote(SCRIPT)} {folder} {cause} {int(existing)}"
    if cause == "EFBIG":
        if existing:
            subprocess.run([py, "-c", OLD, str(folder)], check=True)
        cmd = [py, "-c", SCRIPT, str(folder), cause, str(int(existing))]
    else:  # a 2 MiB tmpfs (read-only once the existing datasets are in), in a mount namespace of its own
        if shutil.which("unshare") is None:
            pytest.skip("needs util-linux's unshare to mount a small file system")
        ns = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
        cmd = [*ns, "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {folder} && {check}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode and "mount" in proc.stderr and "Operation not permitted" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here (no root, no user namespaces): {proc.stderr.strip()}")
    assert proc.returncode == 0, f"the writer died (code {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("cause", ["ENOSPC", "EFBIG", "EROFS"])
def test_a_failed_save_names_the_target_and_the_cause_and_leaves_nothing(tmp_path, cause, existing):
    out = _run(tmp_path, cause, existing)
    folder = tmp_path / "disk"
    for name in ("d.lmdb", "d.h5", "d.npz"):
        got = out[name]
        assert got["error"] == "DatasetWriteError", got
        assert got["errno"] == getattr(errno, cause), got
        assert got["filename"] == str(folder / name), got
        assert got["message"].startswith(f"cannot write {folder / name}: {os.strerror(getattr(errno, cause))}"), got
        assert f"({cause};" in got["message"] and ".tmp-" not in got["message"], got  # never the hidden name
        if existing:
            assert got["kept"] == [0, 1, 2], got  # the dataset that was there is whole
    assert out["left"] == (["d.h5", "d.lmdb", "d.npz"] if existing else []), out  # no temporary file


def test_the_limit_is_named_in_the_message(tmp_path):
    out = _run(tmp_path, "EFBIG", existing=False)
    assert "ulimit -f: 1048576 bytes" in out["d.lmdb"]["message"], out
