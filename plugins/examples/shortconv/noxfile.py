"""`nox`: install blockzoo-shortconv with blockzoo in a fresh environment and run its tests.

Environment variables: TORCH, what to install first as torch (default `torch`; on a machine without a GPU give a
CPU build, since the default pulls a CUDA one); BLOCKZOO, where pip finds blockzoo (default `blockzoo>=0.1,<0.2`,
or a checkout's folders of the core and of what the plugin requires from it, the conformance kit among them:
`BLOCKZOO="../blockzoo/core ../blockzoo/libraries/testing" nox`).
"""

import os
import shlex

import nox

nox.options.reuse_venv = "yes"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(*shlex.split(os.environ.get("TORCH", "torch")))
    session.install(*shlex.split(os.environ.get("BLOCKZOO", "blockzoo>=0.1,<0.2")))
    session.install("-e", ".[test]")
    # Strict: a plugin that fails to load is an error, not a warning.
    session.run("pytest", "-n", "auto", "tests", *session.posargs, env={"BLOCKZOO_STRICT_PLUGINS": "1"})
