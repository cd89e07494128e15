"""What a new user meets first: --version, --help with defaults, flags that cannot apply refused
with a line naming the CLI's own flags (exit 2), errors that say what the path is, a reader of
stdout going away (`k31jax info | head -1`), and the status line of a long wait."""

import importlib.metadata
import io
import os
import subprocess
import sys
import time

import pytest

from helpers.paths import REPO_ROOT
from helpers.processes import cli_env
from k31jax.cli import main
from k31jax.cli._common import StatusLine
from k31jax.config import preset_names


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())  # help wraps lines where it likes


def test_version_comes_from_the_package_metadata(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"k31jax {importlib.metadata.version('k31jax')}"


@pytest.mark.parametrize("command, shown", [
    ("generate", ["--max-new-tokens MAX_NEW_TOKENS longest answer, in tokens (thinking included) (default: 32)",
                  "--max-len MAX_LEN cache length (prompt + output) (default: 4096)"]),
    ("chat", ["(thinking included) (default: 256)"]),
    ("train", ["--seq-len SEQ_LEN", "(default: 512)", "--lr LR", "(default: 0.0003)"]),
    ("serve", ["--port PORT", "(default: 8000)", "--max-batch MAX_BATCH", "(default: 8)"]),
    ("plan", ["--batch BATCH (default: 1)"]),
])
def test_help_shows_the_defaults(command, shown, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    for text in shown:
        assert text in flat(out), text
    assert "(default: None)" not in out and "(default: False)" not in out and "(default: [])" not in out


def test_help_lists_the_presets_and_says_what_generate_does(capsys):
    presets = ", ".join(preset_names())
    for command in ("generate", "chat", "info", "plan"):
        assert presets in flat(run([command, "--help"], capsys)[1]), command
    listing = flat(run(["--help"], capsys)[1])
    assert "generate one answer (raw completion for the embedded model, else the K3 chat format)" in listing


def test_bare_info_describes_the_model_generate_runs(capsys):
    code, out, _ = run(["info"], capsys)
    assert code == 0
    assert out.startswith("embedded (the embedded default model: what generate, chat and serve run without --ckpt)")


@pytest.mark.parametrize("flags, message", [
    (["--no-think", "--thinking-budget", "3"], "--thinking-budget 3: thinking is off (--no-think)"),
    (["--effort", "none", "--thinking-budget", "3"], "--thinking-budget 3: thinking is off (--effort none)"),
    (["--no-think", "--effort", "high"], "--effort high: thinking is off (--no-think)"),
    (["--raw", "--effort", "high"], "--effort high: --raw renders no chat format, which has no thinking"),
    (["--raw", "--thinking-budget", "8"], "--thinking-budget 8: --raw renders no chat format"),
    (["--max-new-tokens", "1000000"], "--max-new-tokens 1000000: does not fit --max-len 4096"),
])
def test_flags_that_cannot_apply_are_refused(flags, message, capsys):
    code, _, err = run(["generate", "--prompt", "x", "--config", "tiny", *flags], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert "Engine(" not in err


def test_chat_refuses_contradicting_thinking_flags_too(capsys):
    code, _, err = run(["chat", "--no-think", "--thinking-budget", "3"], capsys)
    assert code == 2 and "thinking is off" in err


def test_effort_on_the_embedded_models_raw_completion_is_refused(capsys):
    # the embedded model completes raw text by default: --effort would be silently ignored
    code, _, err = run(["generate", "--prompt", "def f():", "--effort", "high"], capsys)
    assert code == 2
    assert "--effort high: this model completes raw text by default" in err and "--chat" in err


def test_a_prompt_longer_than_the_cache_names_the_cli_flags(capsys):
    code, _, err = run(["generate", "--chat", "--prompt", "x " * 100, "--max-len", "64", "--max-new-tokens", "8",
                        "--no-think"], capsys)
    assert code == 2 and "more than --max-len 64; raise --max-len or lower --max-new-tokens" in err, err
    assert "Engine(" not in err


def test_ckpt_that_is_a_file_is_called_a_file(tmp_path, capsys):
    note = tmp_path / "a_file.txt"
    note.write_text("not a checkpoint")
    code, _, err = run(["generate", "--prompt", "x", "--ckpt", str(note)], capsys)
    assert code == 2 and f"--ckpt {note}: a file, not a folder" in err
    code, _, err = run(["generate", "--prompt", "x", "--ckpt", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such checkpoint folder" in err


def test_verify_says_a_folder_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(["verify", str(tmp_path), "--no-progress"], capsys)
    assert code == 1 and "not a k31jax checkpoint" in err and "convert it again" not in err


def test_stdout_reader_gone_is_quiet():
    """`k31jax info | head -1`: the reader closes the pipe; the command stops as a Unix tool
    does (exit 141, SIGPIPE's), without an error line or a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: deterministic
    proc = subprocess.run([sys.executable, "-m", "k31jax.cli", "info"], stdout=write_end, stderr=subprocess.PIPE,
                          text=True, cwd=REPO_ROOT, env=cli_env(), timeout=120)
    os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "error" not in proc.stderr and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_redraws_with_elapsed_time_and_erases_itself():
    tty = TerminalStream()
    with StatusLine("prefill", stream=tty, interval=0.01) as status:
        time.sleep(0.1)
        status.set("generating: 3 tokens")
        time.sleep(0.1)
    shown = tty.getvalue()
    assert "\r\x1b[K[k31jax] prefill (0 s)" in shown and "\r\x1b[K[k31jax] generating: 3 tokens (0 s)" in shown
    assert shown.endswith("\r\x1b[K")  # erased: the answer starts on a clean line
    piped = io.StringIO()
    with StatusLine("prefill", stream=piped, interval=0.01):
        time.sleep(0.05)
    assert piped.getvalue() == ""  # logs and pipes get nothing


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_lora_folder_without_an_adapter_is_named(command, tmp_path, capsys):
    code, _, err = run([command, "--lora", str(tmp_path), *(["--prompt", "x"] if command == "generate" else [])],
                       capsys)
    assert code != 0 and f"{tmp_path / 'adapter_config.json'}: missing" in err, err
    assert "Traceback" not in err
