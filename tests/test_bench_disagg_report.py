"""The mixed-load benchmark's greedy-token verdict (benchmarks/engine/disagg_report.py): a probe
that differs between colocated and disaggregated runs fails the quiet check unless the colocated
engine itself answered that probe two ways; the exact check fails on any difference."""
from __future__ import annotations

from benchmarks.engine.disagg_report import compare

COLOCATED = {"q0": [1, 2, 3], "r0": [1, 2, 3], "q1": [4, 5, 6], "r1": [4, 9, 9], "s0": [7, 8]}


def test_a_probe_that_differs_where_the_colocated_answer_is_stable_fails_the_quiet_check():
    check = compare(COLOCATED, {"q0": [1, 2, 4], "q1": [4, 5, 6], "s0": [7, 8]}, "quiet")
    assert not check["ok"]
    assert check["probes_differ_stable"] == ["q0"] and check["differ"] == {"q0": 2}


def test_a_probe_whose_colocated_answer_is_unstable_is_reported_not_failed():
    check = compare(COLOCATED, {"q0": [1, 2, 3], "q1": [4, 7, 7], "s0": [7, 0]}, "quiet")
    assert check["ok"]
    assert check["colocated_unstable"] == ["q1"] and check["colocated_repeats_equal"] == 1
    assert check["probes_equal"] == 1 and check["equal"] == 0 and check["tokens_in_common"] == 1


def test_the_exact_check_fails_on_a_loaded_request_that_differs():
    check = compare(COLOCATED, {"q0": [1, 2, 3], "q1": [4, 5, 6], "s0": [7, 0]}, "exact")
    assert not check["ok"] and check["first_token_differs"] == 0
