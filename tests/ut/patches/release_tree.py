"""vllm-ascend's release tree outside ``vllm_ascend/`` for the patch-tool tests: a stand-in sdist, or the real one.

export_patches reads files outside the wheel from the release's sdist (or a git tag). The synthetic
series of the tool tests only adds files there, so they get a stand-in sdist holding nothing but
its ``PKG-INFO`` and stay offline. The tests of the committed series against upstream's own CI
scripts need the real tree: the release sdist from the package index (what CI has), made a git
repository at the manifest's tag, or the repository ``$VLLM_ASCEND_GIT`` names when it is set.
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from export_patches import Manifest, PristineSource, load_manifest


def fake_sdist(
    path: Path, distribution: str, version: str, files: dict[str, str] | None = None, top: str | None = None
) -> Path:
    """An sdist-shaped archive of a release holding ``PKG-INFO`` and ``files`` (in ``top``, by default
    the release's top directory)."""
    top = top or f"{distribution.replace('-', '_')}-{version}"
    contents = {"PKG-INFO": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n", **(files or {})}
    with tarfile.open(path, "w:gz") as archive:
        for name, text in contents.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def upstream_git() -> Path | None:
    value = os.environ.get("VLLM_ASCEND_GIT")
    return Path(value) if value else None


@functools.cache
def release_source(manifest_path: Path) -> PristineSource:
    """The pristine release of a project manifest: the tag of ``$VLLM_ASCEND_GIT``, else the sdist
    (downloaded once per session; export_patches checks it against the package index)."""
    return PristineSource(load_manifest(manifest_path), git_repo=upstream_git())


def _git(cwd: Path, *args: str) -> None:
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", *ident, *args], cwd=cwd, env=env, check=True, capture_output=True)


def release_repository(manifest: Manifest, workdir: Path) -> Path:
    """A git repository holding the manifest's tag: ``$VLLM_ASCEND_GIT``, else the release sdist's
    tree committed and tagged in workdir (the sdist holds the tag's tracked files; it lacks only the
    contents of git submodules, which the series does not touch)."""
    given = upstream_git()
    if given is not None:
        return given
    if manifest.archive:
        # A commit's line (main): its source archive is no git history, and a git tag named like the commit's
        # hash would not resolve to a commit of another repository.
        pytest.skip(f"{manifest.path.name}: set VLLM_ASCEND_GIT to a vllm-ascend git repository holding {manifest.tag}")
    source = release_source(manifest.path)
    source.sdist_files()  # its top directory and version checked
    with tarfile.open(source.sdist_path()) as archive:
        archive.extractall(workdir, filter="data")  # file modes kept
    repo = workdir / f"{manifest.distribution.replace('-', '_')}-{manifest.version}"
    _git(workdir, "init", "-q", str(repo))
    _git(repo, "add", "-A", "--force")
    _git(repo, "commit", "-q", "-m", f"{manifest.distribution} {manifest.version} (release sdist)")
    _git(repo, "tag", manifest.tag)
    return repo
