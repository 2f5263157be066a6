"""The models table: what lies under LMSP_MODELS_DIR, with content digests.

Model files never enter the database. Every folder ``<dir>/<name>/`` is read
by ``tasks_app.model_layouts.folder_layout`` (docs/models.md): its default
model registers as ``name``, each variant (``onnx/model_q4.onnx``) as
``name:q4``. A tag folder ``<dir>/<name>/<tag>/`` is read the same way: its
default model is ``name:tag``, its variants ``name:tag-<variant>``.

A model's digest covers exactly the files it uses (graph, external data, side
files), so a new variant beside it does not make it reload. Digests are
recomputed only for files whose size or mtime changed, and hashing happens
outside any transaction so a scan of large files never holds the SQLite write
lock.

What is not a model is reported, not raised: each problem names the folder
or model and the file. A folder whose files are wrong registers nothing (and
loses what it had); one whose files could not be read (permissions, a file
replaced mid-scan) keeps its models as they were until a scan reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from tasks_app.model_layouts import (
    COMMUNITY_DIR,
    CONFIG,
    GENAI_CONFIG,
    LAYOUT_GENAI,
    NAME_RE,
    TOKENIZER,
    LayoutModel,
    folder_layout,
)
from tasks_app.models import ModelRecord

logger = logging.getLogger(__name__)

ONNX_BACKEND = "onnxruntime"
LATEST = "latest"
_MAX_NAME = ModelRecord._meta.get_field("name").max_length
_CHUNK = 1024 * 1024
# The summary kept in ``ModelRecord.config`` (the API's ``context_length`` is ``max_position_embeddings``).
_CONFIG_KEYS = ("model_type", "max_position_embeddings", "vocab_size", "num_hidden_layers")


@dataclass
class ScanReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Folders or models left as they were because a file could not be read."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """(folder or model name, why it is not registered): each names the file."""
    hashed_files: int = 0


class _Unreadable(Exception):
    """A file of the folder could not be read (as opposed to read and found wrong)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    return str(exc)


@dataclass
class _Folder:
    """One folder the scan reads: its files as ``folder_layout`` wants them, and its JSON files."""

    root: Path
    rel: str
    unreadable: bool = False
    _json: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.root / self.rel

    def files(self) -> list[str]:
        """The files directly in the folder and in its ``onnx/``, as POSIX paths relative to it."""
        found = []
        for entry in sorted(self.path.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.is_file():
                found.append(entry.name)
            elif entry.name == COMMUNITY_DIR and entry.is_dir():
                found.extend(
                    f"{COMMUNITY_DIR}/{sub.name}"
                    for sub in sorted(entry.iterdir())
                    if sub.is_file() and not sub.name.startswith(".")
                )
        return found

    def read_json(self, name: str) -> Any:
        if name in self._json:
            return self._json[name]
        try:
            data = json.loads((self.path / name).read_text(encoding="utf-8"))
        except OSError as exc:
            self.unreadable = True
            raise ValueError(_reason(exc)) from None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(_reason(exc)) from None
        # The configs are read again for the summary; tokenizer.json (megabytes) only once.
        if name != TOKENIZER:
            self._json[name] = data
        return data


@dataclass(frozen=True)
class _Found:
    name: str
    folder: _Folder
    model: LayoutModel


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _subfolders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _holds_model_files(files: list[str]) -> bool:
    """Whether a subfolder looks meant as a tag folder (a graph or a config), not an assets folder."""
    return any(name.endswith(".onnx") or name in (CONFIG, GENAI_CONFIG) for name in files)


def _model_name(name: str, tag_dir: str | None, variant: str | None) -> str:
    tag = "-".join(part for part in (tag_dir, variant) if part)
    return f"{name}:{tag}" if tag else name


def _walk(
    root: Path, report: ScanReport, listed: set[str]
) -> Iterator[tuple[_Folder, tuple[LayoutModel, ...], str, str | None]]:
    """(folder, its models, name, tag folder) of every model folder, reporting the ones that are not;
    adds each folder it could list to ``listed``."""
    for name_dir in _subfolders(root):
        if not NAME_RE.match(name_dir.name):
            report.problems.append(
                (name_dir.name, "the folder name is not a model name (letters, digits, '.', '_', '-'; at most 100)")
            )
            continue
        parent = _Folder(root, name_dir.name)
        try:
            files = parent.files()
            tag_dirs = [p for p in _subfolders(parent.path) if p.name != COMMUNITY_DIR]
        except OSError as exc:
            _unreadable(report, parent.rel, f"is not readable: {_reason(exc)}")
            continue
        listed.add(parent.rel)
        tagged = []
        for tag_dir in tag_dirs:
            folder = _Folder(root, f"{name_dir.name}/{tag_dir.name}")
            try:
                tag_files = folder.files()
            except OSError as exc:
                _unreadable(report, folder.rel, f"is not readable: {_reason(exc)}")
                continue
            listed.add(folder.rel)
            if not _holds_model_files(tag_files):
                continue
            if not NAME_RE.match(tag_dir.name):
                report.problems.append((folder.rel, "the folder name is not a tag (letters, digits, '.', '_', '-')"))
                continue
            tagged.append((folder, tag_files))
        # A folder holding only tag folders (``llama/7b/``, ``llama/13b/``, maybe a README) is no model itself.
        if _holds_model_files(files) or not tagged:
            yield from _read(parent, files, name_dir.name, None, report)
        for folder, tag_files in tagged:
            yield from _read(folder, tag_files, name_dir.name, folder.path.name, report)


def _read(
    folder: _Folder, files: list[str], name: str, tag_dir: str | None, report: ScanReport
) -> Iterator[tuple[_Folder, tuple[LayoutModel, ...], str, str | None]]:
    layout = folder_layout(files, read_json=folder.read_json)
    for problem in layout.problems:
        if folder.unreadable:
            _unreadable(report, folder.rel, problem)
        else:
            report.problems.append((folder.rel, problem))
    if layout.models:
        yield folder, layout.models, name, tag_dir


def _unreadable(report: ScanReport, where: str, message: str) -> None:
    logger.warning("model scan: %s %s", where, message)
    report.problems.append((where, message))
    report.skipped.append(where)


def _claim(root: Path, report: ScanReport, listed: set[str]) -> list[_Found]:
    """Every model under ``root`` under its name; a name claimed twice keeps its first claim."""
    claimed: dict[str, _Found] = {}
    for folder, models, name, tag_dir in _walk(root, report, listed):
        for model in models:
            full = _model_name(name, tag_dir, model.tag)
            where = f"{folder.rel}/{model.graph}"
            # `name` and `name:latest` are one model (selectors.model_find_by_name).
            key = full.removesuffix(f":{LATEST}")
            if len(full) > _MAX_NAME:
                report.problems.append((folder.rel, f"{model.graph}: the name {full!r} is over {_MAX_NAME} characters"))
            elif key in claimed:
                first = claimed[key]
                report.problems.append(
                    (full, f"{where} is not registered: {first.folder.rel}/{first.model.graph} already is {first.name}")
                )
            else:
                claimed[key] = _Found(full, folder, model)
    return list(claimed.values())


def _file_entries(found: _Found, known: dict[str, dict[str, Any]], report: ScanReport) -> dict[str, Any]:
    """{file: {size, mtime_ns, sha256}} over exactly the model's files; ``known`` is keyed from the root."""
    entries: dict[str, Any] = {}
    for name in found.model.files:
        path = found.folder.path / name
        key = f"{found.folder.rel}/{name}"
        try:
            stat = path.stat()
            old = known.get(key)
            if not (old and old.get("size") == stat.st_size and old.get("mtime_ns") == stat.st_mtime_ns):
                old = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256_file(path)}
                known[key] = old
                report.hashed_files += 1
        except OSError as exc:
            raise _Unreadable(f"{name} is not readable: {_reason(exc)}") from None
        entries[name] = old
    return entries


def model_digest(files: dict[str, Any]) -> str:
    """One digest for the whole model, over the sorted per-file digests."""
    manifest = "".join(f"{name}\0{entry['sha256']}\n" for name, entry in sorted(files.items()))
    return "sha256:" + hashlib.sha256(manifest.encode("utf-8")).hexdigest()


def _config_summary(found: _Found) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    if found.model.layout == LAYOUT_GENAI:
        # As the builder leaves it: no config.json, the same facts in genai_config.json's `model`.
        model = found.folder.read_json(GENAI_CONFIG)["model"]
        decoder = model["decoder"]
        for key, value in (
            ("model_type", model.get("type")),
            ("max_position_embeddings", model.get("context_length")),
            ("vocab_size", model.get("vocab_size")),
            ("num_hidden_layers", decoder.get("num_hidden_layers")),
        ):
            if value is not None:
                summary[key] = value
    if CONFIG in found.model.files:
        config = found.folder.read_json(CONFIG)
        for key in _CONFIG_KEYS:
            if key in config:
                summary.setdefault(key, config[key])
    return {key: summary[key] for key in _CONFIG_KEYS if key in summary}


def _has_chat_template(found: _Found) -> bool:
    if "chat_template.jinja" in found.model.files:
        return True
    if "tokenizer_config.json" not in found.model.files:
        return False
    return "chat_template" in found.folder.read_json("tokenizer_config.json")


def _record_values(found: _Found, files: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": found.folder.rel,
        "graph": found.model.graph,
        "layout": found.model.layout,
        "backend": ONNX_BACKEND,
        "size_bytes": sum(entry["size"] for entry in files.values()),
        "digest": model_digest(files),
        "files": files,
        # Our ONNX backend resumes a decoder-only model by re-prefilling prompt plus
        # generated ids; every model the layouts accept has its tokenizer and config.
        "capabilities": {"resumable_snapshots": True, "chat_template": _has_chat_template(found)},
        "config": _config_summary(found),
    }


def model_scan(*, models_dir: Path | None = None) -> ScanReport:
    """Register every model under the models folder, refresh changed ones, drop vanished ones."""
    root = Path(models_dir or settings.LMSP_MODELS_DIR)
    report = ScanReport()
    existing = {m.name: m for m in ModelRecord.objects.all()}
    known = {f"{m.path}/{name}": entry for m in existing.values() for name, entry in m.files.items()}
    scanned: dict[str, dict[str, Any]] = {}
    listed: set[str] = set()
    for found in _claim(root, report, listed) if root.is_dir() else []:
        try:
            scanned[found.name] = _record_values(found, _file_entries(found, known, report))
        except _Unreadable as exc:
            _unreadable(report, found.name, str(exc))

    kept = _kept(existing.values(), report.skipped, listed)
    with transaction.atomic():
        for name, values in scanned.items():
            record = existing.get(name)
            if record is None:
                ModelRecord.objects.create(name=name, **values)
                report.added.append(name)
            elif any(getattr(record, key) != value for key, value in values.items()):
                for key, value in values.items():
                    setattr(record, key, value)
                record.save(update_fields=[*values.keys(), "updated_at"])
                report.updated.append(name)
            else:
                report.unchanged.append(name)
        gone = sorted(set(existing) - set(scanned) - kept)
        if gone:
            ModelRecord.objects.filter(name__in=gone).delete()
        report.removed.extend(gone)
    return report


def _kept(records: Any, skipped: list[str], listed: set[str]) -> set[str]:
    """The registered models the scan could not read: the model or its folder skipped, or its
    folder never listed because the folder above it could not be."""
    marks = set(skipped)
    return {
        record.name
        for record in records
        if record.name in marks
        or record.path in marks
        or (record.path not in listed and record.path.split("/")[0] in marks)
    }
