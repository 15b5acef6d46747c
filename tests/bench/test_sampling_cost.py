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


def test_against_loads_another_version_of_the_kernels_or_says_why_not(tmp_path):
    """--against times another nucleus.py beside this tree's (CUDA only); on the CPU the module still has to
    load, and a missing file or one without the kernels is a clear error."""
    from pathlib import Path

    import pytest

    import kvspec_kernels.nucleus as nucleus
    from bench.sampling_cost import load_against

    copy = tmp_path / "nucleus_copy.py"
    copy.write_text(Path(nucleus.__file__).read_text())
    module = load_against(copy)
    assert module is not nucleus and module.nucleus_probs_triton is not nucleus.nucleus_probs_triton
    with pytest.raises(SystemExit, match="no file"):
        load_against(tmp_path / "missing.py")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(SystemExit, match="nucleus_probs_triton"):
        load_against(tmp_path / "empty.py")
    out = tmp_path / "s.json"
    assert main(["--tiny", "--rows", "2", "--out", str(out), "--against", str(copy)]) == 0
    assert json.loads(out.read_text())["meta"]["against"] == str(copy)


def test_the_other_versions_kernels_are_compared_on_the_same_rows():
    """compare_against (CUDA in measure; here the kernels interpreted, timed once on the CPU): the other
    version's rows off the reference, and each ratio's numerator the mean of this tree's two timings."""
    import torch

    import kvspec_kernels.nucleus as nucleus
    from bench.sampling_cost import compare_against, zipf_logits

    logits = zipf_logits(3, 300, "cpu", 1)
    p = torch.full((3,), 0.9)
    ref = nucleus.nucleus_probs_ref(logits, p)
    rec = {"kernel_graph": {"ms_p50": 2.0}, "rounded_graph": {"ms_p50": 1.0}}
    times = iter([4.0, 3.0, 6.0, 5.0])            # against exact, against rounded, this exact, this rounded
    compare_against(rec, logits, p, ref, nucleus, lambda fn: (fn(), {"ms_p50": next(times)})[1])
    assert rec["against_rows_with_other_kept_set"] == 0
    assert rec["kernel_over_against_graph"] == (2.0 + 6.0) / 2 / 4.0
    assert rec["rounded_over_against_graph"] == (1.0 + 5.0) / 2 / 3.0
