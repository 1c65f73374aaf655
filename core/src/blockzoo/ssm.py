"""`blockzoo.ssm` is `blockzoo_ssm`, of the distribution blockzoo-ssm (`pip install blockzoo-ssm`): the numerics
shared by the state-space mixers moved out of the core. This name stays for plugins written against plugin API 1.1."""

from blockzoo._satellite import alias_package

alias_package(__name__, "blockzoo_ssm", "blockzoo-ssm")
