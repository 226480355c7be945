#!/usr/bin/env python3
"""Exports this repository's fork-style files as a ``git format-patch`` series against vllm-ascend.

Why: vllm-ascend maintainers take the change as a PR and Ascend CI applies it to a release
checkout, so the series in ``patches/`` must always equal what the working tree holds. There is
one manifest per vllm-ascend release (``patches/vllm-ascend-v<version>.toml``); it says which
repository file goes to which vllm-ascend path and in which commit; this script builds a
throw-away git repository holding the pristine vllm-ascend files the series touches, commits the
mapped files on top, and runs ``git format-patch``. Without ``--manifest`` it uses the manifest
whose ``[base] version`` is the installed vllm-ascend's (or the release it is a post-release of).

Pristine sources come from PyPI artefacts only (CI has no GitHub access): the installed
vllm-ascend distribution when every file read matches its ``RECORD`` hash, else the release wheel
fetched with ``pip download`` (its sha256 checked against the package index's before any use).
The wheel holds ``vllm_ascend/`` only; files outside it (``tests/``, and ``.github/``: the e2e
test's entry in upstream's suite configuration, which the series edits) come from the release's
sdist, which holds the tag's whole tree (fetched with ``pip download --no-binary``, its sha256
checked the same way, its top directory and ``PKG-INFO`` version checked), or, with ``--git DIR``
or ``$VLLM_ASCEND_GIT``, at the manifest's tag from that vllm-ascend git repository (bare or not).
``--checkout`` verifies ``git am`` against a real tag checkout.
A line with no release on the package index (vllm-ascend main at a commit) names a source archive
of that commit in ``[base] archive`` instead; every pristine file, ``tests/`` included, then comes
from it (see SourceArchive).

    scripts/export_patches.py                    regenerate patches/<series>/
    scripts/export_patches.py --check            exit 1 if patches/ is stale or does not apply
    scripts/export_patches.py --checkout DIR     also ``git am`` the series onto the manifest's tag
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCHES_DIR = REPO_ROOT / "patches"


class ExportError(RuntimeError):
    """A problem the user must fix (manifest, sources, stale series); printed without a trace."""


# ------------------------------------------------------------------------------------ manifest
@dataclass(frozen=True)
class FileRule:
    source_glob: str
    target: str | None  # None: same path; "dir/": that directory + the file name; else a path

    def target_for(self, source: str) -> str:
        if self.target is None:
            return source
        if self.target.endswith("/"):
            return self.target + Path(source).name
        return self.target


@dataclass(frozen=True)
class Rewrite:
    find: str
    replace: str


@dataclass(frozen=True)
class Edit:
    path: str
    find: str
    replace: str


@dataclass(frozen=True)
class PatchSpec:
    slug: str
    subject: str
    message: str
    files: tuple[FileRule, ...]
    rewrites: tuple[Rewrite, ...] = ()
    edits: tuple[Edit, ...] = ()
    # Names none of this patch's files may contain once rewritten (as a whole identifier):
    # a form the rewrites do not cover fails the export instead of being half-rewritten.
    forbid: tuple[str, ...] = ()
    # vllm-ascend files this patch deletes (each must exist in the pristine sources).
    deletes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    path: Path
    distribution: str
    version: str
    tag: str
    output: str
    author: str
    date: str
    scope: tuple[str, ...]
    exclude: tuple[str, ...]
    patches: tuple[PatchSpec, ...]
    # A source archive (or tree) of the base commit, relative to the repository root; None: PyPI.
    archive: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


def manifest_versions(patches_dir: Path = PATCHES_DIR) -> dict[Path, tuple[str, str]]:
    """Every manifest in patches_dir with the (distribution, version) of its ``[base]``."""
    found = {}
    for path in sorted(patches_dir.glob("*.toml")):
        base = tomllib.loads(path.read_text()).get("base", {})
        if "distribution" in base and "version" in base:
            found[path] = (base["distribution"], base["version"])
    return found


# A release ("0.23.0"), or a build of one that changes no source by design: a post-release
# ("0.23.0.post1") or a local build ("0.23.0+cpu"). Pre-releases and dev builds are other releases.
_RELEASE = re.compile(r"v?(\d+\.\d+\.\d+)((?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?)")


def base_release(version: str) -> str | None:
    """The release a version is, or follows ("0.23.0.post1" -> "0.23.0"); None when unparsable."""
    match = _RELEASE.fullmatch(version.strip())
    return match.group(1) if match else None


def manifests_for(version: str, distribution: str, available: dict[Path, tuple[str, str]]) -> tuple[list[Path], bool]:
    """The manifests for ``version``: those naming it exactly, else (second item True) those
    naming the release it follows. A follow-up release is only *probably* unchanged: whoever
    uses such a manifest must check the files it touches (apply_patches does)."""
    exact = [path for path, (dist, v) in available.items() if dist == distribution and v == version]
    if exact:
        return exact, False
    base = base_release(version)
    derived = [path for path, (dist, v) in available.items() if dist == distribution and base is not None and v == base]
    return derived, bool(derived)


def default_manifest(patches_dir: Path = PATCHES_DIR) -> Path:
    """The manifest whose ``[base]`` names the vllm-ascend release installed here.

    The series only applies to the release it was cut against, so the installed distribution,
    not a version written into this script, picks it. A post-release or local build of that
    release picks it too; the pristine files then come from the release's wheel (PristineSource).
    """
    available = manifest_versions(patches_dir)
    installed: dict[str, str | None] = {}
    for distribution, _ in available.values():
        try:
            installed[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            installed[distribution] = None
    matching = []
    for distribution, version in installed.items():
        if version is not None:
            matching += manifests_for(version, distribution, available)[0]
    if len(matching) == 1:
        return matching[0]
    listing = "\n  ".join(f"{path.name} ({dist} {version})" for path, (dist, version) in available.items()) or "(none)"
    here = (
        ", ".join(f"{dist} {version or 'not installed'}" for dist, version in installed.items()) or "nothing to compare"
    )
    reason = "several manifests match" if matching else "no manifest matches"
    raise ExportError(f"{reason} the installed release ({here}). Manifests in {patches_dir}:\n  {listing}")


def load_manifest(path: Path | None = None) -> Manifest:
    """Read a manifest; without a path, the one for the installed vllm-ascend release."""
    path = default_manifest() if path is None else path
    data = tomllib.loads(path.read_text())
    patches = []
    for entry in data["patch"]:
        for edit in entry.get("edit", []):
            # A patch key written after a [[patch.edit]] table lands in that table (TOML): refuse it.
            if unknown := sorted(set(edit) - {"path", "find", "replace"}):
                raise ExportError(f"{path.name}: [[patch.edit]] of {edit.get('path')} has unknown keys {unknown}")
        patches.append(
            PatchSpec(
                slug=entry["slug"],
                subject=entry["subject"],
                message=entry["message"]["text"].strip(),
                files=tuple(FileRule(f["from"], f.get("to")) for f in entry.get("files", [])),
                rewrites=tuple(Rewrite(r["find"], r["replace"]) for r in entry.get("rewrite", [])),
                edits=tuple(Edit(e["path"], e["find"], e["replace"]) for e in entry.get("edit", [])),
                forbid=tuple(entry.get("forbid", [])),
                deletes=tuple(entry.get("delete", [])),
            )
        )
    return Manifest(
        path=path,
        distribution=data["base"]["distribution"],
        version=data["base"]["version"],
        tag=data["base"]["tag"],
        output=data["base"]["output"],
        author=data["commit"]["author"],
        date=data["commit"]["date"],
        scope=tuple(data["classify"]["scope"]),
        exclude=tuple(data["classify"]["exclude"]),
        patches=tuple(patches),
        archive=data["base"].get("archive"),
    )


def _matches(path: str, pattern: str) -> bool:
    # fnmatch's "*" crosses "/", so "a/**/*.py" would miss "a/x.py": accept both spellings.
    return fnmatch.fnmatchcase(path, pattern) or (
        "/**/" in pattern and fnmatch.fnmatchcase(path, pattern.replace("/**/", "/"))
    )


def _tracked_files(root: Path) -> list[str]:
    """Every file under root, repository-relative, skipping caches and virtual environments."""
    skip = {".git", "__pycache__", ".pytest_cache", "build"}
    found = []
    for folder, dirs, names in os.walk(root):
        # Pruned, not filtered: CI builds the other lines' venvs while this runs, and a walk into a venv that
        # pip is rewriting meets folders that vanish under it.
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]
        rel = Path(folder).relative_to(root)
        found.extend((rel / name).as_posix() for name in names if (Path(folder) / name).is_file())
    return sorted(found)


@dataclass
class ResolvedPatch:
    spec: PatchSpec
    files: dict[str, bytes] = field(default_factory=dict)  # vllm-ascend path -> content
    sources: dict[str, str] = field(default_factory=dict)  # vllm-ascend path -> repo path


def resolve(manifest: Manifest, root: Path = REPO_ROOT) -> list[ResolvedPatch]:
    """Map the repository's files onto the patches; refuse unclassified or doubly-mapped files."""
    files = _tracked_files(root)
    resolved = [ResolvedPatch(spec) for spec in manifest.patches]
    owner: dict[str, str] = {}
    targets: dict[str, str] = {}
    for patch in resolved:
        for rule in patch.spec.files:
            hits = [
                f for f in files if _matches(f, rule.source_glob) and not any(_matches(f, x) for x in manifest.exclude)
            ]
            for source in hits:
                if source in owner:
                    raise ExportError(
                        f"{source} is matched by two rules ({owner[source]!r} and "
                        f"{rule.source_glob!r}) in {manifest.path.name}"
                    )
                target = rule.target_for(source)
                if target in targets:
                    raise ExportError(f"{source} and {targets[target]} both map to {target}")
                owner[source], targets[target] = rule.source_glob, source
                text = (root / source).read_bytes()
                for rewrite in patch.spec.rewrites:
                    text = text.replace(rewrite.find.encode(), rewrite.replace.encode())
                _refuse_forbidden(text, patch.spec, source, manifest)
                patch.files[target] = text
                patch.sources[target] = source
    unclassified = [
        f
        for f in files
        if any(_matches(f, s) for s in manifest.scope)
        and f not in owner
        and not any(_matches(f, x) for x in manifest.exclude)
    ]
    if unclassified:
        raise ExportError(
            "files in the manifest's scope that no patch rule exports and `exclude` does not "
            f"list (add each to {manifest.path.name}):\n  " + "\n  ".join(unclassified)
        )
    empty = [p.spec.slug for p in resolved if not p.files and not p.spec.edits and not p.spec.deletes]
    if empty:
        raise ExportError(f"patches with no files: {', '.join(empty)}")
    return resolved


def _refuse_forbidden(text: bytes, spec: PatchSpec, source: str, manifest: Manifest) -> None:
    """Raise when a rewritten file still names something ``spec.forbid`` lists."""
    for name in spec.forbid:
        # Whole identifiers only: "_x_scheduling" does not name "x".
        pattern = re.compile(rb"(?<!\w)" + re.escape(name.encode()) + rb"(?!\w)")
        for number, line in enumerate(text.splitlines(), start=1):
            if pattern.search(line):
                raise ExportError(
                    f"{source}:{number} still names {name!r} after the rewrites of patch "
                    f"{spec.slug!r}; add a rewrite for this form to {manifest.path.name}:\n  "
                    + line.decode(errors="replace").strip()
                )


# ------------------------------------------------------------------------- pristine vllm-ascend
class SourceArchive:
    """The vllm-ascend tree at the manifest's commit: a directory, or a ``.tar.gz`` holding it in one
    top directory (``git archive`` output, as ``shared/upstream/vllm-ascend-main-<commit>.tar.gz``).
    ``VLLM_ASCEND_SRC`` (as for scripts/bootstrap.sh) overrides the manifest's ``[base] archive``."""

    def __init__(self, manifest: Manifest, root: Path = REPO_ROOT) -> None:
        given = os.environ.get("VLLM_ASCEND_SRC")
        self.path = Path(given).resolve() if given else (root / str(manifest.archive)).resolve()
        if not self.path.exists():
            raise ExportError(
                f"{manifest.path.name} reads pristine vllm-ascend {manifest.tag} from {self.path}, which does "
                "not exist: put the source archive there or set VLLM_ASCEND_SRC to it (a directory or .tar.gz)"
            )
        self._files: dict[str, bytes] | None = None

    def read(self, path: str) -> bytes | None:
        if self.path.is_dir():
            file = self.path / path
            return file.read_bytes() if file.is_file() else None
        if self._files is None:
            self._files = {}
            with tarfile.open(self.path) as archive:
                for member in archive.getmembers():
                    top, _, rest = member.name.partition("/")
                    handle = archive.extractfile(member) if member.isfile() and rest else None
                    if handle is not None:
                        self._files[rest] = handle.read()
        return self._files.get(path)


class PristineSource:
    """Reads files of the released vllm-ascend: ``vllm_ascend/`` from its installed copy or its wheel,
    the rest from its sdist or, when given, the tag of a git repository; or (a manifest with ``[base] archive``)
    every file from the source archive of its commit."""

    def __init__(
        self,
        manifest: Manifest,
        wheel: Path | None = None,
        cache_dir: Path | None = None,
        git_repo: Path | None = None,
        sdist: Path | None = None,
    ) -> None:
        self._manifest = manifest
        self._wheel = wheel
        self.git_repo = git_repo  # a vllm-ascend git repository: files outside the wheel, at the tag
        self._sdist = sdist  # else the release sdist (downloaded on first use): files outside the wheel
        self._sdist_files: dict[str, bytes] | None = None
        self._cache_dir = cache_dir or Path(tempfile.gettempdir()) / "vllm-ascend-balance-wheels"
        self._archive = SourceArchive(manifest) if manifest.archive and not wheel else None
        self._installed = None if wheel or self._archive else self._installed_record()
        self.origin = str(wheel) if wheel else "installed distribution (RECORD-verified)"
        if self._archive is not None:
            self.origin = f"source archive {self._archive.path}"

    def _installed_record(self) -> dict[str, tuple[Path, str]] | None:
        try:
            dist = metadata.distribution(self._manifest.distribution)
        except metadata.PackageNotFoundError:
            return None
        if dist.version != self._manifest.version:
            return None
        record = {}
        for entry in dist.files or []:
            if entry.hash is not None and entry.hash.mode == "sha256":
                record[str(entry)] = (Path(dist.locate_file(entry)), entry.hash.value)
        return record

    def read(self, path: str) -> bytes | None:
        """The pristine content of ``path``, or None when the release has no such file."""
        if self._archive is not None:
            return self._archive.read(path)
        if self._installed is not None:
            if path not in self._installed:
                if path.startswith("vllm_ascend/"):
                    return None
            else:
                location, digest = self._installed[path]
                content = location.read_bytes() if location.exists() else b""
                actual = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=")
                if actual.decode() == digest:
                    return content
                # Modified (e.g. patched in place): fall back to the wheel for every file.
                self._installed = None
        if not path.startswith("vllm_ascend/"):
            # Not in the wheel: the tag's file, or the sdist's (None when absent there).
            return self._read_tag(path) if self.git_repo is not None else self.sdist_files().get(path)
        with zipfile.ZipFile(self._wheel_path()) as wheel:
            try:
                return wheel.read(path)
            except KeyError:
                return None

    def _read_tag(self, path: str) -> bytes | None:
        """``path`` at the manifest's tag in ``git_repo``; None when the tag has no such file."""

        def cat_file(*args: str) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(["git", "-C", str(self.git_repo), "cat-file", *args], capture_output=True)

        tag = self._manifest.tag
        if cat_file("-e", f"{tag}^{{commit}}").returncode != 0:
            raise ExportError(f"{self.git_repo} is not a git repository holding vllm-ascend's tag {tag}")
        if cat_file("-e", f"{tag}:{path}").returncode != 0:
            return None
        return cat_file("blob", f"{tag}:{path}").stdout

    def sdist_path(self) -> Path:
        """The release sdist: the one given, else downloaded (index-checked) into the cache."""
        if self._sdist is None:
            self._sdist = download_sdist(self._manifest.requirement, self._cache_dir)
        return self._sdist

    def sdist_files(self) -> dict[str, bytes]:
        """Every regular file of the sdist, by path inside its top directory."""
        if self._sdist_files is None:
            self._sdist_files = read_sdist(self.sdist_path(), self._manifest.distribution, self._manifest.version)
        return self._sdist_files

    def _wheel_path(self) -> Path:
        if self._wheel is None:
            self._wheel = download_wheel(self._manifest.requirement, self._cache_dir)
            self.origin = str(self._wheel)
        return self._wheel


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    # For an sdist, pip prepares the metadata with vllm-ascend's setup.py (hence setuptools-scm in
    # requirements/tools.txt, and no build isolation: its build requirements pin torch-npu). It
    # builds NPU kernels unless COMPILE_CUSTOM_KERNELS=0 and asks npu-smi unless SOC_VERSION is set.
    env = dict(os.environ, COMPILE_CUSTOM_KERNELS="0", SOC_VERSION=os.environ.get("SOC_VERSION", "ascend910b1"))
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True, env=env
    )


def _format_args(sdist: bool) -> tuple[str, ...]:
    return ("--no-binary=:all:", "--no-build-isolation") if sdist else ("--only-binary=:all:",)


def index_sha256(requirement: str, sdist: bool = False) -> str:
    """The sha256 the package index publishes for the wheel (or sdist) pip would fetch for requirement.

    ``pip install --dry-run --report`` resolves from the index's metadata without installing
    anything (no dependencies, whatever is installed here).
    """
    result = _pip(
        "install",
        "--dry-run",
        "--no-deps",
        "--ignore-installed",
        *_format_args(sdist),
        "-q",
        "--report",
        "-",
        requirement,
    )
    try:
        (item,) = json.loads(result.stdout)["install"]
        archive = item["download_info"]["archive_info"]
        digest = archive.get("hashes", {}).get("sha256") or archive["hash"].split("sha256=", 1)[1]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ExportError(
            f"could not learn the sha256 of {requirement} from the package index "
            f"(pip install --dry-run --report):\n{result.stderr.strip()}"
        ) from None
    return digest


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download_wheel(requirement: str, dest: Path, sdist: bool = False) -> Path:
    """The release wheel (or sdist; no dependencies) in dest, its sha256 checked against the index's.

    A file already in dest is reused only when its hash matches (dest may be a shared temporary
    directory: anything could have put a file there); otherwise it is removed and the file is
    downloaded again, into a fresh directory, and checked the same way before it is moved in.
    """
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}" + (".tar.gz" if sdist else "-*.whl")
    expected = index_sha256(requirement, sdist)
    for cached in sorted(dest.glob(pattern)):
        if file_sha256(cached) == expected:
            return cached
        cached.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as fresh:
        result = _pip("download", "--no-deps", *_format_args(sdist), "-q", "-d", fresh, requirement)
        wheels = sorted(Path(fresh).glob(pattern))  # or the sdist
        if result.returncode != 0 or len(wheels) != 1:
            raise ExportError(f"could not download {requirement} with pip:\n{result.stderr.strip()}")
        actual = file_sha256(wheels[0])
        if actual != expected:
            raise ExportError(
                f"the downloaded {wheels[0].name} has sha256 {actual}, but the "
                f"package index publishes {expected}: not using it"
            )
        return Path(shutil.move(wheels[0], dest / wheels[0].name))


def download_sdist(requirement: str, dest: Path) -> Path:
    """The release sdist in dest, checked as download_wheel checks a wheel."""
    return download_wheel(requirement, dest, sdist=True)


def read_sdist(path: Path, distribution: str, version: str) -> dict[str, bytes]:
    """The regular files of an sdist by path inside its top directory, which must be the release's
    (``vllm_ascend-0.18.0/``, its ``PKG-INFO`` naming that version)."""
    top = f"{distribution.replace('-', '_')}-{version}"
    refusal = f"{path} is not the sdist of {distribution} {version}"
    files = {}
    with tarfile.open(path) as archive:
        for member in archive:
            if member.name != top and not member.name.startswith(top + "/"):
                raise ExportError(f"{refusal}: {member.name} is outside {top}/")
            content = archive.extractfile(member) if member.isfile() else None
            if content is not None:
                files[member.name[len(top) + 1 :]] = content.read()
    if f"\nVersion: {version}\n" not in files.get("PKG-INFO", b"").decode(errors="replace"):
        raise ExportError(f"{refusal}: its PKG-INFO does not name {version}")
    return files


# ------------------------------------------------------------------------------ git machinery
def _git_env(manifest: Manifest) -> dict[str, str]:
    name, _, email = manifest.author.partition(" <")
    env = dict(os.environ)
    # Output must not depend on whoever runs this: no user/system git config, fixed identity/date.
    env.update(
        {
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email.rstrip(">"),
            "GIT_COMMITTER_NAME": name,
            "GIT_COMMITTER_EMAIL": email.rstrip(">"),
            "GIT_AUTHOR_DATE": manifest.date,
            "GIT_COMMITTER_DATE": manifest.date,
            "LC_ALL": "C",
            "TZ": "UTC",
        }
    )
    return env


def git(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {cwd}:\n{(result.stdout + result.stderr).strip()}")
    return result.stdout


def _touched_paths(patches: list[ResolvedPatch]) -> list[str]:
    paths = {p for patch in patches for p in patch.files}
    paths |= {edit.path for patch in patches for edit in patch.spec.edits}
    paths |= {path for patch in patches for path in patch.spec.deletes}
    return sorted(paths)


def build_base(
    manifest: Manifest, patches: list[ResolvedPatch], source: PristineSource, workdir: Path
) -> dict[str, bytes | None]:
    """A git repository at workdir holding the pristine version of every path the series touches."""
    env = _git_env(manifest)
    git(["init", "-q", str(workdir)], cwd=workdir.parent, env=env)
    pristine = {path: source.read(path) for path in _touched_paths(patches)}
    for path, content in pristine.items():
        if content is not None:
            (workdir / path).parent.mkdir(parents=True, exist_ok=True)
            (workdir / path).write_bytes(content)
    git(["add", "-A"], cwd=workdir, env=env)
    git(["commit", "-q", "--allow-empty", "-m", f"{manifest.distribution} {manifest.tag}"], cwd=workdir, env=env)
    git(["tag", "pristine"], cwd=workdir, env=env)
    return pristine


def commit_message(spec: PatchSpec) -> str:
    return f"{spec.subject}\n\n{spec.message}\n"


def generate(
    manifest: Manifest, patches: list[ResolvedPatch], source: PristineSource, workdir: Path
) -> dict[str, bytes]:
    """The series as {file name: content}, built in workdir (which must not exist yet)."""
    env = _git_env(manifest)
    workdir.mkdir(parents=True)
    repo = workdir / "repo"
    repo.mkdir()
    pristine = build_base(manifest, patches, source, repo)
    for patch in patches:
        for path, content in patch.files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_bytes(content)
        for edit in patch.spec.edits:
            _apply_edit(repo, edit, pristine.get(edit.path) is not None)
        for path in patch.spec.deletes:
            if pristine.get(path) is None:
                raise ExportError(f"{patch.spec.slug} deletes {path}, which is not in the pristine vllm-ascend sources")
            (repo / path).unlink()
        git(["add", "-A"], cwd=repo, env=env)
        message_file = workdir / f"{patch.spec.slug}.msg"
        message_file.write_text(commit_message(patch.spec))
        git(["commit", "-q", "-F", str(message_file)], cwd=repo, env=env)
    out = workdir / "series"
    git(
        [
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--full-index",
            "--no-renames",
            "-o",
            str(out),
            "pristine",
        ],
        cwd=repo,
        env=env,
    )
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _apply_edit(repo: Path, edit: Edit, exists: bool) -> None:
    target = repo / edit.path
    if not exists:
        where = "" if edit.path.startswith("vllm_ascend/") else " (read from the release sdist, or the tag of --git)"
        raise ExportError(f"edit target {edit.path} is not in the pristine vllm-ascend sources{where}")
    text = target.read_text()
    count = text.count(edit.find)
    if count != 1:
        raise ExportError(
            f"the anchor of the edit to {edit.path} occurs {count} times in the pristine file "
            f"(expected exactly once); upstream moved it, update the manifest:\n{edit.find}"
        )
    target.write_text(text.replace(edit.find, edit.replace))


def am(series: list[Path], repo: Path, env: dict[str, str]) -> None:
    """``git am`` the series; on failure, abort and name the patch that did not apply."""
    # --keep-non-patch: keep vllm-ascend's "[Scheduler][Feature]" subject tags, drop "[PATCH n/m]".
    result = subprocess.run(
        ["git", "am", "-q", "--keep-non-patch", *map(str, series)], cwd=repo, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        subprocess.run(["git", "am", "--abort"], cwd=repo, env=env, capture_output=True)
        raise ExportError(f"git am failed in {repo}:\n{(result.stdout + result.stderr).strip()}")


# ---------------------------------------------------------------------------------- commands
def series_dir(manifest: Manifest, root: Path) -> Path:
    return root / manifest.output


def export(manifest: Manifest, root: Path, source: PristineSource) -> list[str]:
    """Regenerate the series in place; returns the file names written."""
    patches = resolve(manifest, root)
    with tempfile.TemporaryDirectory() as tmp:
        series = generate(manifest, patches, source, Path(tmp) / "export")
    out = series_dir(manifest, root)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, content in series.items():
        (out / name).write_bytes(content)
    return sorted(series)


def check(manifest: Manifest, root: Path, source: PristineSource) -> list[str]:
    """Problems with the committed series (empty when it is current and applies)."""
    problems: list[str] = []
    patches = resolve(manifest, root)
    committed_dir = series_dir(manifest, root)
    committed = {p.name: p.read_bytes() for p in sorted(committed_dir.glob("*.patch"))}
    with tempfile.TemporaryDirectory() as tmp:
        expected = generate(manifest, patches, source, Path(tmp) / "export")
        for name in sorted(set(expected) | set(committed)):
            if name not in committed:
                problems.append(f"missing from {manifest.output}: {name}")
            elif name not in expected:
                problems.append(f"not produced by the manifest any more: {manifest.output}/{name}")
            elif committed[name] != expected[name]:
                problems.append(f"stale: {manifest.output}/{name}")
        if committed:
            repo = Path(tmp) / "apply"
            repo.mkdir()
            env = _git_env(manifest)
            build_base(manifest, patches, source, repo)
            try:
                am([committed_dir / name for name in sorted(committed)], repo, env)
            except ExportError as error:
                problems.append(f"the committed series does not apply to pristine {manifest.requirement}: {error}")
            else:
                problems += _compare_tree(repo, patches)
    return problems


def _compare_tree(repo: Path, patches: list[ResolvedPatch]) -> list[str]:
    problems = []
    for patch in patches:
        for path, content in patch.files.items():
            applied = repo / path
            if not applied.exists():
                problems.append(f"after git am, {path} is missing ({patch.sources[path]} is new)")
            elif applied.read_bytes() != content:
                problems.append(f"after git am, {path} differs from {patch.sources[path]}")
        problems += [
            f"after git am, {path} still exists (deleted by the series)"
            for path in patch.spec.deletes
            if (repo / path).exists()
        ]
    return problems


def verify_checkout(manifest: Manifest, root: Path, checkout: Path, workdir: Path) -> Path:
    """Clone checkout at the manifest's tag into workdir and ``git am`` the committed series."""
    env = _git_env(manifest)
    clone = workdir / f"vllm-ascend-{manifest.tag}"
    git(["clone", "-q", "--shared", "--no-checkout", str(checkout), str(clone)], cwd=workdir, env=env)
    git(["checkout", "-q", "--detach", manifest.tag], cwd=clone, env=env)
    series = sorted(series_dir(manifest, root).glob("*.patch"))
    if not series:
        raise ExportError(f"no patches in {manifest.output}")
    am(series, clone, env)
    problems = _compare_tree(clone, resolve(manifest, root))
    if problems:
        raise ExportError("\n".join(problems))
    return clone


# Loaded (as sitecustomize) by every Python process of a --run-tests session, subprocesses too.
# vllm-ascend's package __init__ of vllm_ascend/patch/platform imports torch_npu, which cannot
# exist on a CPU machine: the packages are registered without running it, and the patched
# checkout's vllm_ascend (e.g. platform.py, which a series may edit), vllm_ascend/core and
# vllm_ascend/patch/platform come first on their search paths (files only a build generates,
# such as _build_info.py, still come from the installed package).
_CPU_SHIM = """\
import sys, types
import vllm_ascend
_root = {root!r}
vllm_ascend.__path__.insert(0, _root + "/vllm_ascend")
import vllm_ascend.core
vllm_ascend.core.__path__.insert(0, _root + "/vllm_ascend/core")
for _name in ("vllm_ascend.patch", "vllm_ascend.patch.platform"):
    _module = types.ModuleType(_name)
    _module.__path__ = [_root + "/" + _name.replace(".", "/")]
    sys.modules[_name] = _module
"""


def run_series_unit_tests(manifest: Manifest, root: Path, clone: Path, workdir: Path, pytest_args: list[str]) -> int:
    """Run the unit tests the series adds, inside the patched clone, on this CPU environment."""
    tests = sorted(
        path
        for patch in resolve(manifest, root)
        for path in patch.files
        if path.startswith("tests/ut/") and Path(path).name.startswith("test_")
    )
    shim = workdir / "cpu-shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_CPU_SHIM.format(root=str(clone)))
    env = dict(os.environ, PYTHONPATH=str(shim))
    # --confcutdir: vllm-ascend's tests/ut/conftest.py needs torch_npu; the series' own
    # tests/ut/core/conftest.py provides everything its tests use.
    conf_dirs = sorted({str(clone / Path(t).parent) for t in tests})
    if len(conf_dirs) != 1:
        raise ExportError(f"--run-tests expects the series' unit tests in one directory: {conf_dirs}")
    cmd = [
        str(Path(sys.executable).with_name("pytest")),
        "-p",
        "no:cacheprovider",
        "--confcutdir",
        conf_dirs[0],
        "--rootdir",
        str(clone),
        *tests,
        *pytest_args,
    ]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=clone, env=env).returncode


def _origin(source: PristineSource, manifest: Manifest) -> str:
    if manifest.archive:  # every file from the commit's source archive
        return source.origin
    outside = f"{manifest.tag} of {source.git_repo}" if source.git_repo else source.sdist_path()
    return f"{source.origin}; outside the wheel: {outside}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", type=Path, default=REPO_ROOT, help="repository whose files are exported (default: this one)"
    )
    parser.add_argument(
        "--manifest", type=Path, help="default: the patches/*.toml whose [base] version is the installed vllm-ascend's"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed series is stale or does not apply"
    )
    parser.add_argument(
        "--wheel", type=Path, help="read pristine sources from this wheel instead of the installed copy"
    )
    parser.add_argument("--sdist", type=Path, help="read pristine files outside vllm_ascend/ from this sdist")
    parser.add_argument("--checkout", type=Path, help="a vllm-ascend git repository: git am the series onto its tag")
    parser.add_argument(
        "--git",
        type=Path,
        default=os.environ.get("VLLM_ASCEND_GIT") or None,
        help="a vllm-ascend git repository (bare or not) holding the tag: pristine files outside the wheel "
        "(default: $VLLM_ASCEND_GIT, else --checkout, else the release sdist)",
    )
    parser.add_argument("--keep", type=Path, help="with --checkout: leave the patched clone in this new directory")
    parser.add_argument(
        "--run-tests",
        nargs=argparse.REMAINDER,
        metavar="PYTEST_ARGS",
        help="with --checkout: then run the unit tests the series adds, in the "
        "patched clone, with this Python environment (CPU)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        try:
            manifest = load_manifest(args.manifest)
        except ExportError as error:
            raise ExportError(f"{error}\nGive one with --manifest.") from None
        source = PristineSource(manifest, wheel=args.wheel, git_repo=args.git or args.checkout, sdist=args.sdist)
        if args.check:
            problems = check(manifest, root, source)
            if problems:
                print(
                    "export_patches --check FAILED (regenerate with "
                    "`python scripts/export_patches.py`):\n  " + "\n  ".join(problems),
                    file=sys.stderr,
                )
                return 1
            origin = _origin(source, manifest)
            print(f"{manifest.output} is current and applies to pristine {manifest.requirement} ({origin})")
        elif not args.checkout:
            written = export(manifest, root, source)
            origin = _origin(source, manifest)
            print(f"wrote {len(written)} patches to {manifest.output} (pristine {manifest.requirement} from {origin}):")
            for name in written:
                print(f"  {name}")
        if args.checkout:
            with tempfile.TemporaryDirectory() as tmp:
                workdir = args.keep or Path(tmp)
                workdir.mkdir(parents=True, exist_ok=True)
                clone = verify_checkout(manifest, root, args.checkout, workdir)
                print(
                    f"git am of {manifest.output} onto {manifest.tag} of {args.checkout} "
                    f"succeeded" + (f": {clone}" if args.keep else ""),
                    flush=True,
                )
                if args.run_tests is not None:
                    return run_series_unit_tests(manifest, root, clone, workdir, args.run_tests)
        elif args.run_tests is not None:
            parser.error("--run-tests needs --checkout")
    except ExportError as error:
        print(f"export_patches: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
