"""Run the system benchmarks: a thin entry point for `ort-lora bench` (same arguments).

python bench/run_bench.py --out docs/bench --cache-dir .cache/bench     # full, ~20 min
python bench/run_bench.py --quick --out results/bench-quick             # tiny model
"""

import sys

from ort_lora.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
