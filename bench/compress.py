"""Group-top-k beside global top-k compressors; same as `fedring bench compress`.

python bench/compress.py --numel 10000000 --density 0.01 [--json]
"""

import sys

from fedring.cli import app

if __name__ == "__main__":
    app(["bench", "compress", *sys.argv[1:]])
