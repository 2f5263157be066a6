"""The models table: scan, digests, the demo model command, GET /models and GET /models/{id}."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path

import openai
import pytest
from django.core.management import call_command

from tasks_app.models import ModelRecord
from tasks_app.registry.scan import model_scan
from tests.support.api import ApiClient
from tests.support.problems import assert_problem


@pytest.fixture
def models_root(tmp_path: Path, demo_models_root: Path, settings) -> Path:
    root = tmp_path / "models"
    shutil.copytree(demo_models_root, root)
    settings.LMSP_MODELS_DIR = root
    return root


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.django_db
def test_scan_registers_folder_with_digests(models_root):
    report = model_scan()
    assert report.added == ["demo"]
    model = ModelRecord.objects.get(name="demo")
    folder = models_root / "demo"
    # Exactly the files the backend reads: special_tokens_map.json is not one of them.
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "special_tokens_map.json")
    assert (folder / "special_tokens_map.json").is_file()
    assert sorted(model.files) == files
    assert (model.path, model.graph, model.layout) == ("demo", "model.onnx", "optimum")
    for name in files:
        assert model.files[name]["sha256"] == sha256(folder / name)
        assert model.files[name]["size"] == (folder / name).stat().st_size
    assert model.size_bytes == sum((folder / n).stat().st_size for n in files)
    assert model.digest.startswith("sha256:") and len(model.digest) == 71
    assert model.backend == "onnxruntime"
    assert model.capabilities["resumable_snapshots"] is True
    assert model.config["max_position_embeddings"] >= 32768
    # The database holds no model bytes.
    assert model.size_bytes > 10 * len(str(model.files))


@pytest.mark.django_db
def test_rescan_hashes_only_changed_files(models_root):
    model_scan()
    before = ModelRecord.objects.get(name="demo")
    again = model_scan()
    assert again.hashed_files == 0
    assert again.unchanged == ["demo"]

    config = models_root / "demo" / "generation_config.json"
    config.write_text(config.read_text() + "\n")
    changed = model_scan()
    assert changed.hashed_files == 1
    assert changed.updated == ["demo"]
    after = ModelRecord.objects.get(name="demo")
    assert after.digest != before.digest
    assert after.files["generation_config.json"]["sha256"] == sha256(config)

    # Same size and content but a new mtime: rehashed, digest unchanged.
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    touched = model_scan()
    assert touched.hashed_files == 1
    assert ModelRecord.objects.get(name="demo").digest == after.digest


@pytest.mark.django_db
def test_scan_names_tags_and_drops_vanished_folders(models_root):
    shutil.copytree(models_root / "demo", models_root / "demo" / "v2", ignore=shutil.ignore_patterns("v2"))
    shutil.copytree(models_root / "demo", models_root / "other", ignore=shutil.ignore_patterns("v2"))
    (models_root / "not-a-model").mkdir()
    (models_root / "not-a-model" / "README").write_text("no onnx here")
    report = model_scan()
    assert sorted(report.added) == ["demo", "demo:v2", "other"]
    assert ModelRecord.objects.get(name="demo:v2").digest == ModelRecord.objects.get(name="demo").digest

    shutil.rmtree(models_root / "other")
    report = model_scan()
    assert report.removed == ["other"]
    assert sorted(ModelRecord.objects.values_list("name", flat=True)) == ["demo", "demo:v2"]


@pytest.mark.django_db
def test_models_command_scan_and_list(models_root):
    out = io.StringIO()
    call_command("lmsp_models", "scan", stdout=out)
    assert "added: demo" in out.getvalue()
    out = io.StringIO()
    call_command("lmsp_models", "list", stdout=out)
    assert out.getvalue().startswith("demo\tonnxruntime\t")


@pytest.mark.django_db
def test_build_demo_model_command_writes_and_registers(tmp_path, settings):
    settings.LMSP_MODELS_DIR = tmp_path
    out = io.StringIO()
    call_command("lmsp_build_demo_model", stdout=out)
    assert "registered demo" in out.getvalue()
    folder = tmp_path / "demo"
    for name in (
        "model.onnx",
        "model.onnx_data",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (folder / name).is_file(), name
    first = ModelRecord.objects.get(name="demo").digest

    # --if-missing keeps the files; a rebuild is byte-identical.
    call_command("lmsp_build_demo_model", "--if-missing", stdout=io.StringIO())
    call_command("lmsp_build_demo_model", stdout=io.StringIO())
    assert ModelRecord.objects.get(name="demo").digest == first


@pytest.mark.django_db
def test_models_endpoint(api):
    reply = api.get("/lmsp/v1/models")
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "list"
    [model] = body["data"]
    record = ModelRecord.objects.get(name="demo")
    assert model["id"] == "demo"
    assert model["object"] == "model"
    assert model["backend"] == "onnxruntime"
    assert model["digest"] == record.digest
    assert model["size_bytes"] == record.size_bytes
    assert model["capabilities"]["resumable_snapshots"] is True
    assert body["first_id"] == body["last_id"] == "demo"
    assert body["has_more"] is False


@pytest.mark.django_db
def test_models_endpoint_paginates_newest_first(api, models_root):
    for tag in ("a", "b", "c"):
        shutil.copytree(models_root / "demo", models_root / f"m{tag}", ignore=shutil.ignore_patterns("v2"))
        model_scan()
    names, after = [], None
    while True:
        page = api.get("/lmsp/v1/models", limit=2, **({"after": after} if after else {})).json()
        names.extend(m["id"] for m in page["data"])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert names == ["mc", "mb", "ma", "demo"]


# --- GET /models/{id} ----------------------------------------------------------------------------------

COMMUNITY_FIXTURE = Path(__file__).parent / "fixtures" / "models" / "qwen2-community"


@pytest.fixture
def community_root(models_root: Path) -> Path:
    """The demo model and the onnx-community fixture (``qwen2-community`` and its variants), registered."""
    shutil.copytree(COMMUNITY_FIXTURE, models_root / "qwen2-community")
    model_scan()
    return models_root


@pytest.mark.django_db
def test_one_model_is_the_object_the_list_shows(api, community_root):
    listed = {model["id"]: model for model in api.get("/lmsp/v1/models", limit=100).json()["data"]}
    variants = {f"qwen2-community:{v}" for v in ("int8", "q4", "fp16", "q4f16", "uint8", "bnb4")}
    assert set(listed) == {"demo", "qwen2-community", *variants}

    reply = api.get("/lmsp/v1/models/qwen2-community:q4")

    assert reply.status_code == 200, reply.content
    assert reply.json() == listed["qwen2-community:q4"]
    record = ModelRecord.objects.get(name="qwen2-community:q4")
    assert reply.json()["digest"] == record.digest
    assert reply.json()["layout"] == "onnx-community"
    assert listed["demo"]["layout"] == "optimum"
    # `name` and `name:latest` are one model, as in a request body.
    assert api.get("/lmsp/v1/models/demo:latest").json() == listed["demo"]
    assert api.get("/lmsp/v1/models/qwen2-community%3Aint8").json() == listed["qwen2-community:int8"]


@pytest.mark.django_db
def test_an_unknown_model_is_404_model_not_found(api, community_root):
    body = assert_problem(api.get("/lmsp/v1/models/qwen2-community:q5"), 404, "model_not_found")
    assert "qwen2-community:q5" in body["detail"]
    assert_problem(api.get("/lmsp/v1/models/demo:endless"), 404, "model_not_found")


@pytest.mark.django_db
def test_one_model_needs_the_read_scope_as_the_list_does(make_client, community_root):
    _, writer = make_client("writer", scopes="responses")
    for path in ("/lmsp/v1/models", "/lmsp/v1/models/qwen2-community:q4"):
        assert_problem(ApiClient(None).get(path), 401, "unauthorized")
        assert_problem(ApiClient(writer).get(path), 403, "insufficient_scope")


def test_the_openai_package_retrieves_a_model(transactional_db, make_client, community_root, web_server):
    _, token = make_client("sdk", scopes="read")
    sdk = openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=token, max_retries=0, timeout=60)

    model = sdk.models.retrieve("qwen2-community:q4")

    record = ModelRecord.objects.get(name="qwen2-community:q4")
    assert (model.id, model.object, model.owned_by) == ("qwen2-community:q4", "model", "local")
    assert model.created == int(record.created_at.timestamp())
    assert model.model_extra["digest"] == record.digest
    assert model.model_extra["layout"] == "onnx-community"
    assert sdk.models.retrieve("demo:latest").id == "demo"
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.models.retrieve("qwen2-community:q5")
    assert refused.value.body["code"] == "model_not_found"
    assert {m.id for m in sdk.models.list()} >= {"qwen2-community", "qwen2-community:int8", "qwen2-community:q4"}
