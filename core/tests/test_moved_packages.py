"""`blockzoo.ssm` and `blockzoo.testing`, moved out of the core into blockzoo-ssm and blockzoo-testing, keep their
old import paths (plugins written against plugin API 1.1 use them): the very same modules under both names, and an
ImportError saying what to install where the satellite is missing."""

import subprocess
import sys

import pytest


def test_the_old_names_are_the_moved_packages_themselves():
    import blockzoo.ssm
    import blockzoo.ssm.state_passing
    import blockzoo.testing
    import blockzoo.testing.distributed
    import blockzoo_ssm
    import blockzoo_ssm.state_passing
    import blockzoo_testing
    import blockzoo_testing.distributed
    from blockzoo.ssm import scan

    assert blockzoo.ssm is blockzoo_ssm and blockzoo.testing is blockzoo_testing
    # Submodules too: one module object, not a second copy with its own classes (and kernels compiled twice).
    assert blockzoo.ssm.state_passing is blockzoo_ssm.state_passing and scan is sys.modules["blockzoo_ssm.scan"]
    assert blockzoo.testing.distributed is blockzoo_testing.distributed
    assert blockzoo_ssm.state_passing.__spec__.name == "blockzoo_ssm.state_passing"  # its own spec kept
    from blockzoo.testing import MixerConformance  # what a 1.1 plugin's conformance test imports

    assert MixerConformance is blockzoo_testing.MixerConformance


@pytest.mark.parametrize(
    "old, new, distribution",
    [("blockzoo.ssm", "blockzoo_ssm", "blockzoo-ssm"), ("blockzoo.testing", "blockzoo_testing", "blockzoo-testing")],
)
def test_without_the_satellite_the_old_name_says_what_to_install(old, new, distribution):
    # None in sys.modules: the import system's own "not installed" for that name.
    code = f"import sys; sys.modules[{new!r}] = None; import {old}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: {old} moved to the distribution {distribution} (imported as {new}), which is not installed: "
        f"pip install {distribution}"
    )
