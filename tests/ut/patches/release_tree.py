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

from export_patches import (
    Manifest,
    PristineSource,
    SourceArchive,
    _git_env,
    am,
    load_manifest,
    series_dir,
    verify_checkout,
)


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


def patched_tree(manifest: Manifest, root: Path, workdir: Path) -> Path:
    """The release's tree with the committed series applied (``git am``) and checked against the project.

    A commit's line (main, ``[base] archive``) without ``$VLLM_ASCEND_GIT``: its source archive committed in a
    fresh repository (a git tag named like the commit's hash would not resolve to that commit), then the series.
    """
    if not manifest.archive or upstream_git() is not None:
        return verify_checkout(manifest, root, release_repository(manifest, workdir), workdir)
    archive = SourceArchive(manifest, root).path
    with tarfile.open(archive) as tree:
        tree.extractall(workdir, filter="data")
    (repo,) = [path for path in workdir.iterdir() if path.is_dir()]
    _git(workdir, "init", "-q", str(repo))
    _git(repo, "add", "-A", "--force")
    _git(repo, "commit", "-q", "-m", f"{manifest.distribution} {manifest.tag} (source archive)")
    am(sorted(series_dir(manifest, root).glob("*.patch")), repo, _git_env(manifest))
    return repo
