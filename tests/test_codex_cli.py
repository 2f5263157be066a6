"""Codex CLI, the real binary (``@openai/codex``, pinned in tests/clients/js), against a real uvicorn and worker.

Codex is configured as a user would (PROFILE.md 10.1, docs/agents.md): a
throwaway ``CODEX_HOME`` whose ``config.toml`` sets only ``model``,
``model_provider`` and the provider's ``base_url``, ``env_key`` and
``wire_api``; everything else is Codex's default (its ~16k-token prompt,
its default tools with ``web_search`` and a ``namespace`` tool,
``client_metadata``, ``include``, ``store: false``, always streamed).

The demo model writes word salad and Codex asks with ``tool_choice: auto``,
so a tool round trip needs a model that calls: the demo model scripted
(tests/support/codex_scripted.py) to write one ``exec_command`` call right
after a prompt of the length Codex's first request has (read off the plain
turn's stored usage), and the demo model's own text after any other prompt,
which is the answer to the call's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tasks_app.models import Response
from tasks_app.registry.scan import model_scan
from tests.support.codex_scripted import scripted_after_prompt
from tests.support.server import REPO

CODEX = REPO / "tests" / "clients" / "js" / "node_modules" / ".bin" / "codex"
# A Codex turn on the demo model prefills ~16k tokens on a small CPU: generous, never a speed assertion.
TIMEOUT_SECONDS = 240
TOOL_MODEL = "codex-tools"
# What the scripted model runs through Codex's own shell tool: harmless, and its output is known.
MARK = "codex-round-trip-42"
TOOL_PROMPT = "Run the echo."
TOOL_CALL = '<tool_call>{"name": "exec_command", "arguments": {"cmd":"echo ' + MARK + '"}}</tool_call>'

pytestmark = [
    pytest.mark.skipif(
        not CODEX.exists(),
        reason="Codex CLI is not installed: run `npm ci` in tests/clients/js (it needs node and npm)",
    ),
    # A client's protocol: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
    pytest.mark.sqlite_pass,
]


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    last_message: str

    def report(self) -> str:
        head = f"codex {' '.join(self.args)} -> {self.returncode}"
        return f"{head}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-6000:]}"

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]


@dataclass
class Codex:
    home: Path
    workdir: Path
    env: dict[str, str]

    def __call__(self, *args: str, model: str | None = None) -> Run:
        last = self.home / "last-message.txt"
        last.unlink(missing_ok=True)
        command = [
            str(CODEX),
            "exec",
            *args[:-1],
            "--skip-git-repo-check",
            "--output-last-message",
            str(last),
            *(("--model", model) if model else ()),
            args[-1],
        ]
        done = subprocess.run(
            command,
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
        text = last.read_text() if last.exists() else ""
        return Run(list(args), done.returncode, done.stdout, done.stderr, text)


@pytest.fixture
def codex(web_server, running_worker, make_client, tmp_path_factory: pytest.TempPathFactory) -> Codex:
    """``codex exec`` with a fresh CODEX_HOME pointing at the test server, as the README's block sets it."""
    _, token = make_client("codex")
    home = tmp_path_factory.mktemp("codex-home")
    workdir = tmp_path_factory.mktemp("codex-work")
    (home / "config.toml").write_text(
        'model = "demo"\n'
        'model_provider = "lmsp"\n'
        "\n"
        "[model_providers.lmsp]\n"
        'name = "LMSP"\n'
        f'base_url = "{web_server.base}/lmsp/v1"\n'
        'env_key = "LMSP_TOKEN"\n'
        'wire_api = "responses"\n'
    )
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "LMSP_TOKEN": token,
        "NO_COLOR": "1",
        "RUST_LOG": "error",
    }
    return Codex(home, workdir, env)


def codex_responses() -> list[Response]:
    return list(Response.objects.filter(client__name="codex").order_by("created_at", "id"))


def text_of(response: Response) -> str:
    return "".join(
        part["text"] for item in response.output if item["type"] == "message" for part in item["content"]
    ).strip()


def test_a_turn_with_codex_defaults_is_answered_and_what_codex_shows_is_the_stored_text(codex):
    run = codex("Say hello.")

    assert run.returncode == 0, run.report()
    (response,) = codex_responses()
    assert response.status == "completed", (response.error, run.report())
    request = response.request
    # Codex's defaults, accepted as they come (PROFILE.md 10.1).
    assert request["stream"] is True and request["store"] is False
    assert request["include"] == ["reasoning.encrypted_content"]
    assert request["client_metadata"]["session_id"] == request["prompt_cache_key"]
    assert {tool["type"] for tool in request["tools"]} >= {"function", "namespace", "web_search"}
    # What the user is shown (streamed: codex exec always streams) is what the service stored.
    assert run.last_message.strip() == text_of(response) != ""
    assert response.usage["input_tokens"] > 8192


@pytest.fixture
def tool_model(codex, worker_models_root: Path) -> str:
    """The demo model scripted to call ``exec_command`` after a prompt as long as Codex's first one."""
    # The same words as the run's: Codex's prompt is then the same, token for token.
    probe = codex(TOOL_PROMPT)
    assert probe.returncode == 0, probe.report()
    prompt_tokens = codex_responses()[-1].usage["input_tokens"]
    folder = worker_models_root / f"{TOOL_MODEL}-{prompt_tokens}"
    if not folder.exists():
        source = worker_models_root / "demo"
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
        eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
        staging = worker_models_root / f".{folder.name}"
        shutil.rmtree(staging, ignore_errors=True)
        scripted_after_prompt(
            source,
            staging,
            prompt_tokens=prompt_tokens,
            script=tokenizer.encode(TOOL_CALL, add_special_tokens=False).ids,
            eos=eos[0] if isinstance(eos, list) else eos,
        )
        staging.rename(folder)
    model_scan(models_dir=worker_models_root)
    return folder.name


def test_a_tool_round_trip_runs_codexs_shell_tool_and_answers_with_its_output(codex, tool_model):
    run = codex("--json", TOOL_PROMPT, model=tool_model)

    assert run.returncode == 0, run.report()
    call_turn, answer_turn = codex_responses()[-2:]
    (call,) = [item for item in call_turn.output if item["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": f"echo {MARK}"})
    # Codex ran it and sent its output back in the next turn's history (store: false, all of it resent).
    given = answer_turn.request["input"]
    (output,) = [item for item in given if item.get("type") == "function_call_output"]
    assert output["call_id"] == call["call_id"] and MARK in json.dumps(output["output"])
    assert next(item for item in given if item.get("type") == "function_call")["call_id"] == call["call_id"]
    executed = [e["item"] for e in run.events() if e.get("type") == "item.completed"]
    assert any(
        item.get("type") == "command_execution" and MARK in item.get("aggregated_output", "") for item in executed
    )
    assert answer_turn.status == "completed"
    assert run.last_message.strip() == text_of(answer_turn)


def test_resume_replays_the_history_and_continues_the_session(codex):
    first = codex("Say hello.")
    assert first.returncode == 0, first.report()

    again = codex("resume", "--last", "Say more.")

    assert again.returncode == 0, again.report()
    before, after = codex_responses()[-2:]
    assert after.status == "completed"
    # The session is one conversation: its key is the prefix cache's routing hint for both turns.
    assert after.request["prompt_cache_key"] == before.request["prompt_cache_key"]
    replayed = [item for item in after.request["input"] if item.get("role") == "assistant"]
    assert replayed and "".join(part["text"] for part in replayed[-1]["content"]).strip() == text_of(before)
    assert after.usage["input_tokens"] > before.usage["input_tokens"]
    assert again.last_message.strip() == text_of(after)
