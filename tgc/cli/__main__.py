"""`python -m tgc.cli`: the `tgc` command."""
from tgc.cli import console

console()
