"""Configs of training: optimizer, learning-rate schedule, the loop. Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal

from blockzoo.benchmarks.base import BenchmarkConfig
from blockzoo.config import (
    Config,
    ConfigFieldError,
    PolymorphicConfig,
    at_least,
    check,
    configclass,
    field,
    greater_than,
)
from blockzoo.data.config import DatasetConfig
from blockzoo.training.fp8_config import FP8Config
from blockzoo.training.tracking_config import TrackerConfig


@configclass
class OptimizerConfig(PolymorphicConfig):
    kind: ClassVar[str] = "optimizer"
    default_type: ClassVar[str] = "adamw"


@configclass
class AdamWConfig(OptimizerConfig):
    learning_rate: float = field(
        3.0e-4, doc="Peak learning rate (parameters scale it by their lr_scale).", validator=greater_than(0)
    )
    beta_1: float = field(0.9, doc="Decay of the first moment.", validator=at_least(0))
    beta_2: float = field(0.95, doc="Decay of the second moment.", validator=at_least(0))
    epsilon: float = field(1.0e-8, doc="Added to the denominator.", validator=greater_than(0))
    weight_decay: float = field(
        0.1, doc="Decoupled weight decay of the parameters that take it.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(self.beta_1 < 1, "beta_1", f"must be < 1, got {self.beta_1}")
        check(self.beta_2 < 1, "beta_2", f"must be < 1, got {self.beta_2}")


@configclass
class ScheduleConfig(Config):
    """Linear warmup from 0, then a decay to `minimum_learning_rate_ratio` × the peak at the last step."""

    warmup_iters: int = field(0, doc="Steps of linear warmup.", validator=at_least(0))
    decay: Literal["cosine", "linear", "constant"] = field("cosine", doc="Shape of the decay after warmup.")
    minimum_learning_rate_ratio: float = field(0.1, doc="Final learning rate / peak.", validator=at_least(0))


@configclass
class EvaluationConfig(Config):
    interval: int | None = field(
        None, doc="Evaluate every this many steps (and at the end); None: never.", validator=at_least(1)
    )
    iters: int = field(
        10,
        doc="Micro-batches of each validation set per evaluation (at most: a set may hold fewer).",
        validator=at_least(1),
    )
    datasets: dict[str, DatasetConfig] = field(
        factory=dict,
        doc="Named validation sets, each any dataset config (its evaluation split: `validation_fraction` of a "
        "prepared dataset, 1 for all of it), evaluated at every evaluation as `evaluation_loss/<name>`; "
        "sequence_length and micro_batch_size not given are the run's `data` settings. The `data` section's own "
        "held-out split is `evaluation_loss`, when it has one.",
    )
    harness: BenchmarkConfig | None = field(
        None,
        doc="Benchmark tasks (lm-evaluation-harness by default: `{tasks: [...], interval: N}`, needs blockzoo-lm-eval) "
        "run on the model being trained at their own interval and at the end; their figures join the step's logged "
        "entry, their whole results go to `<output_dir>/evaluation/step_<N>.json`. None: no benchmark.",
    )


Recompute = Literal["none", "selective", "full"]


@configclass
class TrainingConfig(Config):
    train_iters: int = field(1000, doc="Optimizer steps of the whole run.", validator=at_least(1))
    gradient_accumulation: int = field(
        1, doc="Micro-batches per optimizer step on each data-parallel rank.", validator=at_least(1)
    )
    optimizer: OptimizerConfig = field(factory=AdamWConfig, doc="The optimizer.")
    schedule: ScheduleConfig = field(factory=ScheduleConfig, doc="The learning-rate schedule.")
    gradient_clipping: float | None = field(
        1.0, doc="Clip the global gradient norm to this; None: no clipping.", validator=greater_than(0)
    )
    log_interval: int = field(
        10,
        doc="Log every this many steps. The host reads the steps' figures from the device only then (and at "
        "evaluations, checkpoints and the end), so a non-finite loss stops the run there, naming its step; the updates "
        "after it are skipped.",
        validator=at_least(1),
    )
    evaluation: EvaluationConfig = field(factory=EvaluationConfig, doc="Evaluation on the validation split.")
    output_dir: str = field("runs/blockzoo", doc="Where checkpoints go; a run resumes from the latest one there.")
    checkpoint_interval: int | None = field(
        None, doc="Save every this many steps (and at the end); None: only at the end.", validator=at_least(1)
    )
    checkpoint_keep: int = field(3, doc="How many of the latest checkpoints to keep.", validator=at_least(1))
    trackers: dict[str, TrackerConfig | None] = field(
        factory=dict,
        doc="Where the run's figures go, by name (several at once), merged over `{jsonl: {type: jsonl}}` (the run's "
        "`metrics.jsonl`): adding a tracker keeps jsonl, `jsonl: null` turns it off. Types: `jsonl`, `tensorboard`, "
        "`wandb`, `mlflow` (each its own plugin distribution), `<plugin>.<name>`. See docs/tracking.md.",
    )
    trackers_required: bool = field(
        False,
        doc="A tracker that fails (library missing, disk full, network down, an error in it) stops the run with an "
        "error naming it. False: the failure is reported once and the run trains on without that tracker.",
    )
    checkpoint_base_weights: bool = field(
        False,
        doc="A PEFT fine-tuning (`model.peft`) of a `model.pretrained` base: also write the frozen base weights into "
        "every checkpoint. False: its checkpoints hold the adapters (and their optimizer state) only, and a reference "
        "to the base (path, model config, checksums of its weights) that resume, load and convert check and read.",
    )
    compile: Literal["none", "blocks"] = field(
        "none",
        doc="`blocks`: torch.compile each block's training forward (and its backward), fusing its elementwise work; "
        "blocks of one configuration share one compilation. Evaluation and generation run eagerly.",
    )
    fp8: FP8Config | None = field(
        None,
        doc="FP8 training of the linear layers through torchao's float8 (`{recipe: tensorwise}`; needs blockzoo[fp8] "
        "and a GPU with FP8 tensor cores); a linear's `fp8: false` opts it out. None: the compute dtype. docs/fp8.md.",
    )
    cuda_graphs: bool = field(
        False,
        doc="Replay each training step's forward, backward and clipping as one CUDA graph (one process on a GPU), for "
        "steps bound by the host's kernel launches. Micro-batches are padded to a few shapes (empty documents up to a "
        "power of two, the length bound a power of two); the second step of a shape is captured and later ones "
        "replay it (up to 4 shapes, each holding its own gradients); a step that cannot be captured runs eagerly, and "
        "the run says why.",
    )
    recompute: Recompute = field(
        "none",
        doc="Activation recomputation of every block: `none` keeps what the backward pass needs; `selective` keeps "
        "the outputs of matrix products, attention and collectives and recomputes the rest (norms, activations, "
        "rotary); `full` keeps only each block's input and recomputes the whole block.",
    )
    recompute_blocks: dict[str, Recompute] = field(
        factory=dict,
        doc="Per named block (a `pattern`'s block names; `block` for a `fixed` sequence), overriding `recompute`.",
    )
    peak_tflops: float | None = field(
        None,
        doc="The device's peak for MFU; None: known GPUs (H100/H200: 989), else MFU is not reported.",
        validator=greater_than(0),
    )
    export_format: str | None = field(
        None,
        doc="At the end, also write the model in this checkpoint format (e.g. `llama`: a Hugging Face directory "
        "transformers loads). None: no export.",
    )
    export_dir: str | None = field(
        None, doc="Where the export goes (a new or empty directory). None: `<output_dir>/<export_format>`."
    )

    def __attrs_post_init__(self) -> None:
        check(self.export_format is not None or self.export_dir is None, "export_dir", "needs an export_format")
        check(
            self.evaluation.interval is not None or not self.evaluation.datasets,
            "evaluation.datasets",
            "validation sets are evaluated every training.evaluation.interval steps, which is null: set it",
        )
        if self.export_format is not None:
            from blockzoo.conversion import ConversionError, get_format

            try:
                get_format(self.export_format)
            except ConversionError as error:
                raise ConfigFieldError("export_format", str(error)) from None
