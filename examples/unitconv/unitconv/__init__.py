"""A streamrl task package written only against `streamrl.api`: convert a quantity from one
unit to another with a `convert` tool that runs in the tool workers' sandbox."""
