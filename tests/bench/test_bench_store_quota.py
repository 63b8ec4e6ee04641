"""bench/store_quota.py runs, and its figures say what the storage does: a flood past the bound
leaves the quota storage within it and hivemind's holding all of it."""

import pytest

from bench import store_quota


def test_the_store_benchmark_bounds_the_flood_and_keeps_the_honest_records(capsys):
    out = store_quota.main(["--writers", "20", "--flood", "600", "--max-mib", "1", "--repeats", "1"])
    honest, flood, sybils = (out["patterns"][p] for p in ("honest", "flood", "sybils"))
    assert honest["quota_held"] == honest["hivemind_held"] > 0  # nothing honest dropped under the bound
    for pattern in (flood, sybils):
        assert pattern["hivemind_held"] > 2 ** 20 >= pattern["quota_held"] > 0
    assert "quota µs/store" in capsys.readouterr().out


def test_a_count_that_is_not_positive_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        store_quota.main(["--flood", "-3", "--repeats", "0"])
    assert "--flood, --repeats must be greater than 0" in capsys.readouterr().err
