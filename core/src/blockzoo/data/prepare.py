"""`blockzoo prepare`: tokenize a corpus into a dataset the `memmap` type reads. Torch-free.

The inputs (`inputs`: files, directories, globs of every format there) are cut into work units (`inputs.plan_units`:
they depend on the inputs alone); each unit is tokenized into one shard (`storage`) by one of `workers` processes,
which read their documents in batches (`readers`), so memory stays flat whatever the corpus size. Shards are
numbered by unit, so one worker and many write the same files. The tokenizer's end-of-document token, when it has
one (the byte tokenizer always does), is appended to every document.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from blockzoo.data.errors import DatasetError
from blockzoo.data.inputs import InputFile, WorkUnit, plan_units, resolve_inputs
from blockzoo.data.readers import read_piece
from blockzoo.data.storage import (
    DatasetFiles,
    ShardFiles,
    ShardWriter,
    begin_dataset,
    finish_dataset,
    temporary,
    token_dtype,
)
from blockzoo.data.tokenizer import Tokenizer, load_tokenizer

_REPORT_SECONDS = 0.2  # how often a worker reports its progress


def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    tokenizer: str | Path = "byte",
    format: str = "auto",
    field: str = "text",
    eod_token: str | None = None,
    workers: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize the documents of `inputs` into the dataset with path prefix `output`; returns its metadata.
    `progress`: show a bar on stderr when it is a terminal."""
    files = resolve_inputs(inputs, format)
    if Path(output).is_dir():
        raise DatasetError(f"the output {output} is a directory; give a path prefix such as {Path(output) / 'tokens'}")
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DatasetError(f"--workers must be at least 1, got {workers}")
    encoder = load_tokenizer(tokenizer, eod_token=eod_token)
    units = plan_units(files)
    dataset = DatasetFiles(Path(output))
    jobs = [
        _Job(unit, dataset.shard(dataset.shard_name(unit.number, len(units))).stem, str(tokenizer), eod_token, field,
             token_dtype(encoder.vocab_size))
        for unit in units
    ]  # fmt: skip
    begin_dataset(dataset)
    try:
        from blockzoo.data.progress import PrepareProgress

        with PrepareProgress(total_bytes=sum(unit.size for unit in units), enabled=progress) as bar:
            if min(workers, len(jobs)) == 1:
                summaries = [_tokenize(job, encoder, bar.advance) for job in jobs]
            else:
                summaries = _in_processes(jobs, min(workers, len(jobs)), bar.advance)
        shards = [summary for summary in summaries if summary["num_documents"] > 0]
        if not shards:
            names = ", ".join(str(file.path) for file in files)
            raise DatasetError(f"the corpus is empty: {names} hold no document with text")
        return finish_dataset(dataset, encoder, shards, _sources(files))
    except BaseException:
        for job in jobs:
            shard = ShardFiles(job.stem)
            temporary(shard.tokens).unlink(missing_ok=True)
            temporary(shard.index).unlink(missing_ok=True)
        raise


def _sources(files: Sequence[InputFile]) -> list[str]:
    return [str(file.path) for file in files]


@attrs.frozen
class _Job:
    """What a worker needs to tokenize one unit into one shard (sent to worker processes: plain values)."""

    unit: WorkUnit
    stem: Path
    tokenizer: str
    eod_token: str | None
    field: str
    dtype: str


def _tokenize(job: _Job, encoder: Tokenizer, report: Callable[[int, int, int], None]) -> dict[str, Any]:
    """Tokenize a unit's documents into its shard (left under temporary names); `report(documents, tokens,
    input bytes)` is called with what was done since its last call, at most every _REPORT_SECONDS and at the end."""
    writer = ShardWriter(ShardFiles(job.stem), job.dtype)
    eod = encoder.eod_token_id
    done = [0, 0, 0]
    last_report = time.monotonic()
    try:
        for piece in job.unit.pieces:
            for texts, read in read_piece(piece, job.field):
                tokens = writer.num_tokens
                for ids in encoder.encode_batch(texts) if texts else ():
                    if eod is not None:
                        ids.append(eod)
                    if ids:
                        writer.add(ids)
                done[0] += len(texts)
                done[1] += writer.num_tokens - tokens
                done[2] += read
                if time.monotonic() - last_report >= _REPORT_SECONDS:
                    report(*done)
                    done, last_report = [0, 0, 0], time.monotonic()
        writer.close()
    except BaseException:
        writer.discard()
        raise
    report(*done)
    if writer.num_documents == 0:
        writer.discard()
    return writer.summary()


# ---------------------------------------------------------------------------------------------------------------------
# Worker processes


def _in_processes(jobs: list[_Job], workers: int, report: Callable[[int, int, int], None]) -> list[dict[str, Any]]:
    """Run the jobs on `workers` fresh processes (spawned: nothing of this process's threads or pyarrow pools is
    inherited); their progress comes through a queue. Returns the shard summaries in unit order. The first error
    stops the run: the units not started are cancelled, those running finish, and the error is raised (a worker
    that dies, killed for memory say, is an error too: the pool is then broken, never waited on forever)."""
    context = multiprocessing.get_context("spawn")
    progress = context.Queue()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(progress,))
    try:
        futures = [pool.submit(_run_job, job) for job in jobs]
        while not all(future.done() for future in futures):
            _drain(progress, report, timeout=0.1)
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
        _drain(progress, report, timeout=0)
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _drain(progress: Any, report: Callable[[int, int, int], None], timeout: float) -> None:
    try:
        report(*progress.get(timeout=timeout) if timeout else progress.get_nowait())
        while True:
            report(*progress.get_nowait())
    except queue.Empty:
        pass


_worker_progress: Any = None
_worker_tokenizers: dict[tuple[str, str | None], Tokenizer] = {}


def _start_worker(progress: Any) -> None:
    global _worker_progress
    _worker_progress = progress
    # One tokenizing thread per worker: the workers are the parallelism (`tokenizers` would start one per CPU).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # pyarrow (imported later, when a worker reads a columnar file) on the C allocator: a worker's peak measured
    # 22 MiB lower than on pyarrow's default, mimalloc, which keeps freed batches, for the same CPU time.
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


def _run_job(job: _Job) -> dict[str, Any]:
    key = (job.tokenizer, job.eod_token)
    if key not in _worker_tokenizers:
        _worker_tokenizers[key] = load_tokenizer(job.tokenizer, eod_token=job.eod_token)
    return _tokenize(job, _worker_tokenizers[key], lambda *done: _worker_progress.put(done))
