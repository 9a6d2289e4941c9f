"""`python -m fedring` is the `fedring` command."""

from fedring.cli import main

if __name__ == "__main__":
    main()
