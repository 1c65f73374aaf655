#!/usr/bin/env bash
# The one script to run on the GPU machine (which has torch, triton and transformers but no network):
#
#   bash benchmarks/device.sh [SUITE[:ARGUMENTS]]...      e.g.  bash benchmarks/device.sh llama "kernels:--cases ce-128256"
#
# A SUITE ending in .py is a script of its own (a mixer's benchmark, e.g.
# mixers/gated_delta_net/benchmarks/gdn_kernel.py:--no-torch), run with its ARGUMENTS and no --json.
#
# 1. installs .whl/*.whl (made on a CPU machine by benchmarks/make_wheels.sh: cattrs, a Triton-only mamba-ssm,
#    liger-kernel, flash-linear-attention, torchtitan and torchao with their light imports) into /tmp/site with `pip --no-index --no-deps --target`, and the project's
#    distributions editable with `--no-deps --no-build-isolation` (skipped when a previous call on this machine
#    installed the same wheels and pyproject files);
# 2. runs each named suite (llama, mamba2, moe, kernels, trainer, hybrid; ARGUMENTS after a colon go to its command line)
#    under `timeout`, writing $OUT/<suite>.log and $OUT/<suite>.jsonl as results come;
# 3. then, when GPU_TESTS names test paths, `pytest -m gpu $GPU_TESTS` under its own timeout ($OUT/gpu-tests.log).
# 4. leaves $OUT/autotuning.tar.gz (Triton's autotuning results); copied to the project root as .autotuning.tar.gz
#    and carried, it spares the next fresh machine the minutes its kernels' autotuning takes.
# It ends with a summary: each suite's exit status, its ratio lines and failures, the tests' last lines.
#
# Environment: OUT (default /tmp/device-out), BUDGET (seconds for the whole script, default 570: a device call may run
# 600), SUITE_TIMEOUT (the most one suite may take, default 300), GPU_TESTS (paths, default none), GPU_TESTS_TIMEOUT
# (default 240, kept aside from the budget before the suites run).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
BUDGET=${BUDGET:-570}
SUITE_TIMEOUT=${SUITE_TIMEOUT:-300}
GPU_TESTS=${GPU_TESTS:-}
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-240}
SUITES=(llama mamba2 moe kernels trainer hybrid)
mkdir -p "$OUT"

export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# Triton's autotuning results (TRITON_CACHE_AUTOTUNING) are what makes a fresh machine's first calls take minutes;
# compiling a kernel takes seconds. The results an earlier call left in $OUT (carried back as .autotuning.tar.gz)
# are restored into Triton's cache: each is keyed by the kernel's source, the GPU target, Triton's version and the
# tuning key, so one made elsewhere is a miss, never a wrong answer.
export TRITON_CACHE_DIR=/tmp/compile-cache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/compile-cache/inductor TRITON_CACHE_AUTOTUNING=1
if [[ -f .autotuning.tar.gz && ! -d $TRITON_CACHE_DIR ]]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .autotuning.tar.gz -C "$TRITON_CACHE_DIR" &&
    echo "# autotuning results restored: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) kernels"
fi

for requested in "$@"; do
  name=${requested%%:*}
  if [[ $name != *.py && ! " ${SUITES[*]} " == *" $name "* ]]; then
    echo "unknown suite '$name' (suites: ${SUITES[*]}; arguments after a colon: llama:--cases 4x4096)" >&2
    exit 2
  fi
done

# -- 1. install ---------------------------------------------------------------------------------------------------------
DISTRIBUTIONS=(core libraries/ssm libraries/testing mixers/attention mixers/mamba mixers/mamba_2 mixers/discrete_mamba_2
  mixers/gated_delta_net mixers/mla mlps/mlp mlps/moe adapters/lora converters/huggingface)
existing=()
for distribution in "${DISTRIBUTIONS[@]}"; do [[ -f $distribution/pyproject.toml ]] && existing+=("$distribution"); done
DISTRIBUTIONS=("${existing[@]}")
stamp=$(cat .whl/*.whl "${DISTRIBUTIONS[@]/%//pyproject.toml}" 2>/dev/null | sha256sum | cut -c1-16)
if [[ -f /tmp/site/.installed && $(cat /tmp/site/.installed) == "$stamp" ]]; then
  echo "# already installed here ($stamp)"
else
  start=$SECONDS
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if ((${#wheels[@]} == 0)); then
    echo "# no wheels in .whl/ (run benchmarks/make_wheels.sh on the CPU machine; carry .whl): peers will be absent"
  else
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${wheels[@]}" \
      >"$OUT/install.log" 2>&1 || { echo "# installing the wheels failed:"; tail -20 "$OUT/install.log"; }
  fi
  editable=()
  for distribution in "${DISTRIBUTIONS[@]}"; do editable+=(-e "$distribution"); done
  if python3 -m pip install -q --no-deps --no-build-isolation "${editable[@]}" >>"$OUT/install.log" 2>&1; then
    echo "$stamp" >/tmp/site/.installed
  else
    echo "# installing the project failed:"; tail -20 "$OUT/install.log"
  fi
  echo "# installed in $((SECONDS - start)) s"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c 'import sys, importlib.metadata as m
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "mamba_ssm", "liger_kernel", "fla-core", "torchtitan", "torchao",
             "cattrs", "blockzoo"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")' 2>&1
  git rev-parse HEAD 2>/dev/null || echo "no git checkout here"
  git diff --quiet HEAD 2>/dev/null || echo "(tracked files differ from that commit)"
} >"$OUT/environment.txt"
cat "$OUT/environment.txt"

# -- 2. the suites ------------------------------------------------------------------------------------------------------
reserve=0
[[ -n $GPU_TESTS ]] && reserve=$GPU_TESTS_TIMEOUT
declare -A status logs
for requested in "$@"; do
  name=${requested%%:*}
  arguments=""
  [[ $requested == *:* ]] && arguments=${requested#*:}
  left=$((BUDGET - SECONDS - reserve - 15))
  limit=$((left < SUITE_TIMEOUT ? left : SUITE_TIMEOUT))
  if ((limit < 30)); then
    echo "# $name: skipped, $left s left of the budget"
    status[$requested]="skipped"
    continue
  fi
  echo "# $name $arguments: up to $limit s"
  log=$OUT/$(basename "$name" .py).log
  for ((copy = 2; ; copy++)); do [[ -e $log ]] || break; log=$OUT/$(basename "$name" .py)-$copy.log; done  # named twice
  logs[$requested]=$log
  command=(python3 "benchmarks/$name.py" --json "$OUT/$name.jsonl")
  [[ $name == *.py ]] && command=(python3 "$name")
  # shellcheck disable=SC2086 # the suite's arguments are words
  timeout --signal=INT --kill-after=20 "$limit" "${command[@]}" $arguments >"$log" 2>&1
  code=$?
  status[$requested]=$code
  ((code == 124)) && status[$requested]="124 (timed out after $limit s)"
  echo "# $name: exit ${status[$requested]}"
done

# -- 3. GPU tests -------------------------------------------------------------------------------------------------------
if [[ -n $GPU_TESTS ]]; then
  left=$((BUDGET - SECONDS - 10))
  limit=$((left < GPU_TESTS_TIMEOUT ? left : GPU_TESTS_TIMEOUT))
  echo "# pytest -m gpu $GPU_TESTS: up to $limit s"
  # shellcheck disable=SC2086
  timeout --signal=INT --kill-after=20 "$limit" \
    python3 -m pytest -m gpu -q -rfEs --tb=short --durations=20 -p no:cacheprovider -n 0 $GPU_TESTS >"$OUT/gpu-tests.log" 2>&1
  echo "# gpu tests: exit $?"
fi

# -- the autotuning results, for the next call to carry -----------------------------------------------------------------
if [[ -d $TRITON_CACHE_DIR ]]; then
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar --null -czf "$OUT/autotuning.tar.gz" -T -)
fi

# -- summary ------------------------------------------------------------------------------------------------------------
echo
echo "# summary (full logs and JSON lines in $OUT)"
for requested in "$@"; do
  name=${requested%%:*}
  echo "## $requested: exit ${status[$requested]:-not run}"
  log=${logs[$requested]:-}
  if [[ $name == *.py && -n $log && -f $log ]]; then
    grep -v "^  " "$log" | tail -12 | cut -c1-240
  elif [[ -n $log && -f $log ]]; then
    grep -E "^[a-z0-9]+ / | vs | against the fastest |: (out of memory|error|absent)|Traceback|Error" "$log" |
      grep -v "^  File " | cut -c1-240
  fi
done
if [[ -n $GPU_TESTS && -f $OUT/gpu-tests.log ]]; then
  echo "## gpu tests"
  tail -25 "$OUT/gpu-tests.log"
fi
