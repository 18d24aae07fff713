import json
import time
from pathlib import Path

from edge.timing import StartTimer, process_age_s, read_last_report, write_report


def test_process_age_is_measured_from_exec() -> None:
    age = process_age_s()
    assert 0 < age < 24 * 3600


def test_phases_are_recorded_with_offsets_and_rates(tmp_path: Path) -> None:
    timer = StartTimer()
    with timer.phase("a", x=1) as ph:
        time.sleep(0.01)
        ph.bytes = 10_000_000
    timer.add("b", 0.0, 0.5, nbytes=None, y=2)
    report = timer.report(extra_field=True)
    names = [p["name"] for p in report["phases"]]
    assert names == ["b", "a"]  # sorted by start offset
    a = report["phases"][1]
    assert a["seconds"] >= 0.01 and a["mb_per_s"] > 0 and a["detail"] == {"x": 1}
    assert "bytes" not in report["phases"][0]
    assert report["ready_s"] >= a["start_s"] and report["extra_field"] is True

    path = write_report(report, tmp_path)
    assert json.loads(path.read_text()) == report
    assert read_last_report(tmp_path) == report
    assert not list(tmp_path.rglob("*.tmp"))
    assert read_last_report(tmp_path / "none") is None
