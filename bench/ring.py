"""Bytes per agent of dense, exact, bounded and all-gather rings; same as `fedring bench ring`.

python bench/ring.py --agents 8 --numel 1000000 --density 0.01 [--json]
"""

import sys

from fedring.cli import app

if __name__ == "__main__":
    app(["bench", "ring", *sys.argv[1:]])
