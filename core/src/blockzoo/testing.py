"""`blockzoo.testing` is `blockzoo_testing`, of the distribution blockzoo-testing (`pip install blockzoo-testing`):
the conformance kit moved out of the core. This name stays for plugins' tests written against plugin API 1.1."""

from blockzoo._satellite import alias_package

alias_package(__name__, "blockzoo_testing", "blockzoo-testing")
