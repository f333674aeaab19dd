"""Each engine's tests (tests/engines/NAME), run in that engine's environment, one test per engine.

``./dev engines`` (part of ``./dev test``) builds the environments under ``.engines/``. Without one the
test skips; when its build failed the test fails with the build log's tail. Each inner run's summary
line is printed at the end of the session (see conftest.py), so a CI log shows what ran.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from .envs import ENGINE_NAMES, REPO, EngineEnv, engines_dir

TIMEOUT_S = 15 * 60
TAIL_LINES = 150
PYTEST_ARGS = ("-q", "-rs", "-p", "no:cacheprovider")
# pytest's last line, as -q prints it: "3 passed, 1 skipped in 12.34s" (possibly framed by "=").
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.* in [\d.]+s.*?)\s*=*$")


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def summary_line(output: str) -> str:
    """The inner session's final summary, or a note that it printed none."""
    for line in reversed(output.splitlines()):
        if m := SUMMARY.match(line.strip()):
            return m.group(1)
    return "no pytest summary in its output"


@pytest.mark.slow
@pytest.mark.engines
@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_engine(name: str, engine_summaries: dict[str, str]) -> None:
    env = EngineEnv.of(name)
    if env.failure.is_file():
        pytest.fail(f"./dev engines could not build {env.path}; its log ends:\n{env.failure.read_text()}")
    if not env.built():
        pytest.skip(f"no engine environment {env.path}: run ./dev engines (it builds none on a GPU host)")
    if not env.tests():
        pytest.skip(f"tests/engines/{name}/ holds no test files yet")
    command = [str(env.python), "-m", "pytest", f"tests/engines/{name}", *PYTEST_ARGS]
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    environ |= {
        "KVSTORE_ENGINE": name,
        "KVSTORE_ENGINES": str(engines_dir()),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    try:
        run = subprocess.run(
            command, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        engine_summaries[name] = f"timed out after {TIMEOUT_S} s"
        pytest.fail(f"{name}: its tests ran past {TIMEOUT_S} s; their output ends:\n{tail(output)}")
    engine_summaries[name] = summary_line(run.stdout)
    if run.returncode != 0:
        pytest.fail(f"{name}: its tests exited {run.returncode} ({' '.join(command)}):\n{tail(run.stdout)}")
    if " passed" not in engine_summaries[name]:
        pytest.skip(f"{name}: no engine test passed ({engine_summaries[name]}):\n{tail(run.stdout, 30)}")
