"""bench.sampling_cost's CPU smoke run: it writes a record per row count with the nucleus sizes and the
sorted reference's timings (the kernel's rows need CUDA)."""
import json

from bench.sampling_cost import main


def test_tiny_run_writes_a_record_per_row_count(tmp_path):
    out = tmp_path / "s.json"
    assert main(["--tiny", "--rows", "1,3", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["rows"] for r in records] == [1, 3]
    assert len(records[1]["nucleus_sizes"]) == 3 and min(records[1]["nucleus_sizes"]) >= 1
    assert all(r["sorted_ref"]["ms_p50"] > 0 for r in records)
