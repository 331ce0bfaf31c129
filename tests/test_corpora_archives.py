"""Archives as untrusted input: crafted tar and zip members are refused, digests are pinned."""

import io
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from bov_jax.corpora import registry
from bov_jax.corpora.archives import extract_tar, extract_zip, file_sha256
from bov_jax.errors import DataError

GOOD = ("pkg/data/a.txt", b"alpha\n")


def _tar(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    """A .tar.gz holding regular files given as (name, bytes) and crafted TarInfo entries."""
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return path


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _zip(path: Path, members: list[tuple[str, bytes] | zipfile.ZipInfo], link: str = "") -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for member in members:
            if isinstance(member, zipfile.ZipInfo):
                zf.writestr(member, link)
            else:
                zf.writestr(*member)
    return path


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


def _unpack(archive: Path, tmp_path: Path, patterns=("pkg/*",)) -> Path:
    dest = tmp_path / "dest"
    fetched = registry.Fetched(archive, "pkg", "1", file_sha256(archive))
    return registry.unpack(fetched, dest, patterns)


def test_regular_files_are_extracted_and_reused(tmp_path):
    archive = _tar(tmp_path / "good.tgz", [GOOD, ("pkg/doc/b.txt", b"beta"), ("other/c", b"c")])
    dest = _unpack(archive, tmp_path, ("pkg/*",))
    assert (dest / "pkg/data/a.txt").read_bytes() == b"alpha\n"
    assert {p.relative_to(dest).as_posix() for p in _files(dest)} == {
        "pkg/data/a.txt",
        "pkg/doc/b.txt",
        ".complete",
    }
    (dest / "pkg/doc/b.txt").unlink()  # a finished tree of the same archive is reused as is
    assert not (_unpack(archive, tmp_path) / "pkg/doc/b.txt").exists()
    zipped = _zip(tmp_path / "good.zip", [GOOD])
    shutil.rmtree(dest)
    assert (_unpack(zipped, tmp_path) / "pkg/data/a.txt").read_bytes() == b"alpha\n"


UNSAFE = "an absolute path, '..' or a path outside"


@pytest.mark.parametrize(
    "member, message",
    [
        (("pkg/data/../../../x", b"escaped"), f"'pkg/data/../../../x': {UNSAFE}"),
        (("/tmp/bov_jax_absolute_x", b"escaped"), f"'/tmp/bov_jax_absolute_x': {UNSAFE}"),
        (_link("pkg/data/passwd", "/etc/passwd", tarfile.LNKTYPE), "hard link to '/etc/passwd'"),
        (_link("pkg/data/up", "../../etc/passwd", tarfile.LNKTYPE), "hard link to '../../etc"),
    ],
    ids=["traversal", "absolute", "hardlink-passwd", "hardlink-up"],
)
def test_crafted_tar_members_are_refused(tmp_path, member, message):
    archive = _tar(tmp_path / "bad.tgz", [GOOD, member])
    before = _files(tmp_path)
    with pytest.raises(DataError, match="bad.tgz: refusing member") as err:
        _unpack(archive, tmp_path)
    assert message in str(err.value)
    written = _files(tmp_path) - before
    assert all(p.is_relative_to(tmp_path / "dest") for p in written), written
    assert not any(p.name in ("x", "passwd", "up") for p in written)
    assert not Path("/tmp/bov_jax_absolute_x").exists()
    assert not (tmp_path / "dest/.complete").exists()


def test_links_are_never_created(tmp_path, caplog):
    archive = _tar(
        tmp_path / "links.tgz",
        [
            GOOD,
            _link("pkg/data/out", "/etc/passwd", tarfile.SYMTYPE),
            _link("pkg/data/in", "a.txt", tarfile.SYMTYPE),
            _link("pkg/data/twin", "pkg/data/a.txt", tarfile.LNKTYPE),
            _link("pkg/data/orphan", "other/c", tarfile.LNKTYPE),
        ],
    )
    dest = _unpack(archive, tmp_path)
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert {p.name for p in (dest / "pkg/data").iterdir()} == {"a.txt", "twin"}
    twin = dest / "pkg/data/twin"  # a copy of an extracted file, not a second name for it
    assert twin.read_bytes() == b"alpha\n" and twin.stat().st_nlink == 1
    skipped = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert skipped == [
        f"{archive}: skipping member 'pkg/data/in', a symbolic link to 'a.txt'",
        f"{archive}: skipping member 'pkg/data/orphan', a hard link to a member not extracted "
        "to 'other/c'",
        f"{archive}: skipping member 'pkg/data/out', a symbolic link to '/etc/passwd'",
    ]


def test_unselected_members_are_checked_too(tmp_path):
    archive = _tar(tmp_path / "bad.tgz", [GOOD, ("elsewhere/../../x", b"escaped")])
    with pytest.raises(DataError, match=f"refusing member 'elsewhere/../../x': {UNSAFE}"):
        _unpack(archive, tmp_path, ("pkg/*",))


def test_member_resolving_outside_through_an_existing_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "pkg").symlink_to(outside)
    archive = _tar(tmp_path / "bad.tgz", [GOOD])
    with tarfile.open(archive) as tar, pytest.raises(DataError, match=UNSAFE):
        extract_tar(tar, "bad.tgz", dest)
    assert not any(outside.iterdir())


def _zip_symlink(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize(
    "member",
    [("pkg/data/../../../x", b"escaped"), ("/tmp/bov_jax_absolute_x", b"escaped")],
    ids=["traversal", "absolute"],
)
def test_crafted_zip_members_are_refused(tmp_path, member):
    archive = _zip(tmp_path / "bad.zip", [GOOD, member])
    dest = tmp_path / "dest"
    before = _files(tmp_path)
    with zipfile.ZipFile(archive) as zf, pytest.raises(DataError) as err:
        extract_zip(zf, "bad.zip", dest, ("pkg/*",))
    assert f"bad.zip: refusing member {member[0]!r}: {UNSAFE}" in str(err.value)
    assert all(p.is_relative_to(dest) for p in _files(tmp_path) - before)
    assert not Path("/tmp/bov_jax_absolute_x").exists()


def test_zip_symlink_is_skipped(tmp_path, caplog):
    archive = _zip(tmp_path / "links.zip", [GOOD, _zip_symlink("pkg/data/link")], "/etc/passwd")
    with zipfile.ZipFile(archive) as zf:
        assert extract_zip(zf, "links.zip", tmp_path / "dest", ("pkg/*",)) == 1
    assert not (tmp_path / "dest/pkg/data/link").exists()
    assert "skipping member 'pkg/data/link', a symbolic link to '/etc/passwd'" in caplog.text


class LocalMirror:
    """A registry whose downloads copy archives from a local directory; counts the downloads."""

    def __init__(self, mirror: Path):
        self.mirror, self.downloads = mirror, 0

    def find(self, name: str, download_dir: Path) -> Path | None:
        path = download_dir / f"{name}.tgz"
        return path if path.exists() else None

    def download(self, name: str, download_dir: Path) -> Path:
        self.downloads += 1
        return Path(shutil.copy(self.mirror / f"{name}.tgz", download_dir))

    def registries(self) -> dict[str, registry.Registry]:
        return {"local": registry.Registry(self.find, self.download, lambda path: ("pkg", "1"))}


@pytest.fixture
def mirror(tmp_path) -> LocalMirror:
    (tmp_path / "mirror").mkdir()
    _tar(tmp_path / "mirror/pkg.tgz", [GOOD])
    return LocalMirror(tmp_path / "mirror")


def test_download_is_verified_against_the_pin(tmp_path, mirror):
    pin = file_sha256(mirror.mirror / "pkg.tgz")
    fetched = registry.fetch(
        registry.Package("local", "pkg", pin), tmp_path / "dl", mirror.registries()
    )
    assert (fetched.path, fetched.sha256, mirror.downloads) == (tmp_path / "dl/pkg.tgz", pin, 1)
    registry.fetch(registry.Package("local", "pkg", pin), tmp_path / "dl", mirror.registries())
    assert mirror.downloads == 1  # a verified cached archive is reused

    with pytest.raises(DataError, match=f"archive {tmp_path}/dl/pkg.tgz has sha256 {pin}, but"):
        registry.fetch(
            registry.Package("local", "pkg", "0" * 64), tmp_path / "dl", mirror.registries()
        )
    assert not (tmp_path / "dl/pkg.tgz").exists()  # the refused download is not kept


def test_cached_archive_with_another_digest_is_fetched_again(tmp_path, mirror):
    pin = file_sha256(mirror.mirror / "pkg.tgz")
    (tmp_path / "dl").mkdir()
    _tar(tmp_path / "dl/pkg.tgz", [("pkg/data/a.txt", b"tampered")])
    fetched = registry.fetch(
        registry.Package("local", "pkg", pin), tmp_path / "dl", mirror.registries()
    )
    assert mirror.downloads == 1 and file_sha256(fetched.path) == pin


def test_unpack_verifies_the_archive_before_extracting(tmp_path):
    archive = _tar(tmp_path / "pkg.tgz", [GOOD])
    fetched = registry.Fetched(archive, "pkg", "1", file_sha256(archive))
    _tar(archive, [("pkg/data/a.txt", b"swapped")])  # replaced after it was fetched
    with pytest.raises(DataError, match="pkg.tgz has sha256"):
        registry.unpack(fetched, tmp_path / "dest")
    assert not _files(tmp_path / "dest")


def _ar_member(name: str, data: bytes) -> bytes:
    header = f"{name:<16}{0:<12}{0:<6}{0:<6}{644:<8}{len(data):<10}`\n".encode()
    return header + data + b"\n" * (len(data) % 2)


def test_crafted_deb_is_refused_while_streaming(tmp_path):
    """A .deb (ar: debian-binary, control.tar.gz, data.tar.gz) with a traversal member."""
    control = _tar(tmp_path / "control.tar.gz", [("./control", b"Package: x\nVersion: 1\n")])
    data = _tar(tmp_path / "data.tar.gz", [GOOD, ("pkg/data/../../../x", b"escaped")])
    deb = tmp_path / "x_1_all.deb"
    deb.write_bytes(
        b"!<arch>\n"
        + _ar_member("debian-binary", b"2.0\n")
        + _ar_member("control.tar.gz", control.read_bytes())
        + _ar_member("data.tar.gz", data.read_bytes())
    )
    before = _files(tmp_path)
    with pytest.raises(DataError, match="x_1_all.deb: refusing member 'pkg/data/../../../x'"):
        _unpack(deb, tmp_path)
    assert all(p.is_relative_to(tmp_path / "dest") for p in _files(tmp_path) - before)
