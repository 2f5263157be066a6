"""``manage.py lmsp_models pull`` against a local stand-in for the Hugging Face Hub.

The command runs in its own process, as a user runs it, with ``HF_ENDPOINT``
pointing at tests/support/hf_hub.py serving the onnx-community fixture
(tests/fixtures/models/qwen2-community) as a repository.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command

from tasks_app.models import ModelRecord
from tests.support.db import database_url
from tests.support.hf_hub import HubStandIn, hf_hub_stand_in
from tests.support.server import REPO, free_port
from tests.support.specs import prompt_for
from workers.backends import get_backend
from workers.backends.base import SamplingParams

REPO_ID = "lmsp-fixtures/qwen2-community"
NAME = "qwen2-community"
FIXTURE = REPO / "tests" / "fixtures" / "models" / NAME
REFERENCES = REPO / "tests" / "fixtures" / "model_references.json"
# What the backend reads beside a graph: the fixture's configs and tokenizer (not special_tokens_map.json).
SIDE = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
DEFAULT_FILES = SIDE | {"onnx/model.onnx", "onnx/model.onnx_data"}
Q4_FILES = SIDE | {"onnx/model_q4.onnx", "onnx/model_q4.onnx_data"}
TOKEN = "hf_stand_in_secret"

# Each pull is a manage.py process of its own (slow: not in scripts/test --quick). A pull is files and the hub;
# the registration it ends in is model_scan's, which tests/test_models.py tests on both databases: the SQLite
# pass only.
pytestmark = [pytest.mark.usefixtures("transactional_db"), pytest.mark.slow, pytest.mark.sqlite_pass]


@pytest.fixture(scope="module")
def repo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files, copied once: what the stand-in serves and the pulled files are compared with."""
    folder = tmp_path_factory.mktemp("repo") / NAME
    shutil.copytree(FIXTURE, folder)
    return folder


@pytest.fixture
def hub(repo_folder: Path) -> Iterator[HubStandIn]:
    with hf_hub_stand_in({REPO_ID: repo_folder}) as running:
        yield running


@pytest.fixture
def models(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
def pull(hub: HubStandIn, models: Path, tmp_path: Path):
    """``pull(*args, token=..., endpoint=...)`` runs the command; returns the finished process."""

    def run(*args: str, token: str | None = None, endpoint: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
        env.update(
            DATABASE_URL=database_url(),
            LMSP_MODELS_DIR=str(models),
            HF_ENDPOINT=endpoint or hub.url,
            HF_HOME=str(tmp_path / "hf-home"),  # no login of the machine's user
            HF_HUB_DISABLE_TELEMETRY="1",
        )
        if token:
            env["HF_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "manage.py", "lmsp_models", "pull", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    return run


def succeeded(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def failed(done: subprocess.CompletedProcess[str]) -> str:
    """The one-line error of a failed run (huggingface_hub's retry warnings may come before it)."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("CommandError: "), done.stderr
    return last.removeprefix("CommandError: ")


def visible(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if not p.name.startswith("."))


def model_files(folder: Path) -> set[str]:
    """The files of a model folder as the scan sees them: no dotfiles."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")}


def downloaded_files(models: Path) -> list[Path]:
    """Every file a pull left under the models folder, staging included (its lock files aside)."""
    return sorted(p for p in models.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def reference_case() -> dict:
    """The first request recorded for the fixture when it was exported, with its prompt ids."""
    return json.loads(REFERENCES.read_text())["models"][NAME]["cases"][0]


def sample(folder: Path, graph: str) -> tuple[list[int], list[int]]:
    """(prompt ids, 8 sampled ids with a fixed seed) of the model in ``folder``."""
    case = reference_case()
    model = get_backend("onnxruntime").load(folder, graph=graph, device="cpu")
    try:
        prompt = model.prompt_ids(prompt_for(case["request"]))
        generation = model.generate(prompt, SamplingParams(seed=7, max_output_tokens=8), should_stop=lambda: False)
        return prompt, [step.token_id for step in generation if step.token_id is not None]
    finally:
        model.close()


def test_the_fixture_is_the_repository_these_tests_expect(repo_folder: Path):
    files = model_files(repo_folder)
    assert DEFAULT_FILES | Q4_FILES | {"onnx/model_int8.onnx"} <= files
    assert "chat_template.jinja" not in files  # else the backend reads it: add it to SIDE


def test_pull_places_and_registers_the_default_model_with_only_its_files(
    pull, hub: HubStandIn, models: Path, repo_folder: Path
):
    out = succeeded(pull(REPO_ID))

    commit = hub.repos[REPO_ID].commit
    assert out.splitlines()[-1] == f"registered {NAME} (onnx/model.onnx, {REPO_ID}@{commit[:12]})"
    assert hub.served_files() == DEFAULT_FILES
    assert visible(models) == [NAME]
    folder = models / NAME
    assert model_files(folder) == DEFAULT_FILES
    for path in DEFAULT_FILES:
        assert (folder / path).read_bytes() == (repo_folder / path).read_bytes(), path
    record = ModelRecord.objects.get()
    assert (record.name, record.path, record.graph, record.layout) == (NAME, NAME, "onnx/model.onnx", "onnx-community")
    assert set(record.files) == DEFAULT_FILES
    source = json.loads((folder / ".lmsp-source.json").read_text())
    assert source["repo"] == REPO_ID
    assert source["models"][NAME]["commit"] == commit and source["models"][NAME]["variant"] is None
    assert not [p for p in downloaded_files(models) if not p.is_relative_to(folder)]  # the staging folder is gone

    prompt, tokens = sample(folder, "onnx/model.onnx")
    assert prompt == reference_case()["prompt_ids"]
    assert len(tokens) == 8 and (prompt, tokens) == sample(repo_folder, "onnx/model.onnx")


def test_a_variant_pulled_into_the_same_folder_keeps_the_default(
    pull, hub: HubStandIn, models: Path, repo_folder: Path
):
    succeeded(pull(REPO_ID))
    default = ModelRecord.objects.get(name=NAME)
    hub.clear_requests()
    commit = hub.repos[REPO_ID].commit

    out = succeeded(pull(REPO_ID, "--variant", "q4", "--revision", commit))

    assert out.splitlines()[-1] == f"registered {NAME}:q4 (onnx/model_q4.onnx, {REPO_ID}@{commit[:12]})"
    assert hub.served_files() == Q4_FILES - DEFAULT_FILES  # the side files in the folder are not fetched again
    assert all(f"/resolve/{commit}/" in r.path for r in hub.requests if "/resolve/" in r.path)
    assert visible(models) == [NAME]
    assert model_files(models / NAME) == DEFAULT_FILES | Q4_FILES
    q4 = ModelRecord.objects.get(name=f"{NAME}:q4")
    assert (q4.path, q4.graph, set(q4.files)) == (NAME, "onnx/model_q4.onnx", Q4_FILES)
    assert ModelRecord.objects.get(name=NAME).digest == default.digest
    source = json.loads((models / NAME / ".lmsp-source.json").read_text())
    assert source["models"][NAME]["variant"] is None
    assert source["models"][f"{NAME}:q4"] | {"pulled_at": None} == {
        "variant": "q4",
        "revision": commit,
        "commit": commit,
        "graph": "onnx/model_q4.onnx",
        "files": source["models"][f"{NAME}:q4"]["files"],
        "pulled_at": None,
    }
    assert set(source["models"][f"{NAME}:q4"]["files"]) == Q4_FILES

    prompt, tokens = sample(models / NAME, "onnx/model_q4.onnx")
    assert len(tokens) == 8 and (prompt, tokens) == sample(repo_folder, "onnx/model_q4.onnx")


def test_an_interrupted_download_is_never_registered_and_the_next_run_resumes_it(
    pull, hub: HubStandIn, models: Path, repo_folder: Path
):
    cut_file, cut_at = "onnx/model.onnx_data", 50_000
    size = (repo_folder / cut_file).stat().st_size
    hub.interrupt(cut_file, after=cut_at)

    message = failed(pull(REPO_ID))

    assert message.startswith(f"the download of {cut_file} stopped at 50.0 KB of {size / 1000:.1f} KB (")
    assert message.endswith("run the same command again to resume it")
    assert visible(models) == []
    scan = io.StringIO()
    call_command("lmsp_models", "scan", "--dir", str(models), stdout=scan)  # as a worker or the admin would
    assert ModelRecord.objects.count() == 0 and ".partial" not in scan.getvalue()
    first_run = hub.served_files() - {cut_file}
    hub.clear_faults()
    hub.clear_requests()

    out = succeeded(pull(REPO_ID))

    assert f"resuming {cut_file} at 50.0 KB" in out
    assert hub.served_files() == DEFAULT_FILES - first_run  # what the first run finished is not fetched again
    resumed = [r for r in hub.requests if r.file == cut_file]
    assert [(r.headers.get("range"), r.status) for r in resumed] == [(f"bytes={cut_at}-", 206)]
    assert (models / NAME / cut_file).read_bytes() == (repo_folder / cut_file).read_bytes()
    assert ModelRecord.objects.get().name == NAME


@pytest.mark.parametrize(("path", "check"), [("onnx/model.onnx_data", "sha256"), ("tokenizer.json", "git blob id")])
def test_a_file_that_fails_its_checksum_is_deleted_and_nothing_is_registered(
    pull, hub: HubStandIn, models: Path, repo_folder: Path, path: str, check: str
):
    hub.corrupt(path)

    message = failed(pull(REPO_ID))

    assert message.startswith(f"{path} does not match {REPO_ID}@")
    assert f": {check} " in message and message.endswith("the file was deleted and nothing was registered")
    assert ModelRecord.objects.count() == 0
    assert visible(models) == []
    basename = path.rsplit("/", 1)[-1]
    assert not [p for p in downloaded_files(models) if p.name.startswith(basename)]

    hub.clear_faults()
    succeeded(pull(REPO_ID))
    assert (models / NAME / path).read_bytes() == (repo_folder / path).read_bytes()


def test_an_unknown_variant_names_the_repositorys_variants(pull, models: Path):
    message = failed(pull(REPO_ID, "--variant", "q8"))

    assert message == (
        f"{REPO_ID} has no variant 'q8'; it has: the default (onnx/model.onnx), bnb4 (onnx/model_bnb4.onnx), "
        "fp16 (onnx/model_fp16.onnx), int8 (onnx/model_int8.onnx), q4 (onnx/model_q4.onnx), "
        "q4f16 (onnx/model_q4f16.onnx), uint8 (onnx/model_uint8.onnx)"
    )
    assert ModelRecord.objects.count() == 0
    assert downloaded_files(models) == []


def test_hf_token_is_sent_to_the_hub_as_a_bearer_token_and_not_to_the_cdn(pull, hub: HubStandIn, models: Path):
    hub.require_token(TOKEN)

    assert "HF_TOKEN" in failed(pull(REPO_ID))
    assert failed(pull(REPO_ID, token="hf_wrong")) == f"{hub.url} refused the token in HF_TOKEN (401 Unauthorized)"
    assert ModelRecord.objects.count() == 0
    hub.clear_requests()

    succeeded(pull(REPO_ID, token=TOKEN))

    hub_requests = [r for r in hub.requests if not r.path.startswith("/cdn/")]
    cdn_requests = [r for r in hub.requests if r.path.startswith("/cdn/")]
    assert hub_requests and cdn_requests
    assert {r.headers.get("authorization") for r in hub_requests} == {f"Bearer {TOKEN}"}
    assert {r.headers.get("authorization") for r in cdn_requests} == {None}
    assert ModelRecord.objects.get().name == NAME


def test_a_folder_that_pull_did_not_make_is_left_alone(pull, models: Path):
    (models / NAME).mkdir()
    (models / NAME / "notes.txt").write_text("mine")

    message = failed(pull(REPO_ID))

    assert message == (
        f"{models / NAME} already exists and was not made by lmsp_models pull: "
        f"pass --name to pull {REPO_ID} under another name"
    )
    assert model_files(models / NAME) == {"notes.txt"}
    out = succeeded(pull(REPO_ID, "--name", "qwen-pulled"))
    assert out.splitlines()[-1].startswith("registered qwen-pulled (onnx/model.onnx, ")
    assert ModelRecord.objects.get().name == "qwen-pulled"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("lmsp-fixtures/no-such-model",), "lmsp-fixtures/no-such-model was not found on {url} (a private repository"),
        ((REPO_ID, "--revision", "v9"), f"{REPO_ID} has no revision 'v9'"),
        ((REPO_ID, "--name", "no good"), "'no good' is not a model name ("),
        (("not a repo id",), "'not a repo id' is not a repository id (owner/name): "),
    ],
)
def test_what_cannot_be_pulled_is_a_one_line_error(pull, hub: HubStandIn, models: Path, args, expected):
    assert failed(pull(*args)).startswith(expected.format(url=hub.url))
    assert ModelRecord.objects.count() == 0
    assert downloaded_files(models) == []


def test_an_endpoint_that_does_not_answer_is_a_one_line_error(pull, models: Path):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    message = failed(pull(REPO_ID, endpoint=endpoint))

    assert message.startswith(f"cannot reach {endpoint} (")
    assert message.endswith("check the network, or HF_ENDPOINT if you use a mirror")


def test_pulling_again_fetches_nothing_the_folder_has(pull, hub: HubStandIn, models: Path):
    succeeded(pull(REPO_ID))
    record = ModelRecord.objects.get()
    hub.clear_requests()

    out = succeeded(pull(REPO_ID))

    assert out.splitlines()[-1].startswith(f"registered {NAME} (")
    assert hub.served_files() == set()
    assert ModelRecord.objects.get().digest == record.digest
    assert model_files(models / NAME) == DEFAULT_FILES


def test_hf_endpoint_is_read_when_the_command_runs_not_when_huggingface_hub_was_imported(
    hub: HubStandIn, models: Path, monkeypatch: pytest.MonkeyPatch
):
    import huggingface_hub.constants

    assert huggingface_hub.constants.ENDPOINT != hub.url  # read at import, before this test set it
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    # Read at import too: else the client asks huggingface.co for its agent list, for the User-Agent.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    out = io.StringIO()

    call_command("lmsp_models", "pull", REPO_ID, "--dir", str(models), stdout=out)

    assert out.getvalue().splitlines()[-1].startswith(f"registered {NAME} (")
    assert hub.served_files() == DEFAULT_FILES
    assert ModelRecord.objects.get().name == NAME
