"""scripts/gpu_check.py at tiny shapes on the CPU: the same code paths as on a GPU, minus CUDA graph capture."""
import json

from scripts import gpu_check


def test_gpu_check_runs_at_tiny_shapes_on_the_cpu(tmp_path):
    out, doc = tmp_path / "r.json", tmp_path / "gpu.md"
    assert gpu_check.main(["--tiny", "--device", "cpu", "--no_tests", "--out", str(out), "--doc", str(doc)]) == 0
    r = json.loads(out.read_text())
    assert r["copy_bandwidth_GBps"] > 0 and set(r["decode"]) == {"bf16", "int4"}
    assert all(d["tokens_per_s"] > 0 and 0 < d["fraction_of_floor"] for d in r["decode"].values())
    assert list(r["verify_cost"]) == ["1", "2", "4", "8", "16", "32", "64"] and r["verify_cost"]["1"]["vs_T1"] == 1.0
    rows = r["eagle_oracle"]["rows"]  # a perfect oracle is always accepted (the last cycle is cut at 24 tokens)
    assert rows[0]["p_miss"] == 0.0 and rows[0]["tau"] > 4.5
    assert rows[-1]["tau"] < rows[0]["tau"]
    assert "verify cost vs T=1" in doc.read_text()


def test_gpu_check_without_a_gpu_says_so(capsys):
    import torch
    if torch.cuda.is_available():
        return
    assert gpu_check.main(["--no_tests"]) == 2 and "no CUDA GPU here" in capsys.readouterr().err
