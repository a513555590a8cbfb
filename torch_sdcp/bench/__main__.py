import sys

from torch_sdcp.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
