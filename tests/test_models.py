"""The models table: scan, digests, the demo model command and GET /models."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path

import pytest
from django.core.management import call_command

from tasks_app.models import ModelRecord
from tasks_app.services.model_scan import model_scan


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
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert sorted(model.files) == files
    for name in files:
        assert model.files[name]["sha256"] == sha256(folder / name)
        assert model.files[name]["size"] == (folder / name).stat().st_size
    assert model.size_bytes == sum((folder / n).stat().st_size for n in files)
    assert model.digest.startswith("sha256:") and len(model.digest) == 71
    assert model.backend == "onnxruntime"
    assert model.capabilities["resumable_snapshots"] is True
    assert model.config["max_position_embeddings"] >= 8192
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
