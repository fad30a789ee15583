"""`ort-lora` itself: --version, and each subcommand's --help says what it does in full."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from ort_lora.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ort-lora {version('ort-lora')}"


def test_unknown_command_is_named(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "serve", "export"])
def test_help_describes_the_command_in_whole_sentences(command, capsys):
    try:
        code = main([command, "--help"])
    except SystemExit as exc:  # argparse's own exit after --help
        code = exc.code
    assert code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # argparse: usage, blank line, description
    assert description.rstrip().endswith((".", ")")), description
