"""The registered names' config classes: the formats have no settings, the classes only name the kind."""

from __future__ import annotations

from blockzoo.config import configclass
from blockzoo.data.formats import InputCompressionConfig, InputFormatConfig


@configclass
class ParquetFormatConfig(InputFormatConfig):
    """`parquet`: the `--field` column of each row."""


@configclass
class ArrowFormatConfig(InputFormatConfig):
    """`arrow`: Arrow IPC files and streams (`datasets`' cache files among them), the `--field` column of each row."""


@configclass
class DatasetsFormatConfig(InputFormatConfig):
    """`datasets`: a directory written by `datasets`' `save_to_disk`, read as its Arrow files."""


@configclass
class ZstdCompressionConfig(InputCompressionConfig):
    """`.zst` line files (zstandard)."""
