"""``loadtests.stress`` (``make test-stress``): its report reading, and one real run under load."""

from __future__ import annotations

from loadtests import stress

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="boom"/></testcase>
<testcase classname="tests.test_b" name="test_setup" time="0.1"><error message="port"/></testcase>
<testcase classname="tests.test_b" name="test_gpu" time="0.0"><skipped message="no gpu"/></testcase>
</testsuite></testsuites>
"""


def test_a_report_gives_counts_and_the_failed_tests(tmp_path):
    report = tmp_path / "run.xml"
    report.write_text(REPORT)
    counts, failed = stress.read_report(report)
    assert counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    assert failed == ["tests.test_a::test_bad (failed)", "tests.test_b::test_setup (error)"]


def test_failures_are_counted_per_test_across_runs(tmp_path):
    runs = [
        stress.RunResult(1, 1, 10.0, failed=["t::flaky (failed)"]),
        stress.RunResult(2, 0, 11.0),
        stress.RunResult(3, 1, 12.0, failed=["t::flaky (failed)", "t::other (error)"]),
        stress.RunResult(4, 1, 9.0),  # non-zero with nothing failed: a leaked process, say
    ]
    text, failed = stress.summary(runs, tmp_path)
    assert failed
    assert "  2/4  t::flaky (failed)" in text and "  1/4  t::other (error)" in text
    assert "run 4 exited 1 with no failed test" in text
    assert "3 failures over 4 runs" in text


def test_one_run_under_busy_load_reports_clean(tmp_path, capsys):
    (tmp_path / "test_tiny.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    code = stress.main(
        [
            "--runs",
            "1",
            "--load",
            "busy",
            "--workdir",
            str(tmp_path / "out"),
            "--",
            str(tmp_path),
            "-p",
            "no:randomly",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "run 1/1: clean" in out and "0 failures over 1 runs" in out
