"""The benchmarks: scripts that import the installed package (set-up: ``pip install -e .``).

Run each from the repository root as a module or as a file, e.g. ``python -m bench.bench_e2e
--smoke`` or ``python bench/bench_e2e.py --smoke``; ``--help`` lists a script's options. Results
go to ``bench/results/``. ``bench._common`` and ``bench._timing`` hold what several scripts share.
"""
