"""The serialize / inspect / bench scripts on a small image folder and real dataset files."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from bridgeflow._cli_serialize import bench_file, detect_format, main, register
from bridgeflow._sources import DataFromList
from bridgeflow.serialize import CorruptDataError
from bridgeflow.serialize._hdf5_format import HDF5Data
from bridgeflow.serialize._images import ImageFolderData
from bridgeflow.serialize._lmdb_format import LMDBDataset
from bridgeflow.serialize._npz_format import NumpyData
from bridgeflow.testing import assert_same_datapoints, check_dataflow


@pytest.fixture
def image_folder(tmp_path):
    """root/{cat,dog,zebra}/*: PNGs (lossless, so decoding is checkable), one grayscale, one JPEG."""
    root = tmp_path / "images"
    rng = np.random.default_rng(0)
    arrays = {}
    for name in ["dog", "cat", "zebra"]:
        (root / name).mkdir(parents=True)
        for k in range(3):
            arr = rng.integers(0, 255, (8 + k, 10, 3), dtype=np.uint8)
            path = root / name / f"img{k}.png"
            Image.fromarray(arr).save(path)
            arrays[str(path)] = arr
    gray = rng.integers(0, 255, (6, 5), dtype=np.uint8)
    Image.fromarray(gray).save(root / "cat" / "gray.png")
    arrays[str(root / "cat" / "gray.png")] = gray
    Image.fromarray(arrays[str(root / "dog" / "img0.png")]).save(root / "dog" / "photo.jpg", quality=90)
    (root / "dog" / "notes.txt").write_text("not an image")
    return root, arrays


def run(argv, capsys=None):
    code = main([str(a) for a in argv])
    return code, (capsys.readouterr() if capsys else None)


def test_image_folder_flow(image_folder):
    root, arrays = image_folder
    df = ImageFolderData(root, decode=False)
    assert df.classes == ["cat", "dog", "zebra"] and len(df) == 11
    out = check_dataflow(df, deterministic=True)
    for (path, label), (raw, got_label) in zip(df.files, out):  # the file's bytes, as cv2.imdecode takes them
        assert raw.dtype == np.uint8 and raw.ndim == 1 and raw.tobytes() == open(path, "rb").read()
        assert got_label == label
    assert [lbl for _, lbl in df.files] == [0] * 4 + [1] * 4 + [2] * 3
    decoded = ImageFolderData(root, decode=True)
    for i, (path, _) in enumerate(decoded.files):
        img = decoded[i][0]
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3  # grayscale too: RGB
        if path.endswith(".png"):
            ref = arrays[path] if arrays[path].ndim == 3 else np.stack([arrays[path]] * 3, axis=-1)
            np.testing.assert_array_equal(img, ref)
    gray = ImageFolderData(root, decode=True, mode=None)[decoded.files.index([str(root / "cat" / "gray.png"), 0])]
    np.testing.assert_array_equal(gray[0], arrays[str(root / "cat" / "gray.png")])


def test_serialize_image_folder_to_lmdb_with_progress(image_folder, tmp_path, capsys):
    root, _ = image_folder
    out = tmp_path / "imgs.lmdb"
    code, cap = run(["serialize", root, out], capsys)
    assert code == 0, cap.err
    assert "wrote 11 datapoints" in cap.out
    assert "dp/s" in cap.err and "11/11" in cap.err  # tqdm: count and rate on stderr
    ref = list(ImageFolderData(root))
    with LMDBDataset(out, shuffle=False) as ds:
        assert_same_datapoints(ref, list(ds))
    assert detect_format(str(out)) == "lmdb"


@pytest.mark.parametrize("ext", ["lmdb", "h5", "npz"])
def test_encoded_images_decode_with_cv2_as_tensorpack_code_does(image_folder, tmp_path, ext):
    import cv2

    from bridgeflow.serialize import load_dataset

    root, _ = image_folder
    out = tmp_path / f"imgs.{ext}"
    assert run(["serialize", root, out, "--quiet"])[0] == 0
    with load_dataset(out) as ds:
        ds.reset_state()
        got = list(ds)
    files = ImageFolderData(root).files
    assert len(got) == len(files) == 11
    for (path, label), (img, got_label) in zip(files, got):
        decoded = cv2.imdecode(img, cv2.IMREAD_COLOR)  # tensorpack's idiom, as it is
        np.testing.assert_array_equal(decoded, cv2.imread(path, cv2.IMREAD_COLOR))
        assert got_label == label


def test_files_written_with_bytes_images_still_load_as_bytes(image_folder, tmp_path):
    import cv2

    from bridgeflow.serialize._lmdb_format import LMDBSerializer

    root, _ = image_folder
    old = tmp_path / "old.lmdb"  # as bridgeflow wrote image folders before: bytes
    LMDBSerializer.save(ImageFolderData(root, encoded="bytes"), old, progress=False)
    new = tmp_path / "new.lmdb"
    assert run(["serialize", root, new, "--quiet"])[0] == 0
    with LMDBDataset(old, shuffle=False) as a, LMDBDataset(new, shuffle=False) as b:
        for (raw, la), (arr, lb) in zip(a, b):
            assert isinstance(raw, bytes) and isinstance(arr, np.ndarray) and la == lb
            assert raw == arr.tobytes()
            # the one-line decode of docs/serialization.md reads both
            np.testing.assert_array_equal(cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR),
                                          cv2.imdecode(np.frombuffer(arr, np.uint8), cv2.IMREAD_COLOR))
    with pytest.raises(ValueError, match="encoded"):
        ImageFolderData(root, encoded="str")


def test_decode_to_hdf5_and_workers_keep_order(image_folder, tmp_path, leak_check):
    root, arrays = image_folder
    serial, parallel = tmp_path / "a.h5", tmp_path / "b.h5"
    assert run(["serialize", root, serial, "--decode", "--quiet"])[0] == 0
    assert run(["serialize", root, parallel, "--decode", "--quiet", "--workers", "2"])[0] == 0
    a, b = HDF5Data(serial, shuffle=False), HDF5Data(parallel, shuffle=False)
    da, db = check_dataflow(a, deterministic=True), check_dataflow(b, deterministic=True)
    assert_same_datapoints(da, db)
    files = ImageFolderData(root).files
    for (path, label), (img, got) in zip(files, da):
        assert got == label
        if path.endswith(".png") and arrays[path].ndim == 3:
            np.testing.assert_array_equal(img, arrays[path])


def test_module_function_source_and_conversions(tmp_path, capsys):
    mod = tmp_path / "make_flow.py"
    mod.write_text(textwrap.dedent("""
        import numpy as np
        from bridgeflow import DataFromList, MapData

        def expand(dp):
            return [np.full((2, 3), dp[0], np.int32), dp[0], "s%d" % dp[0]]

        def flow():
            return MapData(DataFromList([[i] for i in range(20)], shuffle=False), expand)

        def no_map():
            return DataFromList([[1]])
    """))
    src = f"{mod}:flow"
    assert run(["serialize", src, tmp_path / "a.npz", "--quiet"])[0] == 0
    assert run(["serialize", tmp_path / "a.npz", tmp_path / "b.lmdb", "--quiet"])[0] == 0
    assert run(["serialize", tmp_path / "b.lmdb", tmp_path / "c.h5", "--quiet"])[0] == 0
    assert run(["serialize", tmp_path / "c.h5", tmp_path / "d.bin", "--format", "npz", "--quiet",
                "--limit", "5"])[0] == 0
    capsys.readouterr()
    ref = [[np.full((2, 3), i, np.int32), i, f"s{i}"] for i in range(20)]
    for path, cls in (("a.npz", NumpyData), ("b.lmdb", LMDBDataset), ("c.h5", HDF5Data)):
        with cls(tmp_path / path, shuffle=False) as ds:
            assert_same_datapoints(ref, list(ds))
    assert_same_datapoints(ref[:5], list(NumpyData(tmp_path / "d.bin", shuffle=False)))
    assert run(["serialize", src, tmp_path / "w.lmdb", "--workers", "2", "--quiet", "--checksum"])[0] == 0
    assert LMDBDataset(tmp_path / "w.lmdb").meta["checksum"] == "crc32"
    with LMDBDataset(tmp_path / "w.lmdb", shuffle=False) as ds:
        assert_same_datapoints(ref, list(ds))  # the map stage ran in 2 processes, order kept
    code, cap = run(["serialize", f"{mod}:no_map", tmp_path / "v.lmdb", "--workers", "2"], capsys)
    assert code == 1 and "MapData" in cap.err


def test_bench_of_a_file_in_batches(tmp_path, capsys):
    from bridgeflow import DataFromList
    from bridgeflow.serialize import LMDBSerializer

    path = tmp_path / "x.lmdb"
    LMDBSerializer.save(DataFromList([[np.zeros(3, np.float32), i] for i in range(30)], shuffle=False), path,
                        progress=False)
    args = argparse.Namespace(size=20, warmup=5, quiet=True, batch=8, seconds=0)
    assert bench_file(str(path), args) == 0
    out = capsys.readouterr().out
    # --size and --warmup count datapoints: 20 are 3 batches of 8 (24), 5 one batch
    assert out.count("timing rounds of 24 datapoints in batches of 8 after 8 untimed") == 2, out
    assert len(re.findall(r"^3 batches in [\d.]+s: [\d.]+ batches/s \([\d.]+ datapoints/s at 8 a batch\)$", out,
                          re.M)) == 2, out


def test_inspect_and_bench(tmp_path, capsys):
    from bridgeflow import DataFromList
    from bridgeflow.serialize import LMDBSerializer

    path = tmp_path / "x.lmdb"
    LMDBSerializer.save(DataFromList([[np.zeros((4, 5), np.float32), i] for i in range(30)], shuffle=False),
                        path, progress=False)
    code, cap = run(["inspect", path, "--num", "1"], capsys)
    assert code == 0
    assert "count:   30" in cap.out and "codec:   bridgeflow" in cap.out
    assert "checksum: crc32 per value, checked on every read" in cap.out
    assert "shape=(4, 5)" in cap.out and "float32" in cap.out and "datapoint 1" not in cap.out
    args = argparse.Namespace(size=50, warmup=5, quiet=True, batch=0, seconds=0.2)
    assert bench_file(str(path), args) == 0
    out = capsys.readouterr().out
    assert "sequential read" in out and "shuffled read" in out and out.count("datapoints/s") == 2
    # 30 datapoints timed 50 at a time after 5 untimed: it says it read the file more than once
    assert out.count("timing rounds of 50 datapoints for at least 0.2 s after 5 untimed; a round reads the file "
                     "1.7 times (pass --size") == 2
    # rounds of 50 again until 0.2 s have passed: a count of whole rounds, timed over at least that long
    for line in (ln for ln in out.splitlines() if ln.endswith("datapoints/s")):
        n, seconds = line.split(" datapoints in ")[0], line.split(" datapoints in ")[1].split("s:")[0]
        assert int(n) % 50 == 0 and int(n) > 50 and float(seconds) >= 0.2, line


def test_errors_name_the_problem(tmp_path, capsys):
    (tmp_path / "exists.lmdb").write_bytes(b"x")
    folder = tmp_path / "imgs" / "a"
    folder.mkdir(parents=True)
    Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(folder / "z.png")
    code, cap = run(["serialize", tmp_path / "imgs", tmp_path / "exists.lmdb", "--quiet"], capsys)
    assert code == 1 and "exists.lmdb already exists; pass --overwrite" in cap.err and "overwrite=True" not in cap.err
    code, cap = run(["serialize", tmp_path / "imgs", tmp_path / "out.weird", "--quiet"], capsys)
    assert code == 1 and "--format" in cap.err
    code, cap = run(["serialize", tmp_path / "nothing_here", tmp_path / "o.lmdb"], capsys)
    assert code == 1 and "nothing_here" in cap.err
    code, cap = run(["inspect", tmp_path / "exists.lmdb"], capsys)
    assert code == 1 and "exists.lmdb" in cap.err
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    code, cap = run(["serialize", tmp_path / "imgs", tmp_path / "o.h5", "--decode", "--quiet"], capsys)
    assert code == 1 and "broken.png" in cap.err
    assert not (tmp_path / "o.h5").exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    with pytest.raises(CorruptDataError):
        ImageFolderData(tmp_path / "imgs", decode=True)[0]


def test_register_adds_commands_to_a_parser():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serialize", "a:b", "out.lmdb", "--workers", "3", "--decode"])
    assert args.workers == 3 and args.decode and callable(args.func)
    assert parser.parse_args(["inspect", "x.h5"]).num == 2


def test_python_dash_m_runs_the_script(image_folder, tmp_path):
    root, _ = image_folder
    out = tmp_path / "x.npz"
    proc = subprocess.run([sys.executable, "-m", "bridgeflow._cli_serialize", "serialize", str(root), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(NumpyData(out)) == 11 and "ETA" not in proc.stdout


def test_load_recognises_formats_by_content(tmp_path):
    from bridgeflow import DataFromList
    from bridgeflow.serialize import HDF5Serializer, LMDBSerializer, NumpySerializer, load

    dps = [[np.arange(3) + i, i] for i in range(4)]
    for saver, name, cls in ((LMDBSerializer, "a.data", LMDBDataset), (HDF5Serializer, "b.data", HDF5Data),
                             (NumpySerializer, "c.data", NumpyData)):
        saver.save(DataFromList(dps, shuffle=False), tmp_path / name, progress=False)
        ds = load(tmp_path / name)  # no telling extension: the first bytes decide
        assert isinstance(ds, cls)
        assert_same_datapoints(dps, check_dataflow(ds, deterministic=True))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CorruptDataError, match="notes.txt"):
        load(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="format"):
        load(tmp_path / "a.data", format="csv")


def test_format_is_the_one_keyword_and_fmt_still_works_with_a_warning(tmp_path):
    from bridgeflow.serialize import LMDBSerializer, load_dataset

    path = tmp_path / "a.data"
    LMDBSerializer.save(DataFromList([[1], [2]], shuffle=False), path, progress=False)
    assert isinstance(load_dataset(path, format="lmdb"), LMDBDataset)
    with pytest.warns(DeprecationWarning, match=r"fmt=.*deprecated.*format="):
        assert isinstance(load_dataset(path, fmt="lmdb"), LMDBDataset)
    with pytest.raises(CorruptDataError, match="written by bridgeflow's LMDBSerializer, not tensorpack's"):
        load_dataset(path, format="tensorpack")  # tensorpack's LMDB layout, asked for by name
    with pytest.raises(CorruptDataError, match="a.data is an LMDB file, not an HDF5 one: load it with "
                                               r"LMDBSerializer.load\(path\)"):
        load_dataset(path, format="hdf5")


def test_each_loader_names_the_loader_of_a_file_of_another_format(tmp_path):
    from bridgeflow.serialize import HDF5Serializer, LMDBData, LMDBSerializer, NumpySerializer

    files = {"lmdb": tmp_path / "x.lmdb", "hdf5": tmp_path / "x.h5", "npz": tmp_path / "x.npz"}
    savers = {"lmdb": LMDBSerializer, "hdf5": HDF5Serializer, "npz": NumpySerializer}
    loaders = {"lmdb": "LMDBSerializer", "hdf5": "HDF5Serializer", "npz": "NumpySerializer"}
    for fmt, path in files.items():
        savers[fmt].save(DataFromList([[1]]), path, progress=False)
    for fmt, load in [*((f, s.load) for f, s in savers.items()), ("lmdb", LMDBData)]:
        for other, path in files.items():
            if other == fmt:
                continue
            with pytest.raises(CorruptDataError, match=rf"{path.name} is an? .* file, not an? .* one: load it "
                                                       rf"with {loaders[other]}\.load\(path\)") as info:
                load(path)
            assert "damaged" not in str(info.value)  # it reads as a wrong loader, not as corruption


MAPPED_FLOW = """
from bridgeflow import DataFromList, MapData

def parse(dp):
    if dp[0] == 7:
        return {"x": 1}["missing"]
    return [dp[0] * 2]

def flow():
    return MapData(DataFromList([[i] for i in range(20)], shuffle=False), parse)
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_errors_keep_type_and_place_with_workers_and_name_the_datapoint(tmp_path, workers):
    (tmp_path / "mapped.py").write_text(MAPPED_FLOW)
    proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", "serialize", "mapped.py:flow", "o.lmdb", "--quiet",
                           "--workers", workers], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert "error: KeyError: 'missing' (in mapped.py:6, parse, at datapoint 7 of the source)" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "o.lmdb").exists()


def test_images_that_do_not_decode_are_refused_by_default_or_skipped_each_named(image_folder, tmp_path, capsys):
    root, _ = image_folder
    data = (root / "dog" / "photo.jpg").read_bytes()
    (root / "dog" / "photo.jpg").write_bytes(data[:len(data) // 2])  # a truncated JPEG: starts like one
    bad = root / "dog" / "photo.jpg"
    for workers in ("0", "2"):
        code, cap = run(["serialize", root, tmp_path / f"x{workers}.lmdb", "--quiet", "--workers", workers], capsys)
        assert code == 1 and f"{bad}: cannot decode image" in cap.err, cap.err
        assert "(at datapoint 7 of the source)" in cap.err, cap.err
        assert not (tmp_path / f"x{workers}.lmdb").exists()
        proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", "serialize", str(root),
                               str(tmp_path / f"s{workers}.lmdb"), "--quiet", "--workers", workers, "--bad-images",
                               "skip"], capture_output=True, text=True, timeout=120)  # the real stderr
        assert proc.returncode == 0, proc.stderr
        assert "wrote 10 datapoints" in proc.stdout and "skipped 1 images that do not decode (named above)" in \
            proc.stdout
        # named at the end by the command, whichever process read it (not by a worker's log line), without -v
        assert proc.stderr.count(f"skipped (does not decode): {bad}") == 1, proc.stderr
        assert proc.stderr.count(str(bad)) == 2, proc.stderr  # and once as it happened
        assert f"skipped (not an image): {root / 'dog' / 'notes.txt'}" in proc.stderr, proc.stderr
        assert len(LMDBDataset(tmp_path / f"s{workers}.lmdb")) == 10
    code, cap = run(["serialize", root, tmp_path / "k.lmdb", "--quiet", "--bad-images", "keep"], capsys)
    assert code == 0 and "wrote 11 datapoints" in cap.out  # stored unchecked, as before
    with pytest.raises(CorruptDataError, match="photo.jpg: cannot decode"):
        ImageFolderData(root, bad_images="error")[ImageFolderData(root).files.index([str(bad), 1])]


SLOW_MAP = textwrap.dedent("""
    import os
    import time
    import numpy as np
    from bridgeflow import DataFromList, MapData

    def slow(dp):
        open(os.path.join(os.path.dirname(__file__), "started"), "w").close()  # a worker maps
        time.sleep(0.05)
        return [np.zeros(1000, np.uint8), dp[0]]

    def flow():
        return MapData(DataFromList([[i] for i in range(100_000)], shuffle=False), slow)
""")


@pytest.mark.parametrize("delay", [0.01, 0.05, 0.15])
def test_a_double_ctrl_c_with_workers_leaves_no_shared_memory(tmp_path, delay):
    """Two Ctrl-C to ``bridgeflow serialize --workers 2``: the second came while the first stopped the pool's
    workers and left its 608-byte control segment in /dev/shm. Cleaning up now finishes first."""
    import signal
    import time

    from conftest import SHM_DIR, wait_for

    (tmp_path / "slow_map.py").write_text(SLOW_MAP)
    proc = subprocess.Popen([sys.executable, "-m", "bridgeflow.cli", "serialize", str(tmp_path / "slow_map.py") +
                             ":flow", str(tmp_path / "out.lmdb"), "--workers", "2", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not (tmp_path / "started").exists():
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # the terminal sends Ctrl-C to the whole group
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode in (130, -signal.SIGINT), err[-1000:]  # -2: the second came after the CLI's handler
    left = lambda: [n for n in os.listdir(SHM_DIR) if n.startswith(f"bf{proc.pid}_")]
    assert wait_for(lambda: not left()), left()  # orphaned workers sweep within a second or two when quiet
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.lmdb")]


SLOW_FLOW = textwrap.dedent("""
    import os
    import time
    import numpy as np
    from bridgeflow import DataFromGenerator

    def flow():
        def gen():
            open(os.path.join(os.path.dirname(__file__), "started"), "w").close()  # the save reads the flow
            for i in range(100_000):
                time.sleep(0.002)
                yield [np.zeros(5000, np.uint8) + i % 200, i]
        return DataFromGenerator(gen, size=100_000)
""")


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "npz"])
@pytest.mark.parametrize(("sig", "code", "said"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_or_sigterm_during_serialize_leaves_the_folder_as_it_was(tmp_path, fmt, sig, code, said):
    """SIGINT (Ctrl-C) or SIGTERM (timeout, Slurm, kill) to a real ``bridgeflow serialize`` mid-write:
    exit 130 / 143, no output, no temporary file."""
    import signal
    import time

    (tmp_path / "slow_flow.py").write_text(SLOW_FLOW)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("x")
    proc = subprocess.Popen([sys.executable, "-m", "bridgeflow.cli", "serialize", str(tmp_path / "slow_flow.py") +
                             ":flow", str(out_dir / f"data.{fmt}"), "--format", fmt],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait until the save reads the flow: a signal that comes while the child still imports (slow under
        # load; npz writes no file before its end) is Python's default, not the CLI's (rc -2 for SIGINT).
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not (tmp_path / "started").exists():
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-1000:]
    assert said in err and "Traceback" not in err
    assert os.listdir(out_dir) == ["keep.txt"]


STALE_HOLDER = """
import fcntl, os, sys, time
path = os.path.join(sys.argv[1], ".data.lmdb.tmp-%d-cafebabe" % os.getpid())
fd = os.open(path, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print(path, flush=True)
time.sleep(120)
"""


def test_a_rerun_removes_temporary_files_of_dead_writers_only(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = out_dir / f".data.lmdb.tmp-{dead}-deadbeef"  # a writer killed by SIGKILL left it
    stale.write_bytes(b"x" * 4096)
    (out_dir / f".data.lmdb.tmp-{dead}-deadbeef-lock").write_bytes(b"")
    other = out_dir / f".other.lmdb.tmp-{dead}-deadbeef"  # another target's: not this save's business
    other.write_bytes(b"x")
    live = subprocess.Popen([sys.executable, "-c", STALE_HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True)
    try:
        held = live.stdout.readline().strip()  # a live writer, holding its lock
        unlocked = out_dir / f".data.lmdb.tmp-{live.pid}-0badf00d"  # a live pid, no lock: kept too
        unlocked.write_bytes(b"")
        (tmp_path / "flows.py").write_text("def flow():\n    return [[1], [2]]\n")
        code = main(["serialize", str(tmp_path / "flows.py") + ":flow", str(out_dir / "data.lmdb"), "--quiet"])
        assert code == 0
        assert sorted(os.listdir(out_dir)) == sorted(["data.lmdb", os.path.basename(held), unlocked.name,
                                                      other.name])
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def split_folder(tmp_path):
    root = tmp_path / "photos"
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / split / name / "a.png")
    return root


def test_a_folder_of_splits_is_refused_naming_split(split_folder, tmp_path, capsys):
    code, cap = run(["serialize", split_folder, tmp_path / "x.lmdb", "--quiet"], capsys)
    assert code == 1 and "holds only train, val: dataset splits, not classes" in cap.err
    assert "--split train" in cap.err and os.path.join(str(split_folder), "train") in cap.err
    assert not (tmp_path / "x.lmdb").exists()
    code, cap = run(["serialize", split_folder, tmp_path / "x.lmdb", "--quiet", "--split", "train"], capsys)
    assert code == 0 and LMDBDataset(tmp_path / "x.lmdb").classes == ["cat", "dog"]
    assert len(ImageFolderData(split_folder, split="val")) == 2


@pytest.mark.parametrize("fmt", ["lmdb", "h5", "npz"])
def test_class_names_are_stored_in_the_file_and_shown_by_inspect(image_folder, tmp_path, capsys, fmt):
    root, _ = image_folder
    out = tmp_path / f"x.{fmt}"
    assert run(["serialize", root, out, "--quiet"], capsys)[0] == 0
    from bridgeflow.serialize import load_dataset

    with load_dataset(out) as ds:
        assert ds.classes == ["cat", "dog", "zebra"]
    code, cap = run(["inspect", out], capsys)
    assert code == 0 and "classes: 3 (0=cat, 1=dog, 2=zebra)" in cap.out
    converted = tmp_path / "converted.npz"  # a conversion keeps them
    assert run(["serialize", out, converted, "--quiet"], capsys)[0] == 0
    assert NumpyData(converted).classes == ["cat", "dog", "zebra"]


def test_non_image_files_are_skipped_with_a_count_or_refused(image_folder, tmp_path, capsys):
    root, _ = image_folder
    code, cap = run(["serialize", root, tmp_path / "x.lmdb", "--quiet"], capsys)
    assert code == 0 and "wrote 11 datapoints" in cap.out and "skipped 1 files that are not images" in cap.out
    assert f"skipped (not an image): {root / 'dog' / 'notes.txt'}" in cap.err, cap.err  # named, without -v
    code, cap = run(["serialize", root, tmp_path / "y.lmdb", "--quiet", "--non-images", "error"], capsys)
    assert code == 1 and "notes.txt is not an image file (by its extension)" in cap.err
    assert not (tmp_path / "y.lmdb").exists()


def test_a_file_named_like_an_image_holding_none_is_a_bad_image_like_a_truncated_one(image_folder, tmp_path, capsys):
    """A 7-byte .jpg used to be skipped as "not an image" while a truncated JPEG stopped the command: both are
    images that do not decode, refused by default, skipped and named with --bad-images skip."""
    root, _ = image_folder
    (root / "cat" / "fake.jpg").write_bytes(b"garbage")
    code, cap = run(["serialize", root, tmp_path / "x.lmdb", "--quiet"], capsys)
    assert code == 1 and f"{root / 'cat' / 'fake.jpg'}: cannot decode image" in cap.err, cap.err
    assert not (tmp_path / "x.lmdb").exists()
    code, cap = run(["serialize", root, tmp_path / "y.lmdb", "--quiet", "--bad-images", "skip"], capsys)
    assert code == 0 and "wrote 11 datapoints" in cap.out and "skipped 1 images that do not decode" in cap.out
    assert f"skipped (does not decode): {root / 'cat' / 'fake.jpg'}" in cap.err, cap.err
    code, cap = run(["serialize", root, tmp_path / "z.lmdb", "--quiet", "--bad-images", "keep"], capsys)
    assert code == 0 and "wrote 11 datapoints" in cap.out  # unchecked: only its first bytes are looked at
    assert f"skipped (not an image): {root / 'cat' / 'fake.jpg'}" in cap.err, cap.err


USER_CODE = """
import numpy as np
from bridgeflow import DataFromGenerator

def broken():
    return 1 / 0

def fails_midway():
    def gen():
        for i in range(10):
            if i == 5:
                raise RuntimeError("sensor 5 unreadable")
            yield [np.zeros(3), i]
    return DataFromGenerator(gen)
"""


@pytest.mark.parametrize(("function", "line"), [
    ("broken", r"ZeroDivisionError: division by zero \(in userflows.py:6, broken\)"),
    ("fails_midway", r"RuntimeError: sensor 5 unreadable \(in userflows.py:12, gen, at datapoint 5 of the source\)"),
])
def test_errors_in_user_code_are_one_line_unless_traceback(tmp_path, function, line):
    (tmp_path / "userflows.py").write_text(USER_CODE)
    argv = [sys.executable, "-m", "bridgeflow.cli", "serialize", f"userflows.py:{function}", "o.lmdb", "--quiet"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(line, lines[0]) and "--traceback" in lines[0], proc.stderr
    proc = subprocess.run([*argv, "--traceback"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert f"userflows.py\", line {6 if function == 'broken' else 12}" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["__pycache__", "userflows.py"] or \
        sorted(os.listdir(tmp_path)) == ["userflows.py"]


@pytest.mark.parametrize(("argv", "message"), [
    (["serialize", "bf_no_such_module:flow", "o.lmdb"], "No module named 'bf_no_such_module'"),
    (["serialize", "flows.py:nope", "o.lmdb"], "has no attribute 'nope'"),
    (["serialize", "flows.py:needs_arg", "o.lmdb"], "flows.py:needs_arg must be callable without arguments"),
    (["serialize", "flows.py:number", "o.lmdb"], "gave a int, not a DataFlow"),
    (["serialize", "no_such_folder", "o.lmdb"], "'no_such_folder' is neither an existing folder/file"),
    (["serialize", "flows.py:flow", "o.csv"], "cannot tell the format from 'o.csv'; pass --format"),
    (["serialize", "flows.py:flow", "missing_dir/o.lmdb"], "folder .*missing_dir does not exist"),
    (["serialize", "flows.py:flow", "o.lmdb", "--workers", "-2"], "--workers must be >= 0"),
    (["serialize", "flows.py", "o.lmdb"], "flows.py: not an LMDB, HDF5 or npz file"),
    (["inspect", "nothing.h5"], "no such dataset file: nothing.h5"),
    (["bench", "nothing.h5"], "no such dataset file: nothing.h5"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, argv, message):
    (tmp_path / "flows.py").write_text("from bridgeflow import DataFromList\n\ndef flow():\n"
                                       "    return DataFromList([[1]])\n\ndef needs_arg(n):\n"
                                       "    return DataFromList([[n]])\n\nnumber = 5\n")
    proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "--traceback" not in proc.stderr  # the line says it all: no traceback would tell more
    assert sorted(os.listdir(tmp_path)) == ["flows.py"]


def test_unknown_format_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", "serialize", "a:b", "o.x", "--format", "csv"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice: 'csv'" in proc.stderr
