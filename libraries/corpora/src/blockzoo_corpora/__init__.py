"""blockzoo-corpora: the input formats of `blockzoo prepare` that need a library (pyarrow, zstandard): `parquet`,
`arrow`, `datasets` (a directory written by `save_to_disk`) and the `zst` compression of line files."""
