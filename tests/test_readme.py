"""The README's code blocks, run as a reader would run them, so that the README cannot go stale.

Every ```bash and ```python block of README.md runs, in order, in one bash shell started in the repository (a
python block as ``python - <<HEREDOC``), against a server started the way ``make serve`` starts it
(``deconv-serve``, on the CPU unless a GPU is visible). The only edits: the README's ports 8000 and 8001 become free
ports (``DECONV_URL`` names the first, as a reader's default does), and ``mktemp`` writes under pytest's temporary
directory. A block is skipped only when the line before its fence says ``<!-- readme-test: not run (why) -->``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
SKIP_MARK = "<!-- readme-test: not run"
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    run: bool


def readme_blocks(text: str) -> list[Block]:
    """Every fenced code block of ``text`` with its language and whether the README test runs it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, language = i, m.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"README.md:{start + 1}: code block is not closed")
        skip = start > 0 and lines[start - 1].startswith(SKIP_MARK)
        blocks.append(Block(language, "\n".join(lines[start + 1 : end]), start + 1,
                            run=language in ("bash", "python") and not skip))
        i = end + 1
    return blocks


def script(blocks: list[Block], ports: dict[str, int]) -> str:
    """One bash script of the runnable blocks, the README's ports replaced by ``ports``."""
    parts = ["set -euo pipefail"]
    for block in blocks:
        if not block.run:
            continue
        code = block.code
        for old, new in ports.items():
            code = re.sub(rf"\b{old}\b", str(new), code)
        parts.append(f"echo '>>> README.md:{block.line} ({block.language})' >&2")
        if block.language == "python":
            assert "__README_PYTHON__" not in code
            parts.append(f"python - <<'__README_PYTHON__'\n{code}\n__README_PYTHON__")
        else:
            parts.append(code)
    return "\n".join(parts) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_blocks_are_found_and_marked() -> None:
    blocks = readme_blocks(README.read_text())
    ran = [b for b in blocks if b.run]
    skipped = [b for b in blocks if not b.run]
    assert {b.language for b in ran} == {"bash", "python"}
    assert len(ran) >= 6
    # Only the long-running or machine-specific commands are left out, each with a marker saying why.
    assert {b.code.split()[0] for b in skipped} <= {"make", "docker"}, [b.line for b in skipped]


def test_parser_sees_markers_and_unclosed_blocks() -> None:
    text = "a\n```bash\necho 1\n```\n<!-- readme-test: not run (x) -->\n```python\nprint(2)\n```\n```text\nz\n```\n"
    blocks = readme_blocks(text)
    assert [(b.language, b.code, b.run) for b in blocks] == [
        ("bash", "echo 1", True), ("python", "print(2)", False), ("text", "z", False)]
    with pytest.raises(ValueError, match="not closed"):
        readme_blocks("```bash\necho 1\n")
    s = script(blocks, {"8000": 1234})
    assert "echo 1" in s
    assert "print(2)" not in s


@pytest.fixture
def readme_server(tmp_path: Path) -> Iterator[str]:
    """``deconv-serve`` on the bundled layers, as ``make serve`` runs it; yields its URL once ready."""
    port = free_port()
    env = {**os.environ, "DECONV_HOST": "127.0.0.1", "DECONV_PORT": str(port), "DECONV_LOG_LEVEL": "warning"}
    env.pop("DECONV_LAYER_REPOSITORY", None)
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([str(VENV_BIN / "deconv-serve")], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready in 600 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def untracked(paths: list[str]) -> set[str]:
    out = subprocess.run(["git", "ls-files", "--others", "--", *paths], cwd=ROOT, capture_output=True, text=True)
    return set(out.stdout.split())


@pytest.mark.skipif(not (VENV_BIN / "activate").exists() or sys.platform == "win32",
                    reason="the README's commands use the install's .venv (make install)")
def test_readme_code_blocks_run(readme_server: str, tmp_path: Path) -> None:
    port = int(readme_server.rsplit(":", 1)[1])
    second = free_port()
    text = script(readme_blocks(README.read_text()), {"8000": port, "8001": second})
    (tmp_path / "readme.sh").write_text(text)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DECONV_", "VIRTUAL_ENV"))}
    env.update(TMPDIR=str(tmp), DECONV_URL=readme_server)
    watched = ["*.npy", "*.safetensors", "my_layers", "my_model.py"]
    before = untracked(watched)
    proc = subprocess.Popen(["bash", str(tmp_path / "readme.sh")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:  # the shell's process group: the background server of "Serve your own model" if a block failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, out
    # What the README promises, seen in its output.
    assert "(1, 8, 32, 32)" in out  # curl
    assert "(2, 8, 32, 32)" in out  # tritonclient
    assert "gen_0" in out
    assert "gen_2" in out
    assert "422 invalid_input" in out
    assert "torch.bfloat16" in out
    assert "32 (1, 8, 64, 64)" in out
    assert "torch.Size([8, 32, 64, 64]) True ConvTranspose2d" in out  # kernels
    # Every file went into the temporary directory, none into the repository.
    assert untracked(watched) <= before
    assert list(tmp.glob("*/x.npy"))
    assert list(tmp.glob("*/my_layers/gen_0.json"))
