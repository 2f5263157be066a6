"""``lmsp_models pull``: one model of a Hugging Face repository, downloaded, verified, placed and registered.

The repository's file list (with sizes, LFS sha256 and git blob ids) goes
through ``folder_layout``, the rule the scan applies to a folder on disk, so
a pull fetches exactly the files the scan will read for that variant: its
graph, the graph's external data and the side files.

Files are downloaded into ``<models dir>/.partial/<name>/<variant>/``, which
the scan never reads (it skips dot folders). A file is moved to its final
name in that folder only once its size and checksum match what the
repository lists; an interrupted download stays there as
``<file>.<oid>.incomplete`` and the next pull of the same variant resumes it
with a ``Range`` request. The finished folder is then renamed into place, or,
when the model folder exists already (another variant pulled before), its
files are moved in one by one with the graph last: the scan keys a model off
its graph, so it never sees a graph whose data is not there yet.

Where the folder came from (repository, commit, variant, files) is written to
``.lmsp-source.json`` in the model folder (a dotfile, which the scan skips);
a pull refuses to write into a folder that another repository, or no pull,
made.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import filelock
import httpx2
from django.conf import settings
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, validate_repo_id
from huggingface_hub.utils import tqdm as hf_tqdm

from tasks_app.exceptions import ModelPullFailed
from tasks_app.model_layouts import NAME_RE, LayoutModel, folder_layout
from tasks_app.models import ModelRecord
from tasks_app.registry.scan import ScanReport, model_scan

logger = logging.getLogger(__name__)

SOURCE_FILE = ".lmsp-source.json"
PARTIAL_DIR = ".partial"
# In a staging folder: {file: oid} of the files verified there.
VERIFIED_FILE = ".verified.json"
# A variant's staging folder; "_" cannot start a tag, so it never names one.
_DEFAULT_STAGING = "_default"
_CHUNK = 1024 * 1024
# Retries of a download whose connection dropped after some bytes came; one that brings nothing fails.
_RETRIES = 5

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RemoteFile:
    """A file of the repository, as the Hub lists it."""

    path: str
    """Relative to the model folder (the repository root, or ``subfolder``)."""
    repo_path: str
    size: int
    blob_id: str
    """The git object id: of the file itself, or of its LFS pointer."""
    sha256: str | None
    """The content's sha256 for an LFS file, else None (then ``blob_id`` is checked)."""

    @property
    def oid(self) -> str:
        return self.sha256 or self.blob_id


@dataclass(frozen=True)
class PullResult:
    name: str
    """The registered name: ``<name>`` for the default model, ``<name>:<variant>``."""
    folder: Path
    repo: str
    commit: str
    variant: str | None
    graph: str
    files: tuple[str, ...]
    downloaded_bytes: int
    """Bytes fetched by this run (a resumed file counts only its rest)."""
    scan: ScanReport


def model_pull(
    *,
    repo: str,
    variant: str | None = None,
    revision: str | None = None,
    name: str | None = None,
    models_dir: Path | None = None,
    subfolder: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    echo: Echo | None = None,
) -> PullResult:
    """Download the model ``variant`` (None: the default ``model.onnx``) of ``repo`` and register it.

    ``endpoint`` defaults to ``HF_ENDPOINT`` as set when called (huggingface_hub
    reads it once, at import); ``token`` to huggingface_hub's own lookup
    (``HF_TOKEN``, then a stored login). Raises ``ModelPullFailed`` with a
    one-line reason; nothing is registered then.
    """
    root = Path(models_dir or settings.LMSP_MODELS_DIR)
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    with _hub_errors(repo=repo, revision=revision, endpoint=endpoint):
        validate_repo_id(repo)
    name = name or repo.rstrip("/").rsplit("/", 1)[-1]
    if not NAME_RE.match(name):
        raise ModelPullFailed(
            f"{name!r} is not a model name (letters, digits, '.', '_', '-', starting with a letter or digit; "
            "at most 100): pass --name"
        )
    pull = _Pull(
        repo=repo,
        subfolder=(subfolder or "").strip("/"),
        variant=variant,
        revision=revision,
        root=root,
        name=name,
        endpoint=endpoint,
        token=token,
        say=echo or (lambda line: None),
    )
    with _hub_errors(repo=repo, revision=revision, endpoint=endpoint), _disk_errors(root):
        (root / PARTIAL_DIR).mkdir(parents=True, exist_ok=True)
        # Kept after the pull: deleting a lock file another process may hold open breaks the lock.
        lock = filelock.FileLock(str(root / PARTIAL_DIR / f"{name}.lock"), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise ModelPullFailed(f"another pull into {name} is running (lock {lock.lock_file})") from None
        try:
            commit, model, fetcher = pull.download()
        finally:
            lock.release()
        report = model_scan(models_dir=root)
    if not ModelRecord.objects.filter(name=pull.registered).exists():
        # A problem names the folder, a path in it, or one of its models (``name:q4``).
        ours = [(w, m) for w, m in report.problems if w.split(":")[0] == name or w.startswith(f"{name}/")]
        problems = "; ".join(f"{w}: {m}" for w, m in ours)
        raise ModelPullFailed(f"{pull.target} is in place but the scan did not register {pull.registered}: {problems}")
    return PullResult(
        name=pull.registered,
        folder=pull.target,
        repo=repo,
        commit=commit,
        variant=variant,
        graph=model.graph,
        files=tuple(model.files),
        downloaded_bytes=fetcher.downloaded,
        scan=report,
    )


@dataclass
class _Pull:
    repo: str
    subfolder: str
    variant: str | None
    revision: str | None
    root: Path
    name: str
    endpoint: str
    token: str | None
    say: Echo

    @property
    def target(self) -> Path:
        return self.root / self.name

    @property
    def registered(self) -> str:
        return f"{self.name}:{self.variant}" if self.variant else self.name

    @property
    def where(self) -> str:
        return f"{self.repo}/{self.subfolder}" if self.subfolder else self.repo

    def download(self) -> tuple[str, LayoutModel, _Fetcher]:
        """Fetch, verify and place the model's files (under the pull's lock): (commit, model, fetcher)."""
        _check_owner(self.target, self.repo, self.subfolder)
        info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
            self.repo, revision=self.revision, files_metadata=True
        )
        commit = info.sha or self.revision or "main"
        remote = _remote_files(info.siblings or [], self.subfolder)
        staging_root = self.root / PARTIAL_DIR / self.name
        staging = staging_root / (self.variant or _DEFAULT_STAGING)
        fetcher = _Fetcher(
            repo=self.repo,
            commit=commit,
            endpoint=self.endpoint,
            token=self.token,
            staging=staging,
            placed=self.target,
            say=self.say,
        )
        layout = folder_layout(remote, read_json=lambda path: fetcher.read_json(remote, path))
        try:
            model = _pick(layout.models, layout.problems, self.variant, self.where)
        except ModelPullFailed:
            # No such model: the side files read to find that out are of no use.
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                staging_root.rmdir()
            raise
        files = [remote[path] for path in model.files]
        _check_space(self.root, staging, self.target, files)
        total = _human(sum(f.size for f in files))
        self.say(f"pulling {self.where}@{commit[:12]} ({self.variant or 'default'}): {len(files)} files, {total}")
        for item in files:
            fetcher.fetch(item)
        entry = _source_entry(self.repo, self.subfolder, self.revision, commit, self.registered, model, files)
        _place(staging, self.target, model, entry)
        with contextlib.suppress(OSError):  # other variants' partial downloads may still be there
            staging_root.rmdir()
        return commit, model, fetcher


# --- the repository's files ---------------------------------------------------------------------------


def _remote_files(siblings: list[Any], subfolder: str) -> dict[str, RemoteFile]:
    prefix = f"{subfolder}/" if subfolder else ""
    files = {}
    for sibling in siblings:
        if not sibling.rfilename.startswith(prefix):
            continue
        lfs = sibling.lfs
        size = lfs.size if lfs else sibling.size
        if size is None or sibling.blob_id is None:
            raise ModelPullFailed(
                f"the endpoint listed {sibling.rfilename} without its size and checksum, so it cannot be verified"
            )
        path = sibling.rfilename[len(prefix) :]
        files[path] = RemoteFile(
            path=path,
            repo_path=sibling.rfilename,
            size=size,
            blob_id=sibling.blob_id,
            sha256=lfs.sha256 if lfs else None,
        )
    if not files:
        raise ModelPullFailed(f"the repository has no files{f' under {subfolder}/' if subfolder else ''}")
    return files


def _pick(models: tuple[LayoutModel, ...], problems: tuple[str, ...], variant: str | None, where: str) -> LayoutModel:
    if not models:
        raise ModelPullFailed(f"{where} is no model this service loads: {'; '.join(problems)}")
    for model in models:
        if model.tag == variant:
            return model
    available = ", ".join(
        f"{model.tag or 'the default'} ({model.graph})" for model in sorted(models, key=lambda m: m.tag or "")
    )
    asked = f"no variant {variant!r}" if variant else "no default model (model.onnx)"
    raise ModelPullFailed(f"{where} has {asked}; it has: {available}")


# --- downloading and verifying --------------------------------------------------------------------------


class _Fetcher:
    """Downloads repository files into the staging folder, each verified before it takes its final name.

    A file the model folder holds already with the same content (a side file
    of another variant, or the whole model pulled again) is linked, not fetched.
    """

    def __init__(
        self, *, repo: str, commit: str, endpoint: str, token: str | None, staging: Path, placed: Path, say: Echo
    ) -> None:
        self.repo, self.commit, self.endpoint = repo, commit, endpoint
        self.staging, self.placed, self.say = staging, placed, say
        # The token goes to the endpoint only: httpx drops it on a redirect to another origin (the CDN).
        self.headers = build_hf_headers(token=token, library_name="lmsp")
        self.downloaded = 0

    def read_json(self, remote: dict[str, RemoteFile], path: str) -> Any:
        """A side file for ``folder_layout``: every model of the folder uses it, so it is fetched for good."""
        local = self.fetch(remote[path])
        try:
            return json.loads(local.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(str(exc)) from None

    def fetch(self, item: RemoteFile) -> Path:
        dest = self.staging / item.path
        if _verified(self.staging, item):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = _partial(self.staging, item)
        start = partial.stat().st_size if partial.is_file() else 0
        if start > item.size:
            partial.unlink()
            start = 0
        if self._reuse(item, partial):
            problem = None
        else:
            if start:
                self.say(f"resuming {item.path} at {_human(start)} of {_human(item.size)}")
            self._download(item, partial, start)
            self.downloaded += partial.stat().st_size - start
            problem = _verify(partial, item)
        if problem:
            partial.unlink()
            raise ModelPullFailed(
                f"{item.path} does not match {self.repo}@{self.commit[:12]}: {problem}; "
                "the file was deleted and nothing was registered"
            )
        os.replace(partial, dest)
        verified = _read_json_object(self.staging / VERIFIED_FILE) or {}
        _write_json(self.staging / VERIFIED_FILE, {**verified, item.path: item.oid})
        return dest

    def _reuse(self, item: RemoteFile, partial: Path) -> bool:
        """Link the model folder's copy of ``item`` to ``partial`` when it has the repository's content."""
        have = self.placed / item.path
        try:
            if not have.is_file() or have.stat().st_size != item.size or _verify(have, item):
                return False
            partial.unlink(missing_ok=True)
            os.link(have, partial)
        except OSError:  # unreadable, or no hard links here: download it
            return False
        return True

    def _download(self, item: RemoteFile, partial: Path, start: int) -> None:
        url = hf_hub_url(self.repo, item.repo_path, revision=self.commit, endpoint=self.endpoint)
        retries = 0
        with partial.open("r+b" if start else "wb") as fh:
            fh.seek(0, os.SEEK_END)
            while fh.tell() < item.size:
                before = fh.tell()
                try:
                    self._stream(url, fh, item)
                except httpx2.TransportError as exc:  # dropped, timed out: what came is kept
                    fh.flush()
                    if fh.tell() == before or retries == _RETRIES:
                        raise ModelPullFailed(self._stopped(item, fh.tell(), exc)) from None
                    retries += 1
                    time.sleep(min(2 ** (retries - 1), 8))
                except (httpx2.HTTPError, HfHubHTTPError) as exc:
                    fh.flush()
                    raise ModelPullFailed(self._stopped(item, fh.tell(), exc)) from None
                else:
                    if fh.tell() == before:  # an empty body where bytes were due
                        raise ModelPullFailed(self._stopped(item, fh.tell(), "the server sent no data"))

    def _stream(self, url: str, fh: BinaryIO, item: RemoteFile) -> None:
        """Append what the server sends of ``item`` from the file's end, the bytes written as they come.

        huggingface_hub's own downloads (hf_hub_download, http_get) delete a
        failed file or write it in 10 MB pieces; a pull keeps every byte it got.
        """
        offset = fh.tell()
        headers = {**self.headers, "Range": f"bytes={offset}-"} if offset else self.headers
        with get_session().stream("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            if response.status_code >= 400:
                response.read()  # the error's body, for its message
            hf_raise_for_status(response)
            if offset and response.status_code != 206:  # the server ignored the range: start over
                fh.seek(0)
                fh.truncate()
                offset = 0
            with hf_tqdm(
                total=item.size, initial=offset, unit="B", unit_scale=True, desc=item.path, disable=None, name="lmsp"
            ) as bar:
                for chunk in response.iter_bytes():
                    fh.write(chunk)
                    bar.update(len(chunk))

    def _stopped(self, item: RemoteFile, have: int, why: Exception | str) -> str:
        return (
            f"the download of {item.path} stopped at {_human(have)} of {_human(item.size)} ({_one_line(why)}); "
            "run the same command again to resume it"
        )


def _verified(staging: Path, item: RemoteFile) -> bool:
    """Whether the staging folder holds ``item`` verified already (by an earlier run, maybe of another commit)."""
    dest = staging / item.path
    if (_read_json_object(staging / VERIFIED_FILE) or {}).get(item.path) != item.oid:
        return False
    return dest.is_file() and dest.stat().st_size == item.size


def _verify(path: Path, item: RemoteFile) -> str | None:
    size = path.stat().st_size
    if size != item.size:
        return f"{size} bytes, the repository lists {item.size}"
    if item.sha256:
        digest, expected, kind = hashlib.sha256(), item.sha256, "sha256"
    else:
        # A git blob id: sha1 over "blob <size>\0" and the content.
        digest, expected, kind = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False), item.blob_id, "git blob id"
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    found = digest.hexdigest()
    return None if found == expected else f"{kind} {found}, the repository lists {expected}"


def _check_space(root: Path, staging: Path, placed: Path, files: list[RemoteFile]) -> None:
    needed = 0
    for item in files:
        have = placed / item.path
        # A file of that size in the model folder is most likely linked from there, not downloaded.
        if _verified(staging, item) or (have.is_file() and have.stat().st_size == item.size):
            continue
        partial = _partial(staging, item)
        needed += item.size - (partial.stat().st_size if partial.is_file() else 0)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise ModelPullFailed(f"not enough disk space under {root}: {_human(needed)} to download, {_human(free)} free")


def _partial(staging: Path, item: RemoteFile) -> Path:
    """Where ``item`` downloads to; named by its content id, so another revision's bytes never resume it."""
    dest = staging / item.path
    return dest.with_name(f"{dest.name}.{item.oid[:16]}.incomplete")


# --- placing --------------------------------------------------------------------------------------------


def _check_owner(target: Path, repo: str, subfolder: str) -> None:
    if not target.exists():
        return
    source = _read_source(target)
    if source is None or (source.get("repo"), source.get("subfolder") or "") != (repo, subfolder):
        made = f"was pulled from {source.get('repo')}" if source else "was not made by lmsp_models pull"
        raise ModelPullFailed(f"{target} already exists and {made}: pass --name to pull {repo} under another name")


def _read_source(folder: Path) -> dict[str, Any] | None:
    return _read_json_object(folder / SOURCE_FILE)


def _read_json_object(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _source_entry(
    repo: str,
    subfolder: str,
    revision: str | None,
    commit: str,
    registered: str,
    model: LayoutModel,
    files: list[RemoteFile],
) -> dict[str, Any]:
    return {
        "repo": repo,
        "subfolder": subfolder or None,
        "models": {
            registered: {
                "variant": model.tag,
                "revision": revision or "main",
                "commit": commit,
                "graph": model.graph,
                "files": {f.path: {"size": f.size, ("sha256" if f.sha256 else "blob_id"): f.oid} for f in files},
                "pulled_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
        },
    }


def _place(staging: Path, target: Path, model: LayoutModel, entry: dict[str, Any]) -> None:
    keep = {staging / path for path in model.files}
    # Left by earlier runs: another revision's files and partial downloads, the record of what was verified.
    for path in sorted(staging.rglob("*"), reverse=True):
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()
        elif path not in keep:
            path.unlink()
    if not target.exists():
        _write_json(staging / SOURCE_FILE, entry)
        try:
            staging.rename(target)  # the whole model appears at once
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    # Another variant lives there already: move the files in, the graph last.
    for path in sorted(model.files, key=lambda p: p == model.graph):
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / path, target / path)
    source = _read_source(target) or {}
    source.update(repo=entry["repo"], subfolder=entry["subfolder"])
    source["models"] = {**(source.get("models") or {}), **entry["models"]}
    _write_json(target / SOURCE_FILE, source)
    shutil.rmtree(staging)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --- errors ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _hub_errors(*, repo: str, revision: str | None, endpoint: str) -> Iterator[None]:
    """What the Hub client raises, as one line that says what to do."""
    try:
        yield
    except GatedRepoError:
        raise ModelPullFailed(
            f"{repo} is gated: accept its conditions on its page at {endpoint}, "
            "then set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ModelPullFailed(
            f"{repo} was not found on {endpoint} (a private repository needs HF_TOKEN set to a token that can read it)"
        ) from None
    except RevisionNotFoundError:
        raise ModelPullFailed(f"{repo} has no revision {revision!r}") from None
    except HFValidationError as exc:
        raise ModelPullFailed(f"{repo!r} is not a repository id (owner/name): {_one_line(exc)}") from None
    except OfflineModeIsEnabled:
        raise ModelPullFailed("HF_HUB_OFFLINE is set: unset it to download from the Hub") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            raise ModelPullFailed(f"{endpoint} refused the token in HF_TOKEN (401 Unauthorized)") from None
        raise ModelPullFailed(f"{endpoint} answered {status}: {_one_line(exc)}") from None
    except httpx2.HTTPError as exc:
        raise ModelPullFailed(
            f"cannot reach {endpoint} ({_one_line(exc)}): check the network, or HF_ENDPOINT if you use a mirror"
        ) from None


@contextlib.contextmanager
def _disk_errors(root: Path) -> Iterator[None]:
    try:
        yield
    except (ModelPullFailed, HfHubHTTPError, OfflineModeIsEnabled):
        raise
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ModelPullFailed(f"cannot write under {root}{where}: {exc.strerror or exc}") from None


def _one_line(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
