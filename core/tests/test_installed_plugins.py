"""Plugins installed for real with pip, discovered through their entry points, seen through the CLI.

The test packages (core/tests/plugins/) are installed into a private directory put on PYTHONPATH of
subprocesses, so the test environment itself never sees the broken ones:
- acme: a working third-party mixer `acme.shift`;
- broken: raises at import;
- incompatible: declares `blockzoo>=99` (its module raises if it is ever imported);
- duplicate_one / duplicate_two: two distributions that both register `dup.mixer`;
- careless (a site of its own, since it imports torch when loaded): its config module imports torch and it declares
  no blockzoo requirement.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PACKAGES = Path(__file__).parent / "plugins"
TEST_DISTRIBUTIONS = {
    "blockzoo",
    "blockzoo-test-acme",
    "blockzoo-test-broken",
    "blockzoo-test-dup-one",
    "blockzoo-test-dup-two",
    "blockzoo-test-incompatible",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", target]
        + [str(PACKAGES / name) for name in ("acme", "broken", "incompatible", "duplicate_one", "duplicate_two")],
        check=True,
        capture_output=True,
    )
    return target


def blockzoo(site: Path, *arguments: str, **environment: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), **environment)
    return subprocess.run(
        [sys.executable, "-m", "blockzoo", *arguments], capture_output=True, text=True, env=env, timeout=120
    )


def plugins_json(site: Path, **environment: str) -> dict:
    result = blockzoo(site, "plugins", "--json", **environment)
    return {
        plugin["name"] + ":" + (plugin["distribution"] or ""): plugin for plugin in json.loads(result.stdout)["plugins"]
    }


def test_listing_shows_every_plugin_and_its_status(site):
    plugins = plugins_json(site)
    acme = plugins["acme:blockzoo-test-acme"]
    assert acme["status"] == "loaded" and acme["version"] == "0.3.1"
    assert acme["types"] == {"mixer": ["acme.shift"]} and acme["capabilities"] == ["tensor_parallel"]
    assert acme["location"] == str(site / "blockzoo_test_acme")
    broken = plugins["broken:blockzoo-test-broken"]
    assert broken["status"] == "failed"
    # Where it was raised: the plugin's own file and line.
    raised_at = site / "blockzoo_test_broken" / "plugin.py"
    assert (
        broken["error"]
        == f"ImportError: libacme_kernels.so: cannot open shared object file (simulated) ({raised_at}:1)"
    )
    incompatible = plugins["incompatible:blockzoo-test-incompatible"]
    assert incompatible["status"] == "incompatible"  # a `failed` status would mean its module was imported
    assert incompatible["error"] == "requires blockzoo>=99, but blockzoo 0.1.0 is installed"
    one, two = plugins["dup:blockzoo-test-dup-one"], plugins["dup:blockzoo-test-dup-two"]
    assert one["conflicts"] == two["conflicts"] == ["mixer:dup.mixer"]
    assert plugins["blockzoo:blockzoo"]["types"]["block"] == ["decoder", "parallel"]
    # Sorted by plugin name, so every process builds the same registry.
    assert [key.split(":")[0] for key in plugins] == sorted(key.split(":")[0] for key in plugins)


def test_human_listing_and_check(site):
    result = blockzoo(site, "plugins", "--check")
    assert result.returncode == 0, result.stderr
    assert "acme  [loaded]  blockzoo-test-acme 0.3.1" in result.stdout
    assert "mixer: acme.shift" in result.stdout
    assert "error: ImportError: libacme_kernels.so" in result.stdout
    assert "check: ok" in result.stdout


def test_strict_mode_fails_naming_the_plugins(site, tmp_path):
    result = blockzoo(site, "plugins", BLOCKZOO_STRICT_PLUGINS="1")
    assert result.returncode == 1
    config = write_config(tmp_path, "{type: acme.shift}")
    result = blockzoo(site, "config", str(config), BLOCKZOO_STRICT_PLUGINS="1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("blockzoo: error: plugins failed to load (BLOCKZOO_STRICT_PLUGINS is set)")
    assert "plugin 'broken' (blockzoo-test-broken 0.1.0) failed to load: ImportError" in result.stderr
    assert "plugin 'incompatible' (blockzoo-test-incompatible 0.2.0) is incompatible" in result.stderr
    assert "'dup.mixer' is registered by both" in result.stderr


def test_allow_and_block_lists(site):
    plugins = plugins_json(site, BLOCKZOO_PLUGINS="acme")
    # Other installed plugins (first-party ones, in the combined test session) are disabled too; not listed here.
    assert {key: p["status"] for key, p in plugins.items() if p["distribution"] in TEST_DISTRIBUTIONS} == {
        "acme:blockzoo-test-acme": "loaded",
        "blockzoo:blockzoo": "loaded",  # the core's own plugin always loads
        "broken:blockzoo-test-broken": "disabled",
        "dup:blockzoo-test-dup-one": "disabled",
        "dup:blockzoo-test-dup-two": "disabled",
        "incompatible:blockzoo-test-incompatible": "disabled",
    }
    plugins = plugins_json(site, BLOCKZOO_DISABLE_PLUGINS="broken,dup")
    assert plugins["broken:blockzoo-test-broken"]["status"] == "disabled"
    assert plugins["dup:blockzoo-test-dup-two"]["status"] == "disabled"
    assert plugins["acme:blockzoo-test-acme"]["status"] == "loaded"
    # With the bad ones disabled (the incompatible one aside), strict mode is satisfied.
    result = blockzoo(site, "plugins", BLOCKZOO_DISABLE_PLUGINS="broken,dup,incompatible", BLOCKZOO_STRICT_PLUGINS="1")
    assert result.returncode == 0, result.stderr
    result = blockzoo(site, "plugins", BLOCKZOO_DISABLE_PLUGINS="blockzoo")
    assert result.returncode == 2 and "cannot be disabled" in result.stderr


def test_one_of_two_distributions_of_a_plugin_name_is_left_out_as_the_advice_says(site, tmp_path):
    """Both register `dup.mixer`: the error names both and a value of BLOCKZOO_DISABLE_PLUGINS that leaves out only
    the second (the plugin name alone would disable both); following it makes the type usable."""
    config = write_config(tmp_path, "{type: dup.mixer}")
    result = blockzoo(site, "config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'dup' (blockzoo-test-dup-one 1.0.0) and 'dup' (blockzoo-test-dup-two 2.0.0)" in result.stderr
    advice = "BLOCKZOO_DISABLE_PLUGINS=dup:blockzoo-test-dup-two leaves out 'dup' (blockzoo-test-dup-two 2.0.0)"
    assert advice in result.stderr, result.stderr
    plugins = plugins_json(site, BLOCKZOO_DISABLE_PLUGINS="dup:blockzoo-test-dup-two")
    assert plugins["dup:blockzoo-test-dup-two"]["status"] == "disabled"
    assert (
        plugins["dup:blockzoo-test-dup-one"]["status"] == "loaded"
        and not plugins["dup:blockzoo-test-dup-one"]["conflicts"]
    )
    result = blockzoo(site, "config", str(config), BLOCKZOO_DISABLE_PLUGINS="dup:blockzoo-test-dup-two")
    assert result.returncode == 0, result.stderr
    plugins = plugins_json(site, BLOCKZOO_PLUGINS="dup:blockzoo-test-dup-one")
    assert plugins["dup:blockzoo-test-dup-one"]["status"] == "loaded"
    assert plugins["dup:blockzoo-test-dup-two"]["status"] == "disabled"


def test_check_reports_a_config_module_importing_torch_and_a_missing_blockzoo_requirement(site, tmp_path):
    careless_site = tmp_path / "careless-site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*install, str(careless_site), str(PACKAGES / "careless")], check=True, capture_output=True)
    both = Path(f"{careless_site}{os.pathsep}{site}")
    result = blockzoo(both, "plugins", "--check", BLOCKZOO_PLUGINS="careless,acme")
    assert result.returncode == 1, result.stdout
    careless = result.stdout.split("\ncareless  [loaded]", 1)[1].split("\n\n", 1)[0]
    assert "check: blockzoo-test-careless declares no requirement on blockzoo: add one" in careless
    assert "check: importing blockzoo_test_careless.config imports torch" in careless
    acme = result.stdout.split("\nacme  [loaded]", 1)[1].split("\n\n", 1)[0]
    assert "check: ok" in acme  # a torch-free plugin with a requirement passes


def test_the_listing_names_the_other_plugin_of_a_conflict_and_verbose_shows_tracebacks(site):
    listing = blockzoo(site, "plugins", BLOCKZOO_PLUGINS="dup,broken").stdout
    assert (
        "conflict: mixer type 'dup.mixer' is also registered by 'dup' (blockzoo-test-dup-two 2.0.0) (neither is used; "
        "BLOCKZOO_DISABLE_PLUGINS=dup:blockzoo-test-dup-two leaves it out)" in listing
    )
    assert "Traceback" not in listing
    verbose = blockzoo(site, "plugins", "--verbose", BLOCKZOO_PLUGINS="dup,broken").stdout
    assert "    Traceback (most recent call last):" in verbose
    assert 'raise ImportError("libacme_kernels.so' in verbose


def write_config(tmp_path: Path, mixer: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            model:
              hidden_size: 32
              decoder:
                num_blocks: 2
                block: {{mixer: {mixer}, mlp: {{type: none}}}}
            data: {{type: random, sequence_length: 16}}
            """
        )
    )
    return path


def test_an_installed_type_is_usable_in_a_config(site, tmp_path):
    result = blockzoo(site, "config", str(write_config(tmp_path, "{type: acme.shift, shift: 3}")))
    assert result.returncode == 0, result.stderr
    assert "type: acme.shift\n        shift: 3" in result.stdout


def test_errors_at_the_point_of_use(site, tmp_path):
    result = blockzoo(site, "config", str(write_config(tmp_path, "{type: broken.conv}")))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.decoder.block.mixer.type: unknown mixer type 'broken.conv'" in result.stderr
    assert (
        "plugin 'broken' (blockzoo-test-broken 0.1.0) failed to load: ImportError: libacme_kernels.so" in result.stderr
    )
    result = blockzoo(site, "config", str(write_config(tmp_path, "{type: dup.mixer}")))
    assert result.returncode == 2
    assert "blockzoo-test-dup-one 1.0.0" in result.stderr and "blockzoo-test-dup-two 2.0.0" in result.stderr
    result = blockzoo(site, "config", str(write_config(tmp_path, "{type: acme.shift, shift: -1}")))
    assert result.returncode == 2 and "model.decoder.block.mixer.shift: must be >= 0, got -1" in result.stderr
    result = blockzoo(site, "--debug", "config", str(write_config(tmp_path, "{type: acme.shfit}")))
    assert result.returncode == 2 and "Traceback" in result.stderr and "did you mean 'acme.shift'" in result.stderr


def test_structuring_a_full_model_config_imports_no_torch(site, tmp_path):
    path = write_config(tmp_path, "{type: acme.shift}")
    script = textwrap.dedent(
        f"""
        import sys
        from blockzoo.config import load
        from blockzoo.run_config import RunConfig
        config = load(RunConfig, {str(path)!r}, ["model.decoder.num_blocks=4", "distributed.compute_dtype=bf16"])
        assert config.model.decoder.num_blocks == 4
        assert type(config.model.decoder.block.mixer).__name__ == "ShiftMixerConfig"
        print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "numpy")))
        """
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env.update(PYTHONPATH=str(site), BLOCKZOO_DISABLE_PLUGINS="broken,dup")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


def test_plugins_command_is_fast_and_torch_free(site):
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env.update(PYTHONPATH=str(site))
    script = "import sys; from blockzoo.cli import main; main(['plugins']); assert 'torch' not in sys.modules, 'torch'"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - start
    print(f"blockzoo plugins: {elapsed:.2f} s")
    assert elapsed < 5
