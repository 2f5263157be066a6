"""Claude Code, the real binary (``@anthropic-ai/claude-code``, pinned in tests/clients/js), against a real uvicorn
and worker through the Anthropic Messages API (PROFILE.md 11.1, docs/claude-code.md).

Claude Code is set up as the docs tell a user: a throwaway ``HOME`` and only
``ANTHROPIC_BASE_URL=<server>/lmsp``, a token and ``ANTHROPIC_MODEL``;
everything else is its default (its ~28k-demo-token prompt with a billing
header line and ``cache_control`` marks, its tools with tool search on,
``thinking``, ``context_management``, ``output_config``, ``metadata``,
always streamed, ``max_tokens`` 32,000).

The demo model writes word salad and Claude Code asks with no
``tool_choice`` (``auto``), so a tool round trip needs a model that calls:
the demo model scripted (tests/support/codex_scripted.py) to call Claude
Code's ``Read`` right after a prompt of the length Claude Code's first
request has (read off a probe's stored usage), and the demo model's own
text after any other prompt, which is the answer to the tool's result.
Claude Code names the model in its system prompt, so the probe runs on a
copy of the demo model whose name is as many tokens long as the scripted
one's. With tool search off the prompt (~53k demo tokens) is past the demo
model's 32k context: the service refuses it in Claude Code's words; with
four of its tools (``--tools``), their schemas in full, it is answered.
"""

from __future__ import annotations

import json
import os
import re
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

CLAUDE = REPO / "tests" / "clients" / "js" / "node_modules" / ".bin" / "claude"
# A Claude Code prompt is 28k-53k demo tokens to prefill on a small CPU: generous, never a speed assertion.
TIMEOUT_SECONDS = 240
CLIENT = "claude-code"
# The probe's model and the scripted one: names of as many tokens (checked), so the prompts are as long.
PROBE_MODEL = "claude-probe"
PROBE_CONTEXT = 1024
TOOL_MODEL = "claude-tools"
TOOL_PROMPT = "Read the note."
# Tool search off, the tools an edit-and-run session needs: their schemas in full, the prompt in the demo context.
FULL_TOOLS = "Bash,Read,Edit,Write"
NOTE = "The note says: claude-round-trip-42.\n"

# Once per scripts/test run, in the PostgreSQL pass where there is one (the lighter of the two since the
# client protocols' files run in the SQLite pass only): what it checks is Claude Code's own requests against
# the adapter, which writes through the same services on either database. Each Claude Code prompt prefills
# 28-53k tokens: twice would cost CI minutes.
pytestmark = [
    pytest.mark.postgres_pass,
    pytest.mark.skipif(
        not CLAUDE.exists(),
        reason="Claude Code is not installed: run scripts/bootstrap-js (`npm ci` in tests/clients/js; needs npm)",
    ),
]


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> str:
        head = f"claude {' '.join(self.args)} -> {self.returncode}"
        return f"{head}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-6000:]}"


@dataclass
class ClaudeCode:
    base: str
    token: str
    workdir: Path
    homes: pytest.TempPathFactory

    def __call__(self, prompt: str, *args: str, model: str = "demo", bearer: bool = True, **extra_env: str) -> Run:
        """``claude -p prompt`` with a fresh HOME and only the three settings the docs give (plus ``args`` and
        ``extra_env``)."""
        home = self.homes.mktemp("claude-home")
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"{self.base}/lmsp",
            ("ANTHROPIC_AUTH_TOKEN" if bearer else "ANTHROPIC_API_KEY"): self.token,
            "ANTHROPIC_MODEL": model,
            "NO_COLOR": "1",
            **extra_env,
        }
        done = subprocess.run(
            [str(CLAUDE), *args, "-p", prompt],
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
        return Run([*args, "-p", prompt], done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="session")
def claude_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working directory for the session: Claude Code writes its path into the prompt, whose length the
    scripted model is built for."""
    workdir = tmp_path_factory.mktemp("claude-work")
    (workdir / "note.txt").write_text(NOTE)
    return workdir


@pytest.fixture
def claude(web_server, running_worker, make_client, claude_workdir: Path, tmp_path_factory) -> ClaudeCode:
    _, token = make_client(CLIENT)
    return ClaudeCode(web_server.base, token, claude_workdir, tmp_path_factory)


def claude_responses() -> list[Response]:
    return list(Response.objects.filter(client__name=CLIENT).order_by("created_at", "id"))


def text_of(response: Response) -> str:
    return "".join(
        part["text"] for item in response.output if item["type"] == "message" for part in item["content"]
    ).strip()


def tool_names(request: dict[str, Any]) -> list[str]:
    return [tool["name"] for tool in request.get("tools", [])]


def assert_claude_codes_defaults(request: dict[str, Any], *, tool_search: bool) -> None:
    """What Claude Code sends with its defaults, accepted as it comes (PROFILE.md 11.1)."""
    assert request["stream"] is True
    assert request["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert {"thinking", "metadata", "max_tokens"} <= set(request)
    names = tool_names(request)
    assert {"Bash", "Read", "Edit", "Write"} <= set(names)
    deferred = any(tool.get("defer_loading") for tool in request["tools"])
    assert ("ToolSearch" in names and deferred) is tool_search
    assert ("ToolSearch" not in names and not deferred) is not tool_search


def test_a_prompt_with_tool_search_off_and_the_api_key_header_is_answered_with_the_stored_text(claude):
    # Tool search on, the default, and the bearer token are the tool round trip's below (its first request).
    # Four tools: all 21 in full (~53k demo tokens) are the refusal's below; answering them took a 64k copy
    # of the demo model and a prefill of 25 s alone, 80 s and more in a loaded CI run, for the same adapter path.
    run = claude("Say hello.", "--tools", FULL_TOOLS, bearer=False, ENABLE_TOOL_SEARCH="false")

    assert run.returncode == 0, run.report()
    (response,) = claude_responses()
    assert response.status == "completed", (response.error, run.report())
    assert response.protocol == "anthropic"
    assert_claude_codes_defaults(response.request, tool_search=False)
    # What the user is shown is what the service stored, and the prompt is Claude Code's whole long one.
    assert run.stdout.strip() == text_of(response) != ""
    assert sorted(tool_names(response.request)) == sorted(FULL_TOOLS.split(","))
    # Each tool's schema in full: Read's parameters are there, not deferred to a search.
    read = next(tool for tool in response.request["tools"] if tool["name"] == "Read")
    assert "file_path" in read["input_schema"]["properties"]


def test_a_prompt_past_the_models_context_is_refused_in_the_words_claude_code_shows(claude):
    # Tool search off: the 21 tools' schemas in full make ~53k demo tokens, past the demo model's 32k.
    run = claude("Say hello.", ENABLE_TOOL_SEARCH="false")

    assert run.returncode == 1, run.report()
    # Refused before anything is queued, with Anthropic's overflow text, which Claude Code reads.
    assert "Prompt is too long" in run.stdout, run.report()
    assert "limit 32767" in run.stdout, run.report()
    assert claude_responses() == []


def test_auto_permission_mode_the_interactive_default_gets_past_the_refusal_of_anthropics_safeguards(
    claude, probe_model
):
    # Auto, the interactive default, sends ``safeguards`` (Anthropic's server-side check of dangerous tool use)
    # on a session's first request; the service cannot run that check and refuses the field by name, and
    # Claude Code sends the request again without it. On the probe model that request is counted and refused
    # as too long for its context: what Claude Code shows is that, not the refusal of ``safeguards``.
    run = claude("Say hello.", "--permission-mode", "auto", model=probe_model)

    assert run.returncode == 1, run.report()
    assert re.search(rf"~\d+ tokens \(limit {PROBE_CONTEXT - 1}\)", run.stdout), run.report()
    assert "safeguards" not in run.stdout + run.stderr, run.report()


def _scripted_copy(root: Path, name: str, *, prompt_tokens: int | None, script: str, context: int | None = None) -> str:
    """``root/name``: the demo model, scripted to write ``script`` after a prompt of ``prompt_tokens`` (None:
    a plain copy, of ``context`` tokens if given), built once per session (the prompt's length is the
    session's: its working directory)."""
    folder = root / name
    if not folder.exists():
        source = root / "demo"
        staging = root / f".{name}"
        shutil.rmtree(staging, ignore_errors=True)
        if prompt_tokens is None:
            shutil.copytree(source, staging, ignore=shutil.ignore_patterns("endless"))
            if context is not None:
                config = json.loads((staging / "config.json").read_text())
                (staging / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
        else:
            tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
            eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
            scripted_after_prompt(
                source,
                staging,
                prompt_tokens=prompt_tokens,
                script=tokenizer.encode(script, add_special_tokens=False).ids,
                eos=eos[0] if isinstance(eos, list) else eos,
            )
        staging.rename(folder)
    model_scan(models_dir=root)
    return name


@pytest.fixture
def probe_model(worker_models_root: Path) -> str:
    """A copy of demo whose context is too small for Claude Code's prompt: the service counts the prompt at
    accept and refuses it, and Claude Code shows the count, with no prefill of its ~28k tokens."""
    return _scripted_copy(worker_models_root, PROBE_MODEL, prompt_tokens=None, script="", context=PROBE_CONTEXT)


@pytest.fixture
def tool_model(claude, claude_workdir: Path, worker_models_root: Path, probe_model: str) -> tuple[str, str]:
    """The demo model scripted to call ``Read`` on the note after a prompt as long as Claude Code's first one;
    the call it writes."""
    tokenizer = Tokenizer.from_file(str(worker_models_root / "demo" / "tokenizer.json"))
    sentence = "You are powered by the model {}."
    assert len(tokenizer.encode(sentence.format(PROBE_MODEL)).ids) == len(
        tokenizer.encode(sentence.format(TOOL_MODEL)).ids
    )
    # The same words as the run's: Claude Code's prompt is then the same length, token for token.
    probe = claude(TOOL_PROMPT, model=probe_model)
    shown = re.search(rf"~(\d+) tokens \(limit {PROBE_CONTEXT - 1}\)", probe.stdout)
    assert probe.returncode == 1 and shown, probe.report()
    prompt_tokens = int(shown[1])
    call = json.dumps({"name": "Read", "arguments": {"file_path": str(claude_workdir / "note.txt")}})
    marker = worker_models_root / f"{TOOL_MODEL}.prompt-tokens"
    if marker.exists():
        assert int(marker.read_text()) == prompt_tokens, "the session's prompt length changed"
    marker.write_text(str(prompt_tokens))
    return _scripted_copy(
        worker_models_root, TOOL_MODEL, prompt_tokens=prompt_tokens, script=f"<tool_call>{call}</tool_call>"
    ), str(claude_workdir / "note.txt")


def test_a_tool_round_trip_reads_the_file_with_claude_codes_read_tool_and_answers(claude, tool_model):
    model, path = tool_model

    run = claude(TOOL_PROMPT, model=model)

    assert run.returncode == 0, run.report()
    call_turn, answer_turn = claude_responses()[-2:]
    assert (call_turn.model, answer_turn.model) == (model, model)
    # Its first request is Claude Code's defaults as they come: tool search on, a bearer token.
    assert_claude_codes_defaults(call_turn.request, tool_search=True)
    assert call_turn.usage["input_tokens"] > 8192
    (call,) = [item for item in call_turn.output if item["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("Read", {"file_path": path})
    # Claude Code read the file and sent its content back as the tool_use's result in the next request.
    assert answer_turn.protocol == "anthropic"
    messages = answer_turn.request["messages"]
    (tool_use,) = [
        block
        for message in messages
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_use"
    ]
    assert (tool_use["name"], tool_use["input"]) == ("Read", {"file_path": path})
    (result,) = [
        block
        for message in messages
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_result"
    ]
    assert result["tool_use_id"] == tool_use["id"] == call["call_id"]
    assert NOTE.strip() in json.dumps(result["content"])
    assert answer_turn.status == "completed"
    assert run.stdout.strip() == text_of(answer_turn) != ""
    # The second request starts as the first did (its attribution line left out): the worker's prefix
    # cache holds the first request's prompt, and the answer says so.
    cached = answer_turn.usage["input_tokens_details"]["cached_tokens"]
    assert cached >= call_turn.usage["input_tokens"] // 2, (cached, call_turn.usage, answer_turn.usage)
