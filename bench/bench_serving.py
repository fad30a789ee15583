"""The guidellm serving benchmark: a thin entry point for `python -m ort_lora.bench.serving`
(same arguments).

python bench/bench_serving.py --out docs/bench/serving --cache-dir .cache/bench   # ~30 min
python bench/bench_serving.py --servers ort-lora --rates 1,4 --arrivals poisson   # a look
"""

import sys

from ort_lora.bench.serving import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
