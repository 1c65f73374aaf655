"""blockzoo-corpora's hooks: its input formats and compression (config classes only: pyarrow and zstandard are
imported when a file is read)."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_corpora.config import (
    ArrowFormatConfig,
    DatasetsFormatConfig,
    ParquetFormatConfig,
    ZstdCompressionConfig,
)


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="`blockzoo prepare` inputs: Parquet, Arrow IPC, saved `datasets`, .zst files")


@hookimpl
def register_components(register) -> None:
    register("parquet", ParquetFormatConfig, "blockzoo_corpora.columnar:ParquetFormat")
    register("arrow", ArrowFormatConfig, "blockzoo_corpora.columnar:ArrowFormat")
    register("datasets", DatasetsFormatConfig, "blockzoo_corpora.saved:DatasetsFormat")
    register("zst", ZstdCompressionConfig, "blockzoo_corpora.compression:open_zstd")
