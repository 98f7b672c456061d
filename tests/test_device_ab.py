"""benchmarks/device_ab.sh: cases of one stage in one device call, each with its tag, variables and time limit,
all reports in one tarball. Its runner here is a script of the test's own (the real one needs a GPU); the
limits, the skipping and the packing are the helper's."""

from __future__ import annotations

import subprocess
import tarfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RUNNER = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    # a stand-in for run_h200.sh: its report says which case ran it and with what
    out=$1; stage=$2
    echo "first audio p50 1.0 (case $LOAD_TAG)"
    echo "stage=$stage tag=$LOAD_TAG rate=${LOAD_RATES:-} hold=${HOLD:-none}" > "$out/report$LOAD_TAG.txt"
    sleep "${NAP:-0}"
    echo "done" >> "$out/report$LOAD_TAG.txt"
    """
)


def run_cases(tmp_path: Path, *cases: str, **env: str) -> tuple[str, dict[str, str]]:
    runner = tmp_path / "runner.sh"
    runner.write_text(RUNNER)
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "benchmarks/device_ab.sh", str(out), "load-0.6b", *cases],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
        env={"PATH": "/usr/bin:/bin", "AB_RUNNER": str(runner), "AB_KILL": "no-such-process-device-ab-test",
             "LOAD_RATES": "120", **env},
    )
    assert sorted(p.name for p in out.iterdir()) == ["ab.tgz"]  # one file comes back
    with tarfile.open(out / "ab.tgz") as tar:
        files = {
            Path(m.name).name: tar.extractfile(m).read().decode()  # type: ignore[union-attr]
            for m in tar.getmembers() if m.isfile()
        }
    return result.stdout, files


def test_each_case_runs_the_stage_with_its_tag_and_variables_and_all_land_in_one_tarball(tmp_path: Path) -> None:
    stdout, files = run_cases(tmp_path, "-b", "-h100 HOLD=100", "-a HOLD=0 NAP=0")
    assert files["report-b.txt"] == "stage=load-0.6b tag=-b rate=120 hold=none\ndone\n"
    assert files["report-h100.txt"] == "stage=load-0.6b tag=-h100 rate=120 hold=100\ndone\n"
    assert files["report-a.txt"] == "stage=load-0.6b tag=-a rate=120 hold=0\ndone\n"
    assert "first audio p50 1.0 (case -h100)" in files["case-h100.log"]
    assert "first audio p50 1.0 (case -a)" in stdout  # each case's summary is printed as it ends
    assert [line.split(":")[0] for line in files["cases.txt"].splitlines() if "exit 0" in line] == [
        "case -b", "case -h100", "case -a"]


def test_a_case_past_its_limit_is_cut_and_one_the_budget_cannot_hold_is_skipped(tmp_path: Path) -> None:
    stdout, files = run_cases(
        tmp_path, "-slow NAP=30", "-next NAP=3", "-never", AB_FIRST_S="3", AB_CASE_S="6", AB_BUDGET_S="14",
    )
    assert "done" not in files["report-slow.txt"]  # cut at 3 s
    cases = files["cases.txt"]
    assert "case -slow: exit 124" in cases and "cut at its limit" in cases
    assert files["report-next.txt"].endswith("done\n")  # ~5 s in, 9 left: room for its 6
    assert "case -never skipped" in cases and "case -never (" not in cases  # ~10 s in, 4 left and "report-never.txt" not in files
