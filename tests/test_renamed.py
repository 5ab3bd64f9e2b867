"""renamed_keywords: tensorpack's older keyword names taken with a DeprecationWarning at the caller's line."""

from __future__ import annotations

import inspect
import warnings

import pytest

from bridgeflow._renamed import renamed_keywords


class Stage:
    @renamed_keywords(nr_proc="num_proc", nr_prefetch="num_prefetch")
    def __init__(self, ds, num_proc=1, num_prefetch=8):
        self.ds, self.num_proc, self.num_prefetch = ds, num_proc, num_prefetch


class Alias(Stage):
    """A subclass that adds an older name of its own."""

    @renamed_keywords(nr_thread="num_proc")
    def __init__(self, ds, **kwargs):
        super().__init__(ds, **kwargs)


def test_an_older_keyword_is_the_new_one_with_a_warning_at_the_call():
    with pytest.warns(DeprecationWarning, match=r"^Stage\(nr_proc=\.\.\.\) is tensorpack's older name of the "
                                                r"argument: use num_proc=$") as record:
        s = Stage("ds", nr_proc=4)
    assert (s.num_proc, s.num_prefetch) == (4, 8)
    assert len(record) == 1 and record[0].filename == __file__
    with pytest.warns(DeprecationWarning) as record:
        s = Stage("ds", nr_proc=2, nr_prefetch=3)
    assert (s.num_proc, s.num_prefetch) == (2, 3) and len(record) == 2
    with pytest.warns(DeprecationWarning, match="Alias.*use num_proc="):
        assert Alias("ds", nr_thread=5).num_proc == 5


def test_both_spellings_or_an_unknown_keyword_are_errors():
    with pytest.raises(TypeError, match=r"^Stage: got both nr_proc= and num_proc=; pass only num_proc="):
        Stage("ds", nr_proc=2, num_proc=3)
    with pytest.raises(TypeError, match="multiple values for argument 'num_proc'"), pytest.warns(DeprecationWarning):
        Stage("ds", 2, nr_proc=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nr_thread'"):
        Stage("ds", nr_thread=3)


def test_new_names_do_not_warn_and_the_signature_is_kept():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Stage("ds", 3, num_prefetch=4).num_prefetch == 4
    assert list(inspect.signature(Stage).parameters) == ["ds", "num_proc", "num_prefetch"]
