"""TestDataSpeed: rate, summary, stage statistics, repeating a short flow, empty flows."""

from __future__ import annotations

import io
import re

import pytest

from bridgeflow import BatchData, DataFlow, DataFromList, FakeData, MapData, TestDataSpeed, UnbatchData
from bridgeflow._speed import collect_stats, format_stats


class Epochs(DataFlow):
    """Three datapoints per epoch; counts epochs and reports them as statistics."""

    def __init__(self) -> None:
        self.epochs = 0

    def __iter__(self):
        self.epochs += 1
        yield from ([0], [1], [2])

    def stats(self) -> dict[str, float]:
        return {"epochs": self.epochs, "buffer_fill": 0.25}


def test_rate_and_summary():
    out = io.StringIO()
    rate = TestDataSpeed(FakeData([[8]], size=500), size=200, warmup=10, progress=False, file=out).start()
    assert rate > 0
    text = out.getvalue()
    assert text.startswith("200 datapoints in ") and f"{rate:.1f} datapoints/s" in text
    assert "stage statistics" not in text  # plain flows report none


def test_prints_stats_of_a_wrapped_flow_and_repeats_a_short_flow():
    src = Epochs()
    out = io.StringIO()
    speed = TestDataSpeed(MapData(src, lambda dp: dp), size=10, progress=False, file=out)
    assert speed.start() == speed.rate > 0
    assert src.epochs == 4  # 3 datapoints per epoch, 10 wanted
    text = out.getvalue()
    assert "stage statistics:" in text
    assert "  MapData/Epochs: epochs=4 buffer_fill=0.25" in text


def test_summary_goes_to_stdout_by_default(capsys):
    TestDataSpeed(DataFromList([[1]], shuffle=False), size=5, progress=False).start()
    assert "5 datapoints in" in capsys.readouterr().out


def test_warmup_is_not_counted():
    src = Epochs()
    TestDataSpeed(src, size=3, warmup=6, progress=False, file=io.StringIO()).start()
    assert src.epochs == 3


def test_empty_flow_raises():
    with pytest.raises(ValueError, match="DataFromList yielded no datapoint"):
        TestDataSpeed(DataFromList([], shuffle=False), size=5, progress=False).start()


def test_bad_arguments():
    with pytest.raises(ValueError, match="size > 0"):
        TestDataSpeed(DataFromList([[1]]), size=0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        TestDataSpeed(DataFromList([[1]]), size=3, warmup=-1)


def test_iterating_runs_the_test_then_yields():
    out = io.StringIO()
    df = TestDataSpeed(DataFromList([[1], [2]], shuffle=False), size=4, progress=False, file=out)
    assert list(df) == [[1], [2]]
    assert "4 datapoints in" in out.getvalue()


def test_min_seconds_times_more_rounds_of_size(capsys):
    out = io.StringIO()
    speed = TestDataSpeed(FakeData([[2]], size=7), size=5, progress=True, file=out, min_seconds=0.2)
    rate = speed.start()
    n, seconds = out.getvalue().split(" datapoints in ")[0], out.getvalue().split(" datapoints in ")[1].split("s:")[0]
    assert int(n) % 5 == 0 and int(n) > 5 and float(seconds) >= 0.2  # whole rounds of 5, over 0.2 s at least
    assert rate == pytest.approx(int(n) / float(seconds), rel=0.01)
    err = capsys.readouterr().err
    # the bar counts without a total or a percentage: the rounds are not known up front, and a total that grew
    # with them made the percentage go backwards (80, 94, 100, 99%)
    assert "0dp [" in err and "%" not in err and "/5 " not in err, err
    with pytest.raises(ValueError, match="min_seconds >= 0"):
        TestDataSpeed(DataFromList([[1]]), size=3, min_seconds=-1)


def test_progress_bar_goes_to_stderr(capsys):
    TestDataSpeed(FakeData([[2]], size=50), size=50, progress=True).start()
    captured = capsys.readouterr()
    quiet = TestDataSpeed(FakeData([[2]], size=50), size=50, progress=False)
    quiet.start()
    assert capsys.readouterr().err == ""
    assert "50 datapoints in" in captured.out
    assert "0/50" in captured.err and "dp/s" in captured.err and "/50" not in captured.out


def test_collect_and_format_stats():
    stats = collect_stats(MapData(Epochs(), lambda dp: dp))
    assert stats == {"MapData/Epochs": {"epochs": 0, "buffer_fill": 0.25}}
    assert format_stats(stats) == "  MapData/Epochs: epochs=0 buffer_fill=0.25"


def test_a_batching_flow_is_timed_in_batches_with_its_datapoints_beside():
    out = io.StringIO()
    batched = MapData(BatchData(FakeData([[3]], size=100), 10), lambda b: b)  # BatchData anywhere below
    TestDataSpeed(batched, size=4, progress=False, file=out).start()
    m = re.fullmatch(r"4 batches in [\d.]+s: ([\d.]+) batches/s \(([\d.]+) datapoints/s at 10 a batch\)\n",
                     out.getvalue())
    assert m and float(m.group(2)) == pytest.approx(10 * float(m.group(1)), rel=1e-3), out.getvalue()
    out = io.StringIO()
    TestDataSpeed(UnbatchData(BatchData(FakeData([[3]], size=100), 10)), size=4, progress=False, file=out).start()
    assert out.getvalue().startswith("4 datapoints in ")  # batches taken apart again above the BatchData
    out = io.StringIO()
    TestDataSpeed(FakeData([[3]], size=100), size=4, progress=False, file=out, unit="rows").start()
    assert out.getvalue().startswith("4 rows in ") and "rows/s" in out.getvalue()


def test_the_bar_of_one_round_has_its_total_and_counts_batches(capsys):
    TestDataSpeed(BatchData(FakeData([[2]], size=50), 5), size=10, progress=True).start()
    err = capsys.readouterr().err
    assert "0/10" in err and "batch/s" in err, err  # leave=False: tqdm clears it at the end
