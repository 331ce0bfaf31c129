"""Text extractors, one per upstream file format (R data, SWORD modules, dictd, HTML, ...).

Each extractor takes the directory a package was unpacked into and yields document strings.
"""
