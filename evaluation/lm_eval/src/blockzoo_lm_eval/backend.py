"""`BlockzooLM`: lm-evaluation-harness's model interface over a blockzoo `LanguageModel` in memory.

Requests are batched as blockzoo runs documents: packed, each its own document in one `[tokens]` forward pass
(`forward_packed`), so a batch costs its tokens and no padding. Loglikelihood requests are sorted longest first (as
lm-eval's Hugging Face backend does) and those with the same input tokens (the choices of a multiple-choice question
whose continuations are one token, ...) are run once. Tokenization is lm-eval's (`TemplateLM`: a context's trailing
spaces move to the continuation, an empty context is the end-of-text token) over the model's tokenizer without
added special tokens, as lm-eval's Hugging Face backend does by default. Generation is the model's own `generate`
(greedy unless a task samples), cut at the task's stop sequences.

Layouts: `rank` / `world_size` are the data-parallel rank and size, so lm-eval gives each data rank its share of the
documents and gathers the scores over the data group; the tensor-parallel (and sequence-data) ranks of one data rank
run the same requests. Under sequence-tensor parallelism a batch's tokens are padded to a multiple of the tensor
ranks with a filler document. Under pipeline parallelism the model given is a `PipelinedModel`: the same calls, run
through the stages, by every pipeline rank of a data rank alike."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from blockzoo.api import Batch, ByteTokenizer, FileTokenizer, UsageError

DEFAULT_MAX_LENGTH = 2048  # lm-eval's Hugging Face backend's, for a model that states none
DEFAULT_MAX_GEN_TOKS = 256

LoglikelihoodRequest = tuple[Any, list[int], list[int]]  # ((context, continuation) or None, their token ids)


class _Codec:
    """Text to ids and back, without special tokens added (lm-eval adds what it needs itself)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._tokenizers = None
        if isinstance(tokenizer, FileTokenizer):
            import tokenizers

            self._tokenizers = tokenizers.Tokenizer.from_file(str(tokenizer.path))

    def encode(self, text: str) -> list[int]:
        if self._tokenizers is not None:
            return self._tokenizers.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._tokenizers is not None:
            return self._tokenizers.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if isinstance(self.tokenizer, ByteTokenizer) and not skip_special_tokens:
            return self.tokenizer.decode([i for i in ids if i < 256]) + "<|endoftext|>" * sum(i >= 256 for i in ids)
        return self.tokenizer.decode(list(ids))


class BlockzooLM(TemplateLM):
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        distributed: Any,
        *,
        stop_tokens: Sequence[int] = (),
        batch_size: int = 16,
        max_length: int | None = None,
    ):
        super().__init__()
        self.model = model
        self.distributed = distributed
        self.codec = _Codec(tokenizer)
        self.stop_tokens = list(stop_tokens) or _end_of_text(tokenizer)
        self.batch_size = batch_size
        self._max_length = max_length or _model_max_length(model)
        self._device = distributed.device
        self._rank = distributed.data_rank
        self._world_size = distributed.data_size

    # -- what lm-eval asks of a model ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        if not self.stop_tokens:
            raise UsageError(
                "the model's tokenizer has no end-of-text token, which lm-eval puts before an empty context and a "
                "rolling window's first token (a Hugging Face checkpoint names it in eos_token_id)"
            )
        return self.stop_tokens[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.codec.tokenizer, "path", type(self.codec.tokenizer).__name__))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.codec.decode(tokens, skip_special_tokens=skip_special_tokens)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self.distributed.data_group
        if self._world_size == 1 or group is None:
            return tensor.reshape(1)
        gathered = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(gathered, tensor.contiguous(), group=group)
        return torch.stack(gathered).reshape(-1)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        group = self.distributed.data_group
        if self._world_size == 1 or group is None:
            return [obj]
        gathered: list[Any] = [None] * self._world_size
        dist.all_gather_object(gathered, obj, group=group)  # every tensor rank's first data rank needs them
        return gathered if self._rank == dst else None

    def barrier(self) -> None:
        group = self.distributed.data_group
        if self._world_size > 1 and group is not None:
            dist.barrier(group=group)

    # -- scoring -------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[LoglikelihoodRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-probability of each continuation after its context, whether it is the greedy continuation)."""
        inputs: dict[tuple[int, ...], list[int]] = {}  # distinct input tokens -> the requests reading them
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a context and a continuation of tokens")
            tokens = (context + continuation)[-(self.max_length + 1) :][:-1]
            inputs.setdefault(tuple(tokens), []).append(index)
        ordered = sorted(inputs, key=lambda tokens: (-len(tokens), tokens))
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(ordered), self.batch_size):
            chunk = ordered[start : start + self.batch_size]
            rows, targets, sizes, owners = [], [], [], []
            end = 0
            for tokens in chunk:
                end += len(tokens)
                for index in inputs[tokens]:
                    continuation = requests[index][2]
                    rows.extend(range(end - len(continuation), end))
                    targets.extend(continuation)
                    sizes.append(len(continuation))
                    owners.append(index)
            # The logits of the continuations' tokens alone.
            log_probabilities = self._packed_logits(chunk, rows).float().log_softmax(-1)
            target = torch.tensor(targets, device=log_probabilities.device)
            chosen = log_probabilities.gather(1, target[:, None]).squeeze(1)
            greedy = log_probabilities.argmax(-1) == target
            sums = [float(part.sum()) for part in chosen.split(sizes)]
            all_greedy = [bool(part.all()) for part in greedy.split(sizes)]
            for index, total, is_greedy in zip(owners, sums, all_greedy):
                answers[index] = (total, is_greedy)
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], answers[index])
        return answers  # type: ignore[return-value]

    def _packed_logits(self, documents: list[tuple[int, ...]], rows: list[int]) -> torch.Tensor:
        """Logits `[rows, vocab]` of the tokens `rows` indexes among `documents` packed into one forward pass."""
        lengths = [len(tokens) for tokens in documents]
        flat = [token for tokens in documents for token in tokens]
        distributed = self.distributed
        if distributed.sequence_tensor_parallel and (remainder := len(flat) % distributed.tensor_size):
            filler = distributed.tensor_size - remainder  # a document of its own, read by no request
            lengths.append(filler)
            flat.extend([self.eot_token_id] * filler)
        tokens = torch.tensor(flat, dtype=torch.long, device=self._device)
        rows_on_device = torch.tensor(rows, dtype=torch.long, device=self._device)
        return self.model.forward_packed(tokens, Batch(lengths, device=self._device), rows=rows_on_device)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, in windows of `max_length` tokens (lm-eval's disjoint rolling
        windows), the windows of all texts batched together."""
        windows: list[LoglikelihoodRequest] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            tokens = self.tok_encode(text)
            rolling = get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
            )
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_probability, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_probability
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """The model's continuation of each context (its own `generate`, batched by identical generation settings,
        longest first), cut at the first of the task's stop sequences (and the end-of-text token's text)."""
        if self.distributed.sequence_tensor_parallel:
            raise UsageError(
                "generation tasks do not run under sequence-tensor parallelism (distributed.sequence_tensor_parallel); "
                "evaluate with tensor parallelism alone"
            )
        collator = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        end_of_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        outputs = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk)
            options = normalize_gen_kwargs(settings[0], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(options.pop("until", None), eos=end_of_text)
            new_tokens = options.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room < 1:
                raise UsageError(f"a task generates {new_tokens} tokens, as many as max_length ({self.max_length})")
            prompts = [(self.tok_encode(context) or [self.prefix_token_id])[-room:] for context in contexts]
            temperature = float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0
            generated = self.model.generate(
                prompts, new_tokens, temperature=temperature, top_k=options.get("top_k"), stop_token=self.stop_tokens
            )
            for context, setting, tokens in zip(contexts, settings, generated):
                text = postprocess_generated_text(generation=self.tok_decode(tokens), stop=until, think_end_token=None)
                outputs.append(text)
                self.cache_hook.add_partial("generate_until", (context, setting), text)
        return collator.get_original(outputs)


def _end_of_text(tokenizer: Any) -> list[int]:
    """The tokenizer's end-of-text id: its `eod_token_id`, else the `eos_token` of the tokenizer_config.json beside a
    Hugging Face tokenizer.json (what lm-eval's Hugging Face backend uses); none if neither says."""
    stop = getattr(tokenizer, "eod_token_id", None)
    if stop is None and isinstance(tokenizer, FileTokenizer):
        settings = tokenizer.path.with_name("tokenizer_config.json")
        token = json.loads(settings.read_text()).get("eos_token") if settings.is_file() else None
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            import tokenizers

            stop = tokenizers.Tokenizer.from_file(str(tokenizer.path)).token_to_id(token)
    return [] if stop is None else [stop]


def _model_max_length(model: Any) -> int:
    """The `max_position_embeddings` of the Hugging Face checkpoint the model came from, else its learned
    positions, else lm-eval's Hugging Face backend's default."""
    origin = getattr(model, "origin", None)
    if origin is not None and "config.json" in origin.files:
        stated = json.loads((origin.directory / "config.json").read_text()).get("max_position_embeddings")
        if isinstance(stated, int) and stated > 1:
            return stated
    embeddings = model.config.embeddings
    if getattr(embeddings, "position_embeddings", False):
        return int(embeddings.num_position_embeddings)
    return DEFAULT_MAX_LENGTH
