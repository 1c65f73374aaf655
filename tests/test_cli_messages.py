"""Every error message the `blockzoo` command can reach, through the real command: exit code 2,
no traceback, a short message (`blockzoo: error: ...`, at most a few lines) naming what is wrong.

The cases cover each kind of site: argparse (unknown command or flag, a bad or missing value), reading the config
(missing, malformed, not a mapping), overrides (syntax, a bad value, conflicting, an unknown key or type), the run
checks of `config` and `train` (layout, size, evaluation data), each command's own checks (`config schema`,
`--processes`, generate's options and checkpoints, convert's format and dtype, prepare's inputs, plot's metrics)
and the plugin settings. Each case is a test; the command runs once for the module (see DRIVER)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

import blockzoo

ENVIRONMENT = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
RUN = {
    "model": {
        "hidden_size": 16,
        "embeddings": {"vocab_size": 64},
        "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "attention", "heads": 2, "head_size": 8}}},
    },
    "data": {"type": "random", "sequence_length": 16, "micro_batch_size": 2},
    "training": {"train_iters": 1},
}

# id: (arguments, the texts the message holds, extra environment). {config}, {checkpoint}, {tmp}: the fixtures' paths.
CASES = {
    "no such command": (["trian"], ["invalid choice: 'trian'", "blockzoo --help"], {}),
    "unknown flag": (["train", "{config}", "--bogus"], ["unrecognized arguments: --bogus"], {}),
    "bad int value": (
        ["generate", "{checkpoint}", "--prompt", "a", "--max-new-tokens", "many"],
        ["--max-new-tokens: invalid int value: 'many'", "blockzoo generate --help"],
        {},
    ),
    "missing option": (["generate", "{checkpoint}"], ["required: --prompt"], {}),
    "train without a config": (["train"], ["blockzoo train needs a run config"], {}),
    "config file missing": (["config", "{tmp}/absent.yaml"], ["absent.yaml", "No such file"], {}),
    "malformed yaml": (["config", "{tmp}/malformed.yaml"], ["malformed.yaml", "malformed YAML at line 2"], {}),
    "yaml not a mapping": (["config", "{tmp}/list.yaml"], ["list.yaml", "must hold a mapping of keys, found list"], {}),
    "override without =": (["config", "{config}", "model.hidden_size"], ["model.hidden_size", "path.to.key=value"], {}),
    "override of the wrong type": (
        ["train", "{config}", "model.hidden_size=wide"],
        ["model.hidden_size", "expected an integer, got 'wide'"],
        {},
    ),
    "conflicting overrides": (
        ["config", "{config}", "model.hidden_size=8", "model.hidden_size.x=1"],
        ["model.hidden_size.x", "conflicts with the override of 'hidden_size'"],
        {},
    ),
    "unknown key": (["config", "{config}", "training.iters=3"], ["training", "iters"], {}),
    "unknown type": (
        ["train", "{config}", "data.type=parquet"],
        ["data.type", "unknown dataset type 'parquet'"],
        {},
    ),
    "more ranks than processes": (
        ["train", "{config}", "distributed.tensor_parallel=2"],
        ["distributed.tensor_parallel", "torchrun"],
        {},
    ),
    "model too large": (
        ["train", "{config}", "model.hidden_size=1048576", "model.embeddings.vocab_size=1048576"],
        ["model", "memory"],
        {},
    ),
    "memmap data missing": (["train", "{config}", "data.type=memmap", "data.path={tmp}/absent"], ["absent"], {}),
    "config schema with arguments": (["config", "schema", "x=1"], ["`blockzoo config schema` takes no overrides"], {}),
    "config --processes 0": (["config", "{config}", "--processes", "0"], ["--processes must be at least 1, got 0"], {}),
    "generate --max-new-tokens 0": (
        ["generate", "{checkpoint}", "--prompt", "a", "--max-new-tokens", "0"],
        ["--max-new-tokens must be at least 1, got 0"],
        {},
    ),
    "generate --temperature -1": (
        ["generate", "{checkpoint}", "--prompt", "a", "--temperature", "-1"],
        ["--temperature must be >= 0, got -1"],
        {},
    ),
    "generate without a tokenizer": (
        ["generate", "{checkpoint}", "--prompt", "a"],
        ["the checkpoint's data (random type) has no tokenizer"],
        {},
    ),
    "checkpoint missing": (["generate", "{tmp}/absent", "--prompt", "a"], ["absent: does not exist"], {}),
    "not a checkpoint": (["generate", "{tmp}", "--prompt", "a"], ["{tmp}"], {}),
    "convert to an unknown format": (
        ["convert", "{checkpoint}", "{tmp}/out", "--format", "gguf"],
        ["gguf"],
        {},
    ),
    "convert with a bad dtype": (
        ["convert", "{checkpoint}", "{tmp}/out2", "--format", "llama", "--dtype", "int3"],
        ["int3"],
        {},
    ),
    "convert into a non-empty directory": (["convert", "{checkpoint}", "{checkpoint}"], ["{checkpoint}"], {}),
    "prepare a missing file": (["prepare", "{tmp}/absent.txt", "--output", "{tmp}/data"], ["absent.txt"], {}),
    "prepare an empty corpus": (["prepare", "{tmp}/empty.txt", "--output", "{tmp}/data"], ["the corpus is empty"], {}),
    "plot a run without metrics": (["plot", "{tmp}"], ["has no metrics.jsonl"], {}),
    "disabling the core plugin": (
        ["config", "{config}"],
        ["BLOCKZOO_DISABLE_PLUGINS names 'blockzoo', the core's own plugin, which cannot be disabled"],
        {"BLOCKZOO_DISABLE_PLUGINS": "blockzoo"},
    ),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("messages")
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(RUN))
    (tmp / "malformed.yaml").write_text("model: {hidden_size: [\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "empty.txt").write_text("  \n")
    checkpoint = blockzoo.save(blockzoo.build(config), tmp / "checkpoint")
    return {"config": str(config), "checkpoint": str(checkpoint), "tmp": str(tmp)}


# Runs cases one after the other in one interpreter through `blockzoo.cli.main`, the function the `blockzoo` command
# is (`python -m blockzoo` is `raise SystemExit(main())`): what it writes to stderr and its exit code, a traceback
# for an exception that escapes it, as the interpreter would print it.
DRIVER = """
import contextlib, io, json, sys, traceback
from blockzoo.cli import main
results = {}
for case, arguments in json.loads(sys.argv[1]).items():
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(arguments)
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = 1
    results[case] = [code, stderr.getvalue()]
print(json.dumps(results))
"""
# Through `python -m blockzoo` itself, each in its own process: the cases that set the environment, and one more.
OWN_PROCESS = {case for case, (_, _, environment) in CASES.items() if environment} | {"no such command"}


@pytest.fixture(scope="module")
def results(paths) -> dict[str, tuple[int, str]]:
    def command(case: str) -> list[str]:
        return [argument.format(**paths) for argument in CASES[case][0]]

    def run(case: str) -> tuple[int, str]:
        result = subprocess.run(
            [sys.executable, "-m", "blockzoo", *command(case)],
            capture_output=True,
            text=True,
            env={**ENVIRONMENT, **CASES[case][2]},
            timeout=300,
        )
        return result.returncode, result.stderr

    together = {case: command(case) for case in CASES if case not in OWN_PROCESS}
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(together)], capture_output=True, text=True, env=ENVIRONMENT
    )
    assert driver.returncode == 0, driver.stderr
    found = {case: tuple(result) for case, result in json.loads(driver.stdout).items()}
    return found | {case: run(case) for case in OWN_PROCESS}


@pytest.mark.parametrize("case", CASES)
def test_every_message_is_a_short_usage_error(case, results, paths):
    code, stderr = results[case]
    message = stderr.strip()
    assert code == 2, f"exit {code}: {stderr}"
    assert "Traceback" not in message, message
    assert message.startswith("blockzoo: error: ") and "\n\n" not in message, message
    assert len(message.splitlines()) <= 4, message
    for text in CASES[case][1]:
        assert text.format(**paths) in message, f"{text!r} not in: {message}"
