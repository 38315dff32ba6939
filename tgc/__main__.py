"""`python -m tgc`: the `tgc` command (as `python -m tgc.cli`)."""
from tgc.cli import console

console()
