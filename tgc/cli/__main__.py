"""`python -m tgc.cli`: the `tgc` command."""
from tgc.cli.app import main

main()
