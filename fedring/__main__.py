"""`python -m fedring` is the `fedring` command."""

from fedring.cli import main

main()
