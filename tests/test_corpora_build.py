"""The embedded corpus, the text extractors, and the corpus builder (no network)."""

import gzip
import hashlib
import json
import shutil
import struct
import subprocess
import zlib

import pyarrow.parquet as pq
import pytest

from bov_jax.corpora import registry
from bov_jax.corpora.archives import file_sha256
from bov_jax.corpora.corpus_build import MANIFEST, Source, build_corpus
from bov_jax.corpora.sources import austen, dictd, files, fortunes, html_text, rdata, sword
from bov_jax.corpora.sources.text import split_document, unwrap_paragraphs
from bov_jax.data import shards
from bov_jax.data.config import EMBEDDED_DIR


def test_embedded_corpus_and_manifest():
    manifest = json.loads((EMBEDDED_DIR / MANIFEST).read_text())
    files = shards.list_shards(EMBEDDED_DIR)
    assert [s["file"] for s in manifest["shards"]] == [p.name for p in files]
    assert [s["split"] for s in manifest["shards"]] == ["train"] * (len(files) - 1) + ["val"]
    for entry, path in zip(manifest["shards"], files):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        table = pq.read_table(path)
        assert table.num_rows == entry["documents"]
        assert sum(len(t.encode()) for t in table.column("text").to_pylist()) == entry["text_bytes"]
        assert set(table.column("source").to_pylist()) <= {s["name"] for s in manifest["sources"]}
    assert 5e6 <= manifest["text_bytes"] <= 15e6
    for source in manifest["sources"]:
        assert (
            source["licence"]
            and source["version"]
            and source["archive_sha256"]
            and source["documents"] > 0
        )
    assert sum(s["documents"] for s in manifest["sources"]) == manifest["documents"]


def _xdr_int(*values):
    return struct.pack(f">{len(values)}i", *values)


def _xdr_strings(strings, flags=16):
    out = _xdr_int(flags, len(strings))
    for s in strings:
        data = s.encode()
        out += _xdr_int(9, len(data)) + data
    return out


def _xdr_named_list(names, items):
    """VECSXP with a names attribute."""
    attrs = (
        _xdr_int(2 | 1 << 10, 1) + _xdr_int(9, 5) + b"names" + _xdr_strings(names) + _xdr_int(254)
    )
    return _xdr_int(19 | 1 << 9, len(items)) + b"".join(items) + attrs


def test_rdata_and_austen_extractor(tmp_path):
    header = b"X\n" + _xdr_int(2, 0x40201, 0x20300)
    novel = [
        "EMMA",
        "",
        "VOLUME I",
        "",
        "CHAPTER I",
        "",
        "Emma Woodhouse, handsome,",
        "clever, and rich.",
        "",
        "She was the youngest.",
        "CHAPTER II",
        "",
        "Mr. Weston was a native.",
    ]
    blob = zlib.compress(header + _xdr_strings(novel))
    entry = struct.pack(">I", len(header) + 1000) + blob
    index = header + _xdr_named_list(
        ["variables"], [_xdr_named_list(["emma"], [_xdr_int(13, 2, 0, len(entry))])]
    )
    data = tmp_path / austen.RDX
    data.parent.mkdir(parents=True)
    data.write_bytes(gzip.compress(index))
    data.with_suffix(".rdb").write_bytes(entry)
    assert rdata.read_lazyload_db(data) == {"emma": novel}
    assert list(austen.extract(tmp_path)) == [
        "Emma\n\nCHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich.\n\nShe was the youngest.",
        "Emma\n\nCHAPTER II\n\nMr. Weston was a native.",
    ]


def test_sword_extractor(tmp_path):
    entries = [
        "",
        '<milestone type="x-importer"/>',
        '<chapter n="1" osisID="Gen.1" sID="Gen.1"/>',
        '<w lemma="x">In</w> <w>the</w> <w>beginning</w>, <w>God</w>'
        "<note>a footnote</note><w>created</w>.",
        '<div sID="p1" type="x-p"/>A new paragraph &amp; more.',
        '<chapter n="2" osisID="Gen.2" sID="Gen.2"/><title>The Seventh Day</title>',
        "Rest.",
    ]
    block = "".join(entries).encode()
    offsets, pos = [], 0
    for e in entries:
        offsets.append((pos, len(e.encode())))
        pos += len(e.encode())
    offsets.append(offsets[-1])  # a commentary-style link to the previous entry
    module = tmp_path / "usr/share/sword/modules/texts/ztext/tiny"
    module.mkdir(parents=True)
    compressed = zlib.compress(block)
    (module / "ot.bzz").write_bytes(compressed)
    (module / "ot.bzs").write_bytes(struct.pack("<III", 0, len(compressed), len(block)))
    (module / "ot.bzv").write_bytes(b"".join(struct.pack("<IIH", 0, o, n) for o, n in offsets))
    conf = tmp_path / sword.MODS_D / "tiny.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[tiny]\nDataPath=./modules/texts/ztext/tiny/\nModDrv=zText\n")
    assert list(sword.extract_module(tmp_path, "tiny")) == [
        "Gen 1\n\nIn the beginning, God created.\n\nA new paragraph & more.",
        "Gen 2\n\nThe Seventh Day\n\nRest.",  # the linked entry is read once
    ]


def test_dictd_extractor(tmp_path):
    entries = ["apple\n  A fruit.", "banana\n  Another fruit.", "cherry\n  A small fruit."]
    data = "".join(entries).encode()
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n):
        return digits[n // 64] + digits[n % 64] if n >= 64 else digits[n]

    lines, pos = ["00-database-info\tA\tB"], 0
    for word, e in zip(["apple", "banana", "cherry"], entries):
        lines.append(f"{word}\t{b64(pos)}\t{b64(len(e))}")
        pos += len(e)
    lines.append(f"fruit\t{b64(0)}\t{b64(len(entries[0]))}")  # a second headword, same entry
    index = tmp_path / "usr/share/dictd/tiny.index"
    index.parent.mkdir(parents=True)
    index.write_text("\n".join(lines) + "\n")
    index.with_suffix(".dict.dz").write_bytes(gzip.compress(data))
    assert list(dictd.read_entries(index)) == entries
    assert list(dictd.extract(tmp_path, "tiny", target_bytes=50)) == [
        entries[0] + "\n\n" + entries[1],
        entries[2],
    ]


def test_html_fortunes_and_text_helpers(tmp_path):
    page = (
        "<html><head><title>x</title><script>var a;</script></head><body><nav>menu</nav>"
        "<h1>Title</h1><p>Some <b>bold</b>\n text.</p>"
        "<pre>code  line 1\n  line 2</pre></body></html>"
    )
    assert html_text.html_to_text(page) == "Title\n\nSome bold text.\n\ncode  line 1\n  line 2"
    quotes = tmp_path / fortunes.DIRECTORY / "wisdom"
    quotes.parent.mkdir(parents=True)
    quotes.write_text("First quote.\n%\nSecond quote.\n%\nThird.\n")
    (tmp_path / fortunes.DIRECTORY / "wisdom.dat").write_bytes(b"\x00\x01")
    assert list(fortunes.extract(tmp_path, target_bytes=30)) == [
        "First quote.\n\nSecond quote.",
        "Third.",
    ]
    assert unwrap_paragraphs(["a", "b", "", "", "c"]) == "a b\n\nc"
    assert split_document("aaaa\n\nbbbb\n\ncccc", 12) == ["aaaa\n\nbbbb", "cccc"]


@pytest.fixture
def local_deb(tmp_path):
    """A real .deb built locally (dpkg-deb), placed where registry.fetch looks first."""
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: tiny-texts\nVersion: 1.2-3\nArchitecture: all\n"
        "Maintainer: t <t@example.org>\nDescription: t\n"
    )
    texts = root / "usr/share/tiny"
    texts.mkdir(parents=True)
    for i in range(40):
        (texts / f"doc{i:02d}.txt").write_text(f"Document {i}.\n\n" + "Some words here. " * (i + 1))
    downloads = tmp_path / "work/downloads"
    downloads.mkdir(parents=True)
    subprocess.run(
        ["dpkg-deb", "--build", "-Zgzip", str(root), str(downloads / "tiny-texts_1.2-3_all.deb")],
        check=True,
        capture_output=True,
    )
    return tmp_path / "work"


def test_build_corpus_is_deterministic_and_resumable(local_deb, tmp_path):
    (deb,) = (local_deb / "downloads").glob("*.deb")
    source = Source(
        name="tiny",
        package=registry.Package("deb", "tiny-texts", file_sha256(deb)),
        licence="CC0",
        extract=lambda root: files.extract(root, ("usr/share/tiny/*.txt",)),
        members=("usr/share/tiny/*",),
    )
    kwargs = dict(
        corpus_name="t",
        command="test",
        seed=1,
        shard_bytes=4000,
        val_fraction=0.2,
        row_group_size=8,
    )
    first = build_corpus([source], tmp_path / "out", local_deb, **kwargs)
    assert first["sources"][0]["version"] == "1.2-3" and first["documents"] == 40
    assert first["sources"][0]["archive_sha256"] == file_sha256(deb)
    assert [p.name for p in (local_deb / "documents").iterdir()] == [
        f"tiny-{file_sha256(deb)[:16]}.parquet"  # documents are reused only for the same archive
    ]
    assert [s["split"] for s in first["shards"]][-1] == "val" and len(first["shards"]) >= 3
    val = pq.read_table(shards.split_files(tmp_path / "out", "val")[0])
    assert sum(len(t.encode()) for t in val.column("text").to_pylist()) >= 0.2 * first["text_bytes"]
    # Resume: the unpacked tree is gone, the extracted documents are reused; same shards.
    shutil.rmtree(local_deb / "unpacked")
    (tmp_path / "out" / "shard_00099.parquet").write_bytes(b"stale")
    second = build_corpus([source], tmp_path / "out", local_deb, **kwargs)
    assert second == first
    assert not (local_deb / "unpacked").exists()
    assert [p.name for p in shards.list_shards(tmp_path / "out")] == [
        s["file"] for s in first["shards"]
    ]
