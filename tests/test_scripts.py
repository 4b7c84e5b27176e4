"""The timing scripts of scripts/ (verify_cost, cycle_cost, profile_decode, huge_pages_bench, linear_bench,
attention_bench, batch_throughput, quant_report, gpu_check): a bad number or a missing file on the command line is
one error line, before anything loads or compiles, and a prefix or a run too long for the model's context is one
line too, not a traceback from the cache."""
import importlib
import sys

import pytest

from conftest import make_tiny_model, save_checkpoint


def run_main(monkeypatch, script, *argv) -> tuple[int, str]:
    """scripts/<script>.py's main() with these arguments: (exit status, the error line)."""
    module = importlib.import_module(f"scripts.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    code = exit_.value.code
    if isinstance(code, str):  # sys.exit("error: ..."): the interpreter prints it
        return 1, code
    return code, ""


@pytest.mark.parametrize("script,argv,says", [
    ("verify_cost", ["--sizes", "1", "0"], "--sizes, --rounds and --prefix must be at least 1"),
    ("verify_cost", ["--rounds", "0"], "--sizes, --rounds and --prefix must be at least 1"),
    ("verify_cost", ["--prefix", "0"], "--sizes, --rounds and --prefix must be at least 1"),
    ("verify_cost", ["--small_t", "-1"], "--small_t must be 0 or more"),
    ("huge_pages_bench", ["--rounds", "0"], "--sizes, --rounds and --prefix must be at least 1"),
    ("profile_decode", ["--steps", "0"], "--prefix, --steps and --top must be at least 1"),
    ("profile_decode", ["--top", "0"], "--prefix, --steps and --top must be at least 1"),
    ("cycle_cost", ["--rounds", "0"], "--rounds must be at least 1 and --profile 0 or more"),
    ("linear_bench", ["--rows", "0"], "--threads and --rows must be at least 1"),
    ("linear_bench", ["--threads", "0"], "--threads and --rows must be at least 1"),
    ("attention_bench", ["--sizes", "733"], "--sizes in 1..732"),
    ("attention_bench", ["--threads", "0"], "--threads must be at least 1"),
    ("batch_throughput", ["--new_tokens", "0"], "--batch_sizes, --new_tokens and --rounds must be at least 1"),
    ("batch_throughput", ["--batch_sizes", "0", "8"], "--batch_sizes, --new_tokens and --rounds must be at least 1"),
    # quant_report runs each config in a process of its own: a missing file is said once, before any of them
    ("quant_report", ["--draft", "heads/no-such-head"], "--draft heads/no-such-head: no such head directory"),
    ("quant_report", ["--prompts_file", "no/such.jsonl"], "--prompts_file no/such.jsonl: no such file"),
])
def test_timing_scripts_reject_bad_numbers_in_one_line(monkeypatch, capsys, script, argv, says):
    code, line = run_main(monkeypatch, script, *argv)
    err = capsys.readouterr().err + line
    assert code in (1, 2) and err.strip().count("\n") == 0 and err.startswith("error: ") and says in err, err


@pytest.mark.parametrize("script", ["verify_cost", "profile_decode"])
def test_timing_scripts_say_when_the_prefix_outgrows_the_context(monkeypatch, capsys, tmp_path, script):
    checkpoint = save_checkpoint(make_tiny_model(), tmp_path / "tiny")  # block_size 512
    code, _ = run_main(monkeypatch, script, "--checkpoint", str(checkpoint), "--prefix", "600", "--no_compile")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: --prefix 600")
    assert "512-token context" in err


def test_gpu_check_checks_its_output_paths_first(tmp_path, capsys):
    from scripts import gpu_check
    assert gpu_check.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "no" / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: --out {tmp_path / 'no' / 'x.json'}: not a file in an existing directory"
