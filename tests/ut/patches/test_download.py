"""export_patches.download_wheel / download_sdist: a file is used only when its sha256 is the package index's.

The index is a real PEP 503 "simple" index on disk (file:// URLs) and pip is the real pip, so the
test runs offline; only the index's location is set, through pip's own environment variables.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
from export_patches import ExportError, download_sdist, download_wheel, index_sha256, read_sdist
from release_tree import fake_sdist

NAME, VERSION = "balance-fake-dist", "1.0"
REQUIREMENT = f"{NAME}=={VERSION}"
WHEEL = f"balance_fake_dist-{VERSION}-py3-none-any.whl"
SDIST = f"balance_fake_dist-{VERSION}.tar.gz"


def _wheel(path: Path, payload: str) -> Path:
    dist_info = f"balance_fake_dist-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("balance_fake/__init__.py", payload)
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n")
        archive.writestr(
            f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{dist_info}/RECORD", "")
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, archive: Path) -> Path:
    """A simple index publishing one file with its sha256; pip sees only this index."""
    page = tmp_path / "simple" / NAME
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<html><body><a href="{archive.as_uri()}#sha256={_sha256(archive)}">{archive.name}</a></body></html>\n'
    )
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "simple").as_uri())
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return archive


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "files").mkdir()
    return _serve(tmp_path, monkeypatch, _wheel(tmp_path / "files" / WHEEL, "GOOD = 1\n"))


def test_the_index_hash_is_read_and_a_fresh_download_checked_against_it(index: Path, tmp_path: Path) -> None:
    assert index_sha256(REQUIREMENT) == _sha256(index)
    got = download_wheel(REQUIREMENT, tmp_path / "cache")
    assert got == tmp_path / "cache" / WHEEL and got.read_bytes() == index.read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [WHEEL]


def test_a_cached_wheel_is_reused_only_when_its_hash_matches(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    planted = _wheel(cache / WHEEL, "EVIL = 1\n")  # same name, other content
    got = download_wheel(REQUIREMENT, cache)
    assert got.read_bytes() == index.read_bytes()  # replaced by the index's wheel

    inode = got.stat().st_ino
    assert download_wheel(REQUIREMENT, cache).stat().st_ino == inode  # verified, reused
    assert planted == got


def test_a_download_that_is_not_the_indexed_file_is_refused(index: Path, tmp_path: Path) -> None:
    _wheel(index, "CHANGED = 1\n")  # the file changed after the index published its hash
    with pytest.raises(ExportError, match="DO NOT MATCH THE HASHES"):  # pip's own check
        download_wheel(REQUIREMENT, tmp_path / "cache")
    assert list(tmp_path.glob("cache/**/*.whl")) == []


def test_a_downloaded_wheel_is_checked_again_before_it_is_kept(
    index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should pip fetch another file than the one whose hash the index gave (the index changed
    between the two pip runs, say), the download is refused and not kept."""
    import export_patches

    monkeypatch.setattr(export_patches, "index_sha256", lambda requirement, sdist=False: "0" * 64)
    with pytest.raises(ExportError, match=f"has sha256 {_sha256(index)}, but the package index publishes {'0' * 64}"):
        download_wheel(REQUIREMENT, tmp_path / "cache")
    assert list(tmp_path.glob("cache/**/*.whl")) == []


def test_without_an_index_hash_no_wheel_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "simple"
    (empty / NAME).mkdir(parents=True)
    (empty / NAME / "index.html").write_text("<html><body></body></html>\n")
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", empty.as_uri())
    cache = tmp_path / "cache"
    cache.mkdir()
    _wheel(cache / WHEEL, "UNVERIFIABLE = 1\n")
    with pytest.raises(ExportError, match="could not learn the sha256"):
        download_wheel(REQUIREMENT, cache)


def test_an_sdist_is_fetched_and_checked_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip prepares an sdist's metadata (here a setup.py, with this environment's setuptools: no
    build isolation, as vllm-ascend's needs) before it saves it; the hash check is the wheel's."""
    (tmp_path / "files").mkdir()
    setup = f"from setuptools import setup\nsetup(name={NAME!r}, version={VERSION!r}, py_modules=[])\n"
    sdist = fake_sdist(tmp_path / "files" / SDIST, NAME, VERSION, {"setup.py": setup, "payload.txt": "GOOD\n"})
    _serve(tmp_path, monkeypatch, sdist)
    assert index_sha256(REQUIREMENT, sdist=True) == _sha256(sdist)
    cache = tmp_path / "cache"
    cache.mkdir()
    fake_sdist(cache / SDIST, NAME, VERSION, {"payload.txt": "EVIL\n"})  # same name, other content
    got = download_sdist(REQUIREMENT, cache)
    assert got == cache / SDIST and got.read_bytes() == sdist.read_bytes()
    assert read_sdist(got, NAME, VERSION)["payload.txt"] == b"GOOD\n"
