"""Every snippet in README.md runs: the ``pycon`` blocks as one doctest session, the ``console``
blocks command by command with their printed output compared line for line."""

import doctest
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def _blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == kind]


def _console_examples() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every ``$ `` line of the console blocks."""
    examples = []
    for block in _blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            elif examples:
                examples[-1][1].append(line)
    return examples


def test_readme_has_snippets():
    assert len(_blocks("pycon")) >= 2 and len(_console_examples()) >= 4


@pytest.mark.model
@pytest.mark.slow
def test_python_snippets():
    text = "\n".join(_blocks("pycon"))
    test = doctest.DocTestParser().get_doctest(text, {}, "README.md", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("command,expected", _console_examples(), ids=lambda x: str(x)[:60])
def test_console_snippets(command, expected):
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"], "README commands run a module"
    proc = subprocess.run(
        [sys.executable, *argv[1:]],
        capture_output=True,
        text=True,
        cwd=README.parent,
        env=os.environ.copy(),
        timeout=600,
    )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    shown = proc.stdout.splitlines() + errors
    assert shown == expected, proc.stderr[-2000:]
    assert proc.returncode == (2 if errors else 0)
