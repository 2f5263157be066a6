"""``lmsp_models scan`` over the layouts people download (docs/models.md), and over folders that are not models.

The models are the real tiny exports of tests/fixtures/models/ (copied, never
written to); the broken folders are those copies with a file taken away or
spoiled, as a download goes wrong.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import call_command

from tasks_app.models import ModelRecord
from tasks_app.registry.scan import model_scan

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FLAT = ("qwen2-tiny", "llama-tiny", "phi3-tiny", "gpt2-tiny")
COMMUNITY = "qwen2-community"
GENAI = "llama-genai"
GENAI_INT4 = "llama-genai-int4"
INT4_GRAPH = "llama-tiny-cpu-int4-rtn-block-32-acc-level-4.onnx"
LEGACY = "phi3-legacy"
# Reading it fails with EIO for any user, root included (offset 0 is never mapped): a file the scan
# lists but cannot read, as a permission change or a failing disk leaves it.
UNREADABLE = Path("/proc/self/mem")

BACKEND_SIDE_FILES = (
    "config.json",
    "genai_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
# name: (path, graph, layout) of every fixture model.
EXPECTED = {
    **{name: (name, "model.onnx", "optimum") for name in FLAT},
    COMMUNITY: (COMMUNITY, "onnx/model.onnx", "onnx-community"),
    f"{COMMUNITY}:int8": (COMMUNITY, "onnx/model_int8.onnx", "onnx-community"),
    f"{COMMUNITY}:q4": (COMMUNITY, "onnx/model_q4.onnx", "onnx-community"),
    f"{COMMUNITY}:fp16": (COMMUNITY, "onnx/model_fp16.onnx", "onnx-community"),
    f"{COMMUNITY}:q4f16": (COMMUNITY, "onnx/model_q4f16.onnx", "onnx-community"),
    f"{COMMUNITY}:uint8": (COMMUNITY, "onnx/model_uint8.onnx", "onnx-community"),
    f"{COMMUNITY}:bnb4": (COMMUNITY, "onnx/model_bnb4.onnx", "onnx-community"),
    GENAI: (GENAI, "model.onnx", "genai"),
    GENAI_INT4: (GENAI_INT4, INT4_GRAPH, "genai"),
    LEGACY: (LEGACY, "decoder_model_merged.onnx", "optimum-merged"),
}


@pytest.fixture
def root(tmp_path: Path, settings) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    settings.LMSP_MODELS_DIR = root
    return root


def copy(name: str, root: Path, as_name: str | None = None) -> Path:
    return Path(shutil.copytree(FIXTURES / name, root / (as_name or name)))


def side_files(fixture: str) -> list[str]:
    """The files beside the graph that the backend reads, of those the fixture has."""
    return [name for name in BACKEND_SIDE_FILES if (FIXTURES / fixture / name).is_file()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scan_output(root: Path) -> str:
    out = io.StringIO()
    call_command("lmsp_models", "scan", "--dir", str(root), stdout=out)
    return out.getvalue()


def registered() -> dict[str, tuple[str, str, str]]:
    return {m.name: (m.path, m.graph, m.layout) for m in ModelRecord.objects.all()}


# --- each layout ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_layout_registers_its_models_with_graph_layout_and_exactly_their_files(root):
    for name in {path for path, _, _ in EXPECTED.values()}:
        copy(name, root)

    report = model_scan()

    assert report.problems == []
    assert sorted(report.added) == sorted(EXPECTED)
    assert registered() == EXPECTED
    q4 = ModelRecord.objects.get(name=f"{COMMUNITY}:q4")
    # The variant's graph and data, and the side files of the folder above onnx/: no other variant's.
    assert sorted(q4.files) == sorted(["onnx/model_q4.onnx", "onnx/model_q4.onnx_data", *side_files(COMMUNITY)])
    assert "tokenizer.json" in q4.files and "special_tokens_map.json" not in q4.files
    for record in ModelRecord.objects.all():
        folder = root / record.path
        for file, entry in record.files.items():
            assert entry["sha256"] == sha256(folder / file), (record.name, file)
            assert entry["size"] == (folder / file).stat().st_size
        assert record.size_bytes == sum(entry["size"] for entry in record.files.values())
        assert record.graph in record.files
        assert record.capabilities["resumable_snapshots"] is True
    int4 = ModelRecord.objects.get(name=GENAI_INT4)
    assert sorted(int4.files) == sorted([INT4_GRAPH, f"{INT4_GRAPH}.data", *side_files(GENAI_INT4)])
    assert "genai_config.json" in int4.files and "config.json" not in int4.files
    assert int4.capabilities["chat_template"] is True


@pytest.mark.django_db
def test_the_config_summary_comes_from_config_json_or_the_builders_genai_config(root):
    copy("qwen2-tiny", root)
    copy(GENAI_INT4, root)

    model_scan()

    config = json.loads((FIXTURES / "qwen2-tiny" / "config.json").read_text())
    assert ModelRecord.objects.get(name="qwen2-tiny").config == {
        "model_type": config["model_type"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "num_hidden_layers": config["num_hidden_layers"],
    }
    genai = json.loads((FIXTURES / GENAI_INT4 / "genai_config.json").read_text())["model"]
    assert ModelRecord.objects.get(name=GENAI_INT4).config == {
        "model_type": genai["type"],
        "max_position_embeddings": genai["context_length"],
        "vocab_size": genai["vocab_size"],
        "num_hidden_layers": genai["decoder"]["num_hidden_layers"],
    }


@pytest.mark.django_db
def test_a_variant_digest_covers_only_the_files_it_uses(root):
    folder = copy(COMMUNITY, root)
    model_scan()
    before = {m.name: m.digest for m in ModelRecord.objects.all()}
    assert len(set(before.values())) == len(EXPECTED_COMMUNITY)

    with (folder / "onnx" / "model_q4.onnx_data").open("ab") as fh:
        fh.write(b"\0")
    changed = model_scan()

    assert (changed.updated, changed.hashed_files) == ([f"{COMMUNITY}:q4"], 1)
    after = {m.name: m.digest for m in ModelRecord.objects.all()}
    assert after[f"{COMMUNITY}:q4"] != before[f"{COMMUNITY}:q4"]
    assert {n: d for n, d in after.items() if not n.endswith(":q4")} == {
        n: d for n, d in before.items() if not n.endswith(":q4")
    }

    # A side file every variant reads: each one changes, and the file is hashed once.
    config = folder / "generation_config.json"
    config.write_text(config.read_text() + "\n")
    shared = model_scan()
    assert (sorted(shared.updated), shared.hashed_files) == (sorted(EXPECTED_COMMUNITY), 1)
    assert model_scan().hashed_files == 0


EXPECTED_COMMUNITY = [name for name in EXPECTED if name.split(":")[0] == COMMUNITY]


@pytest.mark.django_db
def test_tag_folders_take_the_same_layouts_and_onnx_is_never_a_tag(root):
    copy("qwen2-tiny", root, "qwen2")
    copy(COMMUNITY, root, "qwen2/v2")
    # A folder of tag folders only is a family of models, not a broken model.
    copy("llama-tiny", root, "llama/base")
    copy(GENAI_INT4, root, "llama/int4")
    (root / "llama" / "README.md").write_text("two sizes")

    report = model_scan()

    assert report.problems == []
    assert registered() == {
        "qwen2": ("qwen2", "model.onnx", "optimum"),
        "qwen2:v2": ("qwen2/v2", "onnx/model.onnx", "onnx-community"),
        "qwen2:v2-int8": ("qwen2/v2", "onnx/model_int8.onnx", "onnx-community"),
        "qwen2:v2-q4": ("qwen2/v2", "onnx/model_q4.onnx", "onnx-community"),
        "qwen2:v2-fp16": ("qwen2/v2", "onnx/model_fp16.onnx", "onnx-community"),
        "qwen2:v2-q4f16": ("qwen2/v2", "onnx/model_q4f16.onnx", "onnx-community"),
        "qwen2:v2-uint8": ("qwen2/v2", "onnx/model_uint8.onnx", "onnx-community"),
        "qwen2:v2-bnb4": ("qwen2/v2", "onnx/model_bnb4.onnx", "onnx-community"),
        "llama:base": ("llama/base", "model.onnx", "optimum"),
        "llama:int4": ("llama/int4", INT4_GRAPH, "genai"),
    }


@pytest.mark.django_db
def test_a_name_claimed_twice_is_reported_and_the_first_claim_kept(root):
    community = copy(COMMUNITY, root)
    copy("qwen2-tiny", root, f"{COMMUNITY}/q4")
    # The same folder with a flat model.onnx too: onnx/model.onnx would be the same default model.
    shutil.copy(FIXTURES / "qwen2-tiny" / "model.onnx", community / "model.onnx")

    output = scan_output(root)

    assert registered()[f"{COMMUNITY}:q4"] == (COMMUNITY, "onnx/model_q4.onnx", "onnx-community")
    assert registered()[COMMUNITY] == (COMMUNITY, "model.onnx", "optimum")
    assert (
        f"skipped {COMMUNITY}:q4: {COMMUNITY}/q4/model.onnx is not registered: "
        f"{COMMUNITY}/onnx/model_q4.onnx already is {COMMUNITY}:q4\n"
    ) in output
    assert (
        f"skipped {COMMUNITY}: onnx/model.onnx is not registered: model.onnx already is the default model\n" in output
    )


# --- folders that are not models -----------------------------------------------------------------------


def _drop(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _unreadable(name: str) -> Callable[[Path], None]:
    def spoil(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to(UNREADABLE)

    return spoil


def _legacy_pair(folder: Path) -> None:
    (folder / "model.onnx").rename(folder / "decoder_model.onnx")
    shutil.copy(folder / "decoder_model.onnx", folder / "decoder_with_past_model.onnx")


# (fixture, how the copy is spoiled, what the scan says about the folder)
BROKEN = {
    "no-tokenizer": ("qwen2-tiny", _drop("tokenizer.json"), "has no tokenizer.json (the backend needs"),
    "no-config": ("llama-tiny", _drop("config.json"), "has no config.json (nor an onnxruntime-genai genai_config"),
    "config-not-json": ("phi3-tiny", _write("config.json", "{not json"), "config.json is not readable JSON: "),
    "config-not-object": ("gpt2-tiny", _write("config.json", "[1, 2]"), "config.json is not a JSON object"),
    "config-unreadable": (
        "qwen2-tiny",
        _unreadable("config.json"),
        "config.json is not readable JSON: Input/output error",
    ),
    "legacy-pair": ("qwen2-tiny", _legacy_pair, "holds the unmerged legacy Optimum pair (decoder_model.onnx + "),
    "no-graph": ("llama-tiny", _drop("model.onnx"), "has no model graph: expected model.onnx, onnx/model*.onnx"),
    "genai-decoder-missing": (
        GENAI_INT4,
        _drop(INT4_GRAPH),
        f"genai_config.json names the decoder {INT4_GRAPH}, which is missing",
    ),
}


@pytest.mark.django_db
@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_folder_registers_nothing_and_the_scan_names_the_file(root, case):
    fixture, spoil, message = BROKEN[case]
    spoil(copy(fixture, root, case))
    copy("qwen2-tiny", root)

    output = scan_output(root)

    assert registered() == {"qwen2-tiny": EXPECTED["qwen2-tiny"]}
    lines = [line for line in output.splitlines() if line.startswith(f"skipped {case}: ")]
    assert any(line.startswith(f"skipped {case}: {message}") for line in lines), output
    assert "added: qwen2-tiny\n" in output and "Traceback" not in output


@pytest.mark.django_db
def test_a_folder_that_stops_being_a_model_is_dropped_one_that_cannot_be_read_is_kept(root):
    spoiled, unreadable = copy("qwen2-tiny", root), copy("llama-tiny", root)
    model_scan()
    digest = ModelRecord.objects.get(name="llama-tiny").digest

    (spoiled / "tokenizer.json").unlink()
    _unreadable("config.json")(unreadable)
    report = model_scan()

    assert report.removed == ["qwen2-tiny"]
    assert report.skipped == ["llama-tiny"]
    assert ("llama-tiny", "config.json is not readable JSON: Input/output error") in report.problems
    # Perhaps a moment's fault (a file being replaced): the model stays as it was until a scan reads it.
    assert ModelRecord.objects.get(name="llama-tiny").digest == digest
    assert set(registered()) == {"llama-tiny"}


@pytest.mark.django_db
def test_a_variant_file_that_cannot_be_read_is_a_problem_not_a_traceback(root):
    data = copy(COMMUNITY, root) / "onnx" / "model_q4.onnx_data"
    data.unlink()
    data.symlink_to(UNREADABLE)

    output = scan_output(root)

    assert f"skipped {COMMUNITY}:q4: onnx/model_q4.onnx_data is not readable: Input/output error\n" in output
    # q4f16's own files are model_q4f16.onnx and its _data: it still registers.
    assert set(registered()) == set(EXPECTED_COMMUNITY) - {f"{COMMUNITY}:q4"}


@pytest.mark.django_db
def test_folders_that_are_not_model_names_or_hold_no_model_are_reported(root):
    (root / "my model").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("not a model")
    (root / ".cache").mkdir()
    folder = copy("qwen2-tiny", root)
    # A subfolder without a graph or config (an assets folder) is no tag folder and no problem.
    (folder / "assets").mkdir()
    (folder / "assets" / "logo.txt").write_text("x")

    report = model_scan()

    assert report.added == ["qwen2-tiny"]
    assert [where for where, _ in report.problems] == ["my model", "notes", "notes", "notes"]
    assert report.problems[0][1].startswith("the folder name is not a model name")
    assert report.problems[1][1].startswith("has no model graph")
    assert os.path.isdir(root / ".cache")


def test_the_admins_rescan_shows_each_problem_beside_what_it_registered(admin_client, root):
    copy(COMMUNITY, root)
    (copy("qwen2-tiny", root, "qwen-broken") / "tokenizer.json").unlink()

    page = admin_client.post("/admin/tasks_app/modelrecord/rescan/", follow=True)

    messages = [(message.level_tag, str(message)) for message in page.context["messages"]]
    assert messages[0] == (
        "success",
        f"Rescanned models. added: {', '.join(sorted(EXPECTED_COMMUNITY))}; updated: none; removed: none; "
        "unchanged: 0.",
    )
    assert messages[1:] == [
        ("warning", "Skipped qwen-broken: has no tokenizer.json (the backend needs a fast tokenizer file)")
    ]
    listing = page.content.decode()
    assert f"{COMMUNITY}:q4" in listing and "onnx-community" in listing
