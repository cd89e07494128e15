"""Bad command-line arguments, for every command: one `k31jax CMD: error: ...` line naming the
flag, exit 2 (usage), and for generate / chat before any model is loaded, built or compiled
(the loader is replaced by one that fails the test). `--debug` adds the traceback."""

import json

import pytest

from helpers.faults import one_error, run_bare
from k31jax.cli import _generate


@pytest.fixture
def no_model(monkeypatch):
    """generate / chat must fail before loading anything."""
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(_generate, "load_generation_model", boom)


GENERATE_CASES = [
    (["--temperature", "-1"], "sampling: temperature=-1.0 (must be >= 0)"),
    (["--temperature", "nan"], "sampling: temperature=nan (must be >= 0)"),
    (["--top-p", "0"], "sampling: top_p=0.0 (must be in (0, 1])"),
    (["--top-k", "-3"], "sampling: top_k=-3 (must be >= 0)"),
    (["--min-p", "2"], "sampling: min_p=2.0 (must be in [0, 1])"),
    (["--repetition-penalty", "0"], "sampling: repetition_penalty=0.0 (must be > 0)"),
    (["--thinking-budget", "-1"], "--thinking-budget -1: expected an integer >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected an integer >= 1"),
    (["--max-len", "0"], "--max-len 0: expected an integer >= 1"),
    (["--prefill-chunk", "-4"], "--prefill-chunk -4: expected an integer >= 1"),
    (["--dtype", "int8"], "--dtype 'int8': expected bfloat16, float32 or float16"),
    (["--ckpt", "/nonexistent/ckpt"], "--ckpt /nonexistent/ckpt: no such checkpoint folder"),
    (["--config", "no_such_preset"], "--config 'no_such_preset': not a preset"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: no such folder"),
    (["--mesh", "expert=0"], "--mesh: mesh 'expert=0': axis sizes must be >= 1"),
    (["--mesh", "bogus=2"], "--mesh: mesh 'bogus=2': unknown axes ['bogus']"),
    (["--rules", "nope"], "--rules 'nope': expected one of ep_in_tp, ep_tp, fsdp_ep_tp, tp"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id 2: expected < --num-processes 2"),
    (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    (["--effort", "extreme"], "argument --effort: invalid choice: 'extreme'"),
]


@pytest.mark.parametrize("argv, expected", GENERATE_CASES, ids=[" ".join(a) for a, _ in GENERATE_CASES])
def test_generate_argument_errors(no_model, capsys, argv, expected):
    code, err = run_bare(capsys, "generate", "--prompt", "hi", *argv)
    assert code == 2
    one_error(err, "generate", expected)


@pytest.mark.parametrize("argv, expected", GENERATE_CASES[6:9], ids=["budget", "new-tokens", "max-len"])
def test_chat_argument_errors(no_model, capsys, argv, expected):
    code, err = run_bare(capsys, "chat", *argv)
    assert code == 2
    one_error(err, "chat", expected)


def test_chat_tools_file_errors(no_model, tmp_path, capsys):
    code, err = run_bare(capsys, "chat", "--tools", tmp_path / "absent.json")
    assert code == 2
    one_error(err, "chat", f"--tools {tmp_path / 'absent.json'}: No such file or directory")
    (tmp_path / "bad.json").write_text("{not json")
    code, err = run_bare(capsys, "chat", "--tools", tmp_path / "bad.json")
    assert code == 2
    one_error(err, "chat", f"--tools {tmp_path / 'bad.json'}: Expecting property name")
    (tmp_path / "obj.json").write_text(json.dumps({"name": "x"}))
    code, err = run_bare(capsys, "chat", "--tools", tmp_path / "obj.json")
    assert code == 2
    one_error(err, "chat", "expected a list of tools")


def test_missing_required_argument_is_one_line(capsys):
    code, err = run_bare(capsys, "generate")
    assert code == 2
    one_error(err, "generate", "the following arguments are required: --prompt", "(see k31jax generate --help)")


def test_debug_adds_the_traceback(no_model, capsys):
    capsys.readouterr()
    from k31jax.cli import main

    assert main(["generate", "--prompt", "hi", "--thinking-budget", "-1", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "UsageError" in err
    assert err.rstrip().splitlines()[-1] == "k31jax generate: error: --thinking-budget -1: expected an integer >= 0"


def test_a_runtime_error_is_exit_1(monkeypatch, capsys):
    """A failure after the checks (here: the loader hits an OS error) is one line, exit 1."""
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/ckpt/_CHECKPOINT_METADATA")

    monkeypatch.setattr(_generate, "load_generation_model", unreadable)
    code, err = run_bare(capsys, "generate", "--prompt", "hi")
    assert code == 1
    one_error(err, "generate", "Permission denied: /ckpt/_CHECKPOINT_METADATA")


@pytest.mark.parametrize("cmd, argv, expected", [
    ("info", ["--config", "no_such_preset"], "--config 'no_such_preset': no such config file, and not a preset"),
    ("plan", ["--config", "no_such_preset"], "--config 'no_such_preset': no such config file"),
    ("plan", ["--batch", "0"], "--batch 0: expected an integer >= 1"),
    ("plan", ["--context", "-5"], "--context -5: expected an integer >= 1"),
    ("plan", ["--usable", "1.5"], "--usable 1.5: expected a finite number > 0 and <= 1"),
    ("plan", ["--usable", "nan"], "--usable nan: expected a finite number"),
    ("plan", ["--mesh", "expert=8,tensor"], "--mesh: mesh 'expert=8,tensor': expected axis=size pairs"),
    ("plan", ["--train", "--expert-weights", "mxfp4"], "--expert-weights does not apply with --train"),
    ("plan", ["--train", "--seq-len", "0"], "--seq-len 0: expected an integer >= 1"),
    ("convert", ["src", "dst", "--max-call-gb", "nan"], "--max-call-gb nan: expected a finite number > 0"),
    ("convert", ["src", "dst", "--max-call-gb", "-1"], "--max-call-gb -1.0: expected a finite number > 0"),
    ("convert", ["src", "dst", "--max-call-gb", "inf"], "--max-call-gb inf: expected a finite number > 0"),
    ("convert", ["src"], "DST is required (or pass --dry-run)"),
    ("train", ["--out", "o", "--data", "d", "--steps", "0"], "--steps 0: expected an integer >= 1"),
    ("train", ["--out", "o", "--data", "d", "--steps", "5", "--lr", "nan"], "--lr nan: expected a finite number > 0"),
    ("train", ["--out", "o", "--data", "d", "--steps", "5", "--holdout-fraction", "1"],
     "--holdout-fraction 1.0: expected a finite number >= 0 and <= 0.99"),
    ("eval", ["--data", "d", "--seq-len", "0"], "--seq-len 0: expected an integer >= 1"),
    ("verify", [], "the following arguments are required: ckpt"),
])
def test_other_commands_argument_errors(capsys, tmp_path, monkeypatch, cmd, argv, expected):
    monkeypatch.chdir(tmp_path)  # relative paths in the cases never exist
    code, err = run_bare(capsys, cmd, *argv)
    assert code == 2
    one_error(err, cmd, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created
